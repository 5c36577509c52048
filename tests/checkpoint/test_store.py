"""The checkpoint store is the one owner of the checkpoint layout: its names are the only ones the package
uses, a DDP save writes exactly the layout and loads back, and a sharded engine writes only where the store
says."""

from __future__ import annotations

import ast
import dataclasses
import random
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import require_module
from trainer.checkpoint import store
from trainer.checkpoint.integrity import DamagedCheckpointError
from trainer.checkpoint.safe_io import UnsafeCheckpointError, load_state
from trainer.checkpoint.weights import load_model, tokenizer_dir
from trainer.distributed.ddp import DDPEngine
from trainer.distributed.groups import DistInfo
from trainer.model import AttentionConfig, GPTConfig, build_model

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trainer"
CPU = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))

# ---------------------------------------------------------------------------------------------------
# Only the store spells a checkpoint's names
# ---------------------------------------------------------------------------------------------------

NAMES = {
    "meta.json": re.compile(r"\bmeta\.json\b"),
    "engine.pt": re.compile(r"\bengine\.pt\b"),
    "model.safetensors": re.compile(r"\bmodel\.safetensors\b"),
    "conventions.json": re.compile(r"\bconventions\.json\b"),
    "rank_NNNNN.pt": re.compile(r"\brank_(\{[^}]*\}|\d+|\*)\.pt\b"),
    "step_NNNNNN": re.compile(r"\bstep_(\{[^}]*\}|\d{6}|\*|$)"),
    ".tmp-": re.compile(r"\.tmp-"),
    "checkpoints": re.compile(r"^checkpoints/?$"),
    "lm_head.weight": re.compile(r"^lm_head\.weight$"),
}
"""A checkpoint's names as code would spell them: in a string or an f-string (its fields read as `{}`)."""

OWNER = "trainer/checkpoint/store.py"
ALSO_ALLOWED = {("trainer/checkpoint/hf.py", "model.safetensors"),
                ("trainer/model/families/llama.py", "lm_head.weight"),
                ("trainer/model/families/family.py", "lm_head.weight")}
"""Hugging Face's own names for an export directory's weights and for Llama's untied head (transformers
decides them): the same strings, another decision (hf.WEIGHTS_FILE, the Llama family's pieces). And the head's
parameter as the model names it (families/family.py HEAD: the model's state-dict key, not a checkpoint's; the
model room may not import the checkpoint room)."""

PENDING: set[tuple[str, str]] = set()
"""Files another change is editing; each must import the store's names instead (then leave this set)."""


