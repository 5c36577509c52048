"""GPU training benchmark (not a test): packed rows on the best varlen kernel vs unpacked rows, the same documents.

    python -m trainer.prepare --source demo --out data/demo                    # once
    python bench/gpu_train.py --data data/demo --out runs/gpu_train            # CUDA: gpt2-124m, bf16, T=2048
    python bench/gpu_train.py --data data/demo --out /tmp/g --device cpu --model tiny --seq-len 128 \\
        --tokens-per-step 1024 --micro-batch-tokens 512 --steps 2 --warmup 1   # a CPU dry run

Each step draws one logical batch (tokens_per_step / seq_len packer rows) from one `RowStream` and lays it out
twice: `packed` (attention from --attention, default `auto`: flash-attn, else torch's varlen_attn under bf16
on CUDA) and `unpacked` (one document per row, padded to the longest of its micro-batch, SDPA causal). Each
layout trains its own copy of one init with the real `trainer.run.step.train_step` (bf16 autocast, fp32 AdamW,
the default per-length loss metrics on, as in a run); both run every step, back to back, the order
alternating. The first --warmup steps are not counted; measuring stops after --steps steps or once the
measured steps have used --time-budget seconds, whichever comes first. Documents that run out start another
epoch.

Reported per layout, in <out>/gpu_train.json and <out>/gpu_train.md (LAYOUT_KEYS):
    valid_tokens_per_s      valid targets / summed train_step seconds (the same numerator in both layouts)
    allocated_tokens_per_s  positions computed (padding included) / the same seconds
    token_utilization       real (non-padding) tokens / allocated positions
    peak_mem_gib            CUDA: max over measured steps of the allocator's peak during the step above what
                            was allocated at its start (activations, gradients, temporaries); null on CPU
    mfu                     model FLOPs of the real tokens / second / the device's peak dense bf16 FLOP/s
                            (trainer.run.metrics.PEAK_FLOPS); null where the peak is unknown (CPU). Model
                            FLOPs per step: trainer.run.flops (6 x matmul parameters per real token + 6 x
                            n_layer x n_embd x sum(doc_len^2) for causal attention within documents, forward
                            and backward), the `mfu` of training runs. The same work in both layouts: padding
                            is not counted.
"""  # noqa: E501 (line 1 is the --help description: __doc__.splitlines()[0])

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

import throughput as tp  # bench/throughput.py (beside this file): model config, layouts, engines, timed step
import torch

from trainer.config import LoggingConfig, LossConfig, OptimConfig, RunConfig, TrainConfig
from trainer.data.batch import Document
from trainer.data.config import DataConfig, PackingConfig
from trainer.distributed.config import DistributedConfig
from trainer.distributed.groups import DistInfo
from trainer.model import AttentionConfig, BackendUnavailable, build_model, compute_dtype, resolve_backend
from trainer.run.flops import flop_model
from trainer.run.inputs import build_data, rows_for_rank
from trainer.run.metrics import peak_flops

LAYOUTS = ("packed", "unpacked")
VARLEN_KERNELS = ("flash", "torch_varlen")
LAYOUT_KEYS = (
    "valid_tokens_per_s", "allocated_tokens_per_s", "token_utilization", "peak_mem_gib", "mfu",
    "step_ms_median", "valid_tokens", "allocated_tokens", "real_tokens", "docs", "micro_batches_per_step",
    "loss_first", "loss_last",
)
RESULT_KEYS = (
    "machine", "device", "torch", "model", "n_params", "matmul_params", "dtype", "seq_len", "tokens_per_step",
    "micro_batch_tokens", "attention", "varlen_kernel", "warmup_steps", "measured_steps", "measured_seconds",
    "docs_per_step", "peak_flops", "model_flops_per_step", "valid_tokens_per_s_ratio", "layouts", "args",
)


@dataclass
class Tally:
    """One layout's measured steps."""

    seconds: list[float] = field(default_factory=list)
    valid: int = 0
    allocated: int = 0
    real: int = 0
    docs: int = 0
    micro_batches: int = 0
    losses: list[float] = field(default_factory=list)
    """Every step's loss, warm-up included (same init and documents: the layouts should agree)."""
    peak_bytes: int | None = None

    def add(self, stats, seconds: float, peak: int | None) -> None:
        """Count one measured step (a trainer.run.step.StepStats, its seconds, its peak bytes above its
        start)."""
        self.seconds.append(seconds)
        self.valid += stats.valid_tokens
        self.allocated += stats.allocated_tokens
        self.real += stats.real_tokens
        self.docs += stats.docs
        self.micro_batches += stats.micro_batches
        if peak is not None:
            self.peak_bytes = max(self.peak_bytes or 0, peak)


