"""Packing benchmark (not a test): rows, token utilization and speed of every way to lay out documents.

    python bench/packing.py --lengths bench/lengths/demo_train.txt --seq-len 2048
    python bench/packing.py --lengths bench/lengths/changelog_entries.txt.gz --seq-len 512 --json
    python bench/packing.py --from-shards data/demo --seq-len 2048 --json
    python bench/packing.py --synthetic code_tail --num-docs 50000 --seq-len 2048

Every method packs the same items: documents longer than T are first cut into chunks of at most T by
`split_long(..., "split")`. Utilization is real tokens / allocated positions. Speed times only the
packing call (documents and lengths are built beforehand), best of `--repeats`, on one thread; "docs"
in docs/s are the packed items (chunks of split documents count once each). Batch construction times
`collate_rows` over the online packer's rows, `--collate-rows` rows per batch. The online packer's worst
wait is the most rows any item waited: rows emitted after it arrived and before the row holding it
(the packer bounds it by its buffer size).

Example (T = 10, lengths [7, 5, 4, 3, 2, 2, 1], 24 tokens): the lower bound is ceil(24 / 10) = 3 rows;
BFD and the online packer fill [7, 3], [5, 4, 1], [2, 2] -> utilization 24 / 30 = 80%.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from trainer.data.batch import Document, collate_rows
from trainer.data.packing import (
    OnlinePacker,
    PackingStats,
    best_fit_decreasing,
    first_fit_decreasing,
    greedy_concat,
    split_long,
)

SYNTHETIC = ("fortunes", "chapters", "code_tail")

# Targets with the default buffer (the claims of trainer/data/packing.py and docs/training.md; see
# bench/RESULTS.md). Utilization and batch construction are stated at T = 2048; the gap to BFD and the packing
# speed at every T.
TARGET_UTILIZATION = 0.995
TARGET_GAP_TO_BFD = 0.001
TARGET_DOCS_PER_S = 200_000
TARGET_COLLATE_TOKENS_PER_S = 20_000_000


@dataclass
class Result:
    method: str
    rows: int
    utilization: float
    """Real tokens / allocated positions."""
    tokens_in: int
    tokens_out: int
    """Real tokens found in the method's output rows (must equal tokens_in)."""
    allocated: int
    docs_per_s: float | None
    tokens_per_s: float | None
    worst_wait_rows: int | None = None
    """Online packer only: the most rows an item waited between its arrival and its row."""
    state_tokens_max: int | None = None
    """Online packer only: the most tokens its buffer (its whole `state_dict`) ever held."""


# ---------------------------------------------------------------------------------------------
# Lengths: from a file, from prepared shards, or synthetic
# ---------------------------------------------------------------------------------------------


