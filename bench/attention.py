"""Time and peak memory of document-causal attention, forward + backward, per backend and packed length N.

Not a test. One packed row of N tokens is filled with documents whose lengths follow a heavy-tailed
distribution (lognormal, clipped to the row; or sampled from `--lengths FILE`, one length per line), and
each backend of trainer.model.attention runs forward + backward over flat (N, heads, head_dim) q, k, v.
The step includes building the backend's view of the boundaries (dense mask, flex block mask, host list),
as the model does once per forward pass.

Each (backend, N) runs in its own subprocess so memory is measured cleanly:
    CUDA: torch.cuda.max_memory_allocated() minus what was allocated before the step.
    CPU:  the process's peak resident set (VmHWM, reset through /proc/self/clear_refs after warm-up) minus
          its resident set before the step, with glibc told to return large blocks to the OS at once
          (MALLOC_MMAP_THRESHOLD_) so freed tensors do not hide later ones.
Varlen backends should grow ~linearly in N (x2 per doubling); `dense` grows with N^2 (x4 per doubling) and
is skipped once its N x N mask and scores would pass --dense-max-gb.

Examples:
    python bench/attention.py --device cpu --max-n 32768
    python bench/attention.py --device cpu --forward-only --backends flex,sdpa_docs,dense
    python bench/attention.py --device cuda --backends torch_varlen,flex,sdpa_docs,dense --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import numpy as np

ALL_BACKENDS = ("flash", "torch_varlen", "flex", "sdpa_docs", "dense")


def doc_lengths(n: int, seed: int, median: float, sigma: float, pool: list[int] | None) -> list[int]:
    """Lengths that fill exactly n tokens: lognormal(median, sigma) or drawn from `pool`, clipped, last one
    cut."""
    rng = np.random.default_rng(seed)
    lengths, used = [], 0
    while used < n:
        length = int(rng.choice(pool)) if pool else int(round(rng.lognormal(np.log(median), sigma)))
        length = min(max(length, 1), n - used)
        lengths.append(length)
        used += length
    return lengths


def dense_bytes_estimate(n: int) -> int:
    """`dense` holds the (N, N) Boolean mask and the fp32 additive mask SDPA makes of it: ~5 N^2 bytes.

    (Measured on CPU: 1.3 GiB at N = 16K. A kernel that falls back to SDPA's math path also holds
    fp32 scores per head, several times more: lower --dense-max-gb there.)
    """
    return n * n * (1 + 4)


# ---------------------------------------------------------------------------------------------------
# Worker: one (backend, N) in a fresh process
# ---------------------------------------------------------------------------------------------------


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def worker(spec: dict) -> dict:
    import torch

    from trainer.model.attention import varlen_attention

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    dtype = getattr(torch, spec["dtype"])
    lengths = spec["lengths"]
    n, heads, head_dim = spec["n"], spec["heads"], spec["head_dim"]
    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(n, heads, head_dim, device=device, dtype=dtype, generator=g) for _ in range(3))
    backward = not spec["forward_only"]
    for t in (q, k, v):
        t.requires_grad_(backward)

    def step() -> None:
        with torch.set_grad_enabled(backward):
            out = varlen_attention(q, k, v, cu, max(lengths), backend=spec["backend"])
            if backward:
                out.backward(torch.ones_like(out))
        for t in (q, k, v):
            t.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up: compiles flex, loads kernels
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        import gc

        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the peak-RSS high-water mark to the current RSS
        base = _rss_kib("VmRSS")
        step()
        peak = (_rss_kib("VmHWM") - base) * 1024
    times = []
    for _ in range(spec["repeats"]):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return dict(backend=spec["backend"], n=n, docs=len(lengths), max_len=max(lengths),
                ms=1e3 * statistics.median(times), peak_bytes=int(peak))


# ---------------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------------


def available_backends(device: str, forward_only: bool) -> dict[str, str | None]:
    """backend -> None if it runs here, else why not."""
    import torch

    from trainer.model.attention import backend_unavailable_reason

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    return {b: backend_unavailable_reason(b, torch.device(device), dtype, requires_grad=not forward_only)
            for b in ALL_BACKENDS}


def run_one(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(backend=spec["backend"], n=spec["n"], error=f"timeout after {timeout:.0f}s")
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return dict(backend=spec["backend"], n=spec["n"], error=f"exit {proc.returncode}: {tail[0][:160]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def fmt_ratio(value: float, previous: float | None) -> str:
    return f" (x{value / previous:.1f})" if previous and previous > 0 else ""


def markdown_tables(results: list[dict], backends: list[str], ns: list[int]) -> str:
    by_key = {(r["backend"], r["n"]): r for r in results}
    lines = []
    for title, key, scale, unit in (("time, median", "ms", 1.0, "ms"),
                                    ("peak extra memory", "peak_bytes", 2**-20, "MiB")):
        lines += [f"**{title} ({unit}; in brackets: growth from N/2)**", ""]
        lines.append("| N | docs | " + " | ".join(backends) + " |")
        lines.append("|---:|---:|" + "---:|" * len(backends))
        previous: dict[str, float] = {}
        for n in ns:
            docs = next((str(r["docs"]) for r in results if r["n"] == n and "docs" in r), "")
            cells = []
            for b in backends:
                r = by_key.get((b, n))
                if r is None or "error" in r or "skipped" in r:
                    cells.append((r or {}).get("skipped", "error" if r else "-"))
                    previous.pop(b, None)
                    continue
                value = r[key] * scale
                cells.append(f"{value:,.1f}{fmt_ratio(value, previous.get(b))}")
                previous[b] = value
            lines.append(f"| {n:,} | {docs} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def machine_description(device: str, threads: int | None = None) -> str:
    import torch

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    text = (f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
            f"({threads or torch.get_num_threads()} threads)")
    if device == "cuda":
        text += f", {torch.cuda.get_device_name()}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backends", default=None,
                        help=f"comma list from {ALL_BACKENDS}; default all available")
    parser.add_argument("--min-n", type=int, default=1024, help="smallest packed length N")
    parser.add_argument("--max-n", type=int, default=32768, help="largest packed length N (N doubles)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    parser.add_argument("--median-len", type=float, default=256.0, help="median document length (lognormal)")
    parser.add_argument("--sigma", type=float, default=1.0,
                        help="lognormal sigma: the heavier the tail, the larger")
    parser.add_argument("--lengths", default=None,
                        help="file of document lengths, one per line, sampled instead")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed steps per (backend, N); the median is shown")
    parser.add_argument("--forward-only", action="store_true",
                        help="time the forward pass only (flex on CPU)")
    parser.add_argument("--dense-max-gb", type=float, default=4.0,
                        help="skip dense where its estimate exceeds this")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per (backend, N) subprocess")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads in each worker")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0

    reasons = available_backends(args.device, args.forward_only)
    backends = args.backends.split(",") if args.backends else [b for b in ALL_BACKENDS if reasons[b] is None]
    for b in backends:
        if b not in ALL_BACKENDS:
            parser.error(f"unknown backend {b!r}")
    dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    pool = [int(x) for x in open(args.lengths).read().split()] if args.lengths else None
    ns = []
    n = args.min_n
    while n <= args.max_n:
        ns.append(n)
        n *= 2

    mode = "forward" if args.forward_only else "forward + backward"
    print(f"# attention {mode}: {args.device} {dtype}, {args.heads} heads x {args.head_dim}, doc lengths "
          f"{'from ' + args.lengths if pool else f'lognormal(median {args.median_len:g}, sigma {args.sigma:g})'}")  # noqa: E501
    print(f"# {machine_description(args.device, args.threads)}")
    results = []
    for b in backends:
        for n in ns:
            lengths = doc_lengths(n, args.seed, args.median_len, args.sigma, pool)
            if reasons.get(b) is not None:
                result = dict(backend=b, n=n, skipped="n/a", why=reasons[b])
            elif b == "dense" and dense_bytes_estimate(n) > args.dense_max_gb * 2**30:
                result = dict(backend=b, n=n, skipped=f"> {args.dense_max_gb:g} GB")
            else:
                spec = dict(backend=b, n=n, lengths=lengths, heads=args.heads, head_dim=args.head_dim,
                            device=args.device, dtype=dtype, repeats=args.repeats,
                            forward_only=args.forward_only, threads=args.threads)
                result = run_one(spec, args.timeout)
            result.setdefault("docs", len(lengths))
            results.append(result)
            shown = {k: v for k, v in result.items() if k != "why"}
            print(f"  {json.dumps(shown)}", file=sys.stderr, flush=True)
    for b in ALL_BACKENDS:
        if reasons.get(b):
            print(f"# {b}: not available here: {reasons[b]}")
    print()
    print(markdown_tables(results, backends, ns))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=args.device, dtype=dtype, mode=mode,
                           machine=machine_description(args.device, args.threads),
                           args=vars(args), results=results), f, indent=1)
    failed = [r for r in results if "error" in r]
    for r in failed:
        print(f"# FAILED {r['backend']} N={r['n']}: {r['error']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    raise SystemExit(main())
