"""A task's metrics from its items' per-choice log-likelihoods (natural log, summed over the choice's tokens).

    acc              multiple choice: the choice of highest log-likelihood is the gold; language modeling:
                     greedy decoding reproduces the continuation token for token
    acc_norm         multiple choice: the same, the log-likelihood divided by the choice's characters
                     (lm-eval's)
    bits_per_byte    the gold choices' -sum log-likelihood / (ln 2 x their UTF-8 bytes): continuous, it moves
                     before accuracy does
    loglikelihood    language modeling: the mean log-likelihood of the continuation
    n, *_stderr      items, and the standard error of each mean (sample std / sqrt(n), lm-eval's;
                     None for n < 2)

Ties: the lowest index wins (the first choice of the highest score), so equal scores favour no gold position
that the file's order does not already.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainer.tasks.tasks import LANGUAGE_MODELING, Task


def first_best(scores: Sequence[float]) -> int:
    """The index of the highest score, the lowest index among equal ones. Example: [-1, -1, -2] -> 0."""
    return max(range(len(scores)), key=scores.__getitem__)


def mean_stderr(values: Sequence[float]) -> float | None:
    """Standard error of the mean: sample standard deviation (n - 1) / sqrt(n); None for fewer than 2
    values."""
    n = len(values)
    if n < 2:
        return None
    mean = sum(values) / n
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)


def item_records(task: Task, loglikelihoods: Sequence[float], greedy: Sequence[bool]) -> list[dict]:
    """Per item, in the file's order: its choices' log-likelihoods (in the file's order), the gold, the
    picks."""
    records, at = [], 0
    for item in task.items:
        ll = list(loglikelihoods[at:at + len(item.choices)])
        norm = [v / len(c) for v, c in zip(ll, item.choices, strict=True)]
        record = {"loglikelihoods": ll, "gold": item.gold, "pred": first_best(ll),
                  "pred_norm": first_best(norm)}
        if task.kind == LANGUAGE_MODELING:
            record["greedy"] = bool(greedy[at])
        if item.line:
            record["line"] = item.line
        records.append(record)
        at += len(item.choices)
    return records


def task_metrics(task: Task, records: Sequence[dict]) -> dict:
    """The task's metrics (see the module docstring) from `item_records`."""
    gold_ll = [r["loglikelihoods"][r["gold"]] for r in records]
    gold_bytes = sum(len(item.choices[item.gold].encode("utf-8")) for item in task.items)
    out: dict = {"n": len(records)}
    if task.kind == LANGUAGE_MODELING:
        hits = [float(r["greedy"]) for r in records]
        out |= {"acc": _mean(hits), "acc_stderr": mean_stderr(hits), "loglikelihood": _mean(gold_ll),
                "loglikelihood_stderr": mean_stderr(gold_ll)}
    else:
        hits = [float(r["pred"] == r["gold"]) for r in records]
        norm_hits = [float(r["pred_norm"] == r["gold"]) for r in records]
        out |= {"acc": _mean(hits), "acc_stderr": mean_stderr(hits), "acc_norm": _mean(norm_hits),
                "acc_norm_stderr": mean_stderr(norm_hits)}
    out["bits_per_byte"] = -sum(gold_ll) / (math.log(2) * gold_bytes) if gold_bytes else None
    return out


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None