def run_config(args: argparse.Namespace, device: torch.device) -> RunConfig:
    """The typed config of a `python -m trainer.train` run with these settings (one process)."""
    attention_dtype = compute_dtype(args.dtype)  # what attention sees
    return RunConfig(
        seed=args.seed,
        train=TrainConfig(seq_len=args.seq_len, tokens_per_step=args.tokens_per_step,
                          micro_batch_tokens=args.micro_batch_tokens, max_steps=args.warmup + args.steps,
                          dtype=args.dtype),
        data=DataConfig(path=args.data, num_workers=0),  # tokenize here, between the timed steps
        packing=PackingConfig(layout="packed", pad_to="longest"),
        model=tp.model_config(args.model, args.seq_len),
        attention=AttentionConfig(backend=resolve_backend(args.attention, device, attention_dtype)),
        loss=LossConfig(),
        optim=OptimConfig(lr=args.lr),
        distributed=DistributedConfig(device=device.type),
        logging=LoggingConfig(progress=False),
        run_dir="",
    )


def take_rows(data, n_rows: int) -> list[list[Document]]:
    """The next n_rows packer rows, starting another epoch of the documents when one ends."""
    rows = data.rows.take(n_rows)
    while len(rows) < n_rows:
        data.rows.next_epoch()
        more = data.rows.take(n_rows - len(rows))
        if not more:
            raise SystemExit(f"no documents in {data.tokenizer_dir.parent}: nothing to train on")
        rows += more
    return rows


def run_steps(args: argparse.Namespace, cfg: RunConfig, info: DistInfo, data, engines: dict,
              flops_per_step) -> tuple[dict[str, Tally], float, float, int]:
    """Train both layouts on the same rows, step by step: (tallies, model FLOPs, seconds, measured steps)."""
    n_rows = rows_for_rank(cfg.train.rows_per_step, info)
    tallies = {layout: Tally() for layout in LAYOUTS}
    groups = tp.loss_groups(cfg, sources=1)  # the trainer's default metrics: the length buckets of one source
    flops_total, measured_s, step = 0.0, 0.0, 0
    while step < args.warmup + args.steps and not (args.time_budget and measured_s >= args.time_budget):
        rows = take_rows(data, n_rows)
        measured = step >= args.warmup
        valid_counts = set()
        for layout in LAYOUTS if step % 2 == 0 else LAYOUTS[::-1]:  # alternate: neither always goes first
            mbs = tp.lay_out(rows, layout, cfg, data.pad_id)
            stats, seconds, peak = tp.timed_step(engines[layout], mbs, info, data.pad_id, groups)
            valid_counts.add(stats.valid_tokens)
            tallies[layout].losses.append(stats.loss)
            if measured:
                tallies[layout].add(stats, seconds, peak)
        if len(valid_counts) != 1:
            raise RuntimeError(f"step {step}: the layouts disagree on the valid-target count {valid_counts}")
        step += 1
        if measured:
            flops_total += flops_per_step(rows)
            measured_s += sum(tallies[layout].seconds[-1] for layout in LAYOUTS)
            times = "  ".join(f"{lay} {1e3 * tallies[lay].seconds[-1]:.0f} ms" for lay in LAYOUTS)
            print(f"  step {step - args.warmup}  {times}", file=sys.stderr, flush=True)
        else:
            print(f"  warm-up {step}/{args.warmup}", file=sys.stderr, flush=True)
    data.rows.close()
    return tallies, flops_total, measured_s, step - args.warmup


def layout_summary(t: Tally, flops_per_s_peak: float | None, model_flops_total: float, steps: int) -> dict:
    seconds = sum(t.seconds)
    return dict(
        valid_tokens_per_s=t.valid / seconds,
        allocated_tokens_per_s=t.allocated / seconds,
        token_utilization=t.real / t.allocated,
        peak_mem_gib=t.peak_bytes / 2**30 if t.peak_bytes is not None else None,
        mfu=model_flops_total / seconds / flops_per_s_peak if flops_per_s_peak else None,
        step_ms_median=1e3 * statistics.median(t.seconds),
        valid_tokens=t.valid,
        allocated_tokens=t.allocated,
        real_tokens=t.real,
        docs=t.docs,
        micro_batches_per_step=t.micro_batches / steps,
        loss_first=t.losses[0],
        loss_last=t.losses[-1],
    )


