"""Training throughput (not a test): packed vs unpacked vs bucketed, the same documents,
side by side in one run.

    python -m trainer.prepare --source demo --out data/demo          # once
    python bench/throughput.py --data data/demo
    python bench/throughput.py --data data/demo --attention dense --steps 20 --json out.json
    python bench/throughput.py --data data/demo --compile --layouts packed
                                                      # compiled vs eager, side by side
    python bench/throughput.py --data data/demo --metrics-off --chunk-tokens 4096 --layouts packed,unpacked
                                                      # what the per-step metrics cost, plain and chunked loss

The logical batches (tokens_per_step // seq_len packer rows each) are drawn once from one `RowStream`
(`trainer.data.feed.build_data`), then laid out by `micro_batches` in every layout, so each layout trains on
exactly the same documents with the same targets. Every layout gets its own copy of one model init and a
fresh AdamW (`trainer.run.optim.build_optimizer`, fp32) and runs the real `trainer.run.step.train_step`. Steps
are interleaved (step i runs every layout before step i + 1 starts, the order rotating each step) so machine
noise hits all layouts alike; the first --warmup steps are run but not counted.

    valid tok/s   valid targets / train_step seconds, summed over the measured steps
                  (same numerator everywhere)
    alloc pos/s   allocated positions (padding included) / the same seconds
    utilization   real (non-padding) positions / allocated positions
    step ms       median wall time of train_step (micro-batches are laid out beforehand;
                  "layout ms" times that)
    efficiency    from the totals (the definition below), and the median of the same figure per step (paired)
    peak mem      peak memory of a step above what is held between steps (weights, AdamW moments):
                  CUDA  torch.cuda.max_memory_allocated() - memory_allocated() before the step,
                        max over steps;
                  CPU   measured in a fresh subprocess per layout: peak resident set (VmHWM, reset via
                        /proc/self/clear_refs) minus the resident set before the step, over --mem-steps steps
                        after one unmeasured step, glibc returning large blocks at once
                        (MALLOC_MMAP_THRESHOLD_).

Every variant runs the step as the trainer does by default, with its loss groups (`logging.length_buckets` x
`logging.position_buckets`, [64, 256, 1024] each; with --sources N as a mixture of N sources: each bucket per
source, and tokens and documents per source). --metrics-off adds each variant again without them (no buckets,
one source: the step's plain path), --chunk-tokens N each layout again with loss.chunk_tokens=N; a table then
gives what the metrics cost per layout and loss: "paired" is the median over the measured steps of (seconds on
/ seconds off of the same step) - 1. It also times the FLOP model the loop evaluates on every logged step
(model and hardware FLOPs of the step's documents and batches, trainer.run.flops), against the step. Target:
the metrics cost at most 3% of the step (TARGET_METRICS_COST).

On a CPU shared with other jobs, pass --threads 1: under contention two OpenMP threads slow the many small
kernels of packed rows (sdpa_docs runs one SDPA per document) far more than unpacked's few large ones.

--compile runs every layout twice, eager and with train.compile (trainer/model/compile.py: each block
compiled, the attention kernel left eager), both from the same init on the same documents, interleaved like
the layouts. A second table gives compiled / eager valid tok/s per layout, the compiled variant's first step
(compilation included; "paired" = median of the per-step ratios), the recompilations during the measured steps
(all compiled variants: they share dynamo's cache) and the largest loss difference between the two (float
noise: same weights, same documents). Compiled variants get no CPU memory measurement.

Target: packed's valid-token speed-up over unpacked should be at least 90% of its saving in allocated
positions, efficiency = (valid_tps_packed / valid_tps_unpacked) / (alloc_unpacked / alloc_packed).
Example: unpacked allocates 1.5x the positions of packed; packed must then train >= 1.35x the valid tokens/s.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from omegaconf import OmegaConf

from trainer.config import LoggingConfig, LossConfig, OptimConfig, RunConfig, TrainConfig, resolve_dtype
from trainer.data.batch import Batch, Document, LossGroups
from trainer.data.config import DataConfig, PackingConfig
from trainer.data.pipeline import micro_batches
from trainer.distributed.config import DistributedConfig
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo
from trainer.model import (
    AttentionConfig,
    BackendUnavailable,
    GPTConfig,
    build_model,
    compute_dtype,
    resolve_backend,
)
from trainer.model.compile import CompileCounter
from trainer.run.flops import flop_model
from trainer.run.inputs import build_data, rows_for_rank
from trainer.run.optim import build_optimizer, build_scheduler
from trainer.run.step import train_step

LAYOUTS = ("packed", "unpacked", "bucketed")
BASELINE = "unpacked"
TARGET_EFFICIENCY = 0.90
TARGET_METRICS_COST = 0.03
REPO = Path(__file__).resolve().parent.parent
Steps = list[list[list[Document]]]  # [step][row][document]


@dataclass
class LayoutResult:
    layout: str
    compiled: bool = False
    """train.compile's variant of the layout (--compile)."""
    metrics: bool = True
    """The step sums its loss groups (the trainer's default); False: none (--metrics-off)."""
    chunk_tokens: int = 0
    """loss.chunk_tokens of the variant (0: the plain loss over whole logits)."""
    valid_per_step: list[int] = field(default_factory=list)
    allocated_per_step: list[int] = field(default_factory=list)
    real_tokens: int = 0
    docs: int = 0
    micro_batches: int = 0
    largest_micro_batch: int = 0
    """Allocated positions of the largest micro-batch (rows x row length) in the measured steps."""
    seconds: list[float] = field(default_factory=list)
    layout_seconds: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    """Loss of every step, warm-up included (same init and documents: the layouts should agree)."""
    peak_mem_bytes: int | None = None
    first_step_s: float | None = None
    """Wall time of the first (warm-up) step: compilation included for a compiled variant."""
    flop_seconds: list[float] = field(default_factory=list)
    """Per measured step: the FLOP model's time on the step's documents and batches
    (the loop's logged metric)."""

    @property
    def name(self) -> str:
        return (self.layout + ("+chunked" if self.chunk_tokens else "")
                + ("+compile" if self.compiled else "") + ("" if self.metrics else "-metrics"))

    @property
    def twin(self) -> str:
        """The name of the same variant with the metrics the other way."""
        return replace(self, metrics=not self.metrics).name

    @property
    def valid_tokens(self) -> int:
        return sum(self.valid_per_step)

    @property
    def allocated(self) -> int:
        return sum(self.allocated_per_step)

    @property
    def valid_tps(self) -> float:
        return self.valid_tokens / sum(self.seconds)

    @property
    def allocated_ps(self) -> float:
        return self.allocated / sum(self.seconds)

    @property
    def utilization(self) -> float:
        return self.real_tokens / self.allocated


