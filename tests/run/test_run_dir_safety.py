"""Nothing of an earlier run is lost (trainer.run.run_dir): a fresh run, or a resume of another run's
checkpoint, in a used run dir is refused (or, with train.overwrite=true, moves the old run aside whole), a
resume from an older step sets the newer branch aside so that train.resume=true never picks it again, and a
checkpoint without conventions.json still has its tokenizer checked against the data's. Real runs of
`python -m trainer.train` on the tiny model (trainer/run/run_dir.py)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    ENV,
    ROOT,
    SMALL,
    as_written_before_checksums,
    assert_one_error_line,
    make_trainer,
    metrics,
    run_train,
    torchrun,
)
from trainer.checkpoint import store
from trainer.checkpoint.weights import WeightsError, checkpoint_tokenizer_hash
from trainer.distributed.groups import DistInfo
from trainer.errors import ConfigError
from trainer.run.run_dir import claim_run_dir, unlock_run_dir

EARLIER = ("train.max_steps=8", "train.checkpoint_every=2", "train.keep_last=4", "train.eval_every=0")
"""The earlier run: 8 steps, checkpoints at 2, 4, 6 and 8 all kept, a metrics line per step."""


CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

SEEDED = "replaced-20260101T000000Z"
"""What an earlier train.overwrite=true set aside, put into `earlier`'s run dir before its run."""


@pytest.fixture(scope="module")
def earlier_run(demo_data, tmp_path_factory) -> tuple[Path, str]:
    """A finished run dir and its stdout (read-only: each test works on a copy). Its run started in a dir that
    held only what Hydra writes before every job (.hydra/, the job log) and a set-aside earlier run."""
    run_dir = tmp_path_factory.mktemp("earlier") / "run"
    (run_dir / SEEDED).mkdir(parents=True)
    (run_dir / SEEDED / "metrics.jsonl").write_text('{"step": 1}\n')
    return run_dir, run_train(run_dir, demo_data, *EARLIER).stdout


@pytest.fixture(scope="module")
def earlier(earlier_run) -> Path:
    return earlier_run[0]


def copy_of(run_dir: Path, dest: Path) -> Path:
    shutil.copytree(run_dir, dest)
    return dest


RECORD = (".hydra", "train.log", ".lock")
"""What a run writes into its run dir beside its RUN_FILES once the dir is its own: Hydra's record, the job
log and the lock (trainer/train.py, trainer/run/run_dir.py). A refused run writes none of them."""


def snapshot(directory: Path, record: bool = True) -> dict[str, bytes]:
    """Relative path -> bytes of every file under `directory` (without `record`: RECORD's left out)."""
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and (record or p.relative_to(directory).parts[0] not in RECORD)}


