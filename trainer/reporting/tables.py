"""The report's tables: one line per run; the token loss by document length and by source (with verdicts per
group); a mixture's token shares against its targets; model vs hardware FLOPs/s."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainer.reporting.runs import (
    DEFAULT_TOLERANCE,
    Run,
    describe,
    differing_keys,
    last,
    max_abs_gap,
    mean_utilization,
    peak_memory,
    series,
    steady,
    throughput,
    time_to_reach,
    train_loss,
    unpacked_match,
)
from trainer.reporting.verdicts import fmt_num, ratio, verdict

TABLE_COLUMNS = [
    "run", "differs", "steps", "ranks", "final train loss", "final val loss", "max |Δ train loss|",
    "token utilization", "valid tokens/s", "allocated tokens/s", "speed-up vs unpacked",
    "time to ref. loss", "peak mem (GB)", "work imbalance (data / context)",
    "measured (compute imbalance / wait s)", "notes",
]


def mean_logged(run: Run, key: str, spec: str) -> str:
    """The mean of `key` over the steps that logged it, formatted by `spec`; "—" where none did."""
    values = list(series(run, key).values())
    return fmt_num(sum(values) / len(values), spec) if values else "—"


def work_imbalance(run: Run) -> str:
    """The mean modeled work imbalance over the data ranks (dp_imbalance) and over a context group
    (cp_imbalance), e.g. "3.2% / —"; "—" where the run has none (one data rank, no context parallelism)."""
    return f"{mean_logged(run, 'dp_imbalance', '.1%')} / {mean_logged(run, 'cp_imbalance', '.1%')}"


def measured_imbalance(run: Run) -> str:
    """The mean measured compute imbalance over the data ranks (dp_compute_imbalance) and the mean longest
    wait at the gradient reduction in seconds (dp_wait_s), e.g. "4.1% / 0.012"; "— / —" with one data rank."""
    return f"{mean_logged(run, 'dp_compute_imbalance', '.1%')} / {mean_logged(run, 'dp_wait_s', '.3f')}"


def ranks(run: Run) -> str:
    """How many ranks trained the run and, under context parallelism, how they split:
    "4 (2 data x 2 context)"; "n/a" without summary.json (the world size is read from it)."""
    world = run.config.get("world_size")
    if world is None:
        return "n/a"
    cp = int(run.config.get("distributed.context_parallel") or 1)
    return f"{world} ({world // cp} data x {cp} context)" if cp > 1 else str(world)


def table_rows(runs: Sequence[Run], ref: Run, tolerance: float = DEFAULT_TOLERANCE) -> list[list[str]]:
    """One row of strings per run, in TABLE_COLUMNS order."""
    diff = differing_keys([r.config for r in runs])
    target = last(train_loss(ref))
    rows = []
    for run in runs:
        gap = None if run is ref else max_abs_gap(train_loss(ref), train_loss(run))
        match = unpacked_match(run, runs)
        speed = ratio(throughput(run), throughput(match)) if match else None
        reached = time_to_reach(run, target, tolerance) if target is not None else None
        notes = (["reference"] if run is ref else []) + run.notes
        rows.append([
            run.name,
            describe(run, diff) or "—",
            str(max(series(run, "step"), default=0)),
            ranks(run),
            fmt_num(last(train_loss(run)), ".4f"),
            fmt_num(last(series(run, "val_loss")), ".4f"),
            "—" if run is ref else (fmt_num(gap[0]) + f" ({gap[1]} steps)" if gap else "n/a"),
            fmt_num(mean_utilization(run), ".1%"),
            fmt_num(throughput(run), ",.0f"),
            fmt_num(throughput(run, "allocated_tokens"), ",.0f"),
            f"{speed:.2f}x vs {match.name}" if speed is not None and match else "n/a",
            f"{reached[0]:.1f} s (step {reached[1]})" if reached else "n/a",
            fmt_num(peak_memory(run), ".2f"),
            work_imbalance(run),
            measured_imbalance(run),
            "; ".join(notes),
        ])
    return rows


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


BY_LENGTH = Breakdown("token_loss_by_length", "targets_by_length", "val_token_loss_by_length",
                      "document length", "documents {} tokens", "every length bucket")


BY_POSITION = Breakdown("token_loss_by_position", "targets_by_position", "val_token_loss_by_position",
                        "position in document", "targets at positions {} of their document",
                        "every position bucket")


BY_SOURCE = Breakdown("token_loss_by_source", "targets_by_source", "val_token_loss_by_source", "source",
                      "source {}", "every source")


GROUP_COLUMNS = ["run", "{}", "train token loss", "Δ train vs ref.", "final val token loss", "Δ val vs ref.",
                 "train targets"]


LENGTH_COLUMNS = [c.format(BY_LENGTH.column) for c in GROUP_COLUMNS]


POSITION_COLUMNS = [c.format(BY_POSITION.column) for c in GROUP_COLUMNS]


SOURCE_COLUMNS = [c.format(BY_SOURCE.column) for c in GROUP_COLUMNS] + ["token share", "target share"]


def group_names(runs: Sequence[Run], by: Breakdown) -> list[str]:
    """The groups any run logged, in the order logged. Example (BY_LENGTH): ["<=64", "<=256", ">256"]."""
    names: dict[str, None] = {}
    for run in runs:
        for m in run.metrics:
            names.update(dict.fromkeys(m.get(by.loss) or {}))
    return list(names)


def train_by_group(run: Run, by: Breakdown,
                   steps: set[int] | None = None) -> dict[str, tuple[float | None, int]]:
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
        out[name] = (a - b if a is not None and b is not None else None,
                     c - d if c is not None and d is not None else None)
    return out


def group_rows(runs: Sequence[Run], ref: Run, by: Breakdown) -> list[list[str]]:
    """Rows of GROUP_COLUMNS: each run x group (none when no run logged `by.loss`); BY_SOURCE rows also hold
    the run's token share and target share of each source (SOURCE_COLUMNS)."""
    names = group_names(runs, by)
    rows = []
    for run in runs:
        train, val = train_by_group(run, by), val_by_group(run, by)
        deltas = {} if run is ref else group_deltas(run, ref, by)
        shares, targets_share = token_shares(run), target_shares(run)
        for name in names:
            loss, targets = train.get(name, (None, 0))
            dt, dv = deltas.get(name, (None, None))
            row = [run.name, name, fmt_num(loss, ".4f"), "—" if run is ref else fmt_num(dt, "+.2g"),
                   fmt_num(val.get(name), ".4f"), "—" if run is ref else fmt_num(dv, "+.2g"), f"{targets:,}"]
            if by is BY_SOURCE:
                row += [fmt_num(shares.get(name), ".1%"), fmt_num(targets_share.get(name), ".1%")]
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
            text = "; ".join(f"{by.group.format(name)}: train token loss {fmt_num(dt, '+.2g')}, "
                             f"final val token loss {fmt_num(dv, '+.2g')}" for name, dt, dv in beyond)
            out.append((f"{run.name} {label}", f"{text} against {ref.name} (beyond {fmt_num(tolerance)})"))
        else:
            worst = max((abs(d) for pair in deltas.values() for d in pair if d is not None), default=None)
            out.append((f"{run.name} {label}",
                        f"{by.every} within {fmt_num(tolerance)} of {ref.name} (max |Δ| {fmt_num(worst)})"))
    return out


