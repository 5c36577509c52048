"""What the loop costs around the step (not a test): Trainer.fit's wall time per step against the step's.

    .venv/bin/python bench/fit.py --data data/demo
    .venv/bin/python bench/before_after.py --before 904247a --copy-script --script bench/fit.py --keys 1 \\
        --columns "fit (ms/step)" "around the step (ms/step)" -- --data data/demo

One process, the tiny test model (tests/helpers.py SMALL: seq_len 128, 1024 tokens a step), one CPU rank,
no eval and no checkpoint before the last step. Each configuration trains --steps steps from scratch in a
fresh run dir; the first --warmup are not counted:

    fit               median wall time of a counted turn of the loop: the step, then everything after it
    step              median time of the step alone (Trainer._train_one_step: rows taken, forward, backward,
                      update)
    around the step   median of (turn - its step): what the loop adds per step. Not comparable across
                      versions whose step method does different shares of the work (before issue 58 it
                      also counted, evaluated and logged); compare `fit` then
    log_every         logging.log_every: 1 logs every step (the metrics line, FLOPs), 10 most steps not
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def fit(data: Path, run_dir: Path, steps: int, warmup: int, log_every: int) -> dict:
    from tests.helpers import make_trainer

    trainer = make_trainer(data, run_dir, f"train.max_steps={steps}", f"logging.log_every={log_every}",
                           "logging.progress=false", "logging.wandb.mode=disabled")
    starts: list[float] = []
    inside: list[float] = []
    step = trainer._train_one_step

    def timed():  # each step's start and its own time: the rest of fit's turn is the loop and its parts
        starts.append(time.perf_counter())
        out = step()
        inside.append(time.perf_counter() - starts[-1])
        return out

    trainer._train_one_step = timed
    trainer.fit()
    # one turn = from a step's start to the next one's; the last turn (it saves) is left out
    turns = [b - a for a, b in zip(starts[warmup:-1], starts[warmup + 1:], strict=True)]
    steps_alone = inside[warmup:-1]
    return {"fit": statistics.median(turns), "step": statistics.median(steps_alone),
            "around": statistics.median(t - s for t, s in zip(turns, steps_alone, strict=True))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="a prepared dataset (python -m trainer.prepare)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    args = p.parse_args()
    print("| log_every | fit (ms/step) | step (ms) | around the step (ms/step) |")
    print("|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for log_every in (1, 10):
            r = fit(args.data, Path(tmp) / f"run-{log_every}", args.steps, args.warmup, log_every)
            print(f"| {log_every} | {r['fit'] * 1e3:.2f} | {r['step'] * 1e3:.2f} | {r['around'] * 1e3:.3f} |",
                  flush=True)


if __name__ == "__main__":
    main()