def string_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string the code uses, an f-string as one text with `{}` for each field;
    docstrings (any bare string statement) are prose, not code, and comments are not in the tree."""
    tree = ast.parse(source)
    prose = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)
             and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)}
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    skip = prose | parts
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            out.append((node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "{}"
                                             for v in node.values)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            out.append((node.lineno, node.value))
    return out


def names_spelled(source: str) -> dict[str, list[int]]:
    """Which of NAMES the code spells, and on which lines."""
    found: dict[str, list[int]] = {}
    for line, text in string_literals(source):
        for name, pattern in NAMES.items():
            if pattern.search(text):
                found.setdefault(name, []).append(line)
    return found


def spellers(files: list[Path]) -> dict[tuple[str, str], list[int]]:
    out = {}
    for path in files:
        for name, lines in names_spelled(path.read_text()).items():
            out[(path.relative_to(ROOT).as_posix(), name)] = lines
    return out


def test_only_the_store_spells_a_checkpoints_names():
    found = spellers(sorted(PACKAGE.rglob("*.py")))
    stray = {k: v for k, v in found.items() if k[0] != OWNER and k not in ALSO_ALLOWED | PENDING}
    assert stray == {}, ("use trainer.checkpoint.store's names instead of spelling them (file, name): "
                         f"lines {stray}")
    fixed = PENDING - found.keys()
    assert not fixed, f"{fixed} no longer spell the name: remove them from PENDING"


def test_the_scan_sees_every_name_and_can_fail():
    # the owner's own
    assert set(names_spelled((PACKAGE / "checkpoint" / "store.py").read_text())) == set(NAMES)
    offender = '''
"""A docstring may say meta.json and step_000050 for the reader."""
def save(d, rank, step, model):
    """So may this one: rank_00000.pt."""
    (d / "meta.json").write_text("{}")
    torch.save({}, d / f"rank_{rank:05d}.pt")
    final = d / "checkpoints" / f"step_{step:06d}"
    tmp = final.with_name(".tmp-" + final.name)
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    model.lm_head.weight  # an attribute, not a key
    return "engine.pt", "model.safetensors", "conventions.json"
'''
    found = names_spelled(offender)
    assert set(found) == set(NAMES)
    assert found["meta.json"] == [5] and found["rank_NNNNN.pt"] == [6] and found["step_NNNNNN"] == [7]
    assert names_spelled('"""meta.json, engine.pt"""\nx = "rank_state"\ny = f"rank_{r:05d}.jsonl"\n') == {}


# ---------------------------------------------------------------------------------------------------
# A DDP checkpoint: the whole layout, written by the store, read back
# ---------------------------------------------------------------------------------------------------

LAYOUT = {"meta.json", "conventions.json", "tokenizer", "model.safetensors", "engine.pt", "rank_00000.pt"}
"""The on-disk names of a one-rank DDP checkpoint, spelled out once here: old checkpoints have them
(tests/fixtures/v0), so they must not change."""


def test_the_store_names_are_the_on_disk_names():
    assert {store.META_FILE, store.CONVENTIONS_FILE, store.TOKENIZER_DIR, store.WEIGHTS_FILE,
            store.ENGINE_FILE, store.rank_file(0)} == LAYOUT
    assert (store.DEEPSPEED_DIR, store.TIED_KEY, store.TMP_PREFIX) == ("deepspeed", "lm_head.weight", ".tmp-")
    assert store.checkpoint_dir("run", 50) == Path("run/checkpoints/step_000050")
    assert store.rank_file(12) == "rank_00012.pt" and Path("rank_00012.pt").match(store.RANK_GLOB)
    assert store.STEP_DIR.match(store.step_name(1234567)) and not store.STEP_DIR.match("step_50")
    assert sorted(p.name for p in (ROOT / "tests/fixtures/v0/ddp/step_000002").iterdir()) == sorted(LAYOUT)


MODEL = GPTConfig(n_layer=1, n_head=2, n_embd=16, max_seq_len=32, vocab_size=64)


def ddp_engine(seed: int) -> DDPEngine:
    torch.manual_seed(seed)
    model = build_model(MODEL, AttentionConfig(backend="sdpa_docs"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return DDPEngine(model, opt, sched, CPU, grad_clip=1.0, dtype="fp32")


def one_step(engine: DDPEngine) -> None:
    ids = torch.randint(0, MODEL.vocab_size, (2, 8))
    out = engine.module(ids, labels=ids)
    out.loss_sum.backward()
    engine.optimizer_step()


@pytest.fixture()
def tokenizer(tmp_path) -> Path:
    out = tmp_path / "tok"
    out.mkdir()
    (out / "tokenizer.json").write_text("{}")  # the store copies the directory; it never parses it
    return out


def save(run_dir: Path, step: int, engine, tokenizer: Path, keep_last: int = 2) -> Path:
    meta = {"counters": {"tokens": 7}, "engine": engine.name, "config": {"model": dataclasses.asdict(MODEL)}}
    conventions = {"tokenizer": {"sha256": "x", "vocab_size": MODEL.vocab_size}}
    return store.save_checkpoint(run_dir, step, CPU, engine, rank_state={"data": {"read": step}}, meta=meta,
                                 conventions=conventions, tokenizer_dir=tokenizer, keep_last=keep_last)


def test_a_ddp_checkpoint_holds_exactly_the_layout_and_loads_back(tmp_path, tokenizer):
    engine = ddp_engine(0)
    one_step(engine)
    random.seed(5)
    path = save(tmp_path / "run", 3, engine, tokenizer)
    draws = (random.random(), torch.rand(2))  # the RNG right after the save: a resume continues from here

    assert path == store.checkpoint_dir(tmp_path / "run", 3) == store.latest_checkpoint(tmp_path / "run")
    assert {p.name for p in path.iterdir()} == LAYOUT | {store.CHECKSUMS_FILE}
    assert [p.name for p in store.checkpoint_root(tmp_path / "run").iterdir()] == [path.name]  # no .tmp- left
    weights = load_file(path / store.WEIGHTS_FILE)
    state = engine.module.state_dict()
    assert weights.keys() == state.keys() - {store.TIED_KEY}
    assert all(torch.equal(weights[k], state[k]) for k in weights)
    saved = load_state(path / store.ENGINE_FILE)
    assert saved.keys() == {"model", "optimizer", "scheduler"} and saved["scheduler"]["last_epoch"] == 1

    fresh = ddp_engine(1)
    meta, rank_states = store.load_checkpoint(path, CPU, fresh)
    assert (meta["step"], meta["world_size"], meta["counters"]) == (3, 1, {"tokens": 7})
    record = store.Record.of(meta)  # the writer's parallel sizes, typed
    assert (record.step, record.world_size, record.context, record.tensor,
            record.streams) == (3, 1, 1, 1, [0])
    assert rank_states == {0: {"data": {"read": 3}}}
    assert (random.random(), *torch.rand(2).tolist()) == (draws[0], *draws[1].tolist())
    assert all(torch.equal(v, state[k]) for k, v in fresh.module.state_dict().items())
    assert fresh.lr() == engine.lr() and fresh.optimizer.state_dict()["state"][0]["step"] == 1
    # the weights reader
    assert all(torch.equal(v, state[k]) for k, v in load_model(path).state_dict().items())
    assert tokenizer_dir(path) == path / store.TOKENIZER_DIR


@pytest.mark.parametrize("world, context, tensor", [(8, 2, 2), (8, 1, 2), (6, 3, 1), (4, 1, 1)])
def test_a_records_streams_are_the_first_rank_of_each_data_rank(world, context, tensor):
    """Which written rank holds each data stream: read from meta.json's parallel sizes, or from the run config
    of a checkpoint written before they were recorded; checked against every rank's own ParallelDims."""
    from trainer.distributed.dims import ParallelDims

    firsts: dict[int, int] = {}
    for rank in range(world):
        firsts.setdefault(ParallelDims(world, rank, context, tensor).data_rank, rank)
    expected = [firsts[d] for d in sorted(firsts)]
    new = {"step": 5, "world_size": world, store.PARALLEL_KEY: {"context": context, "tensor": tensor}}
    old = {"step": 5, "world_size": world,
           "config": {"distributed": {"context_parallel": context, "tensor_parallel": tensor}}}
    assert store.Record.of(new).streams == store.Record.of(old).streams == expected
    assert store.Record.of({"step": 5, "world_size": world}).streams == list(range(world))  # DDP of old
    assert len(expected) == world // (context * tensor)


