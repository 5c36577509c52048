"""Downstream scores in the report: each run's accuracy per task with a 95 % interval, and whether two arms
differ beyond what the task's items can resolve.

A run's scores are its last metrics line with `tasks` (train.eval_tasks, trainer.run.evals.TaskScorer). The
interval of an accuracy p over n items is Wilson's score interval (z = 1.96): unlike p ± z sqrt(p(1-p)/n) it
stays inside [0, 1] and is not empty at p = 0 or 1, which small tasks hit. Two runs' accuracies on a task
differ beyond noise when |p1 - p2| > z sqrt(p1(1-p1)/n1 + p2(1-p2)/n2) (two independent binomials; the items
are the same in both arms, so this is conservative), and the task resolves differences of about
z sqrt(2 p(1-p)/n) at their mean accuracy p: 1,000 items at p = 0.5 resolve 4.4 points, not 1.

Example: 620 of 1,000 against 600 of 1,000 -> interval [0.590, 0.649] vs [0.569, 0.630], Δ +2.0 points, within
noise (this task resolves differences of 4.3 points).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainer.reporting.runs import Run, Series
from trainer.reporting.verdicts import fmt_num

Z95 = 1.959964
"""The two-sided 95 % normal quantile."""
TASK_COLUMNS = ["run", "task", "step", "n", "acc [95 % interval]", "acc_norm", "bits/byte",
                "Δ acc vs reference"]


def task_scores(run: Run) -> tuple[int, dict[str, dict]] | None:
    """(step, {task: its metrics}) of the run's last metrics line with `tasks`; None if none has."""
    logged = [m for m in run.metrics if m.get("tasks")]
    return (logged[-1]["step"], logged[-1]["tasks"]) if logged else None


def task_names(runs: Sequence[Run]) -> list[str]:
    """Every task any run scored, in the order first met."""
    names: list[str] = []
    for run in runs:
        scores = task_scores(run)
        names += [name for name in (scores[1] if scores else {}) if name not in names]
    return names


def wilson(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval of a proportion p of n. Example: p 1.0, n 4 -> (0.51, 1.0)."""
    center = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, center - half), min(1.0, center + half)


def resolvable(p: float, n: int, z: float = Z95) -> float:
    """The smallest accuracy difference two arms of n items each around accuracy p tell apart
    (z sqrt(2p(1-p)/n)); at p 0 or 1 that of p = 1/n, so a perfect score still has a limit. Example: p 0.5,
    n 1000 -> 0.0438."""
    p = min(max(p, 1 / n), 1 - 1 / n) if n > 1 else 0.5
    return z * math.sqrt(2 * p * (1 - p) / n)


def differ(a: dict, b: dict, z: float = Z95) -> bool:
    """Whether accuracies a and b ({acc, n}) differ beyond noise (see the module docstring)."""
    se = math.sqrt(a["acc"] * (1 - a["acc"]) / a["n"] + b["acc"] * (1 - b["acc"]) / b["n"])
    return abs(a["acc"] - b["acc"]) > z * se if se > 0 else a["acc"] != b["acc"]


def _interval(m: dict) -> str:
    if m.get("acc") is None or not m.get("n"):
        return "n/a"
    low, high = wilson(m["acc"], m["n"])
    return f"{m['acc']:.3f} [{low:.3f}, {high:.3f}]"


def task_rows(runs: Sequence[Run], ref: Run) -> list[list[str]]:
    """TASK_COLUMNS rows: per run and task, its last scores and its accuracy's Δ against the reference's."""
    reference = task_scores(ref)
    rows = []
    for run in runs:
        scores = task_scores(run)
        if scores is None:
            continue
        step, tasks = scores
        for name, m in tasks.items():
            theirs = (reference[1] if reference else {}).get(name)
            delta = ("" if run is ref or theirs is None or None in (m.get("acc"), theirs.get("acc"))
                     else f"{(m['acc'] - theirs['acc']) * 100:+.1f} points")
            rows.append([run.name, name, str(step), str(m.get("n", "")), _interval(m),
                         fmt_num(m.get("acc_norm"), ".3f"), fmt_num(m.get("bits_per_byte"), ".4f"), delta])
    return rows


def task_verdicts(runs: Sequence[Run], ref: Run) -> list[tuple[str, str]]:
    """One line per run and task the reference scored too: the two accuracies, their difference, whether it is
    beyond noise, and the difference the task resolves."""
    reference = task_scores(ref)
    if reference is None:
        return []
    out = []
    for run in runs:
        scores = task_scores(run)
        if run is ref or scores is None:
            continue
        for name, m in scores[1].items():
            theirs = reference[1].get(name)
            if (theirs is None or None in (m.get("acc"), theirs.get("acc"))
                    or not (m.get("n") and theirs.get("n"))):
                continue
            delta = (m["acc"] - theirs["acc"]) * 100
            smallest = resolvable((m["acc"] + theirs["acc"]) / 2, min(m["n"], theirs["n"])) * 100
            beyond = "beyond noise" if differ(m, theirs) else "within noise"
            out.append((f"{run.name} {name}", f"acc {_interval(m)} vs the reference's {_interval(theirs)}: Δ "
                        f"{delta:+.1f} points, {beyond} (this task's {min(m['n'], theirs['n'])} items "
                        f"resolve differences of about {smallest:.1f} points)"))
    return out


def task_accuracy(run: Run, name: str) -> Series:
    """{step: acc} of task `name` over the run's task steps."""
    return {m["step"]: m["tasks"][name]["acc"] for m in run.metrics
            if m.get("tasks") and name in m["tasks"] and m["tasks"][name].get("acc") is not None}