SHARE_TOLERANCE = 0.02


"""A mixture run holds its weights when each source's share of the run's document tokens is within 0.02 (two
percentage points) of weight / sum of the weights."""


def token_shares(run: Run) -> dict[str, float]:
    """Each source's share of the run's document tokens: summary.json's token_share_by_source (the whole run),
    else the logged steps' tokens_by_source summed.
    Example: steps {a: 70, b: 30}, {a: 50, b: 50} -> a 0.6, b 0.4."""
    if run.summary and run.summary.get("token_share_by_source"):
        return run.summary["token_share_by_source"]
    tokens: dict[str, int] = {}
    for m in run.metrics:
        for name, n in (m.get("tokens_by_source") or {}).items():
            tokens[name] = tokens.get(name, 0) + n
    total = sum(tokens.values())
    return {name: n / total for name, n in tokens.items()} if total else {}


def target_shares(run: Run) -> dict[str, float]:
    """weight / sum of the weights per source: summary.json's target_share_by_source, else the last logged
    step's."""
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
    """The largest |token share - target share| of any source in any logged step (None: no step logged
    shares)."""
    targets = target_shares(run)
    gaps = [abs(share - targets[name]) for m in run.metrics
            for name, share in (m.get("token_share_by_source") or {}).items()
            if share is not None and name in targets]
    return max(gaps, default=None)