def markdown(result: dict) -> str:
    def num(x, fmt: str) -> str:
        return format(x, fmt) if x is not None else "n/a"

    lines = [
        f"**{result['model']}** ({result['n_params'] / 1e6:.1f} M parameters), {result['dtype']}, "
        f"T = {result['seq_len']}, {result['tokens_per_step']:,} positions per step, micro-batches <= "
        f"{result['micro_batch_tokens']:,}; packed attention: `{result['attention']}`; "
        f"{result['measured_steps']} measured steps after {result['warmup_steps']} warm-up "
        f"({result['measured_seconds']:.0f} s), {result['docs_per_step']:.1f} documents per step; "
        f"{result['machine']}",
        "",
        "| layout | valid tok/s | allocated tok/s | utilization | step ms (median) | peak step mem (GiB) "
        "| MFU | micro-batches/step | loss first / last |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in result["layouts"].items():
        lines.append(
            f"| {name} | {r['valid_tokens_per_s']:,.0f} | {r['allocated_tokens_per_s']:,.0f} "
            f"| {r['token_utilization']:.1%} | {r['step_ms_median']:,.1f} | {num(r['peak_mem_gib'], '.2f')} "
            f"| {num(r['mfu'], '.1%')} | {r['micro_batches_per_step']:.1f} "
            f"| {r['loss_first']:.4f} / {r['loss_last']:.4f} |"
        )
    lines += ["", f"packed / unpacked valid tokens/s: {result['valid_tokens_per_s_ratio']:.2f}x"]
    if result["varlen_kernel"] is None and result["device"] == "cuda":
        lines.append(f"NOTE: the packed rows ran `{result['attention']}`, not a varlen kernel "
                     "(flash, torch_varlen)")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="directory written by `python -m trainer.prepare`")
    p.add_argument("--out", required=True, help="directory for gpu_train.json and gpu_train.md")
    p.add_argument("--model", default="gpt2-124m", help="configs/model/<name>.yaml, or a YAML path")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="embedding rows (default: the tokenizer's; 50304 gives GPT-2's 124 M parameters)")
    p.add_argument("--seq-len", type=int, default=2048, help="row length T")
    p.add_argument("--tokens-per-step", type=int, default=65536,
                   help="positions per step: tokens_per_step // T rows")
    p.add_argument("--micro-batch-tokens", type=int, default=32768,
                   help="positions (padding included) per micro-batch")
    p.add_argument("--steps", type=int, default=200, help="at most this many measured steps")
    p.add_argument("--warmup", type=int, default=3, help="steps run first and not counted")
    p.add_argument("--time-budget", type=float, default=150.0,
                   help="stop measuring once the measured steps took this many seconds (0: no limit)")
    p.add_argument("--attention", default="auto", help="packed rows' kernel (auto: the best that runs here)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"],
                   help="bf16 autocast (varlen kernels need it)")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # attention=auto says what it picked and why
    logging.basicConfig(level=logging.INFO, format="# %(message)s")
    if not (Path(args.data) / "manifest.json").is_file():
        print(f"no prepared data in {args.data!r}; create it with:\n"
              f"  python -m trainer.prepare --source demo --out {args.data}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=device)
    try:
        cfg = run_config(args, device)
    except BackendUnavailable as exn:
        print(f"{exn}", file=sys.stderr)
        return 2

    data = build_data(cfg, info)
    cfg.model.vocab_size = args.vocab_size or data.vocab_size
    torch.manual_seed(args.seed)
    model = build_model(cfg.model, cfg.attention, vocab_size=data.vocab_size)
    init_state = {k: v.clone() for k, v in model.state_dict().items()}
    n_params = model.num_params()
    flops = flop_model(model, cfg.attention, "none", device, args.dtype)
    del model
    engines = {layout: tp.build_engine(cfg, info, init_state) for layout in LAYOUTS}
    kernel = cfg.attention.backend
    print(f"# {args.model} ({n_params / 1e6:.1f} M params, vocab {cfg.model.vocab_size}), {args.dtype}, "
          f"T={args.seq_len}, {cfg.train.rows_per_step} rows per step, "
          f"micro-batches <= {args.micro_batch_tokens}, packed attention: {kernel}, "
          "unpacked padded to the longest of each micro-batch")
    print(f"# {tp.machine(device)}")
    if device.type == "cuda" and kernel not in VARLEN_KERNELS:
        print(f"# WARNING: no varlen kernel runs here; packed rows use {kernel}", file=sys.stderr)

    def flops_per_step(rows: list[list[Document]]) -> float:
        return flops.model_flops(len(doc) for row in rows for doc in row)

    tallies, flops_total, measured_s, steps = run_steps(args, cfg, info, data, engines, flops_per_step)
    if steps < 1:
        print("no measured step: raise --steps or --time-budget", file=sys.stderr)
        return 1
    device_peak = peak_flops(device)
    layouts = {lay: layout_summary(tallies[lay], device_peak, flops_total, steps) for lay in LAYOUTS}
    result = dict(
        machine=tp.machine(device), device=device.type, torch=torch.__version__, model=args.model,
        n_params=n_params, matmul_params=flops.matmul_params, dtype=args.dtype, seq_len=args.seq_len,
        tokens_per_step=args.tokens_per_step, micro_batch_tokens=args.micro_batch_tokens, attention=kernel,
        varlen_kernel=kernel if kernel in VARLEN_KERNELS else None, warmup_steps=args.warmup,
        measured_steps=steps, measured_seconds=measured_s, docs_per_step=tallies["packed"].docs / steps,
        peak_flops=device_peak, model_flops_per_step=flops_total / steps,
        valid_tokens_per_s_ratio=(layouts["packed"]["valid_tokens_per_s"]
                                  / layouts["unpacked"]["valid_tokens_per_s"]),
        layouts=layouts, args=vars(args),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_train.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / "gpu_train.md").write_text(text)
    print()
    print(text)
    print(f"written: {out / 'gpu_train.json'}, {out / 'gpu_train.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
