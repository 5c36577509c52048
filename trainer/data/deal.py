"""Equal work, not equal tokens: a step's rows dealt over the data ranks by what they cost to compute.

Packed rows are ~100 % full, so every rank gets the same tokens each step, but not the same work: a row's
attention costs sum(s^2) over its documents, so one 8k document costs far more than sixteen 512-token ones,
and every rank waits for the slowest at the gradient reduction. `deal_rows` re-deals the rows the data ranks
drew for one step so that their modeled work is as equal as whole rows allow. Only whole rows move, between
ranks of one optimizer step: the step's documents, targets and global valid-token denominator stay the same,
so the loss is unchanged.

The rule (longest processing time first, deterministic: every rank computes the same deal from the same rows):
rows by cost, largest first (ties: the lower index in rank order), each to the rank with the least work so far
among those with room (a rank keeps the number of rows it drew; ties: the lower rank). Within a rank its rows
go heaviest first, so micro-batch slot j of every rank holds rows of comparable cost (FSDP2 and ZeRO run each
micro-batch in lockstep).

    deal_rows([9, 1, 1, 1, 8, 2], counts=[3, 3])   # drawn: rank 0 rows 0-2 (work 11), rank 1 rows 3-5 (11)
        -> [[0, 1, 2], [4, 5, 3]]                    # dealt: 11 and 11 (equal already: the same split)
    deal_rows([9, 8, 1, 1], counts=[2, 2])         # drawn: 17 and 2
        -> [[0, 3], [1, 2]]                          # dealt: 10 and 9
"""

from __future__ import annotations

from collections.abc import Sequence


def deal_rows(costs: Sequence[float], counts: Sequence[int]) -> list[list[int]]:
    """For each rank, the indices (into `costs`, the step's rows in rank order) of the rows it computes,
    heaviest first; rank r gets counts[r] rows (sum(counts) == len(costs))."""
    if sum(counts) != len(costs):
        raise ValueError(f"{len(costs)} rows cannot fill ranks of {list(counts)} rows")
    work = [0.0] * len(counts)
    dealt: list[list[int]] = [[] for _ in counts]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        rank = min((r for r in range(len(counts)) if len(dealt[r]) < counts[r]), key=lambda r: (work[r], r))
        dealt[rank].append(i)
        work[rank] += costs[i]
    return dealt


def check_deal(dealt: Sequence[Sequence[int]], counts: Sequence[int]) -> None:
    """Raise unless `dealt` gives every row of the step (0 .. sum(counts) - 1) to exactly one rank and rank r
    exactly counts[r] rows: a row computed twice, or by no rank, would change the step's objective. Example:
    [[0, 0], [2]] for counts [2, 1] -> "row 0 dealt 2 times, row 1 to no rank"."""
    seen = [0] * sum(counts)
    for rows in dealt:
        for i in rows:
            if not 0 <= i < len(seen):
                raise RuntimeError(f"the deal names row {i} of a step of {len(seen)} rows")
            seen[i] += 1
    problems = [f"row {i} dealt {n} times" for i, n in enumerate(seen) if n > 1]
    problems += [f"row {i} to no rank" for i, n in enumerate(seen) if n == 0]
    problems += [f"rank {r} holds {len(rows)} rows, drew {n}" for r, (rows, n) in enumerate(zip(dealt, counts,
                                                                                               strict=True))
                 if len(rows) != n]
    if problems:
        raise RuntimeError(f"a wrong deal of the step's rows: {', '.join(problems)}")


def drawn_rows(counts: Sequence[int]) -> list[list[int]]:
    """The deal without balancing: each rank its own rows, as drawn. Example: [2, 1] -> [[0, 1], [2]]."""
    out, start = [], 0
    for n in counts:
        out.append(list(range(start, start + n)))
        start += n
    return out


def imbalance(work: Sequence[float]) -> float:
    """max / mean - 1 of the ranks' work: 0.0 when even. Example: [10, 12] -> 12 / 11 - 1 = 0.0909."""
    mean = sum(work) / len(work) if len(work) else 0.0
    return max(work) / mean - 1 if mean > 0 else 0.0


def imbalance_of(costs: Sequence[float], dealt: Sequence[Sequence[int]]) -> float:
    """`imbalance` of the ranks' work under `dealt`. Example: costs [9, 8, 1, 1], [[0, 3], [1, 2]] -> work
    [10, 9] -> 10 / 9.5 - 1 = 0.0526."""
    return imbalance([sum(costs[i] for i in rows) for rows in dealt])
