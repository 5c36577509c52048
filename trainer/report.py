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
    not comparable    anything else (seed, data, model size, optimizer, ...), or numbers that contradict the above

Where runs logged them, tables of the token loss by document length and by source of a data mixture (with each
source's token share against its target; a verdict line per compared run naming the groups beyond --tolerance,
and one per mixture run on whether its shares held within SHARE_TOLERANCE), and of model vs hardware FLOPs/s
(MFU, HFU where the device's peak is known). Runs without those keys get the report they always got.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display, PNGs only

import matplotlib.pyplot as plt  # noqa: E402

from trainer.errors import UserError, command  # noqa: E402
from trainer.registry import (  # noqa: E402
    ABLATION,
    CONFIG_FILE,
    IGNORED,
    LAYOUT_INVARIANT_NORMALIZATIONS,
    METRICS_FILE,
    OLDER_RUN_VALUES,
    OTHER,
    SAME_OBJECTIVE,
    SUMMARY_FILE,
    config_key_class,
)

DEFAULT_TOLERANCE = 1e-4
"""Max |Δloss| allowed over the first EARLY_STEPS shared steps of runs with the same objective (fp32)."""
EARLY_STEPS = 10
"""Float rounding differs between layouts (different summation orders) by ~1e-7 of the loss. Training then
amplifies it (Adam turns tiny gradient differences into full-size updates), so two runs of one objective
drift apart slowly: ~1e-6 at step 10, ~1e-3 by step 100 on the demo. A changed objective differs from step 1
on, by far more than 1e-4. So the strict test is on the early steps, and later steps only have to stay within
DRIFT_TOLERANCE (relative) of each other."""
DRIFT_TOLERANCE = 1e-2
TABLE_COLUMNS = [
    "run", "differs", "steps", "final train loss", "final val loss", "max |Δ train loss|",
    "token utilization", "valid tokens/s", "allocated tokens/s", "speed-up vs unpacked",
    "time to ref. loss", "peak mem (GB)", "notes",
]

Series = dict[int, float]  # optimizer step -> value


class ReportError(UserError):
    """A user mistake (no runs, unknown reference)."""


def key_class(key: str) -> str:
    """The class of a dotted config key, as trainer/registry.py registers it; a key it does not know (one of
    another trainer version) is "other": not comparable.

    Example: "logging.wandb.mode" -> "ignored", "data.prefetch" -> "same objective",
    "model.pos_emb" -> "ablation", "seed" -> "other".
    """
    return config_key_class(key) or OTHER


# ---------------------------------------------------------------------------------------------------
# Reading runs
# ---------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One run dir, as read from disk."""

    name: str
    path: Path
    config: dict[str, Any]
    """Flattened to dotted keys, OLDER_RUN_VALUES filled in."""
    metrics: list[dict[str, Any]]
    """One dict per logged step, sorted by step, each step once."""
    summary: dict[str, Any] | None
    """None when summary.json is missing (the run crashed or is still running)."""
    notes: list[str] = field(default_factory=list)


def flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts -> one dict of dotted keys; lists become tuples (comparable, hashable).

    Example: {"seed": 0, "optim": {"lr": 0.1, "betas": [0.9, 0.95]}}
          -> {"seed": 0, "optim.lr": 0.1, "optim.betas": (0.9, 0.95)}
    """
    out: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = tuple(value) if isinstance(value, list) else value
    return out


def is_run_dir(path: Path) -> bool:
    return (path / METRICS_FILE).is_file() or (path / CONFIG_FILE).is_file()


def _natural_key(path: Path) -> list:
    """Sort key putting Hydra's sweep dirs in job order: 0, 1, 2, ..., 10 (not 0, 1, 10, 2)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def find_run_dirs(arg: Path) -> list[Path]:
    """The run dir itself, or the run dirs directly under a sweep dir (in job order)."""
    if not arg.is_dir():
        raise ReportError(f"{arg}: not a directory")
    if is_run_dir(arg):
        return [arg]
    runs = sorted((p for p in arg.iterdir() if p.is_dir() and is_run_dir(p)), key=_natural_key)
    if not runs:
        raise ReportError(f"{arg}: no runs found (a run dir holds metrics.jsonl and config.json; "
                          f"a sweep dir holds run dirs one level down)")
    return runs


def read_metrics(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """metrics.jsonl -> one dict per step, sorted; an unreadable line (a crash mid-write) is noted and skipped."""
    by_step: dict[int, dict[str, Any]] = {}
    if not path.is_file():
        notes.append("no metrics.jsonl")
        return []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            by_step[int(record["step"])] = record  # a rewritten step (resume) keeps its last line
        except (ValueError, KeyError, TypeError):
            notes.append(f"metrics.jsonl line {i} unreadable (skipped)")
    return [by_step[s] for s in sorted(by_step)]


def _read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path` (None: no such file); a ReportError for a file that holds none."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: not valid JSON ({e}); fix or remove it (trainer.train writes it)") from e
    if not isinstance(value, dict):
        raise ReportError(f"{path}: holds a JSON {type(value).__name__}, not an object of config keys; fix or "
                          "remove it (trainer.train writes it)")
    return value


def load_run(path: Path, name: str) -> Run:
    notes: list[str] = []
    raw_config = _read_json(path / CONFIG_FILE)
    if raw_config is None:
        notes.append("no config.json")
    config = {**OLDER_RUN_VALUES, **flatten(raw_config or {})}
    summary = _read_json(path / SUMMARY_FILE)
    if summary is None:
        notes.append("no summary.json (crashed or still running)")
    elif summary.get("world_size") is not None:
        config["world_size"] = summary["world_size"]
    return Run(name, path, config, read_metrics(path / METRICS_FILE, notes), summary, notes)


def run_names(paths: Sequence[Path]) -> list[str]:
    """Each run's dir name; "parent/name" where two runs share a name (two sweeps' job "0")."""
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def load_runs(args: Iterable[Path]) -> list[Run]:
    paths = [run for arg in args for run in find_run_dirs(Path(arg))]
    runs = [load_run(p, name) for p, name in zip(paths, run_names(paths), strict=True)]
    if any("world_size" not in r.config for r in runs):  # unknown for one run: compare no run on it
        for r in runs:
            r.config.pop("world_size", None)
    return runs


# ---------------------------------------------------------------------------------------------------
# Per-run numbers
# ---------------------------------------------------------------------------------------------------


def series(run: Run, key: str) -> Series:
    return {m["step"]: m[key] for m in run.metrics if m.get(key) is not None}


def train_loss(run: Run) -> Series:
    """token_loss (sum of token losses / valid targets: comparable across normalizations), else loss."""
    return {m["step"]: m.get("token_loss", m.get("loss")) for m in run.metrics if m.get("loss") is not None}


def elapsed(run: Run) -> Series:
    """Training wall time at each logged step: elapsed_s, or (older runs) the running sum of step_time_s."""
    if run.metrics and all("elapsed_s" in m for m in run.metrics):
        return series(run, "elapsed_s")
    total, out = 0.0, {}
    for m in run.metrics:
        total += m.get("step_time_s", 0.0)
        out[m["step"]] = total
    return out


def steady(run: Run) -> list[dict[str, Any]]:
    """The non-warm-up steps (all steps when every step is marked warm-up, as in very short runs)."""
    return [m for m in run.metrics if not m.get("warmup", False)] or run.metrics


def throughput(run: Run, key: str = "valid_tokens") -> float | None:
    """Tokens per second of step time over the steady steps (summary.json's mean_*_tokens_per_s).

    Example: steps of 100 tokens in 1 s and 300 tokens in 1 s -> 200.0.
    """
    steps = steady(run)
    seconds = sum(m.get("step_time_s", 0.0) for m in steps)
    return sum(m.get(key, 0) for m in steps) / seconds if seconds else None


def mean_utilization(run: Run) -> float | None:
    values = [m["token_utilization"] for m in steady(run) if "token_utilization" in m]
    return sum(values) / len(values) if values else None


def peak_memory(run: Run) -> float | None:
    values = list(series(run, "peak_mem_gb").values())
    if run.summary and run.summary.get("peak_mem_gb") is not None:
        values.append(run.summary["peak_mem_gb"])
    return max(values) if values else None


def last(s: Series) -> float | None:
    return s[max(s)] if s else None


def max_abs_gap(a: Series, b: Series) -> tuple[float, int] | None:
    """(max |a - b|, number of shared steps) over the steps both series hold; None if they share none.

    Example: {1: 2.0, 2: 1.5, 3: 1.0} vs {1: 2.0, 2: 1.4} -> (0.1, 2) (up to float rounding).
    """
    shared = sorted(set(a) & set(b))
    if not shared:
        return None
    return max(abs(a[s] - b[s]) for s in shared), len(shared)


def time_to_reach(run: Run, target: float, tolerance: float = 0.0) -> tuple[float, int] | None:
    """(elapsed seconds, step) at the first logged step whose train loss is <= target + tolerance (a run
    with the same objective reaches the reference's final loss however float rounding falls); None if never.

    Example: losses 3.0, 2.5, 2.0 at elapsed 1, 2, 3 s with target 2.5 -> (2.0, 2).
    """
    times = elapsed(run)
    for step, loss in sorted(train_loss(run).items()):
        if loss <= target + tolerance and step in times:
            return times[step], step
    return None


# ---------------------------------------------------------------------------------------------------
# Comparing configs
# ---------------------------------------------------------------------------------------------------


def fmt_value(value: Any) -> str:
    """A config value the way a Hydra override writes it: true, null, 0.003, [0.9, 0.95], {name: a, weight: 1}."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return "[" + ", ".join(fmt_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an entry of data.sources
        return "{" + ", ".join(f"{k}: {fmt_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def differing_keys(configs: Sequence[dict[str, Any]]) -> list[str]:
    """Keys (not ignored) whose values are not all equal across the configs; a missing key is null.

    Example: [{"seed": 0, "packing.layout": "packed", "logging.log_every": 1},
              {"seed": 0, "packing.layout": "unpacked", "logging.log_every": 5}] -> ["packing.layout"]
    """
    keys = sorted(set().union(*configs)) if configs else []
    return [k for k in keys if key_class(k) != IGNORED and any(c.get(k) != configs[0].get(k) for c in configs)]


def describe(run: Run, keys: Sequence[str]) -> str:
    """The run's values of `keys` as overrides: "packing.layout=unpacked, seed=1"."""
    return ", ".join(f"{k}={fmt_value(run.config.get(k))}" for k in keys)


def unpacked_match(run: Run, runs: Sequence[Run]) -> Run | None:
    """The run with packing.layout=unpacked whose other settings differ from `run` in the fewest keys."""
    def distance(other: Run) -> tuple[int, int]:
        keys = differing_keys([run.config, other.config])
        return len([k for k in keys if k not in ("packing.layout", "packing.pad_to")]), runs.index(other)

    candidates = [r for r in runs if r.config.get("packing.layout") == "unpacked"]
    return min(candidates, key=distance, default=None)


def choose_reference(runs: Sequence[Run], name: str | None) -> Run:
    """`--reference NAME`, else the first unpacked run, else the first run."""
    if name is not None:
        for run in runs:
            if run.name == name:
                return run
        raise ReportError(f"--reference {name}: no such run (runs: {', '.join(r.name for r in runs)})")
    return next((r for r in runs if r.config.get("packing.layout") == "unpacked"), runs[0])


# ---------------------------------------------------------------------------------------------------
# Verdicts
# ---------------------------------------------------------------------------------------------------


def _num(x: float | None, spec: str = ".2g") -> str:
    return "n/a" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def data_mismatch(run: Run, ref: Run) -> str | None:
    """Where the per-step documents differ: the first shared step whose `docs` or `valid_tokens` differ.

    Example: docs 12 vs 13 at step 3 -> "from step 3: docs 12 vs 13, valid tokens 900 vs 910".
    """
    mine, theirs = {m["step"]: m for m in run.metrics}, {m["step"]: m for m in ref.metrics}
    for step in sorted(set(mine) & set(theirs)):
        a, b = theirs[step], mine[step]
        if (a.get("docs"), a.get("valid_tokens")) != (b.get("docs"), b.get("valid_tokens")):
            return (f"from step {step}: docs {a.get('docs')} vs {b.get('docs')}, "
                    f"valid tokens {a.get('valid_tokens')} vs {b.get('valid_tokens')}")
    return None


def _speed_and_utilization(run: Run, ref: Run) -> str:
    speed = _ratio(throughput(run), throughput(ref))
    return (f"{_num(speed, '.2f')}x valid tokens/s; utilization "
            f"{_num(mean_utilization(ref), '.1%')} -> {_num(mean_utilization(run), '.1%')}")


def _changes(run: Run, ref: Run, keys: Sequence[str]) -> str:
    """"packing.layout packed -> unpacked, ..." (reference value first)."""
    return ", ".join(f"{k} {fmt_value(ref.config.get(k))} -> {fmt_value(run.config.get(k))}" for k in keys)


def verdict(run: Run, ref: Run, tolerance: float) -> str:
    """One line comparing `run` with the reference, from the kind of keys that differ and the numbers."""
    if run is ref:
        return "reference run"
    if not run.metrics or not ref.metrics:
        return f"not comparable: {'this' if not run.metrics else 'the reference'} run logged no metrics"
    keys = differing_keys([ref.config, run.config])
    other = [k for k in keys if key_class(k) == OTHER]
    if other:
        return "not comparable: " + ", ".join(
            f"different {k} ({fmt_value(ref.config.get(k))} vs {fmt_value(run.config.get(k))})" for k in other)
    ablation = [k for k in keys if key_class(k) == ABLATION]
    if ablation:
        return ablation_verdict(run, ref, ablation, [k for k in keys if k not in ablation])
    return same_objective_verdict(run, ref, keys, tolerance)


def same_objective_verdict(run: Run, ref: Run, keys: Sequence[str], tolerance: float) -> str:
    """Only objective-neutral keys differ: the optimized loss must agree step by step (or, under a
    layout-dependent normalization, the loss difference is the price of that normalization).

    Same objective means: max |Δloss| <= tolerance over the first EARLY_STEPS shared steps, and
    |Δloss| <= DRIFT_TOLERANCE x loss on every shared step (see DRIFT_TOLERANCE).
    """
    ref_loss, run_loss = series(ref, "loss"), series(run, "loss")
    gap = max_abs_gap(ref_loss, run_loss)
    if gap is None:
        return "not comparable: no shared logged steps"
    value, n = gap
    nonfinite = [s for s in sorted(set(ref_loss) & set(run_loss))
                 if not (math.isfinite(ref_loss[s]) and math.isfinite(run_loss[s]))]
    if nonfinite:  # NaN equals nothing, itself included: such steps prove no agreement
        return (f"not comparable: non-finite loss at {len(nonfinite)} shared step(s) (first: step {nonfinite[0]}), "
                "where equal losses cannot be checked")
    early_steps = sorted(set(ref_loss) & set(run_loss))[:EARLY_STEPS]
    early = max(abs(ref_loss[s] - run_loss[s]) for s in early_steps)
    drift = max(abs(ref_loss[s] - run_loss[s]) / max(abs(ref_loss[s]), 1e-12) for s in ref_loss if s in run_loss)
    norm = run.config.get("loss.normalization")
    changed = _changes(run, ref, keys) if keys else "nothing (identical settings)"
    if norm not in LAYOUT_INVARIANT_NORMALIZATIONS:
        final = _delta(last(series(run, "loss")), last(series(ref, "loss")))
        return (f"layout-dependent objective: under loss.normalization={norm} the loss depends on the layout; "
                f"{changed} changes it by up to {_num(value)} over {n} steps (final {final}); "
                + _speed_and_utilization(run, ref))
    if early <= tolerance and drift <= DRIFT_TOLERANCE:
        text = f"same objective: max |Δloss| {_num(early)} over "
        if n <= EARLY_STEPS:
            text += f"{n} steps; "
        else:
            text += (f"the first {len(early_steps)} steps ({_num(value)} over all {n}: float rounding amplified "
                     f"by training, within {DRIFT_TOLERANCE:.0%}); ")
        return text + _speed_and_utilization(run, ref)
    mismatch = data_mismatch(run, ref)
    why = f"documents per step differ {mismatch}" if mismatch else "same documents per step"
    found = (f"loss gap {_num(early)} over the first {len(early_steps)} steps above tolerance {_num(tolerance)}"
             if early > tolerance else f"loss drifts {drift:.1%} apart (above {DRIFT_TOLERANCE:.0%})")
    return f"not comparable: {found} ({why}; expected equal losses, only {changed} differs)"


def _delta(new: float | None, old: float | None) -> str:
    """"3.2100 -> 3.2500 (+0.04)": a final value against the reference's."""
    if new is None or old is None:
        return f"{_num(old, '.4f')} -> {_num(new, '.4f')}"
    return f"{old:.4f} -> {new:.4f} ({new - old:+.2g})"


def ablation_verdict(run: Run, ref: Run, ablation: Sequence[str], neutral: Sequence[str]) -> str:
    """A setting changes the objective on purpose: its effect on the final losses, at equal documents."""
    mismatch = data_mismatch(run, ref)
    if mismatch:
        return (f"not comparable: different documents per step ({mismatch}) although only "
                f"{_changes(run, ref, [*ablation, *neutral])} differs")
    train_ref, train_run = train_loss(ref), train_loss(run)
    shared = sorted(set(train_ref) & set(train_run))
    if not shared:
        return "not comparable: no shared logged steps"
    val_ref, val_run = series(ref, "val_loss"), series(run, "val_loss")
    shared_val = sorted(set(val_ref) & set(val_run))
    text = (f"ablation {_changes(run, ref, ablation)}: final train loss "
            f"{_delta(train_run[shared[-1]], train_ref[shared[-1]])} at step {shared[-1]}")
    if shared_val:
        step = shared_val[-1]
        text += f", final val loss {_delta(val_run[step], val_ref[step])} at step {step}"
    else:
        text += ", final val loss n/a"
    text += f", at equal documents per step ({len(shared)} steps)"
    if neutral:
        norms = {run.config.get("loss.normalization"), ref.config.get("loss.normalization")}
        effect = ("objective-neutral" if norms <= LAYOUT_INVARIANT_NORMALIZATIONS
                  else "which changes a layout-dependent normalization too")
        text += f"; also differs in {_changes(run, ref, neutral)} ({effect})"
    return text


# ---------------------------------------------------------------------------------------------------
# The table
# ---------------------------------------------------------------------------------------------------


def table_rows(runs: Sequence[Run], ref: Run, tolerance: float = DEFAULT_TOLERANCE) -> list[list[str]]:
    """One row of strings per run, in TABLE_COLUMNS order."""
    diff = differing_keys([r.config for r in runs])
    target = last(train_loss(ref))
    rows = []
    for run in runs:
        gap = None if run is ref else max_abs_gap(train_loss(ref), train_loss(run))
        match = unpacked_match(run, runs)
        speed = _ratio(throughput(run), throughput(match)) if match else None
        reached = time_to_reach(run, target, tolerance) if target is not None else None
        notes = (["reference"] if run is ref else []) + run.notes
        rows.append([
            run.name,
            describe(run, diff) or "—",
            str(max(series(run, "step"), default=0)),
            _num(last(train_loss(run)), ".4f"),
            _num(last(series(run, "val_loss")), ".4f"),
            "—" if run is ref else (_num(gap[0]) + f" ({gap[1]} steps)" if gap else "n/a"),
            _num(mean_utilization(run), ".1%"),
            _num(throughput(run), ",.0f"),
            _num(throughput(run, "allocated_tokens"), ",.0f"),
            f"{speed:.2f}x vs {match.name}" if speed is not None and match else "n/a",
            f"{reached[0]:.1f} s (step {reached[1]})" if reached else "n/a",
            _num(peak_memory(run), ".2f"),
            "; ".join(notes),
        ])
    return rows


# ---------------------------------------------------------------------------------------------------
# Loss by group: by document length (token_loss_by_length) and by source of a mixture (token_loss_by_source)
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Breakdown:
    """A run's token loss split into groups of targets, as metrics.jsonl logs it: each logged step holds
    {group: token loss, or null without targets} under `loss` and {group: targets} under `targets`; eval steps
    hold the val set's {group: token loss} under `val_loss`."""

    loss: str
    targets: str
    val_loss: str
    column: str
    """The table's name for a group."""
    group: str
    """A group in a verdict line, {} its name: "documents {} tokens"."""
    every: str
    """All groups in a verdict line: "every length bucket"."""


BY_LENGTH = Breakdown("token_loss_by_length", "targets_by_length", "val_token_loss_by_length", "document length",
                      "documents {} tokens", "every length bucket")
BY_SOURCE = Breakdown("token_loss_by_source", "targets_by_source", "val_token_loss_by_source", "source",
                      "source {}", "every source")
GROUP_COLUMNS = ["run", "{}", "train token loss", "Δ train vs ref.", "final val token loss", "Δ val vs ref.",
                 "train targets"]
LENGTH_COLUMNS = [c.format(BY_LENGTH.column) for c in GROUP_COLUMNS]
SOURCE_COLUMNS = [c.format(BY_SOURCE.column) for c in GROUP_COLUMNS] + ["token share", "target share"]


def group_names(runs: Sequence[Run], by: Breakdown) -> list[str]:
    """The groups any run logged, in the order logged. Example (BY_LENGTH): ["<=64", "<=256", ">256"]."""
    names: dict[str, None] = {}
    for run in runs:
        for m in run.metrics:
            names.update(dict.fromkeys(m.get(by.loss) or {}))
    return list(names)


def train_by_group(run: Run, by: Breakdown, steps: set[int] | None = None) -> dict[str, tuple[float | None, int]]:
    """Per group: (token loss over the logged steps in `steps` (all: None), targets): each step's group loss
    weighted by its targets. Example: steps with ("<=64": 2.0 on 10 targets) and (3.0 on 30) -> (2.75, 40)."""
    sums: dict[str, float] = {}
    targets: dict[str, int] = {}
    for m in run.metrics:
        if steps is not None and m["step"] not in steps:
            continue
        for name, loss in (m.get(by.loss) or {}).items():
            n = (m.get(by.targets) or {}).get(name, 0)
            targets[name] = targets.get(name, 0) + n
            sums[name] = sums.get(name, 0.0) + (loss * n if loss is not None else 0.0)
    return {name: (sums[name] / targets[name] if targets[name] else None, targets[name]) for name in targets}


def val_by_group(run: Run, by: Breakdown) -> dict[str, float | None]:
    """The last eval's per-group val token loss ({} without one)."""
    evals = [m[by.val_loss] for m in run.metrics if m.get(by.val_loss)]
    return evals[-1] if evals else {}


def _shared_steps(run: Run, ref: Run) -> set[int]:
    return set(series(run, "step")) & set(series(ref, "step"))


def group_deltas(run: Run, ref: Run, by: Breakdown) -> dict[str, tuple[float | None, float | None]]:
    """Per group: (Δ train token loss over the steps both logged, Δ final val token loss) against `ref`."""
    steps = _shared_steps(run, ref)
    train, train_ref = train_by_group(run, by, steps), train_by_group(ref, by, steps)
    val, val_ref = val_by_group(run, by), val_by_group(ref, by)
    out = {}
    for name in group_names([run, ref], by):
        a, b = train.get(name, (None, 0))[0], train_ref.get(name, (None, 0))[0]
        c, d = val.get(name), val_ref.get(name)
        out[name] = (a - b if a is not None and b is not None else None, c - d if c is not None and d is not None
                     else None)
    return out


def group_rows(runs: Sequence[Run], ref: Run, by: Breakdown) -> list[list[str]]:
    """Rows of GROUP_COLUMNS: each run x group (none when no run logged `by.loss`); BY_SOURCE rows also hold the
    run's token share and target share of each source (SOURCE_COLUMNS)."""
    names = group_names(runs, by)
    rows = []
    for run in runs:
        train, val = train_by_group(run, by), val_by_group(run, by)
        deltas = {} if run is ref else group_deltas(run, ref, by)
        shares, targets_share = token_shares(run), target_shares(run)
        for name in names:
            loss, targets = train.get(name, (None, 0))
            dt, dv = deltas.get(name, (None, None))
            row = [run.name, name, _num(loss, ".4f"), "—" if run is ref else _num(dt, "+.2g"),
                   _num(val.get(name), ".4f"), "—" if run is ref else _num(dv, "+.2g"), f"{targets:,}"]
            if by is BY_SOURCE:
                row += [_num(shares.get(name), ".1%"), _num(targets_share.get(name), ".1%")]
            rows.append(row)
    return rows


def group_verdicts(runs: Sequence[Run], ref: Run, tolerance: float, by: Breakdown) -> list[tuple[str, str]]:
    """One line per run that is compared with the reference (not "not comparable"), when runs logged groups:
    the groups whose train or val token loss differs from the reference's by more than `tolerance`, or that
    every group agrees. Example (BY_LENGTH): ("mixed by document length", "documents <=64 tokens: train token
    loss +0.012, final val token loss +0.0098 against ref (beyond 0.0001)")."""
    if not group_names(runs, by):
        return []
    label = f"by {by.column}"
    out = []
    for run in runs:
        if run is ref or verdict(run, ref, tolerance).startswith("not comparable"):
            continue
        deltas = group_deltas(run, ref, by)
        beyond = [(name, dt, dv) for name, (dt, dv) in deltas.items()
                  if any(d is not None and abs(d) > tolerance for d in (dt, dv))]
        if beyond:
            text = "; ".join(f"{by.group.format(name)}: train token loss {_num(dt, '+.2g')}, final val token loss "
                             f"{_num(dv, '+.2g')}" for name, dt, dv in beyond)
            out.append((f"{run.name} {label}", f"{text} against {ref.name} (beyond {_num(tolerance)})"))
        else:
            worst = max((abs(d) for pair in deltas.values() for d in pair if d is not None), default=None)
            out.append((f"{run.name} {label}",
                        f"{by.every} within {_num(tolerance)} of {ref.name} (max |Δ| {_num(worst)})"))
    return out


# ---------------------------------------------------------------------------------------------------
# Mixtures: token shares by source (token_share_by_source, target_share_by_source)
# ---------------------------------------------------------------------------------------------------

SHARE_TOLERANCE = 0.02
"""A mixture run holds its weights when each source's share of the run's document tokens is within 0.02 (two
percentage points) of weight / sum of the weights."""


def token_shares(run: Run) -> dict[str, float]:
    """Each source's share of the run's document tokens: summary.json's token_share_by_source (the whole run),
    else the logged steps' tokens_by_source summed. Example: steps {a: 70, b: 30}, {a: 50, b: 50} -> a 0.6, b 0.4."""
    if run.summary and run.summary.get("token_share_by_source"):
        return run.summary["token_share_by_source"]
    tokens: dict[str, int] = {}
    for m in run.metrics:
        for name, n in (m.get("tokens_by_source") or {}).items():
            tokens[name] = tokens.get(name, 0) + n
    total = sum(tokens.values())
    return {name: n / total for name, n in tokens.items()} if total else {}


def target_shares(run: Run) -> dict[str, float]:
    """weight / sum of the weights per source: summary.json's target_share_by_source, else the last logged step's."""
    if run.summary and run.summary.get("target_share_by_source"):
        return run.summary["target_share_by_source"]
    logged = [m["target_share_by_source"] for m in run.metrics if m.get("target_share_by_source")]
    return logged[-1] if logged else {}


def mixer_shares(run: Run) -> dict[str, float]:
    """Each source's share of the tokens by the mixer's own count (summary.json's `mixture`, {name: {tokens,
    ...}}: the document tokens it handed out); {} without one. Tokens handed out but not trained by the end (a
    prefetched step, a buffer of an earlier mixer design) count here, not in token_shares."""
    mixture = (run.summary or {}).get("mixture") or {}
    tokens = {name: entry.get("tokens", 0) for name, entry in mixture.items() if isinstance(entry, dict)}
    total = sum(tokens.values())
    return {name: n / total for name, n in tokens.items()} if total else {}


def step_share_gap(run: Run) -> float | None:
    """The largest |token share - target share| of any source in any logged step (None: no step logged shares)."""
    targets = target_shares(run)
    gaps = [abs(share - targets[name]) for m in run.metrics for name, share in (m.get("token_share_by_source") or {})
            .items() if share is not None and name in targets]
    return max(gaps, default=None)


def share_verdicts(runs: Sequence[Run]) -> list[tuple[str, str]]:
    """One line per mixture run (target shares for two sources or more): whether its token shares over the run
    held within SHARE_TOLERANCE of the targets, the worst single step, and the shares by the mixer's count.
    Example: ("mix", "token shares held within 2 points of the targets: functions 70.4% (target 70.0%), modules
    29.6% (target 30.0%); single steps up to 6.1 points off; the mixer's count: functions 70.1%, modules 29.9%")."""
    out = []
    for run in runs:
        targets = target_shares(run)
        if len(targets) < 2:
            continue
        shares = token_shares(run)
        if not shares:
            out.append((f"{run.name} mixture", "token shares n/a: the run logged no tokens_by_source"))
            continue
        listing = ", ".join(f"{name} {_num(shares.get(name), '.1%')} (target {target:.1%})"
                            for name, target in targets.items())
        off = [name for name, target in targets.items() if abs(shares.get(name, 0.0) - target) > SHARE_TOLERANCE]
        points = f"{SHARE_TOLERANCE * 100:g} points"
        text = (f"token shares off target ({', '.join(off)} beyond {points}): " if off
                else f"token shares held within {points} of the targets: ") + listing
        gap = step_share_gap(run)
        if gap is not None:
            text += f"; single steps up to {gap * 100:.1f} points off"
        counted = mixer_shares(run)
        if counted:
            text += "; the mixer's count: " + ", ".join(f"{name} {share:.1%}" for name, share in counted.items())
        out.append((f"{run.name} mixture", text))
    return out


# ---------------------------------------------------------------------------------------------------
# FLOPs both ways: model FLOPs (what the documents need) and hardware FLOPs (what the kernels computed)
# ---------------------------------------------------------------------------------------------------

FLOPS_COLUMNS = ["run", "model FLOPs/s", "hardware FLOPs/s", "hardware / model", "MFU", "HFU"]


def flop_rates(run: Run) -> dict[str, float | None]:
    """mean_model_flops_per_s, mean_hardware_flops_per_s, mean_mfu, mean_hfu: from summary.json, else over the
    steady logged steps as the trainer computes them (summed FLOPs, or utilization x seconds, / summed seconds).
    Example: steady steps of 4e9 model FLOPs in 1 s and 2e9 in 1 s -> mean_model_flops_per_s 3e9."""
    keys = ("mean_model_flops_per_s", "mean_hardware_flops_per_s", "mean_mfu", "mean_hfu")
    if run.summary and any(run.summary.get(k) is not None for k in keys):
        return {k: run.summary.get(k) for k in keys}
    out: dict[str, float | None] = {}
    steps = steady(run)
    for key, metric in zip(keys, ("model_flops", "hardware_flops", "mfu", "hfu"), strict=True):
        timed = [(m[metric], m.get("step_time_s", 0.0)) for m in steps if m.get(metric) is not None]
        seconds = sum(t for _, t in timed)
        total = sum(v if metric.endswith("flops") else v * t for v, t in timed)  # FLOPs, or utilization x s
        out[key] = total / seconds if seconds else None
    return out


def _si(x: float | None, unit: str) -> str:
    """12_300_000_000 -> "12.3 G" + unit."""
    if x is None:
        return "n/a"
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


def flops_table(runs: Sequence[Run]) -> tuple[list[str], list[list[str]]]:
    """(columns, rows) of FLOPS_COLUMNS, without MFU and HFU when no run has them (CPU: no known peak); no rows
    when no run logged FLOPs."""
    rates = [flop_rates(r) for r in runs]
    if all(r["mean_model_flops_per_s"] is None and r["mean_hardware_flops_per_s"] is None for r in rates):
        return FLOPS_COLUMNS, []
    with_peak = any(r["mean_mfu"] is not None or r["mean_hfu"] is not None for r in rates)
    columns = FLOPS_COLUMNS if with_peak else FLOPS_COLUMNS[:4]
    rows = []
    for run, r in zip(runs, rates, strict=True):
        row = [run.name, _si(r["mean_model_flops_per_s"], "FLOP/s"), _si(r["mean_hardware_flops_per_s"], "FLOP/s"),
               _num(_ratio(r["mean_hardware_flops_per_s"], r["mean_model_flops_per_s"]), ".2f")]
        if with_peak:
            row += [_num(r["mean_mfu"], ".1%"), _num(r["mean_hfu"], ".1%")]
        rows.append(row)
    return columns, rows


# ---------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------

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
        ax.plot([xs[s] for s in steps], [ys[s] for s in steps], label=run.name, **_style(i, len(steps)))
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
    return _line_plot(runs, lambda r: series(r, "val_loss"), None, "step", "val loss", "Validation loss vs step")


def plot_utilization(runs: Sequence[Run]) -> plt.Figure:
    fig = _line_plot(runs, lambda r: {s: 100 * u for s, u in series(r, "token_utilization").items()}, None,
                     "step", "token utilization (%)", "Token utilization (non-padding / allocated positions)")
    fig.axes[0].set_ylim(0, 105)
    return fig


def plot_loss_by_length(runs: Sequence[Run]) -> plt.Figure:
    """Grouped bars: per length bucket, each run's final val token loss (its train token loss without eval)."""
    names = group_names(runs, BY_LENGTH)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(1, len(runs))
    for i, run in enumerate(runs):
        val, train = val_by_group(run, BY_LENGTH), train_by_group(run, BY_LENGTH)
        values = [val.get(n) if val else train.get(n, (None, 0))[0] for n in names]
        ax.bar([k + i * width for k in range(len(names))], [v if v is not None else 0.0 for v in values], width,
               label=f"{run.name} ({'val' if val else 'train'})", color=f"C{i % 10}", hatch=None if val else "//")
    ax.set_xticks([k + width * (len(runs) - 1) / 2 for k in range(len(names))], [f"{n} tokens" for n in names])
    ax.set(ylabel="token loss", title="Token loss by document length (final eval; train where no eval)")
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return fig


SMOOTH_STEPS = 10
"""loss_by_source.png averages each source's loss over this many logged steps: a step holds a few documents of
a source (sometimes none), so its per-step loss swings by far more than the curves differ."""


def trailing_loss(run: Run, by: Breakdown, name: str, window: int) -> Series:
    """Per logged step with targets of group `name`: its token loss over the last `window` such steps, each
    weighted by its targets. Example, window 2: (2.0 on 10 targets), (3.0 on 30), (1.0 on 10) -> 2.0, 2.75, 2.5."""
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
            ax.plot(steps, [losses[s] for s in steps], label=f"{name}: {run.name}",
                    **{**_style(i, len(steps)), "color": f"C{j % 10}"})
    ax.set(xlabel="step", ylabel="train token loss",
           title=f"Train token loss by source (mean over the last {SMOOTH_STEPS} logged steps, by targets)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.13))
    return fig


def plot_throughput(runs: Sequence[Run]) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    values = [throughput(r) or 0.0 for r in runs]
    bars = ax.bar(range(len(runs)), values, color=[f"C{i % 10}" for i in range(len(runs))])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize="small")
    ax.set_xticks(range(len(runs)), [r.name for r in runs], rotation=20, ha="right")
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
        if (candidate / "manifest.json").is_file():
            return candidate
    return None


def data_paths(run: Run) -> list[str | None]:
    """The prepared data dirs a run read: data.path, or the path of each source of data.sources (None: urls)."""
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
            notes.append(f"run {run.name}: data dir {data_path!r} not found (no manifest.json there)")
            continue
        key = data_dir.resolve()
        if key not in corpora:
            hist = (json.loads((data_dir / "manifest.json").read_text()).get("splits", {}).get(split, {})
                    .get("lengths", {}).get("histogram"))
            if not hist or len(hist.get("edges", [])) != len(hist.get("counts", [])) + 1:
                notes.append(f"{data_dir / 'manifest.json'} has no lengths.histogram for split {split!r} "
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
        ax.stairs(corpus.counts, corpus.edges, fill=True, alpha=0.35, color=f"C{i % 10}", label=corpus.label)
        for j, seq_len in enumerate(corpus.seq_lens):
            ax.axvline(seq_len, color=f"C{i % 10}", linestyle=LINESTYLES[(j + 1) % len(LINESTYLES)],
                       linewidth=1.5, label=f"train.seq_len={seq_len}")
    if all(c.edges[0] > 0 for c in corpora):
        ax.set_xscale("log", base=2)
    ax.set(xlabel="document length (tokens, EOS included)", ylabel="documents",
           title="Training corpus: document lengths")
    ax.legend(fontsize="small")
    return fig


# ---------------------------------------------------------------------------------------------------
# Writing the report
# ---------------------------------------------------------------------------------------------------


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
    flops_columns: list[str]
    flops_rows: list[list[str]]
    """flops_table's (empty: no run logged FLOPs)."""
    images: list[tuple[str, str]]
    """(PNG file name, caption)."""
    notes: list[str]

    def tables(self) -> list[tuple[str, str, list[str], list[list[str]]]]:
        """(title, intro line, columns, rows) of each table after the verdicts that has rows."""
        tables = [
            ("Token loss by document length", "", LENGTH_COLUMNS, self.length_rows),
            ("Token loss by source", "Train token loss over all logged steps, each weighted by its targets; the "
             "last eval's; both as Δ against the reference over the steps both logged; each source's share of "
             "the run's document tokens against its weight / sum of the weights.", SOURCE_COLUMNS,
             self.source_rows),
            ("FLOPs both ways", "Mean over the non-warm-up steps. Model FLOPs: what the documents need, as if each "
             "ran alone (MFU); hardware FLOPs: what the kernels computed, padding and masked attention included "
             "(HFU). MFU and HFU only where the device's peak is known.", self.flops_columns, self.flops_rows),
        ]
        return [t for t in tables if t[3]]


def write_plots(runs: Sequence[Run], out: Path) -> tuple[list[tuple[str, str]], list[str]]:
    """Save each plot that has data into `out`: (file name, caption) of each, and a note for each left out."""
    corpora, corpus_notes = load_corpora(runs)
    has_val = any(series(r, "val_loss") for r in runs)
    plots: list[tuple[str, str, Callable[[], plt.Figure]]] = [
        ("loss_vs_step.png", "Train loss vs step", lambda: plot_loss_vs_step(runs)),
        ("loss_vs_time.png", "Train loss vs training wall-clock time", lambda: plot_loss_vs_time(runs)),
        *([("val_loss_vs_step.png", "Validation loss vs step", lambda: plot_val_loss(runs))] if has_val else []),
        ("valid_tokens_per_s.png", "Valid tokens/s per run (non-warm-up mean)", lambda: plot_throughput(runs)),
        ("token_utilization.png", "Token utilization over steps", lambda: plot_utilization(runs)),
        *([("loss_by_length.png", "Token loss by document length", lambda: plot_loss_by_length(runs))]
          if group_names(runs, BY_LENGTH) else []),
        *([("loss_by_source.png", "Train token loss by source vs step", lambda: plot_loss_by_source(runs))]
          if group_names(runs, BY_SOURCE) else []),
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
        notes.append("Document-length histogram not available: " + ("; ".join(corpus_notes) or "no data.path") + ".")
    else:
        notes += [f"Document-length histogram: {n}." for n in corpus_notes]
    return [(name, caption) for name, caption, _ in plots], notes


def layout_verdicts(runs: Sequence[Run], ref: Run, tolerance: float) -> list[tuple[str, str]]:
    """Each packed or bucketed run against its unpacked counterpart, where that is not the reference.

    In a sweep over two axes (e.g. normalization x layout) the reference answers one question; this answers
    the other: does the layout change the objective under each setting? Only pairs that differ in
    objective-neutral keys alone are listed. Example: "4_row_mean_packed vs 5_row_mean_unpacked".
    """
    out = []
    for run in runs:
        match = unpacked_match(run, runs)
        if match is None or match is run or match is ref:
            continue
        if all(key_class(k) in (SAME_OBJECTIVE, IGNORED) for k in differing_keys([run.config, match.config])):
            out.append((f"{run.name} vs {match.name}", verdict(run, match, tolerance)))
    return out


def build_report(runs: Sequence[Run], ref: Run, tolerance: float, out: Path) -> Report:
    images, notes = write_plots(runs, out)
    notes += [f"{r.name}: {n}" for r in runs for n in r.notes]
    flops_columns, flops_rows = flops_table(runs)
    return Report(
        reference=ref.name,
        tolerance=tolerance,
        rows=table_rows(runs, ref, tolerance),
        verdicts=[(r.name, verdict(r, ref, tolerance)) for r in runs if r is not ref] + layout_verdicts(runs, ref,
                                                                                                     tolerance)
        + group_verdicts(runs, ref, tolerance, BY_LENGTH) + group_verdicts(runs, ref, tolerance, BY_SOURCE)
        + share_verdicts(runs),
        length_rows=group_rows(runs, ref, BY_LENGTH),
        source_rows=group_rows(runs, ref, BY_SOURCE),
        flops_columns=flops_columns,
        flops_rows=flops_rows,
        images=images,
        notes=notes,
    )


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render_markdown(report: Report) -> str:
    lines = [
        "# Training runs report",
        "",
        f"Reference run: **{report.reference}**. Tolerance for equal losses: {_num(report.tolerance)} (absolute).",
        "",
        "| " + " | ".join(_md_cell(c) for c in TABLE_COLUMNS) + " |",
        "|" + "---|" * len(TABLE_COLUMNS),
        *("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in report.rows),
        "",
        "## Verdicts (against the reference run; each run against its unpacked counterpart)",
        "",
        *(f"- **{name}**: {text}" for name, text in report.verdicts),
        "",
    ]
    for title, intro, columns, rows in report.tables():
        lines += [f"## {title}", "", *([intro, ""] if intro else []),
                  "| " + " | ".join(_md_cell(c) for c in columns) + " |", "|" + "---|" * len(columns),
                  *("| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows), ""]
    lines += ["## Plots", ""]
    for name, caption in report.images:
        lines += [f"![{caption}]({name})", ""]
    if report.notes:
        lines += ["## Notes", "", *(f"- {n}" for n in report.notes), ""]
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
<p>Reference run: <strong>{e(report.reference)}</strong>. Tolerance for equal losses: {e(_num(report.tolerance))} (absolute).</p>
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


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.report", description=__doc__.split("\n\n")[0])
    p.add_argument("dirs", nargs="+", type=Path, metavar="RUN_OR_SWEEP_DIR")
    p.add_argument("--out", type=Path, default=None, help="output dir (default: the sweep dir given, or report/)")
    p.add_argument("--reference", default=None, help="run name to compare against (default: the unpacked run)")
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                   help="max |loss difference| for 'same objective' (default 1e-4, fp32)")
    return p.parse_args(argv)


@command()
def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not (0 <= args.tolerance < math.inf):
        raise ReportError(f"--tolerance must be a finite number >= 0, got {args.tolerance}")
    for path in make_report(args.dirs, args.out, args.reference, args.tolerance):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