def test_saves_keep_the_newest_and_clear_interrupted_ones(tmp_path, tokenizer):
    engine, run_dir = ddp_engine(0), tmp_path / "run"
    partial = store.checkpoint_root(run_dir) / f"{store.TMP_PREFIX}{store.step_name(9)}"
    partial.mkdir(parents=True)
    assert store.incomplete_checkpoints(run_dir) == [partial] and store.latest_checkpoint(run_dir) is None
    for step in (1, 2, 3):
        save(run_dir, step, engine, tokenizer, keep_last=2)
    assert sorted(p.name for p in store.checkpoint_root(run_dir).iterdir()) == ["step_000002", "step_000003"]
    assert store.incomplete_checkpoints(run_dir) == []


def test_loading_a_directory_that_is_not_a_checkpoint_names_the_layout(tmp_path):
    with pytest.raises(store.CheckpointError, match=r"no meta\.json.*<run dir>/checkpoints/step_NNNNNN"):
        store.load_checkpoint(tmp_path, CPU, ddp_engine(0))


# ---------------------------------------------------------------------------------------------------
# A sharded engine writes only into the directory the store names, and reads only checked files
# ---------------------------------------------------------------------------------------------------


class ShardedEngine:
    """The store's side of a sharded engine (as DeepSpeed is), without DeepSpeed: records where it is sent."""

    name = "fake_sharded"
    shard_format = "deepspeed"

    def converts_from(self, world_size: int) -> bool:
        return world_size != 1  # as DeepSpeed's: another number of ranks is converted first

    def __init__(self, engine: DDPEngine):
        self.inner, self.module, self.calls = engine, engine.module, []

    def save_shards(self, directory: Path) -> None:
        self.calls.append(("save", directory))
        directory.mkdir()
        torch.save(self.inner.state_dict(), directory / "shard_0.pt")

    def load_shards(self, directory: Path) -> None:
        self.calls.append(("load", directory))
        self.inner.load_state_dict(torch.load(directory / "shard_0.pt", weights_only=True))

    def full_weights(self) -> dict[str, torch.Tensor]:
        return self.inner.full_weights()

    def local_state(self) -> dict:
        return self.inner.local_state()


def test_a_sharded_engine_gets_the_deepspeed_directory_and_checked_files(tmp_path, tokenizer):
    require_module("deepspeed", "pip install -e '.[deepspeed]'")  # check_deepspeed_files names its types
    engine = ShardedEngine(ddp_engine(0))
    path = save(tmp_path / "run", 1, engine, tokenizer)
    tmp = store.checkpoint_root(tmp_path / "run") / f"{store.TMP_PREFIX}{path.name}"
    assert engine.calls == [("save", tmp / store.DEEPSPEED_DIR)]
    assert {p.name for p in path.iterdir()} == LAYOUT - {store.ENGINE_FILE} | {store.DEEPSPEED_DIR,
                                                                               store.CHECKSUMS_FILE}
    assert set(load_file(path / store.WEIGHTS_FILE)) == set(engine.module.state_dict()) - {store.TIED_KEY}

    fresh = ShardedEngine(ddp_engine(1))
    store.load_checkpoint(path, CPU, fresh)
    assert fresh.calls == [("load", path / store.DEEPSPEED_DIR)]
    assert all(torch.equal(v, engine.module.state_dict()[k]) for k, v in fresh.module.state_dict().items())

    torch.save({"x": _RunsCode()}, path / store.DEEPSPEED_DIR / "shard_0.pt")  # the store refuses it first
    with pytest.raises(DamagedCheckpointError,
                       match=r"shard_0.pt: checksum mismatch: the checkpoint is damaged"):
        store.load_checkpoint(path, CPU, ShardedEngine(ddp_engine(1)))
    store.record_checksums(path)  # a forger records the checksums again: the file is still refused
    refused = ShardedEngine(ddp_engine(1))
    with pytest.raises(UnsafeCheckpointError, match="shard_0.pt: refused"):
        store.load_checkpoint(path, CPU, refused)
    assert refused.calls == []


class _RunsCode:
    def __reduce__(self):
        return (print, ("this would have run",))
