"""A checkpoint reads nothing outside itself and hides no damage: the FSDP2 reader confines every storage path
of DCP's `.metadata` to the checkpoint's dcp/ directory, every file of a checkpoint is checksummed at save and
verified at load, and a refusal is one line on every rank.

The FSDP2 checkpoint is a real one (2 gloo ranks, written through the store); each case copies it into its own
directory, damages or rewrites it (the `.metadata` with DCP's own classes, through the reader's allow-listed
unpickler) and loads it on one rank through the store, as a resume does. One spawn per group of cases.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness import run_distributed
from tests.helpers import ENV, ROOT, SMALL, as_written_before_checksums, assert_one_error_line, run_train
from trainer.checkpoint import store
from trainer.checkpoint.integrity import DamagedCheckpointError, OutsideCheckpointError
from trainer.checkpoint.safe_io import load_state, save_state
from trainer.distributed.config import DistributedConfig
from trainer.distributed.groups import DistInfo, init_distributed
from trainer.run.checkpointer import Checkpointer

pytestmark = pytest.mark.slow

FSDP2 = DistributedConfig(engine="fsdp2", device="cpu")


def _engine(info, seed: int = 0):
    """The tiny model (weights from `seed`), AdamW and its schedule, sharded by FSDP2."""
    from tests.helpers import MODEL
    from trainer.config import OptimConfig
    from trainer.distributed.engine import parallelize
    from trainer.model import AttentionConfig, build_model
    from trainer.run.optim import build_optimizer, build_scheduler

    torch.manual_seed(seed)
    model = build_model(MODEL, AttentionConfig(backend="sdpa_docs"))
    optim = OptimConfig(lr=1e-2, warmup_steps=2)
    opt = build_optimizer(model, optim)
    return parallelize(model, opt, build_scheduler(opt, optim, 3), info, FSDP2, grad_clip=1.0, dtype="fp32")


def _write(rank: int, world: int, root: str) -> str:
    info = init_distributed(FSDP2)
    engine = _engine(info)
    tokenizer = Path(root) / "tokenizer"
    if info.is_main:
        tokenizer.mkdir(parents=True, exist_ok=True)
        (tokenizer / "tokenizer.json").write_text("{}")
    path = store.save_checkpoint(Path(root) / "run", 2, info, engine, rank_state={"data": {}},
                                 meta={"counters": {}, "engine": engine.name}, conventions={},
                                 tokenizer_dir=tokenizer, keep_last=1)
    return str(path)


@pytest.fixture(scope="module")
def fsdp_checkpoint(tmp_path_factory) -> Path:
    """A 2-rank FSDP2 checkpoint (DCP shards, rank files, safetensors, meta); read-only: copy it to damage
    it."""
    return Path(run_distributed(_write, 2, args=(str(tmp_path_factory.mktemp("fsdp_ckpt")),))[0])


def copy_of(checkpoint: Path, root: Path) -> Path:
    """`checkpoint` copied into `root`'s run dir layout (so that it is a checkpoint of its own)."""
    out = store.checkpoint_dir(root, store.read_meta(checkpoint)["step"])
    shutil.copytree(checkpoint, out, symlinks=True)
    return out


def _loads(rank: int, world: int, paths: list[str]) -> list[tuple[str, bool, str]]:
    """Each checkpoint of `paths` loaded through the store into a fresh engine: (error type, UserError?,
    message)."""
    from trainer.errors import UserError

    info = init_distributed(FSDP2)
    out = []
    for path in paths:
        try:
            store.load_checkpoint(path, info, _engine(info, seed=1))
            out.append(("none", False, ""))
        except Exception as e:
            out.append((type(e).__name__, isinstance(e, UserError), str(e)))
    return out


# ---------------------------------------------------------------------------------------------------
# DCP's storage paths stay inside dcp/
# ---------------------------------------------------------------------------------------------------


