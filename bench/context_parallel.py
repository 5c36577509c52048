"""Context parallelism (not a test): how evenly a group shares the work, and what each rank holds and spends.

    .venv/bin/python bench/context_parallel.py                   # both parts, ~1 minute on 2 CPU cores
    .venv/bin/python bench/context_parallel.py --balance-only --seq-len 131072

1. Work balance (host arithmetic, the trainer's own functions): the documents of each length file of
   bench/lengths packed in order (first fit, documents longer than a row cut) into rows of --seq-len, each row
   split over N = 2, 4, 8 ranks three ways, and each rank's work counted by the attention-aware FLOP model
   (trainer.run.flops: 6 N per position + 12 d per (query, key) pair of its own queries, here the attention
   part alone since the dense part is even in every split):
       zigzag        chunks r and 2N - 1 - r of 2N (distributed.context_parallel_split=zigzag)
       balanced      8N chunks dealt 8 to a rank by attention work, row by row (the trainer's default split)
       contiguous    N equal consecutive ranges (what a naive split does)
       doc-aware     N consecutive ranges cut where the prefix work reaches k / N of the row's (balanced by
                     construction up to one position; positions no longer equal per rank, so the dense work
                     and the activations are not)
   Printed: mean and worst max / mean - 1 over the rows.
2. Real ranks (gloo, fp32, CPU): a 4-layer model (n_embd 256, 8 heads) on one packed row of --row-len
   positions from the demo's lengths, forward + backward at CP = 1, 2, 4 for both strategies: the bytes
   autograd saves for backward on each rank (the activations; saved_tensors_hooks, exact), the step time
   (median of --repeats, each rank timed, the slowest kept), and the ratios to CP = 1, side by side in one
   run.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.data.deal import imbalance  # noqa: E402
from trainer.distributed.context import query_pairs, rank_pairs  # noqa: E402

LENGTHS = ROOT / "bench" / "lengths"


def read_lengths(path: Path) -> list[int]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [int(line) for line in f if line.strip() and not line.startswith("#")]


def pack(lengths: list[int], seq_len: int) -> list[np.ndarray]:
    """Rows as cu_seqlens (the padding tail a segment), first fit in order; a longer document cut into
    rows."""
    rows: list[list[int]] = []
    space: list[int] = []
    for n in lengths:
        while n > 0:
            piece = min(n, seq_len)
            n -= piece
            for i, free in enumerate(space):
                if free >= piece:
                    rows[i].append(piece)
                    space[i] -= piece
                    break
            else:
                rows.append([piece])
                space.append(seq_len - piece)
    out = []
    for row, free in zip(rows, space, strict=True):
        segments = row + ([free] if free else [])
        out.append(np.concatenate([[0], np.cumsum(segments)]))
    return out


def split_work(cu: np.ndarray, seq_len: int, size: int, dense: float) -> dict[str, float]:
    """Imbalance (max / mean - 1) of one row under each split: of the attention pairs alone, and of the whole
    work with `dense` pair-equivalents per position (6 N / (12 d n_layer): the matmuls, even in the equal
    splits)."""
    zigzag = rank_pairs(cu, 1, seq_len, size)
    balanced = rank_pairs(cu, 1, seq_len, size, "balanced")
    step = seq_len // size
    contiguous = [query_pairs(cu, np.arange(r * step, (r + 1) * step)) for r in range(size)]
    per_rank_dense = dense * seq_len / size
    seg = np.searchsorted(cu[1:], np.arange(seq_len), side="right")
    per_position = np.arange(seq_len) - cu[seg] + 1
    prefix = np.cumsum(per_position)
    cuts = [0, *np.searchsorted(prefix, [prefix[-1] * k / size for k in range(1, size)]).tolist(), seq_len]
    aware = [float(per_position[a:b].sum()) for a, b in zip(cuts, cuts[1:], strict=False)]
    return {"zigzag": imbalance(zigzag), "balanced": imbalance(balanced), "contiguous": imbalance(contiguous),
            "doc-aware": imbalance(aware), "zigzag total": imbalance([w + per_rank_dense for w in zigzag]),
            "balanced total": imbalance([w + per_rank_dense for w in balanced]),
            "contiguous total": imbalance([w + per_rank_dense for w in contiguous])}


SPLITS = ("zigzag", "balanced", "contiguous", "doc-aware", "zigzag total", "balanced total",
          "contiguous total")
GPT2_124M = 12 * 12 * 768**2 / (2 * 768 * 12)
"""Dense pair-equivalents per position of gpt2-124m (N = 12 x 12 d^2 matmul parameters in the blocks, d = 768,
12 layers; the head's 38.6M left out, which only lowers the imbalance): 6 N / (12 d n_layer) = 4,608."""


def balance(seq_len: int, sizes: list[int], dense: float = GPT2_124M) -> None:
    print(f"## Work balance: rows of {seq_len:,} positions, max / mean - 1 of the ranks' work "
          "(mean over rows / worst row); attention pairs alone, and 'total' with the matmuls of gpt2-124m "
          f"({dense:,.0f} pair-equivalents per position)\n")
    print("| lengths | docs | rows | N | " + " | ".join(SPLITS) + " |")
    print("|---|---:|---:|---:|" + "---|" * len(SPLITS))
    files = sorted(LENGTHS.glob("*.txt*"))
    for path in files:
        lengths = read_lengths(path)
        rows = pack(lengths, seq_len)
        for size in sizes:
            results = [split_work(cu, seq_len, size, dense) for cu in rows]
            cells = []
            for split in SPLITS:
                values = [r[split] for r in results]
                cells.append(f"{100 * statistics.mean(values):.2f}% / {100 * max(values):.2f}%")
            print(f"| {path.name.split('.')[0]} | {len(lengths):,} | {len(rows)} | {size} | "
                  + " | ".join(cells) + " |")
    print()


def _rank(rank: int, world: int, port: int, out: str, strategy: str, row_len: int, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from trainer.data.batch import Document, collate_rows
    from trainer.distributed.context import ContextGroup, with_row_plans
    from trainer.model import AttentionConfig, GPTConfig, build_model, model_inputs

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rng = np.random.default_rng(0)
    lengths = read_lengths(LENGTHS / "demo_train.txt")
    docs, used = [], 0
    for n in lengths:
        n = min(n, row_len - used)
        if n <= 0:
            break
        docs.append(Document(key=f"d{len(docs)}", tokens=rng.integers(4, 500, size=n)))
        used += n
    batch = collate_rows([docs], row_len, 0, "packed")
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=512, n_layer=4, n_head=8, n_embd=256, max_seq_len=row_len),
                        AttentionConfig(backend="sdpa_docs"))
    if world > 1:  # this rank's share of the row, planned on the host (as trainer.run.inputs does)
        batch = with_row_plans([batch], ContextGroup(dist.group.WORLD, world, rank, strategy, "balanced"))[0]
    inputs = model_inputs(batch)
    saved = [0]

    def pack_hook(t):
        saved[0] += t.numel() * t.element_size()
        return t

    times = []
    for i in range(repeats + 1):
        saved[0] = 0
        model.zero_grad()
        dist.barrier()
        t0 = time.perf_counter()
        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            result = model(**inputs)
        result.loss_sum.backward()
        elapsed = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i:  # the first is a warm-up
            times.append(elapsed.item())
    Path(out, f"rank{rank}.txt").write_text(f"{saved[0]} {statistics.median(times)}")
    dist.destroy_process_group()


