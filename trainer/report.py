"""`python -m trainer.report RUN_OR_SWEEP_DIR... [--out DIR]`: compare training runs at a glance.

    python -m trainer.report runs/packed runs/unpacked --out report/
    python -m trainer.report runs/sweeps/2025-06-01_12-00-00     # a Hydra sweep (-m): the report lands in it

A run dir (what `trainer.train` writes on rank 0) holds config.json, metrics.jsonl and, once the run has
finished, summary.json; a sweep dir holds run dirs one level down. The report derives what differs between
the runs from their configs, compares each run with a reference run (`--reference`, else the unpacked run,
else the first), and writes report.md, a self-contained report.html (plots inlined) and the PNG plots.

Each run gets a verdict from the numbers, by the kind of keys its config changes (trainer/registry.py):
    same objective    only settings that must not change the loss (layout, backend, micro-batching, ranks,
                      compile, prefetch, ...) and the per-step losses agree within --tolerance
    layout-dependent  the same, under a normalization that depends on the layout on purpose (row_mean, ...)
    ablation          a setting that changes the objective on purpose (document isolation, positions, ...),
                      compared at equal documents per step
    not comparable    anything else (seed, data, model size, optimizer, ...),
                      or numbers that contradict the above

Where runs logged them, tables of the token loss by document length and by source of a data mixture (with each
source's token share against its target; a verdict line per compared run naming the groups beyond --tolerance,
and one per mixture run on whether its shares held within SHARE_TOLERANCE), and of model vs hardware FLOPs/s
(MFU, HFU where the device's peak is known). Runs without those keys get the report they always got.

The work is trainer.reporting (runs, verdicts, tables, plots, html); this command parses the arguments.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from trainer.errors import command
from trainer.outputs import OutputError, check_not_inside_input
from trainer.reporting.html import default_out, make_report
from trainer.reporting.runs import DEFAULT_TOLERANCE, ReportError


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.report", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, metavar="RUN_OR_SWEEP_DIR")
    p.add_argument("--out", type=Path, default=None,
                   help="output dir (default: the sweep dir given, or report/)")
    p.add_argument("--reference", default=None,
                   help="run name to compare against (default: the unpacked run)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="max |loss difference| for 'same objective' (default 1e-4, fp32)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a report.md / report.html report did not write")
    return p.parse_args(argv)


REPORT_MARKS = {"report.md": "# Training runs report", "report.html": "<title>Training runs report</title>"}
"""What every report this command writes holds near its top: a file without it is someone else's."""


def check_out_dir(out: Path, overwrite: bool) -> None:
    """--out is no input (a run dir, a checkpoint, a dataset, ...: trainer.outputs) and holds no report.md or
    report.html that this command did not write (unless --overwrite)."""
    check_not_inside_input(out)
    for name, mark in REPORT_MARKS.items():
        page = out / name
        if page.exists() and not overwrite and (
                not page.is_file() or mark not in page.read_text(encoding="utf-8", errors="replace")[:4096]):
            raise OutputError(f"--out {out} holds a {name} that trainer.report did not write: it would be "
                              "overwritten; give another directory, or --overwrite to replace it")


@command()
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not (0 <= args.tolerance < math.inf):
        raise ReportError(f"--tolerance must be a finite number >= 0, got {args.tolerance}")
    out = args.out or default_out(args.dirs)
    check_out_dir(out, args.overwrite)
    for path in make_report(args.dirs, out, args.reference, args.tolerance):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
