"""What a data mixture costs the stream (not a test): rows/s of one source vs a two-source mixture of the same
documents, side by side in one run, and the token shares the mixture holds.

    python bench/mixture.py --data data/demo                   # python -m trainer.prepare --source demo first
    python bench/mixture.py --data data/demo --rows 4000 --repeats 3

The mixture is data.sources = [{a: data/demo, 0.7}, {b: data/demo, 0.3}]: the same shards twice (each source
with its own seed, so another order), so the documents' lengths and the tokenization work per document are
those of the single source and only the mixing differs. Each configuration builds the stream as the trainer
does (trainer.data.feed.build_data: DataLoader workers, packer, seq_len rows) and draws --rows rows; the time
from --warmup-rows rows (every source's workers started before, and every packer's
buffer full: a packer emits rows once it holds packing.buffer_size documents, and a mixture has one per
source) to the last row is measured. Configurations run in turn, --repeats times
(ABCABC...), and the median is reported, so load on the machine hits them alike. Also the mixer's own cost per
row, on in-memory sources. Shares: the mixture's trained
tokens by source (Document.source: the two sources share their keys; tests/data/test_mixture.py checks the tag
against the keys of distinct sources) over the first 25 %, 50 % and all of the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from trainer.config import from_container
from trainer.distributed.groups import DistInfo
from trainer.run.inputs import build_data


def run_config(data: Path, workers: int, mixture: bool, seq_len: int) -> dict:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    data_overrides = ([f"data.sources=[{{name:a,path:'{data}',weight:0.7}},"
                       f"{{name:b,path:'{data}',weight:0.3}}]"]
                      if mixture else [f"data.path={data}"])
    config_dir = str(Path(__file__).resolve().parents[1] / "configs")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name="config", overrides=[*data_overrides, f"data.num_workers={workers}",
                                                       f"train.seq_len={seq_len}",
                                                       f"train.tokens_per_step={seq_len}",
                                                       f"train.micro_batch_tokens={seq_len}",
                                                       "data.prefetch=false", "logging.wandb.mode=disabled"])
    return OmegaConf.to_container(cfg, resolve=True)


def draw(container: dict, rows_wanted: int, warmup: int) -> tuple[float, list[list]]:
    """Seconds for `rows_wanted` rows after `warmup` rows (every packer full by then), and all the rows."""
    cfg = from_container(container, "/tmp/bench_mixture_run")
    data = build_data(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))
    rows = data.rows
    try:
        data.rows.start()  # every source's workers
        out, t0 = [], None
        while len(out) < warmup + rows_wanted:
            if t0 is None and len(out) >= warmup:
                t0 = time.perf_counter()
            limit = warmup if t0 is None else warmup + rows_wanted
            got = rows.take(min(64, limit - len(out)))
            if not got:
                rows.next_epoch()
                continue
            out += got
        return time.perf_counter() - t0, out
    finally:
        rows.close()


def mixer_overhead(n: int = 100_000) -> float:
    """Microseconds the mixer adds per row: `n` in-memory rows of 4 documents handed out through Mixture (two
    sources) minus the same taken from one plain list (no reading, packing or tokenizing: the choice and
    counting)."""
    from types import SimpleNamespace

    import numpy as np

    from trainer.data.batch import Document
    from trainer.data.mixture import Mixture
    from trainer.data.packing import PackingStats

    class InMemory:
        docs, stats = SimpleNamespace(lockstep=True, num_workers=0), PackingStats()

        def __init__(self) -> None:
            self.rows = [[Document(f"k{i}_{j}", np.zeros(100, np.int32)) for j in range(4)] for i in range(n)]
            self.next = 0

        def take(self, num_rows: int) -> list:
            out = self.rows[self.next:self.next + num_rows]
            self.next += num_rows
            return out

    def seconds(take) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            take(1)
        return time.perf_counter() - t0

    plain = seconds(InMemory().take)
    mixed = seconds(Mixture([InMemory(), InMemory()], ["a", "b"], [0.7, 0.3], "restart").take)
    return (mixed - plain) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--rows", type=int, default=3000)
    p.add_argument("--warmup-rows", type=int, default=1000,
                   help="rows drawn before the clock starts: a packer emits once its buffer is full, and a "
                        "mixture has one per source")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    configs = {"one source, 1 worker": (1, False), "one source, 2 workers": (2, False),
               "mixture of 2, 1 worker each": (1, True)}
    containers = {name: run_config(args.data.resolve(), w, m, args.seq_len)
                  for name, (w, m) in configs.items()}
    times: dict[str, list[float]] = {name: [] for name in configs}
    shares = None
    for _ in range(args.repeats):
        for name, container in containers.items():
            seconds, rows = draw(container, args.rows, args.warmup_rows)
            times[name].append(seconds)
            if configs[name][1] and shares is None:
                shares = {}
                for fraction in (0.25, 0.5, 1.0):
                    tokens = Counter()
                    for row in rows[: int(fraction * len(rows))]:
                        for doc in row:
                            tokens[doc.source] += len(doc)
                    shares[fraction] = tokens[0] / (tokens[0] + tokens[1])
    base = statistics.median(times["one source, 1 worker"])
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"{args.rows} rows of {args.seq_len} tokens, median of {args.repeats}")
    print(f"{'configuration':32} {'rows/s':>8} {'vs one source, 1 worker':>24}")
    for name in configs:
        med = statistics.median(times[name])
        print(f"{name:32} {args.rows / med:8.0f} {base / med:23.2f}x")
    print("mixture's share of source a (target 0.70) over the first 25 % / 50 % / all rows: "
          + " / ".join(f"{shares[f]:.4f}" for f in (0.25, 0.5, 1.0)))
    overhead = mixer_overhead()
    print(f"the mixer's own cost per row (in-memory sources, 100,000 rows): {overhead:.2f} us")
    if args.json:
        args.json.write_text(json.dumps({"times": times, "shares": shares, "overhead_us": overhead},
                                        indent=1))


if __name__ == "__main__":
    main()
