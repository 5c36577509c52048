"""One optimizer step over one logical batch, and the loss normalizations it can optimize.

The default objective, `global_tokens`:

    loss = sum over every valid target of the step (all micro-batches, all ranks) of its cross-entropy
           / number of those targets

The count is all-reduced once, before any micro-batch runs; each micro-batch's summed loss is then
scaled by 1 / count (times the loss group's size, data x context ranks, to undo the engine's averaging). There
is no per-row, per-micro-batch or per-rank mean anywhere, so the gradient is the same however the documents
of the step are split into rows, micro-batches and ranks.

The other normalizations (`loss.normalization`) exist to measure what common alternatives change. Each
is a mean over *units* of the mean token loss within each unit, written as one weighted sum:

    loss = sum over targets t of ce(t) / targets(unit(t))  /  units of the step (all ranks)

    document_mean     unit = document (a chunk of a split document counts as one): layout-invariant
    micro_batch_mean  unit = micro-batch: depends on how documents are grouped into micro-batches
    row_mean          unit = row: a packed row of 3 documents weighs as much as one unpacked document

Units without targets (padding, an empty rank's placeholder) count for nothing. `loss_weights` builds
the per-token weights; this module is the only place that defines them.

A step whose global loss or gradient norm is not finite is not applied (`Engine.step_if_finite`; DeepSpeed
stops before its step on a non-finite loss): `StepStats.finite` tells the loop, which stops or skips by
`train.on_nonfinite`. Every rank sees the same all-reduced loss and norm, so they all decide alike.

The same all-reduce carries each rank's micro-batch count: engines that communicate inside every
micro-batch (FSDP2, DeepSpeed ZeRO) need all ranks to run the same number, so shorter ranks add empty ones
(`Engine.micro_steps`).

`ComputeClock` measures what the ranks' unequal work costs (metrics `dp_compute_imbalance`, `dp_wait_s`): each
rank's compute up to its last gradient, and its wait from there to the end of the step's gradient reduction,
the first collective that needs every rank's backward (DDP's all-reduce, ZeRO's reduce-scatter). Under FSDP2
the ranks also meet at every layer's all-gather, so part of the wait hides inside the compute.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from trainer.config import NORMALIZATIONS
from trainer.data.feed import (
    IGNORE_INDEX,
    NO_GROUPS,
    Batch,
    Document,
    LossGroups,
    collate_rows,
    source_counts,
)
from trainer.distributed.engine import Engine
from trainer.distributed.groups import DistInfo, dist_sum
from trainer.model import model_inputs


@dataclass
class StepStats:
    """Global (all-rank) figures of one optimizer step."""

    loss: float
    """The optimized objective (see the module docstring)."""
    token_loss: float
    """Sum of token losses / valid targets: the same as `loss` under global_tokens, comparable across
    modes."""
    grad_norm: float
    valid_tokens: int
    allocated_tokens: int
    real_tokens: int
    docs: int
    rows: int
    micro_batches: int
    """On this rank."""
    finite: bool = True
    """False: the loss or the gradient norm was NaN/inf and the update was not applied."""
    group_loss_sums: list[float] | None = None
    """Per loss group (source x length bucket, trainer.data.batch.LossGroups; None without groups): the summed
    token loss of its targets, all ranks."""
    group_targets: list[int] | None = None
    """Per loss group: its targets, all ranks (token loss of a group = its sum / its targets)."""
    source_tokens: list[int] | None = None
    """Per source of the mixture (None without data.sources): its documents' tokens in the step, all ranks."""
    source_docs: list[int] | None = None
    """Per source of the mixture: its documents (chunks count once each) in the step, all ranks."""


def empty_batch(pad_id: int) -> Batch:
    """A one-position batch with no target: a rank without data still joins the gradient all-reduce. Laid out
    as an unpacked row (no document boundaries), which context parallelism pads to its chunks like any
    unpacked row."""
    return collate_rows([[Document(key="<empty>", tokens=np.array([pad_id]))]], 1, pad_id, "unpacked")


