"""Equal work across data ranks (data.balance=rows, issue 55): the modeled imbalance of each step's rows as
the ranks draw them vs dealt by trainer.data.deal, on a real length mix, at several row lengths.

    .venv/bin/python bench/deal.py                              # bench/lengths/mix.txt.gz,
                                                                  T = 1024 8192 32768
    .venv/bin/python bench/deal.py --ranks 8 --rows-per-rank 4 --steps 400 \\
        --lengths bench/lengths/docstrings.txt.gz
    OMP_NUM_THREADS=1 .venv/bin/python bench/deal.py --measure  # + 2 real gloo ranks at T = 8192 on the CPU
    .venv/bin/python bench/deal.py --seq-lens 32768 --cp 4      # + context parallelism: documents kept whole
    OMP_NUM_THREADS=1 .venv/bin/python bench/deal.py --seq-lens 1024 --metric-cost
                                                                # dp_imbalance's cost, on vs off

The documents (their lengths, in the file's order, split into chunks of at most T as packing.long_docs=split
does) are packed by the trainer's online packer (OnlinePacker, packing.buffer_size 1000) into rows of T;
consecutive rows form the steps, rank r drawing rows r*k .. r*k+k-1 of each step (k = --rows-per-rank). A
row's work is what the trainer deals by: its model FLOPs (trainer.run.flops.FlopModel.model_flops, gpt2-124m:
6 N per token + 6 n_layer d s^2 per document). Per T: the mean, median and p95 over steps of max / mean - 1 of
the ranks' work, as drawn and as dealt (deal_rows, or the drawn split when LPT is not better, as
trainer.run.inputs.RowDealer does).

--cp N: the same rows over a context-parallel group of N (distributed.context_parallel_split): per split, the
positions whose keys and values a rank receives per layer (ContextShard.received_rows, allgather: every split
but `documents` all-gathers whole rows) relative to the whole rows', and the mean attention-work imbalance
over the group (rank_pairs: max / mean - 1), one row a micro-batch.

--metric-cost: what ComputeClock (dp_compute_imbalance, dp_wait_s) adds to every step's forward + backward, on
vs off in one process; and what dp_imbalance adds to a logged step, on vs off side by side on 2 gloo ranks:
the step's FLOPs all-reduce as before (2 numbers) and with each data rank's work appended (2 + D numbers) and
its max / mean taken, alternating, 2,000 of each; the median of each.

--measure: 2 gloo ranks (one process each, one thread each) train a small GPT (4 layers, width 256,
per-document SDPA: sdpa_docs, whose cost grows with s^2 as modeled; the deal models this GPT's FLOPs) on the
same steps of rows at --measure-seq-len, each step drawn and then dealt (so both see the same machine state):
each rank times its forward + backward of its rows (its compute), then waits at a barrier (the faster rank's
wait: what a gradient all-reduce would cost it). Per arm: the mean step compute of the slower rank, the mean
wait of the faster one, and the modeled imbalance.
"""

from __future__ import annotations

import argparse
import gzip
import time
from pathlib import Path

import numpy as np

from trainer.data.batch import Document
from trainer.data.deal import deal_rows, drawn_rows, imbalance, imbalance_of
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


