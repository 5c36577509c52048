"""The model, optimizer and LR schedule resume on another number of ranks (issue 21, the engine half), on gloo
ranks.

For each case (engine, W, W'): W ranks run STEPS - 1 AdamW steps (clipping active) on fixed batches and save a
checkpoint through the store; W' ranks build the engine from other weights, load it with store.load_checkpoint
(ZeRO's shards are converted to DeepSpeed's universal checkpoint first) and must hold
  (a) the same full fp32 weights (ZeRO's master copy, and the module's as the engine gathers them),
  (b) the same exp_avg, exp_avg_sq and step per parameter, gathered whole on both sides from the live engines
      (`optimizer_state`, so the expected values do not come from the files the conversion reads), and LR;
  (c) after one more step with the same global batch split over W' ranks, the weights that W ranks reach with
      that step split over W (within 1e-6: only the order of the gradient sums differs).
The checkpoint itself is left as it was, and every new rank gets every old rank's state (its data stream is
dealt from them: trainer.data.reshape, tests/data/test_reshape.py). One spawn of four processes for the world
sizes 4, then 2, then 1, each a fresh gloo group (tests.harness.in_worlds: a spawned rank's start and
DeepSpeed's first initialize take seconds each); DDP's 1-rank checkpoint is written in this process first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.harness import in_worlds, require_module, run_distributed
from tests.helpers import MODEL, PAD, SEQ_LEN, assert_same_params, make_steps, split
from trainer.checkpoint import store
from trainer.config import OptimConfig
from trainer.data.config import PackingConfig
from trainer.data.packing import OnlinePacker
from trainer.data.pipeline import micro_batches
from trainer.distributed.config import DistributedConfig
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo, init_distributed
from trainer.model import AttentionConfig, build_model
from trainer.run.optim import build_optimizer, build_scheduler
from trainer.run.step import train_step

pytestmark = pytest.mark.slow

CASES = [("zero2", 4, 2), ("zero2", 2, 1), ("zero1", 2, 1), ("zero3", 2, 1), ("ddp", 2, 1), ("ddp", 1, 2)]
"""(engine, ranks that write, ranks that load)."""
IDS = [f"{name}-{w}-to-{v}" for name, w, v in CASES]
ENGINES = {"ddp": DistributedConfig(device="cpu"),
           **{f"zero{s}": DistributedConfig(engine="deepspeed", zero_stage=s, device="cpu")
              for s in (1, 2, 3)}}
STEPS = 3
"""Optimizer steps: STEPS - 1 before the checkpoint, one after it."""
ADAMW = OptimConfig(lr=1e-2, warmup_steps=2, min_lr_ratio=0.1)
CLIP = 0.05
"""Below these steps' gradient norms: clipping acts, so the global norm after the load must be right too."""


def build(name: str, info: DistInfo, seed: int):
    """The tiny model (initial weights from `seed`), AdamW over two groups and its schedule, under engine
    `name`."""
    torch.manual_seed(seed)
    model = build_model(MODEL, AttentionConfig(backend="sdpa_docs"))
    opt = build_optimizer(model, ADAMW)
    return parallelize(model, opt, build_scheduler(opt, ADAMW, STEPS), info, ENGINES[name], grad_clip=CLIP,
                       dtype="fp32")


def train(engine, info: DistInfo, steps) -> float:
    """One optimizer step per batch of `steps`, its documents split evenly over the ranks (8: 2, 4 or 8 each);
    the last step's global gradient norm (before clipping)."""
    for docs in split(steps, [1 / info.world_size] * info.world_size):
        rows = list(OnlinePacker(SEQ_LEN, buffer_size=8).pack(docs[info.rank]))
        mbs = micro_batches(rows, PackingConfig(layout="packed"), SEQ_LEN, SEQ_LEN, PAD)
        norm = train_step(engine, mbs, info, PAD).grad_norm
    return norm