# ---------------------------------------------------------------------------------------------------
# Setup: config, documents, model
# ---------------------------------------------------------------------------------------------------


def model_config(name: str, seq_len: int) -> GPTConfig:
    """configs/model/<name>.yaml (or a YAML path), with max_seq_len raised to seq_len if it is shorter."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else REPO / "configs" / "model" / f"{name}.yaml"
    # Resolved as Hydra would compose it: the file may say `max_seq_len: ${train.seq_len}`.
    composed = OmegaConf.create({"train": {"seq_len": seq_len}, "model": OmegaConf.load(path)})
    cfg = GPTConfig(**OmegaConf.to_container(composed.model, resolve=True))
    if cfg.max_seq_len < seq_len:
        print(f"# note: {path.name} has max_seq_len={cfg.max_seq_len} < --seq-len {seq_len}; "
              f"raised to {seq_len}")
        cfg.max_seq_len = seq_len
    return cfg


def run_config(args: argparse.Namespace, device: torch.device) -> RunConfig:
    """The typed config a `python -m trainer.train` run with these settings would get
    (--dtype, one process)."""
    dtype = resolve_dtype(args.dtype, device)
    return RunConfig(
        seed=args.seed,
        train=TrainConfig(seq_len=args.seq_len, tokens_per_step=args.tokens_per_step, dtype=dtype,
                          micro_batch_tokens=args.micro_batch_tokens, max_steps=args.warmup + args.steps),
        # tokenize here, before timing: no worker competes later
        data=DataConfig(path=args.data, num_workers=0),
        packing=PackingConfig(layout="packed", pad_to=args.pad_to),
        model=model_config(args.model, args.seq_len),
        attention=AttentionConfig(backend=resolve_backend(
            args.attention, device, compute_dtype(dtype))),
        loss=LossConfig(),
        optim=OptimConfig(),
        distributed=DistributedConfig(device=device.type),
        logging=LoggingConfig(progress=False),
        run_dir="",
    )


def draw_steps(cfg: RunConfig, info: DistInfo, num_steps: int) -> tuple[Steps, int, int]:
    """(the logical batches of num_steps optimizer steps, pad id, vocab size),
    drawn once from one RowStream."""
    data = build_data(cfg, info)
    n_rows = rows_for_rank(cfg.train.rows_per_step, info)
    steps = [data.rows.take(n_rows) for _ in range(num_steps)]
    if len(steps[-1]) < n_rows:
        raise SystemExit(f"the data ran out after {sum(map(len, steps))} rows; use fewer --steps")
    return steps, data.pad_id, data.vocab_size


def lay_out(rows: list[list[Document]], layout: str, cfg: RunConfig, pad_id: int) -> list[Batch]:
    packing = PackingConfig(**{**asdict(cfg.packing), "layout": layout})
    return micro_batches(rows, packing, cfg.train.seq_len, cfg.train.micro_batch_tokens, pad_id)


def loss_groups(cfg: RunConfig, sources: int, metrics: bool = True) -> LossGroups:
    """The loss groups the trainer's step would sum: logging.length_buckets x `sources` mixture sources (0 or
    1: no mixture) x logging.position_buckets; none with metrics=False. Every document counts as the first
    source (the cost is the same)."""
    if not metrics:
        return LossGroups()
    names = tuple(f"source{i}" for i in range(sources)) if sources > 1 else ()
    return LossGroups(tuple(cfg.logging.length_buckets), names, tuple(cfg.logging.position_buckets))


def build_engine(cfg: RunConfig, info: DistInfo, init_state: dict, compile: bool = False,
                 chunk_tokens: int = 0):
    """The variant's own model (a copy of the shared init), fresh AdamW and schedule,
    wrapped like the trainer's."""
    model = build_model(cfg.model, cfg.attention, loss_chunk_tokens=chunk_tokens).to(info.device)
    model.load_state_dict(init_state)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
    return parallelize(model, optimizer, scheduler, info, cfg.distributed, cfg.train.grad_clip,
                       resolve_dtype(cfg.train.dtype, info.device),
                       compile=compile)