def loss_weights(batch: Batch, normalization: str) -> tuple[torch.Tensor | None, int]:
    """(B, L) weights aligned with `batch.labels`, and the number of units holding a target.

    A target's weight is 1 / (targets of its unit); non-targets weigh 0. global_tokens needs no weights
    (None) and its units are the targets themselves. Example, one packed row [a0 a1 a2 | b0 b1 | pad]
    (labels [-100 a1 a2 -100 b1 -100]):
        document_mean     weights [0 1/2 1/2 0 1 0], 2 units
        row_mean          weights [0 1/3 1/3 0 1/3 0], 1 unit (as micro_batch_mean for a one-row batch)
    """
    valid_BL = batch.labels != IGNORE_INDEX
    if normalization == "global_tokens":
        return None, int(valid_BL.sum())
    B, L = batch.shape
    if normalization == "document_mean":  # unit = segment of cu_seqlens (padding segments hold no target)
        unit_BL = torch.bucketize(torch.arange(B * L), batch.cu_seqlens[1:].long(), right=True).view(B, L)
    elif normalization == "row_mean":
        unit_BL = torch.arange(B)[:, None].expand(B, L)
    elif normalization == "micro_batch_mean":
        unit_BL = torch.zeros(B, L, dtype=torch.long)
    else:
        raise ValueError(f"loss.normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    counts = torch.bincount(unit_BL[valid_BL], minlength=int(unit_BL.max()) + 1)
    weights = torch.where(valid_BL, 1.0 / counts.clamp(min=1)[unit_BL].float(), 0.0)
    return weights, int((counts > 0).sum())


def with_loss_groups(batch: Batch, groups: LossGroups) -> tuple[Batch, list[int]]:
    """`batch` carrying the loss group of each target (source x length bucket, `LossGroups.ids`) and the
    targets per group, for the per-group token losses; unchanged, [] without groups."""
    if not groups.size:
        return batch, []
    groups_BL = groups.ids(batch)
    counts = torch.bincount(groups_BL[batch.labels != IGNORE_INDEX], minlength=groups.size)
    return replace(batch, loss_groups=groups_BL, num_loss_groups=groups.size), counts.tolist()


def with_group_targets(batches: Sequence[Batch], groups: LossGroups) -> tuple[list[Batch], list[int]]:
    """The batches with their loss groups (`with_loss_groups`), and their targets per group summed ([] without
    groups): what the step and the eval count."""
    grouped = [with_loss_groups(b, groups) for b in batches]
    return [b for b, _ in grouped], [sum(c[g] for _, c in grouped) for g in range(groups.size)]


def group_counts(batches: Sequence[Batch], groups: LossGroups) -> tuple[list[Batch], list[int]]:
    """The batches with their loss groups, and this rank's counts to all-reduce with the step's: targets per
    group (`with_group_targets`), then with a mixture tokens and documents per source ([] without groups)."""
    batches, counts = with_group_targets(batches, groups)
    if groups.sources:
        per_source = [source_counts(b, groups.num_sources) for b in batches]
        counts += [sum(t[s] for t, _ in per_source) for s in range(groups.num_sources)]
        counts += [sum(d[s] for _, d in per_source) for s in range(groups.num_sources)]
    return batches, counts


def split_group_counts(counts: Sequence[float], groups: LossGroups) -> tuple[list[int] | None, ...]:
    """`group_counts`' list (all-reduced) as (targets per group, tokens per source, documents per source),
    each None where not measured. Example: 2 sources, no edges, [5, 7, 40, 60, 2, 3] ->
    ([5, 7], [40, 60], [2, 3])."""
    counts = [int(c) for c in counts]
    g, s = groups.size, len(groups.sources)
    return counts[:g] if g else None, counts[g:g + s] if s else None, counts[g + s:] if s else None


class ComputeClock:
    """One rank's measured compute and wait of each step (host clock on CPU, CUDA events on a GPU; read after
    the device is synchronized).

        compute   from the step's counts (its first collective) to the gradient of the token embedding's
                  output in the last micro-batch: every block's backward done, what this rank computes alone
        wait      from there to the end of the last micro-batch's backward, which returns once the gradient
                  reduction is complete: the embedding's own backward, the last bucket's communication, and
                  the time this rank waits for slower ones

    The marks cost a hook on the embedding (its output's gradient), two timestamps and, on CUDA, two events a
    step."""

    def __init__(self, module: torch.nn.Module, device: torch.device) -> None:
        self.embedding = module.wte  # the first module of the forward, so the last of the backward
        self.cuda = device.type == "cuda"
        self._marks: dict[str, float | torch.cuda.Event] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks[name] = event
        else:
            self._marks[name] = time.perf_counter()

    @contextlib.contextmanager
    def last_micro_batch(self) -> Iterator[None]:
        """Around the step's last micro-step: marks 'computed' when its embedding output's gradient is ready
        and 'reduced' when the micro-step returns."""
        def on_output(_module, _args, output):
            if output.requires_grad:
                output.register_hook(lambda grad: self.mark("computed"))
        handle = self.embedding.register_forward_hook(on_output)
        try:
            yield
        finally:
            handle.remove()
        self.mark("reduced")

    def read(self) -> tuple[float, float]:
        """(compute s, wait s) of the last step: after the device is synchronized (the loop does, on CUDA)."""
        start, computed, reduced = (self._marks.get(k) for k in ("start", "computed", "reduced"))
        if start is None or reduced is None:
            return 0.0, 0.0
        computed = reduced if computed is None else computed  # no gradient reached the embedding: all compute
        if self.cuda:
            return start.elapsed_time(computed) / 1e3, computed.elapsed_time(reduced) / 1e3
        return computed - start, reduced - computed


def train_step(engine: Engine, micro_batches: list[Batch], info: DistInfo, pad_id: int,
               normalization: str = "global_tokens", groups: LossGroups = NO_GROUPS,
               clock: ComputeClock | None = None) -> StepStats:
    """Forward/backward every micro-batch of this rank, then one optimizer step. `groups`: the loss groups
    (source x document-length bucket) whose token losses, and with a mixture the tokens and documents per
    source, the stats carry (metrics: the objective is unchanged). A micro-batch with a row plan (Batch.plan,
    context parallelism) runs this rank's share of its positions (trainer.model.model_inputs cuts them).

    The ranks of a context or tensor group hold the same micro-batches: their counts are summed over the data
    group (one rank per data rank, trainer/distributed/dims.py), the losses over the loss group (data x
    context: each position's loss is computed on one of its ranks; the ranks of a tensor group compute the
    same value), so every target is counted once. `clock`: marks this rank's compute and wait
    (ComputeClock)."""
    micro_batches, local_groups = group_counts(micro_batches, groups)
    weighted = [loss_weights(mb, normalization) for mb in micro_batches]
    counts = [0] * info.data_world  # micro-batches per data rank, e.g. [3, 0, 0, 0] on data rank 0 of 4
    counts[info.data_rank] = len(micro_batches)
    local = [
        sum(mb.num_valid_targets for mb in micro_batches),
        sum(units for _, units in weighted),
        sum(mb.num_allocated for mb in micro_batches),
        sum(mb.num_tokens for mb in micro_batches),
        sum(mb.num_docs for mb in micro_batches),
        sum(mb.shape[0] for mb in micro_batches),
        *counts,
        *local_groups,
    ]
    totals = dist_sum(local, info.device, info.data_group)  # one rank per data rank: each row counted once
    valid, units, allocated, real, docs, rows = (int(x) for x in totals[:6])
    busiest = int(max(totals[6:6 + info.data_world]))  # micro-batches of the busiest rank
    group_targets, source_tokens, source_docs = split_group_counts(totals[6 + info.data_world:], groups)
    if valid == 0:
        raise RuntimeError("the logical batch has no valid targets on any rank (data exhausted?)")
    loss_scale = engine.grad_average_factor / units
    if clock is not None:
        clock.mark("start")

    runs = engine.micro_steps(len(micro_batches), busiest)
    batches = list(micro_batches) + [empty_batch(pad_id)] * (runs - len(micro_batches))
    weights = [w for w, _ in weighted] + [None] * (len(batches) - len(micro_batches))
    objective_sum = loss_sum = 0.0
    num_groups = groups.size
    group_sums = torch.zeros(num_groups)
    for i, (mb, w) in enumerate(zip(batches, weights, strict=True)):
        inputs = model_inputs(replace(mb, loss_weights=w).to_device(info.device))
        last = i == len(batches) - 1
        with clock.last_micro_batch() if clock is not None and last else contextlib.nullcontext():
            mb_objective, mb_loss_sum, mb_groups = engine.micro_step(inputs, loss_scale, sync=last)
        objective_sum = objective_sum + mb_objective.float()
        loss_sum = loss_sum + mb_loss_sum.float()
        if mb_groups is not None:
            group_sums = group_sums.to(mb_groups.device) + mb_groups
    # each position's loss is on one rank of `loss`
    global_objective, global_loss_sum, *global_sums = dist_sum(
        [float(objective_sum), float(loss_sum), *group_sums.tolist()], info.device, info.loss_group)
    grad_norm, finite = engine.step_if_finite(global_objective / units)
    return StepStats(
        loss=global_objective / units,
        token_loss=global_loss_sum / valid,
        grad_norm=grad_norm,
        valid_tokens=valid,
        allocated_tokens=allocated,
        real_tokens=real,
        docs=docs,
        rows=rows,
        micro_batches=len(micro_batches),
        finite=finite,
        group_loss_sums=global_sums if num_groups else None,
        group_targets=group_targets,
        source_tokens=source_tokens,
        source_docs=source_docs,
    )