def rewrite_storage_paths(checkpoint: Path, new_path) -> None:
    """Rewrite the `.metadata` of `checkpoint`'s DCP shards with DCP's own classes (unpickled by the reader's
    own allow-list): every item's storage path becomes `new_path(old)`; the checksums are recorded again, as a
    forger would."""
    from trainer.distributed.fsdp import _MetadataUnpickler

    file = checkpoint / store.DCP_DIR / ".metadata"
    with open(file, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    for info in metadata.storage_data.values():
        info.relative_path = new_path(info.relative_path)
    file.write_bytes(pickle.dumps(metadata))
    store.record_checksums(checkpoint)


def test_dcp_storage_paths_that_leave_the_checkpoint_are_refused_before_any_read(fsdp_checkpoint, tmp_path):
    """`../../../../outside/x.distcp`, an absolute path and a symlink leaving dcp/: each refused with one line
    naming the checkpoint and the path (before: the outside file was loaded and trained on); the untouched
    copy loads."""
    outside = tmp_path / "outside"
    outside.mkdir()
    for shard in (fsdp_checkpoint / store.DCP_DIR).glob("*.distcp"):
        shutil.copy(shard, outside / shard.name)
    climbing = copy_of(fsdp_checkpoint, tmp_path / "climbing")
    rewrite_storage_paths(climbing, lambda old: os.path.relpath(outside / old, climbing / store.DCP_DIR))
    absolute = copy_of(fsdp_checkpoint, tmp_path / "absolute")
    rewrite_storage_paths(absolute, lambda old: str(outside / old))
    linked = copy_of(fsdp_checkpoint, tmp_path / "linked")
    shard = linked / store.DCP_DIR / "__0_0.distcp"
    shard.unlink()
    shard.symlink_to(outside / "__0_0.distcp")
    intact = copy_of(fsdp_checkpoint, tmp_path / "intact")
    results = run_distributed(_loads, 1, args=([str(p) for p in (climbing, absolute, linked, intact)],))[0]
    for (kind, user_error, message), path in zip(results[:3], (climbing, absolute, linked), strict=True):
        assert user_error and "\n" not in message, (kind, message)
        assert str(path) in message and "outside" in message, message
        assert "leaves the checkpoint" in message, message
    assert results[3] == ("none", False, ""), results[3]


# ---------------------------------------------------------------------------------------------------
# Every file is checksummed at save and verified at load
# ---------------------------------------------------------------------------------------------------

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def overwrite(file: Path, offset: int, data: bytes = b"\xff" * 64) -> None:
    """64 bytes of `file` overwritten in place at `offset` (from the end if negative): a damaged disk
    block."""
    with open(file, "r+b") as f:
        f.seek(offset, os.SEEK_END if offset < 0 else os.SEEK_SET)
        f.write(data)


@pytest.mark.parametrize("victim", ["dcp/__1_0.distcp", "rank_00001.pt", store.WEIGHTS_FILE,
                                    "tokenizer/tokenizer.json", store.META_FILE])
def test_a_damaged_file_is_one_line_naming_it(fsdp_checkpoint, tmp_path, victim):
    """64 bytes overwritten in a DCP shard, a rank file, the safetensors (before: loaded without a word), the
    tokenizer or the meta: refused before anything is read, naming the file."""
    path = copy_of(fsdp_checkpoint, tmp_path)
    assert store.verify_checkpoint(path, ONE) is True  # intact: every file verified
    file = path / victim
    overwrite(file, file.stat().st_size // 2)
    with pytest.raises(DamagedCheckpointError) as e:
        store.verify_checkpoint(path, ONE)
    assert str(e.value) == f"{file}: checksum mismatch: the checkpoint is damaged; resume from an earlier one"


def test_a_missing_file_or_a_manifest_naming_a_file_outside_is_refused(fsdp_checkpoint, tmp_path):
    path = copy_of(fsdp_checkpoint, tmp_path / "missing")
    (path / "rank_00000.pt").unlink()
    with pytest.raises(DamagedCheckpointError,
                       match=r"rank_00000.pt is missing \(its checksums.json lists it\): "
                             r"the checkpoint is damaged; resume from an earlier one$"):
        store.verify_checkpoint(path, ONE)
    path = copy_of(fsdp_checkpoint, tmp_path / "forged")
    manifest = json.loads((path / store.CHECKSUMS_FILE).read_text())
    manifest["files"]["../../../../etc/hostname"] = "0" * 64
    (path / store.CHECKSUMS_FILE).write_text(json.dumps(manifest))
    with pytest.raises(OutsideCheckpointError,
                       match=r"its checksums.json names '\.\./\.\./\.\./\.\./etc/hostname' "
                             r"leaves the checkpoint \('\.\.'\)"):
        store.verify_checkpoint(path, ONE)
    (path / store.CHECKSUMS_FILE).write_text("{not json")
    with pytest.raises(DamagedCheckpointError,
                       match=r"checksums.json is not valid JSON .*: the checkpoint is damaged"):
        store.verify_checkpoint(path, ONE)


def test_a_checkpoint_without_checksums_loads_unverified_and_says_so(fsdp_checkpoint, tmp_path, capsys):
    path = copy_of(fsdp_checkpoint, tmp_path / "run")
    as_written_before_checksums(path)
    assert store.verify_checkpoint(path, ONE) is False
    assert Checkpointer(tmp_path / "run", ONE, 0, 2, 10).resume_path(str(path)) == path
    assert f"resume: {path} has no checksums.json (written before packtrain recorded checksums): " \
           "its files are loaded unverified" in capsys.readouterr().out


def test_an_explicit_damaged_checkpoint_is_refused(fsdp_checkpoint, tmp_path):
    path = copy_of(fsdp_checkpoint, tmp_path / "run")
    overwrite(path / store.WEIGHTS_FILE, 200)
    with pytest.raises(DamagedCheckpointError,
                       match=r"model.safetensors: checksum mismatch: the checkpoint is damaged"):
        Checkpointer(tmp_path / "run", ONE, 0, 2, 10).resume_path(str(path))


@pytest.fixture(scope="module")
def two_checkpoints(demo_data, tmp_path_factory) -> Path:
    """A real run dir (`python -m trainer.train`, DDP on one rank) with the checkpoints of steps 1 and 2."""
    run_dir = tmp_path_factory.mktemp("two") / "run"
    run_train(run_dir, demo_data, "train.max_steps=2", "train.checkpoint_every=1", "train.eval_every=0")
    return run_dir


def test_resume_true_skips_a_damaged_newest_checkpoint_and_says_which(two_checkpoints, demo_data, tmp_path):
    """The newest checkpoint's rank file damaged: train.resume=true resumes from the one before, saying which
    it skipped and why, and trains on from there."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    damaged = store.checkpoint_dir(run_dir, 2)
    overwrite(damaged / store.rank_file(0), 100)
    proc = run_train(run_dir, demo_data, "train.max_steps=3", "train.checkpoint_every=1",
                     "train.eval_every=0", "train.resume=true")
    assert (f"resume: skipping {damaged}: {damaged / store.rank_file(0)}: checksum mismatch: "
            "the checkpoint is damaged; resume from an earlier one") in proc.stdout, proc.stdout
    assert f"resumed from {store.checkpoint_dir(run_dir, 1)} at step 1" in proc.stdout, proc.stdout
    assert store.verify_checkpoint(store.latest_checkpoint(run_dir), ONE) is True
    assert store.read_meta(store.latest_checkpoint(run_dir))["step"] == 3


# ---------------------------------------------------------------------------------------------------
# A non-finite first step after a resume names the checkpoint
# ---------------------------------------------------------------------------------------------------


def test_non_finite_optimizer_state_is_refused_at_load_naming_the_file_and_tensor(two_checkpoints, demo_data,
                                                                                   tmp_path):
    """NaN in one `exp_avg` of engine.pt with its checksums recorded again (damaged before the save, e.g. in
    memory): the resume is refused at load, one line naming engine.pt and the tensor (before: exit 0, the
    first step finite, NaN in wte.weight a step later, saved again with valid checksums)."""
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    path = store.checkpoint_dir(run_dir, 1)
    state = load_state(path / store.ENGINE_FILE)
    first = min(state["optimizer"]["state"])
    state["optimizer"]["state"][first]["exp_avg"].view(-1)[0] = float("nan")
    save_state(state, path / store.ENGINE_FILE)
    store.record_checksums(path)
    proc = subprocess.run([sys.executable, "-m", "trainer.train", f"data.path={demo_data}",
                           f"hydra.run.dir={run_dir}", *SMALL, "train.max_steps=3", "train.eval_every=0",
                           f"train.resume={path}"],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    line = assert_one_error_line(proc.returncode, proc.stderr, f"{path / store.ENGINE_FILE}: optimizer.",
                                 ".exp_avg holds NaN values: the checkpoint is damaged")
    assert "optim.lr" not in line and not store.checkpoint_dir(run_dir, 3).exists(), line


def test_a_checksums_list_that_does_not_cover_the_checkpoint_is_damage_and_resume_true_skips_it(
        two_checkpoints, tmp_path, capsys):
    """An entry removed from checksums.json, `"files": {}`, checksums.json deleted (meta.json says one was
    written), a file added that it does not list: each refused in one line naming the checkpoint and the file
    (before: an unlisted damaged engine.pt resumed with exit 0); train.resume=true skips such a newest
    checkpoint for the one before it."""
    def manifest(path: Path) -> dict:
        return json.loads((path / store.CHECKSUMS_FILE).read_text())

    def unlisted(path: Path) -> None:
        kept = manifest(path)
        del kept["files"][store.ENGINE_FILE]
        (path / store.CHECKSUMS_FILE).write_text(json.dumps(kept))
        overwrite(path / store.ENGINE_FILE, 100)

    def emptied(path: Path) -> None:
        (path / store.CHECKSUMS_FILE).write_text(json.dumps({**manifest(path), "files": {}}))

    cases = {
        "unlisted": (unlisted, r"engine\.pt is not listed in its checksums\.json \(every file of a "
                               r"checkpoint is\): the checkpoint is damaged; resume from an earlier one$"),
        "empty": (emptied, r"checksums\.json lists no files: the checkpoint is damaged"),
        "deleted": (lambda p: (p / store.CHECKSUMS_FILE).unlink(),
                    r"checksums\.json is missing \(its meta\.json says it was written\): "
                    r"the checkpoint is damaged"),
        "added": (lambda p: (p / "notes.txt").write_text("x"),
                  r"notes\.txt is not listed in its checksums\.json"),
    }
    for name, (damage, message) in cases.items():
        run_dir = tmp_path / name
        shutil.copytree(two_checkpoints, run_dir)
        newest = store.checkpoint_dir(run_dir, 2)
        damage(newest)
        with pytest.raises(DamagedCheckpointError, match=message) as refused:
            Checkpointer(run_dir, ONE, 0, 2, 10).resume_path(str(newest))
        assert str(newest) in str(refused.value) and "\n" not in str(refused.value)
        # the single-file readers (export, generate, evaluate, init_from) refuse it too
        if name == "unlisted":
            with pytest.raises(DamagedCheckpointError, match=message):
                store.verify_file(newest, store.WEIGHTS_FILE)
        assert Checkpointer(run_dir, ONE, 0, 2, 10).resume_path(True) == store.checkpoint_dir(run_dir, 1)
        assert f"resume: skipping {newest}: " in capsys.readouterr().out


def test_a_non_finite_step_after_a_resume_with_no_save_since_names_the_checkpoint():
    """Steps after a resume with no checkpoint written since: the line names the resumed checkpoint as a
    suspect, never "last good checkpoint: None" (what it said before)."""
    from types import SimpleNamespace

    from trainer.run.parts import NonFinite, Resumed

    checkpointer = SimpleNamespace(last=None)
    resumed = Resumed(path=Path("run/checkpoints/step_000004"), at=4)
    part = NonFinite("stop", resumed, checkpointer, {})
    line = part.message(6, "non-finite loss")
    assert "2 steps after resuming from run/checkpoints/step_000004" in line and "None" not in line, line
    assert "the first step after resuming" in part.message(5, "non-finite loss")
    resumed.at = None
    assert "last good checkpoint: none: this run saved none yet" in part.message(6, "x")


# ---------------------------------------------------------------------------------------------------
# One line per mistake, on every rank
# ---------------------------------------------------------------------------------------------------


def _agreed_refusals(rank: int, world: int, paths: list[str]) -> list[tuple[str, bool, str]]:
    """Each checkpoint of `paths` loaded on every rank, then a collective (as the trainer's next step would
    be): (error type, UserError?, message) per checkpoint on this rank."""
    from trainer.distributed.groups import dist_max

    out = _loads(rank, world, paths)
    dist_max(1.0, torch.device("cpu"))  # a rank that went on alone would wait here for one that stopped
    return out


def test_damaged_dcp_metadata_and_a_crafted_rank_file_are_one_line_on_every_rank_without_tracebacks(
        fsdp_checkpoint, tmp_path, capfd):
    """On 2 gloo ranks: a `.metadata` that is empty, cut short or missing (in a checkpoint without checksums,
    so that DCP itself reads it; before: DCP's logger printed its tracebacks on every rank), and a crafted
    rank_00001.pt (checksums recorded again; before: refused on rank 1 alone, while rank 0 went on into a
    collective and died with gloo's "Connection closed by peer" traceback): each the same one-line UserError
    on both ranks, and no "Traceback" on stderr."""
    cases = []
    for name, damage in (("empty", lambda f: f.write_bytes(b"")),
                         ("cut", lambda f: f.write_bytes(f.read_bytes()[:50])),
                         ("missing", lambda f: f.unlink())):
        path = copy_of(fsdp_checkpoint, tmp_path / name)
        as_written_before_checksums(path)
        damage(path / store.DCP_DIR / ".metadata")
        cases.append(path)
    crafted = copy_of(fsdp_checkpoint, tmp_path / "crafted")
    torch.save({"data": {}, "rng": _RunsCode()}, crafted / store.rank_file(1))
    store.record_checksums(crafted)
    cases.append(crafted)
    capfd.readouterr()
    ranks = run_distributed(_agreed_refusals, 2, args=([str(p) for p in cases],))
    err = capfd.readouterr().err
    assert "Traceback" not in err, err[-5000:]
    for i, path in enumerate(cases):
        (kind0, user0, message0), (kind1, user1, message1) = ranks[0][i], ranks[1][i]
        assert user0 and user1 and (kind0, message0) == (kind1, message1), (path, ranks[0][i], ranks[1][i])
        assert "\n" not in message0, message0
        assert str(path) in message0, message0
    assert ".metadata" in ranks[0][2][2]
    assert f"{crafted / store.rank_file(1)}: refused to load" in ranks[0][3][2], ranks[0][3][2]


class _RunsCode:
    def __reduce__(self):
        return (print, ("this ran",))


# ---------------------------------------------------------------------------------------------------
# The weights readers (train.init_from, export, generate) check the file they read
# ---------------------------------------------------------------------------------------------------


def test_the_weights_readers_refuse_damaged_or_outside_weights(checkpoint, tmp_path):
    """model.safetensors with 64 bytes overwritten (before: read without a word) or a symlink leaving the
    checkpoint: refused by load_weights, which init_from, export and generate read the weights with."""
    from trainer.checkpoint.weights import load_weights

    damaged = copy_of(checkpoint, tmp_path / "damaged")
    assert load_weights(damaged).keys()  # intact
    overwrite(damaged / store.WEIGHTS_FILE, (damaged / store.WEIGHTS_FILE).stat().st_size // 2)
    with pytest.raises(DamagedCheckpointError,
                       match=r"model.safetensors: checksum mismatch: the checkpoint is "
                             r"damaged; resume from an earlier one$"):
        load_weights(damaged)
    linked = copy_of(checkpoint, tmp_path / "linked")
    outside = tmp_path / "outside.safetensors"
    shutil.move(linked / store.WEIGHTS_FILE, outside)
    (linked / store.WEIGHTS_FILE).symlink_to(outside)
    with pytest.raises(OutsideCheckpointError,
                       match=r"its entry 'model.safetensors' leaves the checkpoint \(a "
                             r"symlink to .*outside.safetensors\)"):
        load_weights(linked)


def test_the_single_file_readers_verify_every_file_they_read(two_checkpoints, tmp_path):
    """export, generate, evaluate and init_from read meta.json, conventions.json and the tokenizer beside the
    weights: each is verified as the weights are (before: only the weights file), so a tokenizer.json damaged
    after the save is refused, not used to decode."""
    from trainer.checkpoint.weights import load_model, tokenizer_dir

    path = tmp_path / "ckpt"
    shutil.copytree(store.checkpoint_dir(two_checkpoints, 2), path)
    load_model(path) and tokenizer_dir(path)  # intact: read
    tok = path / store.TOKENIZER_DIR / "tokenizer.json"
    tok.write_text(tok.read_text().replace('"<|endoftext|>"', '"<|endofbext|>"', 1))
    with pytest.raises(DamagedCheckpointError, match=r"tokenizer/tokenizer\.json: checksum mismatch"):
        tokenizer_dir(path)
    meta = path / store.META_FILE
    meta.write_text(meta.read_text().replace('"n_layer": 2', '"n_layer": 3'))
    with pytest.raises(DamagedCheckpointError, match=r"meta\.json: checksum mismatch"):
        load_model(path)
