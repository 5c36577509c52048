"""The report written: report.md, a self-contained report.html (plots inlined) and the PNGs
(`make_report`)."""

from __future__ import annotations

import base64
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, PNGs only


from trainer.reporting.plots import write_plots
from trainer.reporting.runs import DEFAULT_TOLERANCE, Run, choose_reference, is_run_dir, load_runs
from trainer.reporting.tables import (
    BY_LENGTH,
    BY_POSITION,
    BY_SOURCE,
    LENGTH_COLUMNS,
    LONG_DOC_COLUMNS,
    POSITION_COLUMNS,
    SOURCE_COLUMNS,
    TABLE_COLUMNS,
    flops_table,
    group_rows,
    group_verdicts,
    long_doc_rows,
    share_verdicts,
    table_rows,
)
from trainer.reporting.tasks import TASK_COLUMNS, task_rows, task_verdicts
from trainer.reporting.verdicts import fmt_num, layout_verdicts, verdict


@dataclass
class Report:
    """Everything report.md and report.html show, already formatted."""

    reference: str
    tolerance: float
    rows: list[list[str]]
    verdicts: list[tuple[str, str]]
    length_rows: list[list[str]]
    """LENGTH_COLUMNS rows (empty: no run logged token_loss_by_length)."""
    source_rows: list[list[str]]
    """SOURCE_COLUMNS rows (empty: no run logged token_loss_by_source)."""
    position_rows: list[list[str]]
    """POSITION_COLUMNS rows (empty: no run logged token_loss_by_position)."""
    flops_columns: list[str]
    flops_rows: list[list[str]]
    """flops_table's (empty: no run logged FLOPs)."""
    task_rows: list[list[str]]
    """TASK_COLUMNS rows (empty: no run scored train.eval_tasks)."""
    long_doc_rows: list[list[str]]
    """LONG_DOC_COLUMNS rows (empty: no run's packer met a document longer than a row)."""
    images: list[tuple[str, str]]
    """(PNG file name, caption)."""
    notes: list[str]

    def tables(self) -> list[tuple[str, str, list[str], list[list[str]]]]:
        """(title, intro line, columns, rows) of each table after the verdicts that has rows."""
        tables = [
            ("Token loss by document length", "", LENGTH_COLUMNS, self.length_rows),
            ("Token loss by position in the document", "Targets grouped by their index in their document (a "
             "chunk of a split one from its own start): cross-document attention and continuous positions "
             "show at the early positions.", POSITION_COLUMNS, self.position_rows),
            ("Token loss by source", "Train token loss over all logged steps, each weighted by its targets; "
             "the last eval's; both as Δ against the reference over the steps both logged; each source's "
             "share of the run's document tokens against its weight / sum of the weights.", SOURCE_COLUMNS,
             self.source_rows),
            ("Long documents", "What each run's layout did to documents longer than a row (summary.json's "
             "packing_stats, rank 0's packer): the shares of documents split, truncated and dropped, of "
             "tokens cut off, and of tokens trained without their document's start (the chunks after a split "
             "document's first).", LONG_DOC_COLUMNS, self.long_doc_rows),
            ("Downstream tasks", "Each run's last scores of train.eval_tasks (trainer.reporting.tasks): "
             "accuracy with its 95 % Wilson interval, acc_norm, the gold answers' bits per byte, and the "
             "accuracy's difference from the reference's.", TASK_COLUMNS, self.task_rows),
            ("FLOPs both ways", "Mean over the non-warm-up steps. Model FLOPs: what the documents need, as "
             "if each ran alone (MFU); hardware FLOPs: what the kernels computed, padding and masked "
             "attention included (HFU). MFU and HFU only where the device's peak is known.",
             self.flops_columns, self.flops_rows),
        ]
        return [t for t in tables if t[3]]


def build_report(runs: Sequence[Run], ref: Run, tolerance: float, out: Path) -> Report:
    images, notes = write_plots(runs, out)
    notes += [f"{r.name}: {n}" for r in runs for n in r.notes]
    flops_columns, flops_rows = flops_table(runs)
    return Report(
        reference=ref.name,
        tolerance=tolerance,
        rows=table_rows(runs, ref, tolerance),
        verdicts=[(r.name, verdict(r, ref, tolerance)) for r in runs if r is not ref]
        + layout_verdicts(runs, ref, tolerance)
        + group_verdicts(runs, ref, tolerance, BY_LENGTH) + group_verdicts(runs, ref, tolerance, BY_POSITION)
        + group_verdicts(runs, ref, tolerance, BY_SOURCE)
        + share_verdicts(runs) + task_verdicts(runs, ref),
        length_rows=group_rows(runs, ref, BY_LENGTH),
        source_rows=group_rows(runs, ref, BY_SOURCE),
        position_rows=group_rows(runs, ref, BY_POSITION),
        flops_columns=flops_columns,
        flops_rows=flops_rows,
        task_rows=task_rows(runs, ref),
        long_doc_rows=long_doc_rows(runs),
        images=images,
        notes=notes,
    )