def real_ranks(row_len: int, repeats: int) -> None:
    import torch.multiprocessing as mp

    from tests.harness import free_port

    print(f"## Real ranks (gloo, fp32, CPU): one packed row of {row_len:,} positions, 4 layers x 256 wide, "
          "8 heads, forward + backward\n")
    print("| CP | strategy | saved for backward per rank (MB) | vs CP=1 | step time (s) | vs CP=1 |")
    print("|---:|---|---:|---:|---:|---:|")
    base = None
    for size, strategy in [(1, "-"), (2, "allgather"), (2, "ulysses"), (4, "allgather"), (4, "ulysses")]:
        with tempfile.TemporaryDirectory() as out:
            mp.start_processes(_rank, args=(size, free_port(), out, strategy, row_len, repeats), nprocs=size,
                               start_method="spawn", join=True)
            results = [Path(out, f"rank{r}.txt").read_text().split() for r in range(size)]
        peak = max(int(b) for b, _ in results) / 2**20
        seconds = float(results[0][1])
        base = base or (peak, seconds)
        print(f"| {size} | {strategy} | {peak:.1f} | {peak / base[0]:.2f} | {seconds:.3f} | "
              f"{seconds / base[1]:.2f} |")
    print()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=32768)
    p.add_argument("--sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--row-len", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--balance-only", action="store_true")
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} CPU cores visible; python {sys.version.split()[0]}\n")
    balance(args.seq_len, args.sizes)
    if not args.balance_only:
        real_ranks(args.row_len, args.repeats)


if __name__ == "__main__":
    main()
