"""Equal work across data ranks (data.balance=rows, issue 55): the modeled imbalance of each step's rows as the
ranks draw them vs dealt by trainer.data.deal, on a real length mix, at several row lengths.

    .venv/bin/python bench/deal.py                                   # bench/lengths/mix.txt.gz, T = 1024 8192 32768
    .venv/bin/python bench/deal.py --ranks 8 --rows-per-rank 4 --steps 400 --lengths bench/lengths/docstrings.txt.gz

The documents (their lengths, in the file's order, split into chunks of at most T as packing.long_docs=split does)
are packed by the trainer's online packer (OnlinePacker, packing.buffer_size 1000) into rows of T; consecutive rows
form the steps, rank r drawing rows r*k .. r*k+k-1 of each step (k = --rows-per-rank). A row's work is what the
trainer deals by: its model FLOPs (trainer.run.flops.FlopModel.model_flops, gpt2-124m: 6 N per token + 6 n_layer
d s^2 per document). Per T: the mean, median and p95 over steps of max / mean - 1 of the ranks' work, as drawn and
as dealt (deal_rows, or the drawn split when LPT is not better, as trainer.run.inputs.RowDealer does).
"""

from __future__ import annotations

import argparse
import gzip
import time
from pathlib import Path

import numpy as np

from trainer.data.batch import Document
from trainer.data.deal import deal_rows, drawn_rows, imbalance_of
from trainer.data.packing import OnlinePacker
from trainer.run.flops import FlopModel

GPT2_124M = FlopModel(matmul_params=85_000_000 + 50304 * 768, n_layer=12, n_embd=768, kernel="flash")
"""gpt2-124m's matmul parameters (12 blocks of 7.08 M, the tied head 38.6 M) and shape."""


def read_lengths(path: Path) -> list[int]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [int(line) for line in f if line.strip() and not line.startswith("#")]


def rows_of(lengths: list[int], seq_len: int, needed: int) -> list[list[int]]:
    """The first `needed` packed rows (document lengths each) of `lengths`, chunks of at most seq_len."""
    chunks = (min(seq_len, n - start) for n in lengths for start in range(0, n, seq_len))
    docs = (Document(key=str(i), tokens=np.zeros(n, dtype=np.int64)) for i, n in enumerate(chunks))
    out = []
    for row in OnlinePacker(seq_len, buffer_size=1000).pack(docs):
        out.append([len(d) for d in row])
        if len(out) == needed:
            break
    return out


def step_imbalances(rows: list[list[int]], ranks: int, per_rank: int) -> tuple[np.ndarray, np.ndarray]:
    drawn, dealt = [], []
    counts = [per_rank] * ranks
    for s in range(len(rows) // (ranks * per_rank)):
        costs = [GPT2_124M.model_flops(row) for row in rows[s * ranks * per_rank:(s + 1) * ranks * per_rank]]
        before = imbalance_of(costs, drawn_rows(counts))
        drawn.append(before)
        dealt.append(min(before, imbalance_of(costs, deal_rows(costs, counts))))
    return np.array(drawn), np.array(dealt)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=Path, default=Path(__file__).parent / "lengths" / "mix.txt.gz")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--rows-per-rank", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    lengths = read_lengths(args.lengths)
    print(f"{args.lengths.name}: {len(lengths):,} documents; {args.ranks} ranks x {args.rows_per_rank} rows a step; "
          "work = gpt2-124m model FLOPs; imbalance = max / mean - 1 over the ranks")
    print(f"{'T':>6} {'steps':>6} | {'drawn mean':>10} {'median':>7} {'p95':>7} | {'dealt mean':>10} {'median':>7} "
          f"{'p95':>7} | deal ms/step")
    for seq_len in args.seq_lens:
        rows = rows_of(lengths, seq_len, args.steps * args.ranks * args.rows_per_rank)
        t0 = time.perf_counter()
        drawn, dealt = step_imbalances(rows, args.ranks, args.rows_per_rank)
        ms = (time.perf_counter() - t0) / max(1, len(drawn)) * 1e3
        print(f"{seq_len:>6} {len(drawn):>6} | {drawn.mean():>9.2%} {np.median(drawn):>7.2%} "
              f"{np.percentile(drawn, 95):>7.2%} | {dealt.mean():>9.2%} {np.median(dealt):>7.2%} "
              f"{np.percentile(dealt, 95):>7.2%} | {ms:.2f}")


if __name__ == "__main__":
    main()