def read_lengths(path: str) -> list[int]:
    """One document length per line; blank lines and `#` comments are skipped; `.gz` files are read as
    gzip."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        return [int(line) for line in (raw.split("#")[0].strip() for raw in f) if line]


def shard_lengths(shard_dir: str, max_docs: int | None = None, batch_size: int = 1024) -> list[int]:
    """Token counts of the train shards of a `python -m trainer.prepare` output, EOS included (+1)."""
    import webdataset as wds
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(shard_dir, "tokenizer", "tokenizer.json"))
    urls = sorted(glob.glob(os.path.join(shard_dir, "train-*.tar")))
    if not urls:
        raise FileNotFoundError(f"no train-*.tar shards in {shard_dir}")
    lengths: list[int] = []
    texts: list[str] = []

    def encode() -> None:
        lengths.extend(len(e.ids) + 1 for e in tok.encode_batch(texts, add_special_tokens=False))
        texts.clear()

    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        texts.append(sample["txt"].decode("utf-8"))
        if len(texts) == batch_size:
            encode()
        if max_docs is not None and len(lengths) + len(texts) >= max_docs:
            break
    encode()
    return lengths


def synthetic_lengths(name: str, num_docs: int, seq_len: int, seed: int = 0) -> list[int]:
    """Length distributions the packer was not tuned on.

    fortunes:  short texts, lognormal around ~70 tokens, clipped to [20, 200]
    chapters:  about T/2 each, normal(T/2, T/8), at least 1 (a few exceed T and get split)
    code_tail: lognormal with median T/8 and sigma 1.5: ~8% exceed T, the longest are many T long
    """
    rng = np.random.default_rng(seed)
    if name == "fortunes":
        x = np.clip(rng.lognormal(np.log(70), 0.6, num_docs), 20, 200)
    elif name == "chapters":
        x = np.maximum(rng.normal(seq_len / 2, seq_len / 8, num_docs), 1)
    elif name == "code_tail":
        x = np.maximum(rng.lognormal(np.log(seq_len / 8), 1.5, num_docs), 1)
    else:
        raise ValueError(f"unknown synthetic distribution {name!r}; expected one of {SYNTHETIC}")
    return [int(n) for n in np.rint(x)]


def split_into_chunks(lengths: Sequence[int], seq_len: int) -> tuple[list[Document], PackingStats]:
    """Documents of the given lengths (token arrays are views of one zero buffer), split to fit T."""
    zeros = np.zeros(max(lengths), dtype=np.int64)
    stats = PackingStats()
    chunks: list[Document] = []
    for i, n in enumerate(lengths):
        chunks.extend(split_long(Document(key=str(i), tokens=zeros[:n]), seq_len, "split", stats))
    return chunks, stats


# ---------------------------------------------------------------------------------------------
# Methods. Each returns rows as lists of item indices, or (for one-doc-per-row layouts) allocations.
# ---------------------------------------------------------------------------------------------


def best_time(fn: Callable[[], object], repeats: int) -> tuple[object, float]:
    best, out = math.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return out, best


def padded_groups(lengths: Sequence[int], group: int) -> int:
    """Allocated positions when each run of `group` items is padded to its own longest."""
    return sum(len(g) * max(g) for g in (lengths[i : i + group] for i in range(0, len(lengths), group)))


def bucketed_groups(lengths: Sequence[int], group: int) -> int:
    return padded_groups(sorted(lengths), group)


def run_methods(
    chunks: list[Document], seq_len: int, batch_docs: int, buffer_size: int | None, repeats: int
) -> tuple[list[Result], list[list[Document]]]:
    lengths = [len(d) for d in chunks]
    total = sum(lengths)
    n = len(lengths)
    results: list[Result] = []

    def add(method: str, rows: int, allocated: int, tokens_out: int, seconds: float | None) -> None:
        speed = None if seconds is None else (n / seconds, total / seconds)
        results.append(
            Result(
                method=method,
                rows=rows,
                utilization=tokens_out / allocated,
                tokens_in=total,
                tokens_out=tokens_out,
                allocated=allocated,
                docs_per_s=None if speed is None else speed[0],
                tokens_per_s=None if speed is None else speed[1],
            )
        )

    # One item per row, padded to T.
    rows, s = best_time(lambda: [[i] for i in range(n)], repeats)
    add("pad_to_max", len(rows), len(rows) * seq_len, total, s)
    # One item per row, micro-batches of `batch_docs` in stream order, each padded to its longest.
    allocated, s = best_time(lambda: padded_groups(lengths, batch_docs), repeats)
    add("pad_to_batch_max", n, allocated, total, s)
    # Sorted by length, then as above.
    allocated, s = best_time(lambda: bucketed_groups(lengths, batch_docs), repeats)
    add("bucketed", n, allocated, total, s)

    for method, fn in (
        ("greedy", greedy_concat),
        ("ffd", first_fit_decreasing),
        ("bfd", best_fit_decreasing),
    ):
        bins, s = best_time(lambda fn=fn: fn(lengths, seq_len), repeats)
        assert all(sum(lengths[i] for i in b) <= seq_len for b in bins), f"{method} overfilled a row"
        add(method, len(bins), len(bins) * seq_len, sum(lengths[i] for b in bins for i in b), s)

    def pack_online() -> list[list[Document]]:
        packer = OnlinePacker(seq_len) if buffer_size is None else OnlinePacker(seq_len, buffer_size)
        return list(packer.pack(chunks))

    online_rows, s = best_time(pack_online, repeats)
    add(
        "online", len(online_rows), len(online_rows) * seq_len, sum(len(d) for r in online_rows for d in r), s
    )
    results[-1].worst_wait_rows, results[-1].state_tokens_max = wait_and_state(chunks, seq_len, buffer_size)

    lower = math.ceil(total / seq_len)
    add("lower_bound", lower, lower * seq_len, total, None)
    return results, online_rows


def wait_and_state(chunks: list[Document], seq_len: int, buffer_size: int | None) -> tuple[int, int]:
    """The online packer's worst wait (rows emitted after an item arrived, before its own row) and the
    most tokens it ever buffered (its state_dict holds exactly the buffered documents).

    Example: an item pushed when 7 rows are out and packed into row 10 (0-based) waited 3 rows.
    """
    packer = OnlinePacker(seq_len) if buffer_size is None else OnlinePacker(seq_len, buffer_size)
    arrived_at: dict[int, int] = {}  # id(item) -> rows emitted before it arrived
    worst = emitted = buffered = most = 0

    def leave(rows: list[list[Document]]) -> None:
        nonlocal worst, emitted, buffered
        for row in rows:
            worst = max(worst, emitted - min(arrived_at.pop(id(d)) for d in row))
            emitted += 1
            buffered -= sum(len(d) for d in row)

    for d in chunks:
        arrived_at[id(d)] = emitted
        buffered += len(d)
        leave(packer.push(d))
        most = max(most, buffered)
    leave(packer.flush())
    return worst, most


def collate_speed(rows: list[list[Document]], seq_len: int, rows_per_batch: int, repeats: int) -> dict:
    """`collate_rows` over the online rows, `rows_per_batch` at a time: positions and real tokens/s."""
    groups = [rows[i : i + rows_per_batch] for i in range(0, len(rows), rows_per_batch)]

    def build() -> int:
        return sum(collate_rows(g, row_len=seq_len, pad_id=1, layout="packed").num_tokens for g in groups)

    real, s = best_time(build, repeats)
    return {
        "batches": len(groups),
        "rows_per_batch": rows_per_batch,
        "positions_per_s": len(rows) * seq_len / s,
        "tokens_per_s": real / s,
        "batches_per_s": len(groups) / s,
    }


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 1e6:
        return f"{x / 1e6:.2f}M"
    if x >= 1e3:
        return f"{x / 1e3:.1f}k"
    return f"{x:.0f}"


def markdown(results: list[Result]) -> str:
    lines = [
        "| method | rows | utilization | tokens in | tokens out | allocated | docs/s | tokens/s "
        "| worst wait |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        wait = "-" if r.worst_wait_rows is None else f"{r.worst_wait_rows:,} rows"
        lines.append(
            f"| {r.method} | {r.rows:,} | {100 * r.utilization:.3f}% | {r.tokens_in:,} | {r.tokens_out:,} "
            f"| {r.allocated:,} | {fmt_rate(r.docs_per_s)} | {fmt_rate(r.tokens_per_s)} | {wait} |"
        )
    return "\n".join(lines)


def target_lines(results: list[Result], collate: dict, seq_len: int, buffer_size: int) -> list[str]:
    by = {r.method: r for r in results}
    online, bfd = by["online"], by["bfd"]
    gap = bfd.utilization - online.utilization
    checks = [
        (f"online within 0.1 pp of BFD: gap {100 * gap:+.3f} pp", gap <= TARGET_GAP_TO_BFD),
        (
            f"online packing {fmt_rate(online.docs_per_s)} docs/s >= 200k",
            online.docs_per_s >= TARGET_DOCS_PER_S,
        ),
        (
            f"worst wait {online.worst_wait_rows:,} rows <= the buffer size ({buffer_size:,})",
            online.worst_wait_rows <= buffer_size,
        ),
    ]
    if seq_len == 2048:
        checks += [
            (
                f"online utilization {100 * online.utilization:.2f}% >= 99.5%",
                online.utilization >= TARGET_UTILIZATION,
            ),
            (
                f"Batch construction {fmt_rate(collate['positions_per_s'])} positions/s "
                f"({fmt_rate(collate['tokens_per_s'])} real tokens/s) >= 20M",
                collate["positions_per_s"] >= TARGET_COLLATE_TOKENS_PER_S,
            ),
        ]
    return [f"- [{'x' if ok else ' '}] {text}{'' if ok else '  **MISSED**'}" for text, ok in checks]


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", help="file with one document length (tokens, EOS included) per line")
    src.add_argument("--from-shards", help="a directory written by `python -m trainer.prepare`")
    src.add_argument("--synthetic", choices=SYNTHETIC, help="a seeded synthetic length distribution")
    p.add_argument("--seq-len", type=int, default=2048, help="row length T")
    p.add_argument("--batch-docs", type=int, default=16, help="docs per micro-batch for the padded baselines")
    p.add_argument("--buffer-size", type=int, default=None, help="online packer buffer (default: its own)")
    p.add_argument("--num-docs", type=int, default=50_000, help="documents to draw for --synthetic")
    p.add_argument(
        "--max-docs", type=int, default=None, help="read at most this many docs from --from-shards"
    )
    p.add_argument("--seed", type=int, default=0, help="seed for --synthetic")
    p.add_argument("--repeats", type=int, default=3, help="timing repeats; the best is reported")
    p.add_argument("--collate-rows", type=int, default=8, help="rows per Batch when timing collate_rows")
    p.add_argument("--save-lengths", help="also write the (unsplit) lengths to this file, one per line")
    p.add_argument("--json", action="store_true", help="print the rows as a JSON list instead of a table")
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    if args.lengths:
        lengths, source = read_lengths(args.lengths), args.lengths
    elif args.from_shards:
        lengths, source = shard_lengths(args.from_shards, args.max_docs), f"shards {args.from_shards}"
    else:
        lengths = synthetic_lengths(args.synthetic, args.num_docs, args.seq_len, args.seed)
        source = f"synthetic {args.synthetic} (n={args.num_docs}, seed={args.seed})"
    if not lengths or min(lengths) < 1:
        sys.exit("need at least one document, every length >= 1")
    if args.save_lengths:
        with open(args.save_lengths, "w") as f:
            f.writelines(f"{n}\n" for n in lengths)

    chunks, stats = split_into_chunks(lengths, args.seq_len)
    results, online_rows = run_methods(chunks, args.seq_len, args.batch_docs, args.buffer_size, args.repeats)
    collate = collate_speed(online_rows, args.seq_len, args.collate_rows, args.repeats)

    if args.json:
        out = [asdict(r) for r in results]
        for r in out:
            if r["method"] == "online":
                r["collate_positions_per_s"] = collate["positions_per_s"]
                r["collate_tokens_per_s"] = collate["tokens_per_s"]
        print(json.dumps(out, indent=2))
        return

    buffer = args.buffer_size or OnlinePacker(args.seq_len).buffer_size
    print(
        f"source: {source}; T = {args.seq_len}; {stats.docs_in:,} docs, {stats.tokens_in:,} tokens; "
        f"{stats.docs_split:,} split into {stats.chunks_from_splits:,} chunks -> {len(chunks):,} items; "
        f"online buffer {buffer}; padded baselines in groups of {args.batch_docs}\n"
    )
    print(markdown(results))
    online = next(r for r in results if r.method == "online")
    print(
        f"\nOnline packer: worst wait {online.worst_wait_rows:,} rows; its state (the buffered documents) "
        f"held at most {online.state_tokens_max:,} tokens between pushes"
    )
    print(
        f"\nBatch construction (collate_rows, {collate['rows_per_batch']} rows x {args.seq_len}, "
        f"{collate['batches']:,} batches): {fmt_rate(collate['positions_per_s'])} positions/s, "
        f"{fmt_rate(collate['tokens_per_s'])} real tokens/s, {fmt_rate(collate['batches_per_s'])} batches/s"
    )
    print(f"python {platform.python_version()}, torch {torch.__version__}, numpy {np.__version__}, 1 thread")
    if args.buffer_size is None:
        print("\nTargets (the default buffer; utilization and batch construction stated for T = 2048 only):")
        print("\n".join(target_lines(results, collate, args.seq_len, buffer)))


if __name__ == "__main__":
    main()
