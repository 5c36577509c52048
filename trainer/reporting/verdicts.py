"""A run against the reference: same objective, layout-dependent, ablation or not comparable, from the numbers
(the classes of the config keys it changes decide which question is asked)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from trainer.registry import (  # noqa: E402
    ABLATION,
    IGNORED,
    LAYOUT_INVARIANT_NORMALIZATIONS,
    OTHER,
    SAME_OBJECTIVE,
)
from trainer.reporting.runs import (
    DRIFT_TOLERANCE,
    EARLY_STEPS,
    Run,
    differing_keys,
    fmt_value,
    key_class,
    last,
    max_abs_gap,
    mean_utilization,
    series,
    throughput,
    train_loss,
    unpacked_match,
)


def fmt_num(x: float | None, spec: str = ".2g") -> str:
    return "n/a" if x is None else format(x, spec)


def ratio(a: float | None, b: float | None) -> float | None:
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
    speed = ratio(throughput(run), throughput(ref))
    return (f"{fmt_num(speed, '.2f')}x valid tokens/s; utilization "
            f"{fmt_num(mean_utilization(ref), '.1%')} -> {fmt_num(mean_utilization(run), '.1%')}")


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
            f"different {k} ({fmt_value(ref.config.get(k))} vs {fmt_value(run.config.get(k))})"
            for k in other)
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
        return (f"not comparable: non-finite loss at {len(nonfinite)} shared step(s) "
                f"(first: step {nonfinite[0]}), where equal losses cannot be checked")
    early_steps = sorted(set(ref_loss) & set(run_loss))[:EARLY_STEPS]
    early = max(abs(ref_loss[s] - run_loss[s]) for s in early_steps)
    drift = max(abs(ref_loss[s] - run_loss[s]) / max(abs(ref_loss[s]), 1e-12)
                for s in ref_loss if s in run_loss)
    norm = run.config.get("loss.normalization")
    changed = _changes(run, ref, keys) if keys else "nothing (identical settings)"
    if norm not in LAYOUT_INVARIANT_NORMALIZATIONS:
        final = _delta(last(series(run, "loss")), last(series(ref, "loss")))
        return (f"layout-dependent objective: under loss.normalization={norm} the loss depends on the "
                f"layout; {changed} changes it by up to {fmt_num(value)} over {n} steps (final {final}); "
                + _speed_and_utilization(run, ref))
    if early <= tolerance and drift <= DRIFT_TOLERANCE:
        text = f"same objective: max |Δloss| {fmt_num(early)} over "
        if n <= EARLY_STEPS:
            text += f"{n} steps; "
        else:
            text += (f"the first {len(early_steps)} steps ({fmt_num(value)} over all {n}: float rounding "
                     f"amplified by training, within {DRIFT_TOLERANCE:.0%}); ")
        return text + _speed_and_utilization(run, ref)
    mismatch = data_mismatch(run, ref)
    why = f"documents per step differ {mismatch}" if mismatch else "same documents per step"
    found = (f"loss gap {fmt_num(early)} over the first {len(early_steps)} steps above tolerance "
             f"{fmt_num(tolerance)}"
             if early > tolerance else f"loss drifts {drift:.1%} apart (above {DRIFT_TOLERANCE:.0%})")
    return f"not comparable: {found} ({why}; expected equal losses, only {changed} differs)"


def _delta(new: float | None, old: float | None) -> str:
    """"3.2100 -> 3.2500 (+0.04)": a final value against the reference's."""
    if new is None or old is None:
        return f"{fmt_num(old, '.4f')} -> {fmt_num(new, '.4f')}"
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