def _measure_rank(rank: int, world: int, port: int, steps: list, seq_len: int, out: str) -> None:
    import json
    import os

    import torch
    import torch.distributed as dist

    from trainer.data.batch import collate_rows
    from trainer.model import AttentionConfig, GPTConfig, build_model, model_inputs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=512, n_layer=4, n_head=4, n_embd=256, max_seq_len=seq_len),
                        AttentionConfig(backend="sdpa_docs"))
    rng = np.random.default_rng(rank)
    times = {"drawn": [], "dealt": []}
    for s, (costs, rows) in enumerate(steps):
        arm = "drawn" if s % 2 == 0 else "dealt"
        counts = [len(rows) // world] * world
        deal = drawn_rows(counts) if arm == "drawn" else deal_rows(costs, counts)
        mine = [[Document(key=f"{i}.{j}", tokens=rng.integers(0, 512, n)) for j, n in enumerate(rows[i])]
                for i in deal[rank]]
        dist.barrier()
        t0 = time.perf_counter()
        for row in mine:  # one row a micro-batch
            batch = collate_rows([row], seq_len, pad_id=0, layout="packed")
            model(**model_inputs(batch)).loss_sum.backward()
        t1 = time.perf_counter()
        dist.barrier()  # the faster rank waits here for the slower
        times[arm].append((t1 - t0, time.perf_counter() - t1, imbalance_of(costs, deal)))
    Path(out, f"rank{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


MEASURED = FlopModel(matmul_params=4 * 12 * 256 * 256 + 512 * 256, n_layer=4, n_embd=256, kernel="sdpa_docs")
"""The measured runs' GPT (4 layers, width 256, vocabulary 512): the deal there models its own FLOPs, as a
run's does."""


def measure(lengths: list[int], seq_len: int, steps: int, rows_per_rank: int) -> None:
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    world = 2
    rows = rows_of(lengths, seq_len, steps * world * rows_per_rank)
    plan = [([MEASURED.model_flops(r)
              for r in rows[s * world * rows_per_rank:(s + 1) * world * rows_per_rank]],
             rows[s * world * rows_per_rank:(s + 1) * world * rows_per_rank]) for s in range(steps)]
    plan = [p for p in plan for _ in range(2)]  # each step twice: drawn, then dealt
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_measure_rank, args=(world, port, plan, seq_len, out), nprocs=world)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]
    print(f"measured: 2 gloo ranks, T = {seq_len}, {rows_per_rank} rows a rank, {steps} steps each arm, "
          "GPT 4 x 256 (sdpa_docs), forward + backward on the CPU")
    print(f"{'arm':>6} | {'modeled imbalance':>17} | {'slower compute s':>16} | "
          f"{'faster rank waits s':>19} | wait share")
    for arm in ("drawn", "dealt"):
        per_step = list(zip(*(r[arm] for r in ranks), strict=True))
        slow = np.mean([max(a[0], b[0]) for a, b in per_step])
        wait = np.mean([(a[1] if a[0] < b[0] else b[1]) for a, b in per_step])
        modeled = np.mean([a[2] for a, _ in per_step])
        print(f"{arm:>6} | {modeled:>16.2%} | {slow:>16.3f} | {wait:>19.3f} | {wait / slow:>9.1%}")


def context_parallel(rows: list[list[int]], seq_len: int, size: int) -> None:
    import torch

    from trainer.distributed.context import ContextGroup, ContextShard, rank_pairs

    print(f"context parallelism: CP = {size}, T = {seq_len}, {len(rows)} rows, one a micro-batch")
    print(f"{'split':>10} | {'K/V rows received / whole rows':>30} | {'attention imbalance (mean)':>26}")
    for split in ("balanced", "zigzag", "documents"):
        received, whole, imbalances = 0, 0, []
        for row in rows:
            cu = np.concatenate([[0], np.cumsum(row), [seq_len]]) if sum(row) < seq_len else \
                np.concatenate([[0], np.cumsum(row)])
            shard = ContextShard(ContextGroup(None, size, 0, "allgather", split),
                                 torch.as_tensor(cu), 1, seq_len)
            received += shard.received_rows()
            whole += (size - 1) * seq_len // size
            imbalances.append(imbalance(rank_pairs(cu, 1, seq_len, size, split)))
        print(f"{split:>10} | {received / whole:>30.1%} | {np.mean(imbalances):>26.2%}")