def share_verdicts(runs: Sequence[Run]) -> list[tuple[str, str]]:
    """One line per mixture run (target shares for two sources or more): whether its token shares over the run
    held within SHARE_TOLERANCE of the targets, the worst single step, and the shares by the mixer's count.
    Example: ("mix", "token shares held within 2 points of the targets: functions 70.4% (target 70.0%),
    modules 29.6% (target 30.0%); single steps up to 6.1 points off; the mixer's count: functions 70.1%,
    modules 29.9%")."""
    out = []
    for run in runs:
        targets = target_shares(run)
        if len(targets) < 2:
            continue
        shares = token_shares(run)
        if not shares:
            out.append((f"{run.name} mixture", "token shares n/a: the run logged no tokens_by_source"))
            continue
        listing = ", ".join(f"{name} {fmt_num(shares.get(name), '.1%')} (target {target:.1%})"
                            for name, target in targets.items())
        off = [name for name, target in targets.items()
               if abs(shares.get(name, 0.0) - target) > SHARE_TOLERANCE]
        points = f"{SHARE_TOLERANCE * 100:g} points"
        text = (f"token shares off target ({', '.join(off)} beyond {points}): " if off
                else f"token shares held within {points} of the targets: ") + listing
        gap = step_share_gap(run)
        if gap is not None:
            text += f"; single steps up to {gap * 100:.1f} points off"
        counted = mixer_shares(run)
        if counted:
            text += "; the mixer's count: " + ", ".join(f"{name} {share:.1%}"
                                                         for name, share in counted.items())
        out.append((f"{run.name} mixture", text))
    return out


LONG_DOC_COLUMNS = ["run", "packing.long_docs", "documents", "split", "truncated", "dropped", "tokens cut",
                    "tokens without their start"]


def long_doc_rows(runs: Sequence[Run]) -> list[list[str]]:
    """What the layout did to long documents, per run, from summary.json's packing_stats (rank 0's packer):
    the share of documents split, truncated and dropped, the share of tokens cut off (truncated or dropped)
    and the share of tokens trained without their document's start (the chunks after a split document's
    first). Runs without packing_stats, or whose packer saw no long document at all, give no row.

    Example: 100 documents of 10,000 tokens, 4 split into 10 chunks holding 1,200 tokens after their first ->
    ["r", "split", "100", "4.0%", "0.0%", "0.0%", "0.0%", "12.0%"]."""
    rows = []
    for run in runs:
        stats = (run.summary or {}).get("packing_stats") or {}
        docs, tokens = stats.get("docs_in", 0), stats.get("tokens_in", 0)
        touched = stats.get("docs_split", 0) + stats.get("docs_truncated", 0) + stats.get("docs_dropped", 0)
        if not docs or not touched:
            continue
        cut = stats.get("tokens_truncated", 0) + stats.get("tokens_dropped", 0)
        without = stats.get("tokens_without_start")
        rows.append([run.name, str(run.config.get("packing.long_docs", "")), f"{docs:,}",
                     *(f"{stats.get(k, 0) / docs:.1%}"
                       for k in ("docs_split", "docs_truncated", "docs_dropped")),
                     f"{cut / tokens:.1%}" if tokens else "n/a",
                     f"{without / tokens:.1%}" if tokens and without is not None else "n/a"])
    return rows


FLOPS_COLUMNS = ["run", "model FLOPs/s", "hardware FLOPs/s", "hardware / model", "MFU", "HFU"]


def flop_rates(run: Run) -> dict[str, float | None]:
    """mean_model_flops_per_s, mean_hardware_flops_per_s, mean_mfu, mean_hfu: from summary.json, else over the
    steady logged steps as the trainer computes them (summed FLOPs, or utilization x seconds, / summed
    seconds). Example: steady steps of 4e9 model FLOPs in 1 s and 2e9 in 1 s -> mean_model_flops_per_s 3e9."""
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
    """(columns, rows) of FLOPS_COLUMNS, without MFU and HFU when no run has them (CPU: no known peak); no
    rows when no run logged FLOPs."""
    rates = [flop_rates(r) for r in runs]
    if all(r["mean_model_flops_per_s"] is None and r["mean_hardware_flops_per_s"] is None for r in rates):
        return FLOPS_COLUMNS, []
    with_peak = any(r["mean_mfu"] is not None or r["mean_hfu"] is not None for r in rates)
    columns = FLOPS_COLUMNS if with_peak else FLOPS_COLUMNS[:4]
    rows = []
    for run, r in zip(runs, rates, strict=True):
        row = [run.name, _si(r["mean_model_flops_per_s"], "FLOP/s"),
               _si(r["mean_hardware_flops_per_s"], "FLOP/s"),
               fmt_num(ratio(r["mean_hardware_flops_per_s"], r["mean_model_flops_per_s"]), ".2f")]
        if with_peak:
            row += [fmt_num(r["mean_mfu"], ".1%"), fmt_num(r["mean_hfu"], ".1%")]
        rows.append(row)
    return columns, rows
