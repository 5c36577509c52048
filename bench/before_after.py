"""One benchmark of two code trees side by side (not a test): bench/fsdp.py (or another bench script printing
a markdown table) of the checkout against the same script of an older commit, run alternately on one machine,
each row's figures as after / before.

    .venv/bin/python bench/before_after.py --before 904247a -- --worlds 2 4 --layouts tp2 fsdp2-tp2 --no-deepspeed

The older commit is checked out into a temporary git worktree (removed at the end) and runs with this venv;
the runs go before, after, after, before (--rounds 2), so a drift of the machine's load over the run weighs on
both alike, and each figure is the mean of its tree's runs ("run pairs": the range of after / before over the
k-th run of each tree). Columns compared: --columns, by their header text.
With --copy-script the checkout's script runs in both trees (a benchmark newer than the older commit; it
imports the package of the tree it is copied into).
"""  # noqa: E501

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table(output: str) -> tuple[list[str], list[list[str]]]:
    """The first markdown table of `output`: (headers, rows of cells)."""
    lines = [line for line in output.splitlines() if line.startswith("|")]
    if len(lines) < 3:
        raise SystemExit(f"no table in the benchmark's output:\n{output}")
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    headers, rows = cells[0], [row for row in cells[2:] if len(row) == len(cells[0])]
    return headers, rows


def run(tree: Path, script: str, args: list[str]) -> tuple[list[str], list[list[str]]]:
    proc = subprocess.run([sys.executable, str(tree / script), *args], cwd=tree, capture_output=True,
                          text=True)
    if proc.returncode:
        raise SystemExit(f"{tree / script} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return table(proc.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="the older commit (any git revision)")
    p.add_argument("--script", default="bench/fsdp.py")
    p.add_argument("--rounds", type=int, default=2, help="before/after pairs, alternated")
    p.add_argument("--keys", type=int, default=3, help="leading columns that name a row")
    p.add_argument("--copy-script", action="store_true",
                   help="run the checkout's --script in the older tree too (it need not exist there)")
    p.add_argument("--columns", nargs="+", default=["trained (GB)", "step (s)"])
    p.add_argument("args", nargs=argparse.REMAINDER, help="-- then the script's own arguments")
    args = p.parse_args()
    script_args = args.args[1:] if args.args[:1] == ["--"] else args.args
    commit = subprocess.run(["git", "rev-parse", "--short", args.before], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        old = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), commit], cwd=ROOT, check=True,
                       capture_output=True)
        if args.copy_script:
            shutil.copyfile(ROOT / args.script, old / args.script)
        try:
            order = ([("before", old), ("after", ROOT), ("after", ROOT), ("before", old)]
                     * ((args.rounds + 1) // 2))
            order = order[:2 * args.rounds]
            runs: dict[str, list] = {"before": [], "after": []}
            for name, tree in order:
                headers, rows = run(tree, args.script, script_args)
                runs[name].append(rows)
                print(f"{name} ({commit if name == 'before' else 'checkout'}): {len(rows)} rows", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, capture_output=True)
    cols = [headers.index(c) for c in args.columns]
    print(f"\n{args.script} {' '.join(script_args)}; before = {commit}, after = the checkout; mean of "
          f"{args.rounds} run(s) each, alternated\n")
    print("| " + " | ".join(headers[:args.keys]) + " | " + " | ".join(
        f"{headers[c]} before | after | after / before | run pairs" for c in cols) + " |")
    print("|" + "---|" * args.keys + "---:|---:|---:|---|" * len(cols))

    def mean(name: str, i: int, c: int) -> float:
        return statistics.mean(float(rows[i][c]) for rows in runs[name])

    for i, row in enumerate(runs["after"][0]):
        figures = []
        for c in cols:
            b, a = mean("before", i, c), mean("after", i, c)
            pairs = [float(after[i][c]) / float(before[i][c])
                     for before, after in zip(runs["before"], runs["after"], strict=True)]
            figures.append(f"{b:.3f} | {a:.3f} | {a / b:.3f} | {min(pairs):.3f} to {max(pairs):.3f}")
        print("| " + " | ".join(row[:args.keys]) + " | " + " | ".join(figures) + " |", flush=True)


if __name__ == "__main__":
    main()