def _metric_cost_rank(rank: int, world: int, port: int, repeats: int, out: str) -> None:
    import json
    import os

    import torch
    import torch.distributed as dist

    from trainer.distributed.groups import dist_sum

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    device, times = torch.device("cpu"), {"off": [], "on": []}
    for i in range(2 * repeats):
        arm = "off" if (i + (i // 2)) % 2 == 0 else "on"  # off-on, on-off, ...: neither always first
        t0 = time.perf_counter()
        if arm == "off":
            dist_sum([1.0, 2.0], device)
        else:
            per_rank = [0.0] * world
            per_rank[rank] = 3.0
            _, _, *per_rank = dist_sum([1.0, 2.0, *per_rank], device)
            imbalance(per_rank)
        times[arm].append(time.perf_counter() - t0)
    Path(out, f"rank{rank}.json").write_text(json.dumps(times))
    dist.destroy_process_group()


def metric_cost(repeats: int = 2000) -> None:
    import json
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_metric_cost_rank, args=(2, port, repeats, out), nprocs=2)
        times = json.loads(Path(out, "rank0.json").read_text())
    off, on = np.median(times["off"]) * 1e6, np.median(times["on"]) * 1e6
    print(f"dp_imbalance on a logged step, 2 gloo ranks, median of {repeats}: FLOPs all-reduce alone "
          f"{off:.1f} us, with the per-rank work and its imbalance {on:.1f} us: +{on - off:.1f} us")


def clock_cost(seq_len: int = 1024, repeats: int = 40) -> None:
    """ComputeClock (dp_compute_imbalance, dp_wait_s) on vs off: one process, the measured runs' GPT, one
    packed row a step; the clock's marks and its hook on the embedding around the forward + backward, arms
    interleaved."""
    import torch

    from trainer.data.batch import collate_rows
    from trainer.model import AttentionConfig, GPTConfig, build_model, model_inputs
    from trainer.run.step import ComputeClock

    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=512, n_layer=4, n_head=4, n_embd=256, max_seq_len=seq_len),
                        AttentionConfig(backend="sdpa_docs"))
    clock = ComputeClock(model, torch.device("cpu"))
    rng = np.random.default_rng(0)
    row = [Document(key=str(j), tokens=rng.integers(0, 512, seq_len // 4)) for j in range(4)]
    inputs = model_inputs(collate_rows([row], seq_len, pad_id=0, layout="packed"))
    times = {"off": [], "on": []}
    for i in range(2 * repeats + 2):
        arm = "off" if (i + (i // 2)) % 2 == 0 else "on"  # off-on, on-off, ...: pairs of neighbours
        t0 = time.perf_counter()
        if arm == "on":
            clock.mark("start")
            with clock.last_micro_batch():
                model(**inputs).loss_sum.backward()
            clock.read()
        else:
            model(**inputs).loss_sum.backward()
        if i >= 2:  # the first two warm up
            times[arm].append(time.perf_counter() - t0)
    off, on = np.median(times["off"]), np.median(times["on"])
    paired = np.median(np.array(times["on"]) - np.array(times["off"]))  # each on minus its neighbouring off
    t0 = time.perf_counter()
    for _ in range(1000):  # the clock's own work, without the model: the marks, the hook added and removed
        clock.mark("start")
        with clock.last_micro_batch():
            pass
        clock.read()
    alone = (time.perf_counter() - t0) / 1000
    print(f"ComputeClock on every step, 1 process, GPT 4 x 256, T = {seq_len}, median of {repeats}: "
          f"forward + backward {off * 1e3:.2f} ms off, {on * 1e3:.2f} ms on; median paired difference "
          f"{paired * 1e6:+.0f} us "
          f"({paired / off:+.2%}); the clock's own marks and hook alone {alone * 1e6:.1f} us")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--lengths", type=Path, default=Path(__file__).parent / "lengths" / "mix.txt.gz")
    p.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 8192, 32768])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--rows-per-rank", type=int, default=4)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--measure", action="store_true", help="also time 2 real gloo ranks (see the docstring)")
    p.add_argument("--metric-cost", action="store_true",
                   help="also time dp_imbalance on vs off (see the docstring)")
    p.add_argument("--cp", type=int, default=0,
                   help="also the keys and values a CP group of this size exchanges")
    p.add_argument("--measure-seq-len", type=int, default=8192)
    p.add_argument("--measure-steps", type=int, default=8)
    p.add_argument("--measure-rows-per-rank", type=int, default=4)
    args = p.parse_args()
    lengths = read_lengths(args.lengths)
    print(f"{args.lengths.name}: {len(lengths):,} documents; {args.ranks} ranks x {args.rows_per_rank} rows "
          "a step; work = gpt2-124m model FLOPs; imbalance = max / mean - 1 over the ranks")
    print(f"{'T':>6} {'steps':>6} | {'drawn mean':>10} {'median':>7} {'p95':>7} | {'dealt mean':>10} "
          f"{'median':>7} {'p95':>7} | deal ms/step")
    for seq_len in args.seq_lens:
        rows = rows_of(lengths, seq_len, args.steps * args.ranks * args.rows_per_rank)
        t0 = time.perf_counter()
        drawn, dealt = step_imbalances(rows, args.ranks, args.rows_per_rank)
        ms = (time.perf_counter() - t0) / max(1, len(drawn)) * 1e3
        print(f"{seq_len:>6} {len(drawn):>6} | {drawn.mean():>9.2%} {np.median(drawn):>7.2%} "
              f"{np.percentile(drawn, 95):>7.2%} | {dealt.mean():>9.2%} {np.median(dealt):>7.2%} "
              f"{np.percentile(dealt, 95):>7.2%} | {ms:.2f}")
    if args.metric_cost:
        metric_cost()
        clock_cost()
    if args.cp:
        for seq_len in args.seq_lens:
            context_parallel(rows_of(lengths, seq_len, args.steps * args.ranks * args.rows_per_rank),
                             seq_len, args.cp)
    if args.measure:
        measure(lengths, args.measure_seq_len, args.measure_steps, args.measure_rows_per_rank)


if __name__ == "__main__":
    main()