def timed_step(engine, mbs: list[Batch], info: DistInfo, pad_id: int, groups: LossGroups):
    """(StepStats, seconds, peak bytes above the step's start on CUDA else None)."""
    cuda = info.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(info.device)
        torch.cuda.reset_peak_memory_stats(info.device)
        base = torch.cuda.memory_allocated(info.device)
    start = time.perf_counter()
    stats = train_step(engine, mbs, info, pad_id, groups=groups)
    if cuda:
        torch.cuda.synchronize(info.device)
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(info.device) - base if cuda else None
    return stats, seconds, peak


# ---------------------------------------------------------------------------------------------------
# The interleaved run
# ---------------------------------------------------------------------------------------------------


def run_interleaved(cfg: RunConfig, info: DistInfo, steps: Steps, pad_id: int, init_state: dict,
                    warmup: int, variants: list[LayoutResult], counter: CompileCounter | None = None,
                    sources: int = 0) -> tuple[dict[str, LayoutResult], int]:
    """Every variant trains every step, in rotating order. Returns (results by name, recompilations counted
    during the measured steps)."""
    results = {r.name: r for r in variants}
    engines = {r.name: build_engine(cfg, info, init_state, r.compiled, r.chunk_tokens) for r in variants}
    groups = {r.name: loss_groups(cfg, sources, r.metrics) for r in variants}
    flops = flop_model(build_model(cfg.model, cfg.attention), cfg.attention, "none", info.device,
                       cfg.train.dtype)
    names = list(results)
    recompiles_at_warmup_end = 0
    for i, rows in enumerate(steps):
        measured = i >= warmup
        if i == warmup and counter is not None:
            recompiles_at_warmup_end = counter.recompiles
        order = names[i % len(names):] + names[: i % len(names)]  # rotate: nobody always goes first
        valid_counts = set()
        for name in order:
            r = results[name]
            t0 = time.perf_counter()
            mbs = lay_out(rows, r.layout, cfg, pad_id)
            layout_s = time.perf_counter() - t0
            stats, seconds, peak = timed_step(engines[name], mbs, info, pad_id, groups[name])
            t0 = time.perf_counter()
            flops.step_flops(rows, mbs)
            flop_s = time.perf_counter() - t0
            valid_counts.add(stats.valid_tokens)
            r.losses.append(stats.loss)
            if i == 0:
                r.first_step_s = seconds
            if not measured:
                continue
            r.valid_per_step.append(stats.valid_tokens)
            r.allocated_per_step.append(stats.allocated_tokens)
            r.real_tokens += stats.real_tokens
            r.docs += stats.docs
            r.micro_batches += stats.micro_batches
            r.largest_micro_batch = max(r.largest_micro_batch, *(mb.num_allocated for mb in mbs))
            r.seconds.append(seconds)
            r.layout_seconds.append(layout_s)
            r.flop_seconds.append(flop_s)
            if peak is not None:
                r.peak_mem_bytes = max(r.peak_mem_bytes or 0, peak)
        if len(valid_counts) != 1:
            raise RuntimeError(f"step {i}: layouts disagree on the valid-target count {valid_counts}")
        tag = "warm-up" if not measured else "step"
        times = "  ".join(f"{name} {1e3 * results[name].seconds[-1]:.0f} ms" for name in names if measured)
        print(f"  {tag} {i + 1}/{len(steps)}  {times}", file=sys.stderr, flush=True)
    return results, (counter.recompiles - recompiles_at_warmup_end) if counter is not None else 0