def _gathered(part: torch.Tensor) -> torch.Tensor:
    """Every rank's equally long `part`, concatenated in rank order."""
    parts = [torch.empty_like(part) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, part.contiguous())
    return torch.cat(parts)


def optimizer_state(engine) -> dict[str, dict[str, torch.Tensor]]:
    """Collective: per parameter name, its whole fp32 value, exp_avg, exp_avg_sq and step, on every rank.

    ZeRO-1/2 keep one flat fp32 partition per group (each rank a contiguous slice of the group's flattened
    parameters, which are views into one flat buffer); ZeRO-3 one per sub-group, each parameter's own
    partition side by side. (DeepSpeed's safe_get_full_optimizer_state raises on some ranks for the no-decay
    group in 0.19.8, leaving the others in its all-reduce.)
    """
    if engine.name == "ddp":
        opt = engine.optimizer
        return {n: {"fp32": p.detach().clone(), **{k: v.clone() for k, v in opt.state[p].items()}}
                for n, p in engine.module.named_parameters()}
    opt = engine.ds.optimizer
    names = {p: n for n, p in engine.module.named_parameters()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    zero3 = engine.name == "deepspeed_zero3"
    groups = opt.fp16_groups if zero3 else opt.bit16_groups
    masters = opt.fp32_partitioned_groups_flat if zero3 else opt.single_partition_of_fp32_groups
    for g, params in enumerate(groups):
        state = opt.optimizer.state[masters[g]]
        step = torch.as_tensor(float(state["step"]))
        for key, flat in (("fp32", masters[g]), ("exp_avg", state["exp_avg"]),
                          ("exp_avg_sq", state["exp_avg_sq"])):
            whole = None if zero3 else _gathered(flat)
            offset = 0
            for p in params:
                if zero3:
                    n = p.ds_tensor.numel()
                    value = _gathered(flat[offset : offset + n])[: p.ds_numel].view(p.ds_shape)
                    offset += n
                else:
                    start = (p.data_ptr() - opt.bit16_groups_flat[g].data_ptr()) // p.element_size()
                    value = whole[start : start + p.numel()].view(p.shape)
                out.setdefault(names[p], {"step": step})[key] = value.clone()
    return out


def weights(engine) -> dict[str, torch.Tensor]:
    """Collective: the whole model's weights, copied (DDP's are the live tensors), on rank 0; {} elsewhere."""
    return {k: v.clone() for k, v in engine.full_weights().items()}


def files(path: Path) -> list[tuple[str, int, int]]:
    """Every file under checkpoint `path`: (relative path, size, modification time)."""
    return sorted((str(f.relative_to(path)), f.stat().st_size, f.stat().st_mtime_ns)
                  for f in path.rglob("*") if f.is_file())


def save_and_step(name: str, info: DistInfo, root: Path) -> dict:
    """STEPS - 1 steps, a checkpoint, what it holds (gathered), then the last step: the reference for (c)."""
    steps = make_steps(num_steps=STEPS, docs_per_step=8)
    engine = build(name, info, seed=0)
    train(engine, info, steps[:-1])
    path = store.save_checkpoint(root / f"{name}-{info.world_size}", STEPS - 1, info, engine, rank_state={},
                                 meta={"counters": {}, "engine": engine.name}, conventions={},
                                 tokenizer_dir=root / store.TOKENIZER_DIR, keep_last=1)
    saved = {"weights": weights(engine), "state": optimizer_state(engine), "lr": engine.lr(),
             "files": files(path)}
    norm = train(engine, info, steps[-1:])
    return {**saved, "next": weights(engine), "norm": norm}


def load_and_step(name: str, written: int, info: DistInfo, root: Path) -> dict:
    """A fresh engine from other weights, the engine state of a `written`-rank checkpoint, then the last
    step."""
    steps = make_steps(num_steps=STEPS, docs_per_step=8)
    path = store.checkpoint_dir(root / f"{name}-{written}", STEPS - 1)
    engine = build(name, info, seed=1)  # the load must replace all of it
    _, rank_states = store.load_checkpoint(path, info, engine)  # the engine, and every old rank's state
    loaded = {"weights": weights(engine), "state": optimizer_state(engine), "lr": engine.lr(),
              "files": files(path), "beside": sorted(p.name for p in path.parent.iterdir()),
              "rank_states": sorted(rank_states), "grad_average_factor": engine.grad_average_factor}
    norm = train(engine, info, steps[-1:])
    return {**loaded, "next": weights(engine), "norm": norm}


def forget_deepspeed_groups() -> None:
    """Drop DeepSpeed's module-level hold on this world (its clone of the world group, the data-parallel
    group, its comm backend), as deepspeed.comm.destroy_process_group does: in_worlds' next phase is another
    world."""
    from deepspeed.comm import comm
    from deepspeed.utils import groups

    groups._release_process_group_references(group=None)
    comm.cdb = None


def on_ranks(rank: int, world_size: int, root: str, writes: list[str], loads: list[tuple[str, int]]) -> dict:
    info = init_distributed(DistributedConfig(device="cpu"))
    out = {("written", name, world_size): save_and_step(name, info, Path(root)) for name in writes}
    for name, written in loads:
        out[("loaded", name, written, world_size)] = load_and_step(name, written, info, Path(root))
    forget_deepspeed_groups()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """Rank 0's results of every case's writing and loading side."""
    require_module("deepspeed", "pip install -e '.[deepspeed]'")
    root = tmp_path_factory.mktemp("reshape")
    (root / store.TOKENIZER_DIR).mkdir()
    one = [name for name, written, _ in CASES if written == 1]
    assert all(ENGINES[name].engine == "ddp" for name in one)  # no process group needed: no spawn
    with torch.random.fork_rng():
        out = {("written", name, 1): save_and_step(name, DistInfo(0, 1, 0, torch.device("cpu")), root)
               for name in one}
    phases = []
    for world_size in (4, 2, 1):  # every checkpoint is written before the phase that loads it
        writes = [name for name, written, _ in CASES if written == world_size != 1]
        loads = [(name, written) for name, written, loaded in CASES if loaded == world_size]
        phases.append((world_size, on_ranks, (str(root), writes, loads)))
    ranks = run_distributed(in_worlds, 4, args=(str(root), phases))
    assert sorted(ranks[0]) == list(range(len(phases)))  # rank 0 took part in every world
    for got in ranks[0].values():
        out.update(got)
    return out


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_engine_state_resumes_on_another_number_of_ranks(results, case):
    name, written, loaded = case
    saved, got = results[("written", name, written)], results[("loaded", name, written, loaded)]
    assert_same_params(got["weights"], saved["weights"], tol=0.0)  # (a)
    assert got["state"].keys() == saved["state"].keys()
    for param, state in saved["state"].items():  # (a) the fp32 master weights, (b) the moments and the step
        assert state.keys() == got["state"][param].keys() >= {"fp32", "exp_avg", "exp_avg_sq", "step"}, param
        for key, value in state.items():
            assert torch.equal(got["state"][param][key], value), f"{param} {key}"
    assert got["lr"] == saved["lr"] and got["grad_average_factor"] == loaded
    assert got["norm"] == pytest.approx(saved["norm"], rel=1e-5) and saved["norm"] > CLIP  # (c), clipped
    assert_same_params(got["next"], saved["next"], tol=1e-6)
    assert any(not torch.equal(got["next"][k], got["weights"][k]) for k in got["next"])  # the step moved them


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_the_checkpoint_is_untouched_and_each_rank_gets_every_old_ranks_state(results, case):
    name, written, loaded = case
    saved, got = results[("written", name, written)], results[("loaded", name, written, loaded)]
    assert got["files"] == saved["files"]  # converted beside it, never in place
    assert got["beside"] == [store.step_name(STEPS - 1)]  # and the converted copy removed
    # its data stream is dealt from all (trainer.data.reshape)
    assert got["rank_states"] == list(range(written))
