"""Peak memory and speed of the memory options (not a test): loss.chunk_tokens and
train.activation_checkpointing against the plain path, each configuration in its own fresh process.

    python bench/memory.py --model tiny --seq-len 512 --micro-batch-tokens 4096 \\
        --variants plain chunk=512 chunk=1024 chunk=4096 ckpt=full ckpt=selective
    python bench/memory.py --model gpt2-124m --seq-len 2048 --micro-batch-tokens 2048 --steps 1 \\
        --variants plain chunk=1024 ckpt=full ckpt=selective chunk=1024+ckpt=full
    python bench/memory.py --head --tokens 4096 --vocab 8192 --width 64   # the loss alone, per implementation

A variant is `plain`, `chunk=N` (loss.chunk_tokens=N), `ckpt=full|selective` (train.activation_checkpointing),
or several joined by `+`. Each runs in a fresh subprocess: the model (configs/model/<name>.yaml, --vocab rows)
from one seed, fp32 AdamW (trainer.run.optim), and the same micro-batches: packed rows of T positions filled
with random tokens in documents whose lengths are drawn from bench/lengths/demo_train.txt. A step is forward +
backward of --micro-batches micro-batches (summed loss / valid targets, as train_step does) and the optimizer
step. Each process runs one unmeasured step first (it allocates the AdamW moments, held between steps like the
weights).

    peak step mem   one process per variant, --mem-steps steps: peak resident set (VmHWM, reset via
                    /proc/self/clear_refs) minus the resident set before them: activations, logits, gradients,
                    transients (bench/throughput.py's method; glibc returns each block over 64 KiB at once,
                    MALLOC_MMAP_THRESHOLD_=65536, which slows large allocations, so this process is not timed)
    step s          --rounds processes per variant with glibc's defaults, --steps timed steps each, the
                    variants in rotating order (machine noise hits all alike): the median of the processes'
                    median step times, and the best step (on a shared machine other jobs only ever add time)
    tok/s           valid targets of a step / best step s
    first loss      of the first step (same init, same batches: every variant should agree)

--head measures the loss alone on random (N, C) hidden states and a (V, C) head, forward + backward:
`plain` (full fp32 logits, F.cross_entropy), `function` (trainer.model.loss.chunked_cross_entropy: per-chunk
gradients in forward, nothing recomputed) and `checkpoint` (torch.utils.checkpoint around each chunk's logits
and loss: the chunk's logits recomputed in backward), the latter two at each --chunks size.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.config import OptimConfig
from trainer.data.batch import IGNORE_INDEX, Batch, Document, collate_rows
from trainer.model import AttentionConfig, build_model, model_inputs
from trainer.model.gpt import apply_activation_checkpointing
from trainer.model.loss import chunked_cross_entropy
from trainer.run.optim import build_optimizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput as tp  # noqa: E402  bench/throughput.py: model_config, machine

REPO = Path(__file__).resolve().parent.parent
LENGTHS = REPO / "bench" / "lengths" / "demo_train.txt"
DEFAULT_VOCAB = {"tiny": 8192, "small": 8192, "gpt2-124m": 50304}  # the demo BPE; GPT-2's 50257 padded to 64


def parse_variant(text: str) -> dict:
    """'chunk=1024+ckpt=full' -> {'chunk_tokens': 1024, 'ckpt': 'full'}; 'plain' -> defaults."""
    variant = {"chunk_tokens": 0, "ckpt": "none"}
    for part in text.split("+"):
        if part == "plain":
            continue
        key, _, value = part.partition("=")
        if key == "chunk":
            variant["chunk_tokens"] = int(value)
        elif key == "ckpt":
            variant["ckpt"] = value
        else:
            raise SystemExit(f"unknown variant part {part!r}: plain | chunk=N | ckpt=full|selective, "
                             "joined by +")
    return variant


def synthetic_batches(n: int, rows: int, seq_len: int, vocab: int, seed: int) -> list[Batch]:
    """n packed micro-batches of `rows` full rows; document lengths from the demo corpus, random tokens."""
    rng = np.random.default_rng(seed)
    pool = np.array([int(x) for x in LENGTHS.read_text().split()])
    batches = []
    for b in range(n):
        batch_rows = []
        for r in range(rows):
            row, space = [], seq_len
            while space:
                length = min(int(rng.choice(pool)), space)
                row.append(Document(f"{b}.{r}.{len(row)}", rng.integers(1, vocab, length)))
                space -= length
            batch_rows.append(row)
        batches.append(collate_rows(batch_rows, seq_len, 0, "packed"))
    return batches


def _status_kib(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{name} not in /proc/self/status")


def _reset_peak() -> int:
    """Resets VmHWM to the current resident set; returns that (bytes)."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


# ---------------------------------------------------------------------------------------------------
# Workers (one configuration per process)
# ---------------------------------------------------------------------------------------------------


