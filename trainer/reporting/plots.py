"""The report's plots (matplotlib, Agg: PNGs only), and the corpora's document lengths read from their
manifests (trainer.data.shards)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, PNGs only

import matplotlib.pyplot as plt  # noqa: E402

from trainer.data.shards import MANIFEST_FILE, PrepareError, load_manifest  # noqa: E402
from trainer.reporting.runs import Run, Series, elapsed, series, throughput, train_loss
from trainer.reporting.tables import (
    BY_LENGTH,
    BY_POSITION,
    BY_SOURCE,
    Breakdown,
    group_names,
    train_by_group,
    val_by_group,
)
from trainer.reporting.tasks import task_accuracy, task_names


def plain(text: str) -> str:
    """Text from the runs (names, paths) as matplotlib shows it: literally, not as mathtext (`$...$` would be
    parsed as TeX, and a run dir named `$\\frac{1}{$` would end the report)."""
    return text.replace("$", r"\$")


LINESTYLES = ["-", "--", ":", "-."]


MARKERS = ["o", "s", "^", "v", "D", "x", "+", "*"]


def _style(i: int, n_points: int) -> dict[str, Any]:
    """Thin lines told apart by colour, dash and marker even where curves coincide: markers are hollow
    (overlapping shapes stay visible) and staggered (run i starts at a different point)."""
    every = max(1, n_points // 8)
    return {"color": f"C{i % 10}", "linestyle": LINESTYLES[i % len(LINESTYLES)], "linewidth": 1.0,
            "marker": MARKERS[i % len(MARKERS)], "markersize": 6, "markerfacecolor": "none",
            "markevery": (i % every, every)}


def _line_plot(runs: Sequence[Run], y: Callable[[Run], Series], x: Callable[[Run], Series] | None,
               xlabel: str, ylabel: str, title: str) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, run in enumerate(runs):
        ys = y(run)
        xs = x(run) if x else {s: float(s) for s in ys}
        steps = [s for s in sorted(ys) if s in xs]
        ax.plot([xs[s] for s in steps], [ys[s] for s in steps], label=plain(run.name),
                **_style(i, len(steps)))
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def plot_loss_vs_step(runs: Sequence[Run]) -> plt.Figure:
    return _line_plot(runs, train_loss, None, "step", "train loss (token_loss)", "Train loss vs step")


def plot_loss_vs_time(runs: Sequence[Run]) -> plt.Figure:
    return _line_plot(runs, train_loss, elapsed, "training time elapsed_s (s)", "train loss (token_loss)",
                      "Train loss vs wall-clock time")


def plot_val_loss(runs: Sequence[Run]) -> plt.Figure:
    return _line_plot(runs, lambda r: series(r, "val_loss"), None, "step", "val loss",
                      "Validation loss vs step")


def plot_utilization(runs: Sequence[Run]) -> plt.Figure:
    fig = _line_plot(runs, lambda r: {s: 100 * u for s, u in series(r, "token_utilization").items()}, None,
                     "step", "token utilization (%)", "Token utilization (non-padding / allocated positions)")
    fig.axes[0].set_ylim(0, 105)
    return fig


def plot_loss_by_length(runs: Sequence[Run], by: Breakdown = BY_LENGTH) -> plt.Figure:
    """Grouped bars: per length (or position) bucket, each run's final val token loss (its train token loss
    without eval)."""
    names = group_names(runs, by)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        val, train = val_by_group(run, by), train_by_group(run, by)
        values = [val.get(n) if val else train.get(n, (None, 0))[0] for n in names]
        ax.bar([k + i * width for k in range(len(names))], [v if v is not None else 0.0 for v in values],
               width, label=plain(f"{run.name} ({'val' if val else 'train'})"), color=f"C{i % 10}",
               hatch=None if val else "//")
    ticks = [f"{n} tokens" if by is BY_LENGTH else f"position {n}" for n in names]
    ax.set_xticks([k + width * (len(runs) - 1) / 2 for k in range(len(names))], ticks)
    ax.set(ylabel="token loss", title=f"Token loss by {by.column} (final eval; train where no eval)")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return fig


SMOOTH_STEPS = 10


"""loss_by_source.png averages each source's loss over this many logged steps: a step holds a few documents of
a source (sometimes none), so its per-step loss swings by far more than the curves differ."""


def trailing_loss(run: Run, by: Breakdown, name: str, window: int) -> Series:
    """Per logged step with targets of group `name`: its token loss over the last `window` such steps, each
    weighted by its targets. Example, window 2: (2.0 on 10 targets), (3.0 on 30), (1.0 on 10) -> 2.0, 2.75,
    2.5."""
    logged = [(m["step"], m[by.loss][name], (m.get(by.targets) or {}).get(name, 0)) for m in run.metrics
              if (m.get(by.loss) or {}).get(name) is not None]
    out = {}
    for k, (step, _, _) in enumerate(logged):
        recent = logged[max(0, k - window + 1): k + 1]
        targets = sum(n for _, _, n in recent)
        if targets:
            out[step] = sum(loss * n for _, loss, n in recent) / targets
    return out


def plot_loss_by_source(runs: Sequence[Run]) -> plt.Figure:
    """Each run's train token loss of each source vs step (trailing mean over SMOOTH_STEPS logged steps):
    colour by source, dash and marker by run; the legend below the axes."""
    names = group_names(runs, BY_SOURCE)
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for i, run in enumerate(runs):
        for j, name in enumerate(names):
            losses = trailing_loss(run, BY_SOURCE, name, SMOOTH_STEPS)
            steps = sorted(losses)
            ax.plot(steps, [losses[s] for s in steps], label=plain(f"{name}: {run.name}"),
                    **{**_style(i, len(steps)), "color": f"C{j % 10}"})
    ax.set(xlabel="step", ylabel="train token loss",
           title=f"Train token loss by source (mean over the last {SMOOTH_STEPS} logged steps, by targets)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    return fig


def plot_task_accuracy(runs: Sequence[Run]) -> plt.Figure:
    """One panel per task of train.eval_tasks: each run's accuracy over its task steps."""
    names = task_names(runs)
    fig, axes = plt.subplots(1, len(names), figsize=(4.5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        for i, run in enumerate(runs):
            acc = task_accuracy(run, name)
            if acc:
                steps = sorted(acc)
                ax.plot(steps, [acc[s] for s in steps], label=plain(run.name), **_style(i, len(steps)))
        ax.set(xlabel="step", ylabel="acc", title=plain(name), ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return fig


def plot_throughput(runs: Sequence[Run]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    values = [throughput(r) or 0.0 for r in runs]
    bars = ax.bar(range(len(runs)), values, color=[f"C{i % 10}" for i in range(len(runs))])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize="small")
    ax.set_xticks(range(len(runs)), [plain(r.name) for r in runs], rotation=20, ha="right")
    ax.set(ylabel="valid tokens/s", title="Valid tokens/s per run (mean over non-warm-up steps)")
    ax.grid(axis="y", alpha=0.3)
    return fig


@dataclass
class Corpus:
    """A training split's document-length histogram (token counts, log2 bins) from manifest.json."""

    label: str
    edges: list[float]
    counts: list[int]
    seq_lens: list[int]


def find_data_dir(data_path: str, run_dir: Path) -> Path | None:
    """The data dir holding manifest.json: `data_path` as given (relative to the cwd), else relative to
    the run dir's parents (where training ran from when the run dir is under it)."""
    for base in [Path("."), *run_dir.resolve().parents]:
        candidate = base / data_path
        if (candidate / MANIFEST_FILE).is_file():
            return candidate
    return None


def data_paths(run: Run) -> list[str | None]:
    """The prepared data dirs a run read: data.path, or the path of each source of data.sources (None:
    urls)."""
    sources = run.config.get("data.sources")
    if sources:
        return [s.get("path") if isinstance(s, dict) else None for s in sources]
    return [run.config.get("data.path")]


def load_corpora(runs: Sequence[Run]) -> tuple[list[Corpus], list[str]]:
    """The histogram of each distinct training corpus, and a note for each one that has none."""
    corpora: dict[Path, Corpus] = {}
    notes: list[str] = []
    for run, data_path in ((r, path) for r in runs for path in data_paths(r)):
        split = run.config.get("data.split", "train")
        data_dir = find_data_dir(str(data_path), run.path) if data_path else None
        if data_dir is None:
            notes.append(f"run {run.name}: data dir {data_path!r} not found (no {MANIFEST_FILE} there)")
            continue
        key = data_dir.resolve()
        if key not in corpora:
            try:
                manifest = load_manifest(data_dir)
            except PrepareError as e:  # a report of the runs still, with a note on the corpus it cannot show
                notes.append(str(e))
                corpora[key] = Corpus(str(data_path), [], [], [])
                continue
            hist = manifest.get("splits", {}).get(split, {}).get("lengths", {}).get("histogram")
            if not hist or len(hist.get("edges", [])) != len(hist.get("counts", [])) + 1:
                notes.append(f"{data_dir / MANIFEST_FILE} has no lengths.histogram for split {split!r} "
                             f"(prepare the data again with the current trainer.prepare)")
                corpora[key] = Corpus(str(data_path), [], [], [])
                continue
            corpora[key] = Corpus(f"{data_path} ({split})", hist["edges"], hist["counts"], [])
        seq_len = run.config.get("train.seq_len")
        if seq_len and seq_len not in corpora[key].seq_lens:
            corpora[key].seq_lens.append(seq_len)
    return [c for c in corpora.values() if c.counts], list(dict.fromkeys(notes))


def plot_doc_lengths(corpora: Sequence[Corpus]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, corpus in enumerate(corpora):
        ax.stairs(corpus.counts, corpus.edges, fill=True, alpha=0.35, color=f"C{i % 10}",
                  label=plain(corpus.label))
        for j, seq_len in enumerate(corpus.seq_lens):
            ax.axvline(seq_len, color=f"C{i % 10}", linestyle=LINESTYLES[(j + 1) % len(LINESTYLES)],
                       linewidth=1.5, label=f"train.seq_len={seq_len}")
    if all(c.edges[0] > 0 for c in corpora):
        ax.set_xscale("log", base=2)
    ax.set(xlabel="document length (tokens, EOS included)", ylabel="documents",
           title="Training corpus: document lengths")
    ax.legend(fontsize="small")
    return fig


def write_plots(runs: Sequence[Run], out: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """Save each plot that has data into `out`: (file name, caption) of each, and a note for each left out."""
    corpora, corpus_notes = load_corpora(runs)
    has_val = any(series(r, "val_loss") for r in runs)
    plots: list[tuple[str, str, Callable[[], plt.Figure]]] = [
        ("loss_vs_step.png", "Train loss vs step", lambda: plot_loss_vs_step(runs)),
        ("loss_vs_time.png", "Train loss vs training wall-clock time", lambda: plot_loss_vs_time(runs)),
        *([("val_loss_vs_step.png", "Validation loss vs step", lambda: plot_val_loss(runs))]
          if has_val else []),
        ("valid_tokens_per_s.png", "Valid tokens/s per run (non-warm-up mean)",
         lambda: plot_throughput(runs)),
        ("token_utilization.png", "Token utilization over steps", lambda: plot_utilization(runs)),
        *([("loss_by_length.png", "Token loss by document length", lambda: plot_loss_by_length(runs))]
          if group_names(runs, BY_LENGTH) else []),
        *([("loss_by_position.png", "Token loss by position in the document",
            lambda: plot_loss_by_length(runs, BY_POSITION))] if group_names(runs, BY_POSITION) else []),
        *([("loss_by_source.png", "Train token loss by source vs step", lambda: plot_loss_by_source(runs))]
          if group_names(runs, BY_SOURCE) else []),
        *([("task_accuracy.png", "Downstream accuracy vs step, per task of train.eval_tasks",
            lambda: plot_task_accuracy(runs))] if task_names(runs) else []),
        *([("doc_lengths.png", "Document lengths of the training corpus, train.seq_len marked",
            lambda: plot_doc_lengths(corpora))] if corpora else []),
    ]
    for name, _, make in plots:
        fig = make()
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    notes = [] if has_val else ["Validation loss: no run logged val_loss (train.eval_every=0?)."]
    if not corpora:
        notes.append("Document-length histogram not available: " + ("; ".join(corpus_notes) or "no data.path")
                     + ".")
    else:
        notes += [f"Document-length histogram: {n}." for n in corpus_notes]
    return [(name, caption) for name, caption, _ in plots], notes
