"""One optimizer step over one logical batch, normalized by the global valid-target count.

    loss = sum over every valid target of the step (all micro-batches, all ranks) of its cross-entropy
           / number of those targets

The count is all-reduced once, before any micro-batch runs; each micro-batch's summed loss is then
scaled by 1 / count (times the world size, to undo DDP's or DeepSpeed's averaging). There is no
per-row, per-micro-batch or per-rank mean anywhere, so the gradient is the same however the documents
of the step are split into rows, micro-batches and ranks.

The same all-reduce carries each rank's micro-batch count: engines that communicate inside every
micro-batch (DeepSpeed ZeRO) need all ranks to run the same number, so shorter ranks add empty ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer.data.batch import Batch, Document, collate_rows
from trainer.distributed import DistInfo, dist_sum
from trainer.model import model_inputs


@dataclass
class StepStats:
    """Global (all-rank) figures of one optimizer step."""

    loss: float
    grad_norm: float
    valid_tokens: int
    allocated_tokens: int
    real_tokens: int
    docs: int
    rows: int
    micro_batches: int
    """On this rank."""


def empty_batch(pad_id: int) -> Batch:
    """A one-position batch with no target: a rank without data still joins the gradient all-reduce."""
    return collate_rows([[Document(key="<empty>", tokens=np.array([pad_id]))]], 1, pad_id, "packed")


def train_step(engine, micro_batches: list[Batch], info: DistInfo, pad_id: int) -> StepStats:
    """Forward/backward every micro-batch of this rank, then one optimizer step."""
    counts = [0] * info.world_size  # micro-batches per rank, e.g. [3, 0, 0, 0] on rank 0 of 4
    counts[info.rank] = len(micro_batches)
    local = [
        sum(mb.num_valid_targets for mb in micro_batches),
        sum(mb.num_allocated for mb in micro_batches),
        sum(mb.num_tokens for mb in micro_batches),
        sum(mb.num_docs for mb in micro_batches),
        sum(mb.shape[0] for mb in micro_batches),
        *counts,
    ]
    totals = dist_sum(local, info.device)
    valid, allocated, real, docs, rows = (int(x) for x in totals[:5])
    if valid == 0:
        raise RuntimeError("the logical batch has no valid targets on any rank (data exhausted?)")
    loss_scale = engine.grad_average_factor / valid

    most = int(max(totals[5:])) if engine.equal_micro_batches else len(micro_batches)
    batches = list(micro_batches) + [empty_batch(pad_id)] * (max(1, most) - len(micro_batches))
    loss_sum = 0.0
    for i, mb in enumerate(batches):
        inputs = model_inputs(mb.to(info.device, non_blocking=True))
        mb_loss_sum, _ = engine.micro_step(inputs, loss_scale, sync=i == len(batches) - 1)
        loss_sum = loss_sum + mb_loss_sum.float()
    grad_norm = engine.optimizer_step()
    (global_loss_sum,) = dist_sum([float(loss_sum)], info.device)
    return StepStats(
        loss=global_loss_sum / valid,
        grad_norm=grad_norm,
        valid_tokens=valid,
        allocated_tokens=allocated,
        real_tokens=real,
        docs=docs,
        rows=rows,
        micro_batches=len(micro_batches),
    )