def train_worker(spec: dict) -> dict:
    """Steps of one variant: peak memory above the start of the measured steps, step times, first loss."""
    variant = parse_variant(spec["variant"])
    cfg = tp.model_config(spec["model"], spec["seq_len"])
    cfg.vocab_size = spec["vocab"]
    rows = spec["micro_batch_tokens"] // spec["seq_len"]
    batches = synthetic_batches(spec["micro_batches"], rows, spec["seq_len"], spec["vocab"], seed=0)
    valid = sum(mb.num_valid_targets for mb in batches)
    torch.manual_seed(0)
    model = build_model(cfg, AttentionConfig(backend=spec["attention"]),
                        loss_chunk_tokens=variant["chunk_tokens"])
    apply_activation_checkpointing(model, variant["ckpt"])
    optimizer = build_optimizer(model, OptimConfig())

    def step() -> float:
        loss = 0.0
        for mb in batches:
            out = model(**model_inputs(mb))
            (out.loss_sum / valid).backward()
            loss += out.loss_sum.item() / valid
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    first_loss = step()  # allocates the AdamW moments: not counted
    base = _reset_peak()
    seconds = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    return dict(peak=_status_kib("VmHWM") * 1024 - base, seconds=seconds, loss=first_loss, valid=valid)


def _checkpointed_chunk_loss(h_nC: torch.Tensor, weight_VC: torch.Tensor,
                             targets_n: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((h_nC @ weight_VC.T).float(), targets_n, ignore_index=IGNORE_INDEX,
                           reduction="sum")


def head_loss(impl: str, h_NC: torch.Tensor, weight_VC: torch.Tensor, targets_N: torch.Tensor, chunk: int):
    """Summed cross entropy of h_NC @ weight_VC.T by one implementation (targets already shifted)."""
    if impl == "plain":
        return F.cross_entropy((h_NC @ weight_VC.T).float(), targets_N, ignore_index=IGNORE_INDEX,
                               reduction="sum")
    if impl == "function":  # chunked_cross_entropy shifts its labels: pass them unshifted, one row
        labels = torch.cat([targets_N.new_full((1,), IGNORE_INDEX), targets_N])[None, :-1]
        return chunked_cross_entropy(h_NC[None], weight_VC, labels, None, chunk)[0]
    if impl == "checkpoint":
        return sum(checkpoint(_checkpointed_chunk_loss, h_NC[s : s + chunk], weight_VC,
                              targets_N[s : s + chunk], use_reentrant=False)
                   for s in range(0, h_NC.shape[0], chunk))
    raise ValueError(impl)


def head_worker(spec: dict) -> dict:
    torch.manual_seed(0)
    n, v, c = spec["tokens"], spec["vocab"], spec["width"]
    h_NC = torch.randn(n, c, requires_grad=True)
    weight_VC = (0.02 * torch.randn(v, c)).requires_grad_()
    targets_N = torch.randint(0, v, (n,))
    targets_N[::50] = IGNORE_INDEX
    targets_N[-1] = IGNORE_INDEX  # as in a row: the last position predicts nothing (and `function` shifts)

    def step() -> float:
        h_NC.grad = weight_VC.grad = None
        loss = head_loss(spec["impl"], h_NC, weight_VC, targets_N, spec["chunk"])
        loss.backward()
        return loss.item()

    first_loss = step()
    base = _reset_peak()
    seconds = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    return dict(peak=_status_kib("VmHWM") * 1024 - base, seconds=seconds, loss=first_loss,
                valid=int((targets_N >= 0).sum()))


def run_worker(spec: dict, memory: bool) -> dict | None:
    """spec in a fresh process of this script; its result dict (None if it failed).

    memory=True: glibc returns every block over 64 KiB to the system when freed, so the resident set follows
    what is live. That costs page faults on every large allocation, so step times come from other processes
    run with glibc's defaults.
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0") if memory else None
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        print(f"# worker {spec} failed: {(proc.stderr or proc.stdout).strip()[-500:]}", file=sys.stderr)
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------------
# Entry
# ---------------------------------------------------------------------------------------------------


def run_all(specs: list[dict], names: list[str], rounds: int, mem_steps: int) -> dict[str, dict]:
    """Per variant: its peak memory (one process, mem_steps measured steps) and its step times (`rounds`
    processes, the order of the variants rotating by one each round)."""
    results: dict[str, dict] = {name: {"peak": None, "runs": []} for name in names}
    pairs = list(zip(specs, names, strict=True))
    for spec, name in pairs if mem_steps else []:
        res = run_worker({**spec, "steps": mem_steps}, memory=True)
        if res is not None:
            results[name]["peak"] = res["peak"]
            print(f"  memory: {name} peak {res['peak'] / 2**20:,.1f} MiB", file=sys.stderr, flush=True)
    for r in range(rounds):
        k = r % len(pairs)
        for spec, name in pairs[k:] + pairs[:k]:
            res = run_worker(spec, memory=False)
            if res is not None:
                results[name]["runs"].append(res)
                print(f"  round {r + 1}: {name} step {statistics.median(res['seconds']):.3f} s",
                      file=sys.stderr, flush=True)
    return results


def table(results: dict[str, dict], baseline: str) -> str:
    """Markdown: peak memory, median step time (of each process's median), tok/s, ratios to `baseline`."""

    def step_s(name: str) -> tuple[float, float] | tuple[None, None]:
        runs = results[name]["runs"]
        if not runs:
            return None, None
        return (statistics.median(statistics.median(r["seconds"]) for r in runs),
                min(min(r["seconds"]) for r in runs))

    def ratio(x: float | None, ref: float | None) -> str:
        return f"{x / ref:.2f}x" if x and ref else "n/a"

    base_peak, (base_median, base_best) = results[baseline]["peak"], step_s(baseline)
    lines = ["| variant | peak step mem (MiB) | mem vs plain | step s (median) | step s (best) "
             "| tok/s (best) | tok/s vs plain (median, best) | first loss |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, res in results.items():
        peak, (median, best) = res["peak"], step_s(name)
        mem = f"{peak / 2**20:,.1f}" if peak is not None else "n/a"
        if median is None:
            lines.append(f"| {name} | {mem} | {ratio(peak, base_peak)} | failed | | | | |")
            continue
        first = res["runs"][0]
        lines.append(f"| {name} | {mem} | {ratio(peak, base_peak)} | {median:.3f} | {best:.3f} "
                     f"| {first['valid'] / best:,.0f} | {ratio(base_median, median)}, "
                     f"{ratio(base_best, best)} | {first['loss']:.6f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="configs/model/<name>.yaml, or a YAML path")
    p.add_argument("--vocab", type=int, default=None,
                   help="vocabulary rows (default: tiny/small 8192, gpt2-124m 50304)")
    p.add_argument("--seq-len", type=int, default=512, help="row length T")
    p.add_argument("--micro-batch-tokens", type=int, default=4096,
                   help="positions per micro-batch (whole rows)")
    p.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--attention", default="sdpa_docs", help="packed rows' attention backend")
    p.add_argument("--variants", nargs="+", default=["plain", "chunk=1024", "ckpt=full", "ckpt=selective"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per process (after one unmeasured)")
    p.add_argument("--mem-steps", type=int, default=1,
                   help="steps the memory process measures (0: skip memory)")
    p.add_argument("--rounds", type=int, default=1, help="times each variant runs, in rotating order")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--head", action="store_true", help="the loss alone: plain vs chunked implementations")
    p.add_argument("--tokens", type=int, default=4096, help="--head: positions N")
    p.add_argument("--width", type=int, default=64, help="--head: hidden width C")
    p.add_argument("--chunks", type=int, nargs="+", default=[512, 1024], help="--head: chunk sizes")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        spec = json.loads(args.worker)
        if spec.get("threads"):
            torch.set_num_threads(spec["threads"])
        print(json.dumps(head_worker(spec) if "impl" in spec else train_worker(spec)))
        return 0
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if args.head:
        vocab = args.vocab or 8192
        names = ["plain"] + [f"{impl} chunk={c}" for c in args.chunks for impl in ("function", "checkpoint")]
        specs = [dict(impl=name.split()[0], chunk=int(name.split("=")[1]) if "=" in name else 0,
                      tokens=args.tokens, vocab=vocab, width=args.width, steps=args.steps, threads=threads)
                 for name in names]
        print(f"# head + loss alone: N={args.tokens}, V={vocab}, C={args.width}, fp32, forward + backward; "
              f"{args.steps} measured steps per process, {args.rounds} round(s)")
    else:
        if args.micro_batch_tokens % args.seq_len:
            raise SystemExit("--micro-batch-tokens must be a multiple of --seq-len (whole rows)")
        vocab = args.vocab or DEFAULT_VOCAB.get(args.model, 8192)
        names = args.variants
        for name in names:
            parse_variant(name)
        specs = [dict(variant=name, model=args.model, vocab=vocab, seq_len=args.seq_len,
                      micro_batch_tokens=args.micro_batch_tokens, micro_batches=args.micro_batches,
                      attention=args.attention, steps=args.steps, threads=threads) for name in names]
        print(f"# {args.model}, V={vocab}, T={args.seq_len}, {args.micro_batches} micro-batch(es) of "
              f"{args.micro_batch_tokens} positions per step, packed ({args.attention}), fp32 AdamW; "
              f"{args.steps} measured steps per process after 1, {args.rounds} round(s)")
    print(f"# {tp.machine(torch.device('cpu'))}")
    load_start = os.getloadavg()[0]
    results = run_all(specs, names, args.rounds, args.mem_steps)
    print()
    print(table(results, names[0]))
    print()
    print(f"load average at start / end: {load_start:.2f} / {os.getloadavg()[0]:.2f} "
          f"({os.cpu_count()} cores)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(args=vars(args), results=results), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
