"""Reading runs (a run dir's config.json, metrics.jsonl, summary.json; a sweep's run dirs), the numbers of one
run, and what differs between runs' configs (each key's class: trainer/registry.py)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.errors import UserError  # noqa: E402
from trainer.registry import (  # noqa: E402
    CONFIG_FILE,
    IGNORED,
    METRICS_FILE,
    OLDER_RUN_VALUES,
    OTHER,
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
    """metrics.jsonl -> one dict per step, sorted; an unreadable line (a crash mid-write) is noted and
    skipped."""
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
        raise ReportError(f"{path}: holds a JSON {type(value).__name__}, not an object of config keys; fix "
                          "or remove it (trainer.train writes it)")
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


def fmt_value(value: Any) -> str:
    """A config value the way a Hydra override writes it: true, null, 0.003, [0.9, 0.95], {name: a,
    weight: 1}."""
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
    return [k for k in keys
            if key_class(k) != IGNORED and any(c.get(k) != configs[0].get(k) for c in configs)]


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