def train(run_dir: Path, data: Path, *overrides: str,
          launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    """`python -m trainer.train` that may fail (tests.helpers.run_train insists on success)."""
    cmd = (launcher or [sys.executable, "-m"]) + ["trainer.train", f"data.path={data}",
                                                  f"hydra.run.dir={run_dir}", *SMALL, *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


# ---------------------------------------------------------------------------------------------------
# A fresh run in a used run dir
# ---------------------------------------------------------------------------------------------------


def test_a_fresh_run_in_a_used_run_dir_is_refused_and_changes_nothing(earlier, demo_data, tmp_path):
    """Nothing at all: not the earlier run's files, nor Hydra's record of it (.hydra/ with its overrides,
    which this run's differ from), nor its job log or lock."""
    run_dir = copy_of(earlier, tmp_path / "run")
    before = snapshot(run_dir)
    assert {".hydra/overrides.yaml", "train.log", ".lock"} <= set(before)
    proc = train(run_dir, demo_data, "train.max_steps=2", "train.checkpoint_every=2", "train.eval_every=0",
                 "seed=3")
    assert_one_error_line(proc.returncode, proc.stderr, f"{run_dir} already holds a run", "metrics.jsonl",
                          "train.resume=true", "hydra.run.dir", "train.overwrite=true")
    assert snapshot(run_dir) == before  # metrics lines, config.json, summary.json, all four checkpoints


@pytest.mark.slow
def test_under_torchrun_both_ranks_refuse_a_used_run_dir_without_waiting(earlier, demo_data, tmp_path):
    """Rank 0 decides and tells rank 1: both exit, no rank is left in a collective; the line is printed once
    (rank 0: a refusal every rank makes alike, trainer.errors.run_command's same_on_every_rank)."""
    run_dir = copy_of(earlier, tmp_path / "run")
    before = snapshot(run_dir)
    t0 = time.perf_counter()
    proc = train(run_dir, demo_data, "train.max_steps=2", "train.eval_every=0", launcher=torchrun())
    assert proc.returncode != 0 and time.perf_counter() - t0 < 60
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and f"{run_dir} already holds a run" in errors[0], proc.stderr
    assert snapshot(run_dir) == before


def test_overwrite_moves_the_earlier_run_aside_whole(earlier, demo_data, tmp_path):
    run_dir = copy_of(earlier, tmp_path / "run")
    before = snapshot(run_dir)
    proc = run_train(run_dir, demo_data, "train.max_steps=2", "train.checkpoint_every=2", "train.keep_last=4",
                     "train.eval_every=0", "train.overwrite=true")
    # The new run alone in the run dir: its own lines, config and checkpoint (not pruned for the old steps 6,
    # 8).
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000002"]
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    assert json.loads((run_dir / "config.json").read_text())["train"]["overwrite"] is True
    # The earlier run whole under replaced-<time>/, said so; an older set-aside run stays as it was.
    [aside] = sorted(set(run_dir.glob("replaced-*")) - {run_dir / SEEDED})
    assert f"moved into {aside} (nothing deleted)" in proc.stdout
    earlier_files = {k: v for k, v in before.items() if not k.startswith((f"{SEEDED}/", *RECORD))}
    assert snapshot(aside) == earlier_files  # every file of the earlier run, byte for byte
    assert (run_dir / SEEDED / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 2


def test_a_run_dir_held_by_a_live_run_refuses_another_and_a_dead_runs_lock_is_taken_over(demo_data, tmp_path):
    """Two trainers started into one run dir: the second (fresh, resumed or overwriting) is refused with one
    line naming the holder's pid and host, and changes nothing of the live run's record; once the holder is
    killed (kill -9: the kernel drops its lock), a resume takes the run dir over and continues it."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer.train", f"data.path={demo_data}", f"hydra.run.dir={run_dir}",
           *SMALL, "train.max_steps=100000", "train.checkpoint_every=1", "train.keep_last=1",
           "train.eval_every=0"]
    first = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while store.latest_checkpoint(run_dir) is None:
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        record = {name: (run_dir / name).read_bytes()
                  for name in (".hydra/overrides.yaml", ".hydra/config.yaml", "config.json", ".lock")}
        assert record[".lock"].decode().startswith(f"pid {first.pid} on {socket.gethostname()}")
        refused = [subprocess.Popen([sys.executable, "-m", "trainer.train", f"data.path={demo_data}",
                                     f"hydra.run.dir={run_dir}", *SMALL, "train.max_steps=2", "seed=5",
                                     *extra],
                                    cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True)
                   for extra in ((), ("train.resume=true",), ("train.overwrite=true",))]  # side by side
        for proc in refused:
            _, stderr = proc.communicate(timeout=300)
            assert_one_error_line(proc.returncode, stderr, f"{run_dir} is in use by another run",
                                  f"pid {first.pid} on {socket.gethostname()}", "hydra.run.dir")
        assert {name: (run_dir / name).read_bytes() for name in record} == record
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    step = store.read_meta(store.latest_checkpoint(run_dir))["step"]
    run_train(run_dir, demo_data, "train.max_steps=100000", "train.checkpoint_every=1", "train.keep_last=1",
              "train.eval_every=0", "train.resume=true", f"train.max_steps={step + 1}")
    assert [m["step"] for m in metrics(run_dir)][-1] == step + 1
    assert f"pid {first.pid} " not in (run_dir / ".lock").read_text()  # the new holder named itself


def test_a_run_dir_that_cannot_be_locked_is_one_error_line(demo_data, tmp_path):
    """The lock file cannot be opened (here: a directory in its place; a read-only run dir alike): one line on
    every rank, and nothing written."""
    run_dir = tmp_path / "run"
    (run_dir / ".lock").mkdir(parents=True)
    proc = train(run_dir, demo_data, "train.max_steps=1", "train.eval_every=0")
    assert_one_error_line(proc.returncode, proc.stderr, f"cannot write into the run dir {run_dir}",
                          "hydra.run.dir must name a directory this run can write")
    assert sorted(p.name for p in run_dir.iterdir()) == [".lock"]


@pytest.mark.parametrize("target", ["dataset", "checkpoint"])
def test_a_prepared_dataset_or_a_checkpoint_is_not_a_run_dir(earlier, demo_data, tmp_path, target):
    """hydra.run.dir naming a prepared dataset (or a checkpoint) is refused before anything is written
    there."""
    run_dir = copy_of(demo_data if target == "dataset" else store.checkpoint_dir(earlier, 8),
                      tmp_path / target)
    before = snapshot(run_dir)
    proc = train(run_dir, demo_data, "train.max_steps=1", "train.eval_every=0")
    what = "prepared dataset" if target == "dataset" else "checkpoint"
    assert_one_error_line(proc.returncode, proc.stderr, f"{run_dir} is a {what}",
                          "choose another hydra.run.dir")
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("case", ["shard_dir", "inside_dataset", "inside_init_checkpoint"])
def test_a_directory_the_run_reads_is_not_its_run_dir(earlier, demo_data, tmp_path, case):
    """hydra.run.dir naming the directory of the run's own shards (data.urls), or a directory inside the
    dataset (data.path) or the checkpoint it starts from (train.init_from): refused before anything is written
    there, naming the setting."""
    data = shutil.copytree(demo_data, tmp_path / "data")
    if case == "shard_dir":
        shards = tmp_path / "shards"
        shards.mkdir()
        for shard in data.glob("train-*.tar"):
            shutil.copy(shard, shards)
        run_dir, extra, what = shards, [f"data.urls={shards}/train-*.tar"], "data.urls"
    elif case == "inside_dataset":
        run_dir, extra, what = data / "runs" / "r", [], "data.path"
    else:
        init = copy_of(store.checkpoint_dir(earlier, 8), tmp_path / "init")
        run_dir, extra, what = init / "finetune", [f"train.init_from={init}"], "train.init_from"
    read = {"shard_dir": tmp_path / "shards", "inside_dataset": data}.get(case, tmp_path / "init")
    before = snapshot(read)
    proc = train(run_dir, data, "train.max_steps=1", "train.eval_every=0", *extra)
    assert_one_error_line(proc.returncode, proc.stderr, f"hydra.run.dir {run_dir.resolve()} ",
                          f"the run reads ({what})", "choose another hydra.run.dir")
    assert snapshot(read) == before  # not a file written (Hydra may have made the empty run dir)


def test_a_resume_with_another_global_batch_says_so(earlier, demo_data, tmp_path):
    run_dir = copy_of(earlier, tmp_path / "run")
    proc = run_train(run_dir, demo_data, "train.max_steps=9", "train.eval_every=0", "train.resume=true",
                     "train.tokens_per_step=2048")
    assert ("resume: train.tokens_per_step 1024 -> 2048: the global batch of every step after 8 differs"
            in proc.stdout)


def test_a_run_dir_holding_only_hydras_files_or_set_aside_runs_is_fresh(earlier_run):
    """What Hydra writes into every new run dir (a timestamped one, a sweep's job dir) before the job starts,
    and what an earlier overwrite set aside, are not a run: `earlier`'s fresh run started there, untouched."""
    run_dir, stdout = earlier_run
    assert (run_dir / ".hydra" / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    assert "overwrite:" not in stdout and [m["step"] for m in metrics(run_dir)] == list(range(1, 9))
    assert (run_dir / SEEDED / "metrics.jsonl").read_text() == '{"step": 1}\n'


# ---------------------------------------------------------------------------------------------------
# A resume from an older step
# ---------------------------------------------------------------------------------------------------


def test_resuming_an_older_step_sets_the_newer_branch_aside(earlier, demo_data, tmp_path):
    """Resumed from step 4 and trained to 6: the old steps 6 and 8 must not stay where train.resume=true would
    pick step 8, nor be overwritten; metrics.jsonl holds steps 1..6 once, the old 5..8 lines are set aside."""
    run_dir = copy_of(earlier, tmp_path / "run")
    before = snapshot(run_dir)
    old_lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "link").symlink_to(run_dir)  # its own checkpoint, named through a symlink and a relative path
    own = os.path.relpath(store.checkpoint_dir(tmp_path / "link", 4), ROOT)
    proc = run_train(run_dir, demo_data, "train.max_steps=6", "train.checkpoint_every=2", "train.keep_last=4",
                     "train.eval_every=0", f"train.resume={own}")
    # The run dir: the new branch from step 4 on (what train.resume=true picks next), old steps 1..4
    # untouched.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "step_000002", "step_000004", "step_000006"]
    assert store.latest_checkpoint(run_dir) == store.checkpoint_dir(run_dir, 6)
    after = snapshot(run_dir)
    for name, data in before.items():
        if name.startswith(("checkpoints/step_000002/", "checkpoints/step_000004/")):
            assert after[name] == data, name
    lines = (run_dir / "metrics.jsonl").read_text().splitlines(keepends=True)
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3, 4, 5, 6] and lines[:4] == old_lines[:4]
    # The abandoned branch under abandoned-after-step_000004-<time>/, said so, byte for byte.
    [aside] = sorted(run_dir.glob("abandoned-after-step_000004-*"))
    assert f"moved into {aside} (nothing deleted)" in proc.stdout and "steps 5..8" in proc.stdout
    assert sorted(p.name for p in (aside / "checkpoints").iterdir()) == ["step_000006", "step_000008"]
    abandoned = snapshot(aside)
    for step in (6, 8):
        for name, data in before.items():
            if name.startswith(f"checkpoints/{store.step_name(step)}/"):
                assert abandoned[name] == data, name
    assert (abandoned["summary.json"] == before["summary.json"]
            and abandoned["config.json"] == before["config.json"])
    assert (aside / "metrics.jsonl").read_text().splitlines(keepends=True) == old_lines[4:]
    assert json.loads((run_dir / "summary.json").read_text())["final_step"] == 6


# ---------------------------------------------------------------------------------------------------
# A checkpoint of another run
# ---------------------------------------------------------------------------------------------------


def test_another_runs_checkpoint_into_a_used_run_dir_is_refused_and_changes_nothing(earlier, demo_data,
                                                                                    tmp_path):
    """Resumed into a run dir that holds a run, a checkpoint from outside its checkpoints/ would mix two runs
    there: refused with the choices, also when its path starts with the run dir's (`run/../other/...`)."""
    run_dir = copy_of(earlier, tmp_path / "run")
    other = copy_of(earlier, tmp_path / "other")
    before, theirs = snapshot(run_dir), store.checkpoint_dir(other, 4)
    proc = train(run_dir, demo_data, "train.max_steps=6", "train.eval_every=0",
                 f"train.resume={run_dir}/../other/checkpoints/{theirs.name}")
    assert_one_error_line(proc.returncode, proc.stderr, f"{run_dir} already holds a run", "metrics.jsonl",
                          f"{theirs.resolve()} is another run's checkpoint", "hydra.run.dir",
                          "train.overwrite=true")
    assert snapshot(run_dir) == before and snapshot(other) == snapshot(earlier)


def test_overwrite_moves_the_earlier_run_aside_for_another_runs_checkpoint(earlier, demo_data, tmp_path):
    run_dir = copy_of(earlier, tmp_path / "run")
    other = copy_of(earlier, tmp_path / "other")
    before, theirs = snapshot(run_dir), store.checkpoint_dir(other, 4)
    proc = run_train(run_dir, demo_data, "train.max_steps=6", "train.checkpoint_every=2", "train.keep_last=4",
                     "train.eval_every=0", "train.overwrite=true", f"train.resume={theirs}")
    # The earlier run whole under replaced-<time>/; the resumed one alone in the run dir, from step 4 on.
    [aside] = sorted(set(run_dir.glob("replaced-*")) - {run_dir / SEEDED})
    assert (f"moved into {aside} (nothing deleted)" in proc.stdout
            and f"resumed from {theirs} at step 4" in proc.stdout)
    assert snapshot(aside) == {k: v for k, v in before.items() if not k.startswith((f"{SEEDED}/", *RECORD))}
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_000006"]
    assert [m["step"] for m in metrics(run_dir)] == [5, 6] and not list(run_dir.glob("abandoned-*"))
    assert snapshot(other) == snapshot(earlier)


# ---------------------------------------------------------------------------------------------------
# The tokenizer of a checkpoint without conventions.json
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """demo_data's documents and shards under another tokenizer of the same size (trained on a 50 kB sample):
    the model's shapes and each shard's documents match, so only the tokenizer check can tell."""
    from trainer.prepare import prepare

    out = tmp_path_factory.mktemp("other_tokenizer")
    prepare("demo", out, vocab_size=512, max_docs=1000, docs_per_shard=200, val_fraction=0.05, seed=0,
            tokenizer_sample_mb=0.05)
    return out


def test_resume_checks_the_tokenizer_of_a_checkpoint_without_conventions(earlier, demo_data, other_tokenizer,
                                                                          tmp_path):
    ckpt = tmp_path / "old" / store.step_name(8)
    shutil.copytree(store.checkpoint_dir(earlier, 8), ckpt)
    (ckpt / store.CONVENTIONS_FILE).unlink()
    as_written_before_checksums(ckpt)  # an old checkpoint: neither file
    ours = hashlib.sha256((ckpt / "tokenizer" / "tokenizer.json").read_bytes()).hexdigest()
    theirs = json.loads((other_tokenizer / "manifest.json").read_text())["tokenizer"]["sha256"]
    assert ours != theirs and checkpoint_tokenizer_hash(ckpt) == ours
    # its own data fits
    assert ours == json.loads((demo_data / "manifest.json").read_text())["tokenizer"]["sha256"]
    before = snapshot(ckpt)
    # in-process (the command's one line: tests/checkpoint/test_init_from.py)
    with pytest.raises(ConfigError) as refused:
        make_trainer(other_tokenizer, tmp_path / "run", "train.max_steps=9", f"train.resume={ckpt}")
    assert ("train.resume:" in str(refused.value) and ours in str(refused.value)
            and theirs in str(refused.value))
    assert snapshot(ckpt) == before and not (tmp_path / "run").exists()
    # Neither the tokenizer nor conventions.json: nothing to check the data against, so refused too.
    shutil.rmtree(ckpt / "tokenizer")
    with pytest.raises(WeightsError, match="the tokenizer its weights were trained with is unknown"):
        checkpoint_tokenizer_hash(ckpt)


# ---------------------------------------------------------------------------------------------------
# A directory of someone's own files
# ---------------------------------------------------------------------------------------------------


def test_a_directory_of_the_users_own_files_is_refused_unless_overwrite_allows_it(tmp_path):
    """hydra.run.dir naming a directory that holds files no run wrote (here: notes and a source tree) is
    refused before a byte is written; train.overwrite=true lets the run write beside them, and they stay as
    they were. What packtrain itself leaves in a run dir (Hydra's record, the job log, a set-aside run) is not
    the user's."""
    mine = tmp_path / "mine"
    (mine / "src").mkdir(parents=True)
    (mine / "notes.txt").write_text("my notes")
    (mine / "src" / "a.py").write_text("x = 1")
    before = snapshot(mine)
    with pytest.raises(ConfigError, match=r"hydra.run.dir .*/mine holds files that no run wrote "
                                          r"\(notes.txt, src/\): "
                                          r".*or write into it anyway with train.overwrite=true"):
        claim_run_dir(mine, False, False, CPU)
    assert snapshot(mine) == before  # not even the lock file
    claim_run_dir(mine, False, True, CPU)
    try:
        assert (mine / ".lock").is_file() and snapshot(mine, record=False) == before
    finally:
        unlock_run_dir(mine)
    ours = tmp_path / "ours"
    for name in (".hydra/config.yaml", "train.log", "replaced-20260101T000000Z/metrics.jsonl"):
        (ours / name).parent.mkdir(parents=True, exist_ok=True)
        (ours / name).write_text("")
    claim_run_dir(ours, False, False, CPU)
    unlock_run_dir(ours)