# ---------------------------------------------------------------------------------------------------
# CPU peak memory: one layout per fresh process
# ---------------------------------------------------------------------------------------------------


def _status_kib(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{name} not in /proc/self/status")


def memory_worker(spec_path: str) -> int:
    """Peak resident set of one layout's steps above the resident set before them, in bytes."""
    spec = torch.load(spec_path, weights_only=False)
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    cfg, layout, pad_id, groups = spec["cfg"], spec["layout"], spec["pad_id"], spec["groups"]
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    engine = build_engine(cfg, info, spec["init_state"])
    batches = [lay_out(rows, layout, cfg, pad_id) for rows in spec["steps"]]
    del spec
    # allocates the AdamW moments: held between steps, not counted
    train_step(engine, batches[0], info, pad_id, groups=groups)
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the high-water mark VmHWM to the current resident set
    base = _status_kib("VmRSS")
    for mbs in batches[1:]:
        train_step(engine, mbs, info, pad_id, groups=groups)
    return (_status_kib("VmHWM") - base) * 1024


def cpu_peak_memory(cfg: RunConfig, steps: Steps, pad_id: int, init_state: dict, layout: str,
                    groups: LossGroups) -> int | None:
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = os.path.join(tmp, "spec.pt")
        spec = dict(cfg=cfg, layout=layout, pad_id=pad_id, init_state=init_state, steps=steps, groups=groups,
                    threads=torch.get_num_threads())
        torch.save(spec, spec_path)
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-worker", spec_path],
                              capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"# memory worker for {layout} failed: {(proc.stderr or proc.stdout).strip()[-300:]}",
              file=sys.stderr)
        return None
    return int(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------------


def efficiency(results: dict[str, LayoutResult]) -> float:
    """(valid_tps_packed / valid_tps_unpacked) / (alloc_unpacked / alloc_packed): 1.0 = all saved positions
    became speed."""
    packed, unpacked = results["packed"], results[BASELINE]
    return (packed.valid_tps / unpacked.valid_tps) / (unpacked.allocated / packed.allocated)


def per_step_efficiency(results: dict[str, LayoutResult]) -> list[float]:
    """The same figure for each measured step alone
    (paired: both layouts ran that step's documents back to back).

    A step has the same valid targets in both layouts, so its figure is (t_unpacked / t_packed) /
    (alloc_unpacked / alloc_packed). Their median shrugs off a burst of load from other processes that
    happens to hit one layout's step; the totals above do not.
    """
    packed, unpacked = results["packed"], results[BASELINE]
    return [
        (t_u / t_p) / (a_u / a_p)
        for t_p, t_u, a_p, a_u in zip(packed.seconds, unpacked.seconds, packed.allocated_per_step,
                                      unpacked.allocated_per_step, strict=True)
    ]


def markdown(results: dict[str, LayoutResult], steps: int) -> str:
    base = results.get(BASELINE) or next(iter(results.values()))  # ratios vs unpacked (eager) when it ran

    def ratio(value: float | None, ref: float | None) -> str:
        return f"{value / ref:.2f}x" if value and ref else "n/a"

    def mib(x: int | None) -> str:
        return f"{x / 2**20:,.1f}" if x is not None else "n/a"

    lines = [
        "| layout | valid tok/s | alloc pos/s | utilization | step ms (median) | layout ms "
        "| micro-batches/step | largest micro-batch (pos) | peak step mem (MiB) | valid tok/s vs unpacked "
        "| allocated vs unpacked | step time vs unpacked | peak mem vs unpacked |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results.values():
        step_ms = 1e3 * statistics.median(r.seconds)
        base_ms = 1e3 * statistics.median(base.seconds)
        lines.append(
            f"| {r.name} | {r.valid_tps:,.0f} | {r.allocated_ps:,.0f} | {r.utilization:.1%} | {step_ms:,.0f} "
            f"| {1e3 * statistics.median(r.layout_seconds):.1f} | {r.micro_batches / steps:.1f} "
            f"| {r.largest_micro_batch:,} | {mib(r.peak_mem_bytes)} | {ratio(r.valid_tps, base.valid_tps)} "
            f"| {ratio(r.allocated, base.allocated)} | {ratio(step_ms, base_ms)} "
            f"| {ratio(r.peak_mem_bytes, base.peak_mem_bytes)} |"
        )
    return "\n".join(lines)


def metrics_markdown(results: dict[str, LayoutResult]) -> tuple[str, dict]:
    """What the step's metrics cost, per variant run both ways (--metrics-off): step time on vs off of the
    same steps, and the FLOP model the loop evaluates per logged step. Returns (the table, figures for the
    JSON)."""
    lines = [
        "| variant | step ms on (median) | step ms off (median) | cost, totals | cost, paired (median) "
        "| verdict | FLOP model ms/step | FLOP model / step |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    figures = {}
    for r in results.values():
        off = results.get(r.twin)
        if not r.metrics or off is None:
            continue
        total = sum(r.seconds) / sum(off.seconds) - 1
        paired = statistics.median(t_on / t_off - 1
                                   for t_on, t_off in zip(r.seconds, off.seconds, strict=True))
        verdict = "PASS" if paired <= TARGET_METRICS_COST else "MISS"
        flop_ms = 1e3 * statistics.median(r.flop_seconds)
        lines.append(
            f"| {r.name} | {1e3 * statistics.median(r.seconds):,.0f} "
            f"| {1e3 * statistics.median(off.seconds):,.0f} "
            f"| {total:+.1%} | {paired:+.1%} | {verdict} | {flop_ms:.2f} "
            f"| {flop_ms / (1e3 * statistics.median(r.seconds)):.2%} |"
        )
        figures[r.name] = dict(cost_totals=total, cost_paired=paired, verdict=verdict, flop_model_ms=flop_ms)
    lines.append(f"\ncost = step time with the metrics / without - 1 "
                 f"(target <= {TARGET_METRICS_COST:.0%}, paired)")
    return "\n".join(lines), figures


def compile_markdown(results: dict[str, LayoutResult], recompiles: int) -> str:
    """Compiled vs eager, per layout: the same documents, the same init (--compile). "paired" is the median
    over the measured steps of eager seconds / compiled seconds of the same step (robust to bursts of
    load)."""
    lines = [
        "| layout | eager valid tok/s | compiled valid tok/s | compiled / eager | paired (median) "
        "| eager step ms (median) | compiled step ms (median) | compiled first step s | eager first step s "
        "| max loss diff |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results.values():
        if not r.compiled:
            continue
        e = results[replace(r, compiled=False).name]
        diff = max(abs(a - b) for a, b in zip(r.losses, e.losses, strict=True))
        paired = statistics.median(t_e / t_c for t_e, t_c in zip(e.seconds, r.seconds, strict=True))
        lines.append(
            f"| {e.name} | {e.valid_tps:,.0f} | {r.valid_tps:,.0f} | {r.valid_tps / e.valid_tps:.2f}x "
            f"| {paired:.2f}x "
            f"| {1e3 * statistics.median(e.seconds):,.0f} | {1e3 * statistics.median(r.seconds):,.0f} "
            f"| {r.first_step_s:.1f} | {e.first_step_s:.1f} | {diff:.1e} |"
        )
    lines.append(f"\nrecompilations during the measured steps (all compiled variants): {recompiles}")
    return "\n".join(lines)


def machine(device: torch.device) -> str:
    cpu = "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"
    if device.type == "cuda":
        text += f", {torch.cuda.get_device_name(device)}"
    return text


# ---------------------------------------------------------------------------------------------------
# Entry
# ---------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/demo", help="directory written by `python -m trainer.prepare`")
    p.add_argument("--seq-len", type=int, default=512, help="row length T")
    p.add_argument("--tokens-per-step", type=int, default=16384,
                   help="positions per step: tokens_per_step // T rows")
    p.add_argument("--micro-batch-tokens", type=int, default=4096,
                   help="positions (padding included) per micro-batch")
    p.add_argument("--steps", type=int, default=20, help="measured optimizer steps per layout")
    p.add_argument("--warmup", type=int, default=2, help="optimizer steps run first and not counted")
    p.add_argument("--attention", default="auto",
                   help="packed rows' kernel: auto (CPU: sdpa_docs) | dense | flex | ...")
    p.add_argument("--model", default="tiny", help="configs/model/<name>.yaml, or a YAML path")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--pad-to", default="longest", choices=["longest", "seq_len"],
                   help="unpacked rows' padding")
    p.add_argument("--mem-steps", type=int, default=3,
                   help="CPU: steps each memory subprocess measures (0: skip)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help="comma-separated layouts to run (default: all three)")
    p.add_argument("--compile", action="store_true",
                   help="also run each layout with train.compile, side by side")
    p.add_argument("--metrics-off", action="store_true",
                   help="also run each variant without the step's loss-group metrics, side by side "
                        "(their cost)")
    p.add_argument("--chunk-tokens", type=int, default=0,
                   help="also run each layout with loss.chunk_tokens=N (the chunked loss), side by side")
    p.add_argument("--sources", type=int, default=2,
                   help="loss groups as in a mixture of N sources "
                        "(per-source metrics too; 0 or 1: one source)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "auto"],
                   help="train.dtype (default fp32)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--memory-worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.memory_worker:
        print(memory_worker(args.memory_worker))
        return 0
    if not (Path(args.data) / "manifest.json").is_file():
        print(f"no prepared data in {args.data!r}; create it with:\n"
              f"  python -m trainer.prepare --source demo --out {args.data}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    layouts = [lay for lay in args.layouts.split(",") if lay]
    if not layouts or set(layouts) - set(LAYOUTS):
        print(f"--layouts must name some of {LAYOUTS}, got {args.layouts!r}", file=sys.stderr)
        return 2
    try:
        cfg = run_config(args, device)
    except BackendUnavailable as exn:
        print(f"{exn}", file=sys.stderr)
        return 2

    steps, pad_id, vocab_size = draw_steps(cfg, info, args.warmup + args.steps)
    cfg.model.vocab_size = vocab_size
    torch.manual_seed(args.seed)
    init_state = copy.deepcopy(build_model(cfg.model, cfg.attention).state_dict())
    n_params = sum(t.numel() for name, t in init_state.items() if name != "lm_head.weight")  # tied to wte
    docs = sum(len(row) for rows in steps[args.warmup:] for row in rows)
    print(f"# {args.model} ({n_params / 1e6:.2f} M params), T={args.seq_len}, {cfg.train.rows_per_step} rows "
          f"({args.tokens_per_step} positions) per step, "
          f"micro-batches <= {args.micro_batch_tokens} positions, "
          f"{cfg.train.dtype} AdamW, packed attention: {cfg.attention.backend}, "
          f"unpacked padded to {args.pad_to}")
    print(f"# {args.steps} measured steps after {args.warmup} warm-up, "
          f"{docs / args.steps:.1f} documents per step, data {args.data}")
    groups = loss_groups(cfg, args.sources)
    print(f"# metrics: {groups.size} loss groups (length buckets {list(groups.edges)} x {groups.num_sources} "
          f"source(s)){'; each variant also without (-metrics)' if args.metrics_off else ''}"
          f"{f'; chunked loss: loss.chunk_tokens={args.chunk_tokens}' if args.chunk_tokens else ''}")
    print(f"# {machine(device)}")

    variants = [LayoutResult(lay, compiled, metrics, chunk)
                for lay in layouts
                for chunk in ((0, args.chunk_tokens) if args.chunk_tokens else (0,))
                for compiled in ((False, True) if args.compile else (False,))
                for metrics in ((True, False) if args.metrics_off else (True,))]
    load_start = f"{os.getloadavg()[0]:.2f}"
    counter = CompileCounter() if args.compile else None
    results, recompiles = run_interleaved(cfg, info, steps, pad_id, init_state, args.warmup, variants,
                                          counter, args.sources)
    if device.type == "cpu" and args.mem_steps > 0:
        mem_steps = steps[:1] + steps[args.warmup : args.warmup + args.mem_steps]
        for layout in layouts:
            results[layout].peak_mem_bytes = cpu_peak_memory(cfg, mem_steps, pad_id, init_state, layout,
                                                             loss_groups(cfg, args.sources))

    print()
    print(markdown(results, args.steps))
    print()
    figures = report_efficiency(results) if "packed" in results and BASELINE in results else {}
    if args.compile:
        print()
        print(compile_markdown(results, recompiles))
        print()
    metrics_table, metrics_figures = metrics_markdown(results)
    print(metrics_table)
    print()
    first = {name: f"{r.losses[0]:.5f}" for name, r in results.items()}
    last = {name: f"{r.losses[-1]:.5f}" for name, r in results.items()}
    print(f"loss at step 1 {first}, at step {len(steps)} {last} (same init, same documents)")
    mem_note = ("CUDA max_memory_allocated above the step's start, max over measured steps"
                if device.type == "cuda"
                else f"CPU peak RSS above the step's start, own subprocess per layout, "
                     f"{args.mem_steps} steps")
    print(f"peak step mem: {mem_note}")
    print(f"load average at start / end: {load_start} / {os.getloadavg()[0]:.2f} ({os.cpu_count()} cores)")
    out = dict(machine=machine(device), args=vars(args), attention=cfg.attention.backend,
               recompiles_measured=recompiles if args.compile else None, metrics_cost=metrics_figures,
               layouts={name: {**asdict(r), "valid_tokens_per_s": r.valid_tps,
                               "allocated_positions_per_s": r.allocated_ps, "utilization": r.utilization}
                        for name, r in results.items()}, **figures)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def report_efficiency(results: dict[str, LayoutResult]) -> dict:
    """Print packed's efficiency against unpacked (eager runs); returns its figures for the JSON."""
    eff = efficiency(results)
    verdict = "PASS" if eff >= TARGET_EFFICIENCY else "MISS"
    paired = per_step_efficiency(results)
    q1, median_eff, q3 = statistics.quantiles(paired, n=4) if len(paired) > 1 else (paired[0],) * 3
    paired_verdict = "PASS" if median_eff >= TARGET_EFFICIENCY else "MISS"
    packed, unpacked = results["packed"], results[BASELINE]
    print(f"efficiency = (valid_tps_packed / valid_tps_unpacked) / (alloc_unpacked / alloc_packed) "
          f"= {packed.valid_tps / unpacked.valid_tps:.3f} / {unpacked.allocated / packed.allocated:.3f} "
          f"= {eff:.1%}  (target >= {TARGET_EFFICIENCY:.0%}): {verdict}")
    print(f"per-step paired efficiency: median {median_eff:.1%} (quartiles {q1:.1%} - {q3:.1%}, "
          f"{len(paired)} steps): {paired_verdict}")
    return dict(efficiency=eff, target=TARGET_EFFICIENCY, verdict=verdict, per_step_efficiency=paired,
                median_per_step_efficiency=median_eff, paired_verdict=paired_verdict)


if __name__ == "__main__":
    raise SystemExit(main())