def _md(text: str) -> str:
    """Text from the runs (names, config values, paths) as Markdown shows it: every `<` that could open an
    HTML tag, comment or declaration escaped, since Markdown renderers pass raw HTML through (a run named
    `<img src=x onerror=...>` stays text); `<=64` and `->` stay as they are.

    Example: "<img src=x>" -> "&lt;img src=x>"; "<=64" -> "<=64"."""
    return re.sub(r"<(?=[A-Za-z/!?])", "&lt;", str(text))


def _md_cell(text: str) -> str:
    return _md(text).replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Report) -> str:
    lines = [
        "# Training runs report",
        "",
        f"Reference run: **{_md(report.reference)}**. Tolerance for equal losses: "
        f"{fmt_num(report.tolerance)} (absolute).",
        "",
        "| " + " | ".join(_md_cell(c) for c in TABLE_COLUMNS) + " |",
        "|" + "---|" * len(TABLE_COLUMNS),
        *("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in report.rows),
        "",
        "## Verdicts (against the reference run; each run against its unpacked counterpart)",
        "",
        *(f"- **{_md(name)}**: {_md(text)}" for name, text in report.verdicts),
        "",
    ]
    for title, intro, columns, rows in report.tables():
        lines += [f"## {title}", "", *([_md(intro), ""] if intro else []),
                  "| " + " | ".join(_md_cell(c) for c in columns) + " |", "|" + "---|" * len(columns),
                  *("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows), ""]
    lines += ["## Plots", ""]
    for name, caption in report.images:
        lines += [f"![{_md(caption)}]({name})", ""]
    if report.notes:
        lines += ["## Notes", "", *(f"- {_md(n)}" for n in report.notes), ""]
    return "\n".join(lines)


HTML_STYLE = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.3em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
figure { margin: 1.5em 0; }
img { max-width: 100%; height: auto; }
"""


def render_html(report: Report, out: Path) -> str:
    """Self-contained HTML: inline style, PNGs as base64 data URIs, no scripts, no external URLs."""
    e = html.escape
    header = "".join(f"<th>{e(c)}</th>" for c in TABLE_COLUMNS)
    body = "\n".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in report.rows)
    verdicts = "\n".join(f"<li><strong>{e(n)}</strong>: {e(t)}</li>" for n, t in report.verdicts)
    figures = "\n".join(
        f'<figure><img src="data:image/png;base64,{base64.b64encode((out / name).read_bytes()).decode()}" '
        f'alt="{e(caption)}"><figcaption>{e(caption)}</figcaption></figure>'
        for name, caption in report.images)
    notes = "".join(f"<li>{e(n)}</li>" for n in report.notes)
    tables = []
    for title, intro, columns, rows in report.tables():
        head = "".join(f"<th>{e(c)}</th>" for c in columns)
        cells = "\n".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in rows)
        tables.append(f"<h2>{e(title)}</h2>\n" + (f"<p>{e(intro)}</p>\n" if intro else "")
                      + f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{cells}\n</tbody>\n</table>")
    by_group = "\n".join(tables)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Training runs report</title>
<link rel="icon" href="data:,">
<style>{HTML_STYLE}</style>
</head>
<body>
<h1>Training runs report</h1>
<p>Reference run: <strong>{e(report.reference)}</strong>. \
Tolerance for equal losses: {e(fmt_num(report.tolerance))} (absolute).</p>
<table>
<thead><tr>{header}</tr></thead>
<tbody>
{body}
</tbody>
</table>
<h2>Verdicts (against the reference run; each run against its unpacked counterpart)</h2>
<ul>
{verdicts}
</ul>
{by_group}
<h2>Plots</h2>
{figures}
{f"<h2>Notes</h2><ul>{notes}</ul>" if notes else ""}
</body>
</html>
"""


def default_out(args: Sequence[Path]) -> Path:
    """The sweep dir when exactly one sweep dir is given, else ./report."""
    if len(args) == 1 and args[0].is_dir() and not is_run_dir(args[0]):
        return args[0]
    return Path("report")


def make_report(args: Sequence[Path], out: Path | None = None, reference: str | None = None,
                tolerance: float = DEFAULT_TOLERANCE) -> list[Path]:
    """Read the runs, write the PNGs, report.md and report.html into `out`; the paths written."""
    runs = load_runs(args)
    ref = choose_reference(runs, reference)
    out = out or default_out(args)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(runs, ref, tolerance, out)
    (out / "report.md").write_text(render_markdown(report))
    (out / "report.html").write_text(render_html(report, out))
    return [out / name for name, _ in report.images] + [out / "report.md", out / "report.html"]
