"""DistributedDataParallel behind the `Engine` interface (trainer.distributed.engine): the default engine.

One process: the plain module, no wrapper. Several: DDP, whose gradient all-reduce runs once per optimizer
step (`no_sync` on every micro-batch but the last), so ranks may run different numbers of micro-batches.

Checkpoints: the state is replicated, so the engine returns it (`state_dict`, `full_weights`) and the
checkpoint store writes it (trainer.checkpoint.store describes the files); the engine writes no file itself.
Nothing in it depends on the number of ranks (the optimizer is not sharded, there is no loss scaler, and the
gradient averaging factor is the running loss group's size), so it loads unchanged on any number.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.distributed.groups import DistInfo
from trainer.distributed.tensor import Unsplit
from trainer.model import compute_dtype

_REPLICATED = "DDP's state is replicated: the checkpoint store saves state_dict(); shard_format is None"


def forward_backward(module, inputs: dict, loss_scale: float, backward=torch.Tensor.backward,
                     autocast=contextlib.nullcontext
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One micro-batch's forward and backward, every engine's: the objective is the weighted sum when the
    inputs carry loss_weights (trainer.run.step.loss_weights), else the plain sum;
    `backward(objective * loss_scale)` (an engine's own, e.g. DeepSpeed's), outside `autocast()`, which wraps
    the forward alone. Returns (objective sum, plain summed token loss, per-group sums or None), detached."""
    with autocast():
        out = module(**inputs, return_logits=False)
    objective = out.loss_sum if out.weighted_loss_sum is None else out.weighted_loss_sum
    backward(objective * loss_scale)
    return objective.detach(), out.loss_sum.detach(), out.group_loss_sums


def repoint_optimizer(optimizer: torch.optim.Optimizer, model: torch.nn.Module,
                      names: dict[int, str]) -> None:
    """After `model`'s parameters were replaced (split over the tensor group, sharded by FSDP2), point the
    optimizer's groups at the new ones, in place, by name. `names`: id of each old parameter -> its name,
    taken before."""
    current = dict(model.named_parameters())
    for group in optimizer.param_groups:
        group["params"] = [current[names[id(p)]] for p in group["params"]]


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, Any]:
    """The optimizer's live state keyed by its parameters' names in `module` (by position where a parameter is
    not the module's own, e.g. DeepSpeed's flat partitions): what a non-finite message names."""
    names = {id(p): name for name, p in module.named_parameters()}
    out = {}
    for i, (param, state) in enumerate(optimizer.state.items()):
        out[names.get(id(param), f"param {i}")] = state
    return out


class ClientOptimizerSteps:
    """The optimizer half of an engine that steps the client's optimizer and LR schedule itself
    (`self.optimizer`, `self.scheduler`) after its own `clip_gradients`: DDP and FSDP2 (DeepSpeed steps them
    inside its engine)."""

    def optimizer_step(self) -> float:
        """Clip, step, advance the schedule, zero the gradients; returns the global grad norm."""
        norm = self.clip_gradients()
        self.apply_gradients()
        return norm

    def step_if_finite(self, loss: float) -> tuple[float, bool]:
        """Clip; apply the update if `loss` (the step's global loss) and the gradient norm are finite, else
        drop the gradients (nothing else changes). Returns (the global gradient norm, whether it was
        applied)."""
        norm = self.clip_gradients()
        if math.isfinite(loss) and math.isfinite(norm):
            self.apply_gradients()
            return norm, True
        self.discard_gradients()
        return norm, False

    def apply_gradients(self) -> None:
        """Optimizer step, schedule step, gradients zeroed."""
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard_gradients(self) -> None:
        """Drop this step's gradients: parameters, optimizer state and schedule stay as they are."""
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def local_state(self) -> dict:
        """This rank's live weights and optimizer state (local shards, by parameter name), not copied: what a
        load checks for non-finite values."""
        return {"model": dict(self.module.named_parameters()),
                "optimizer": optimizer_state_by_name(self.optimizer, self.module)}


class DDPEngine(ClientOptimizerSteps):
    """Model + optimizer + LR schedule under DistributedDataParallel (plain module for one process).

    DDP averages gradients over the ranks it wraps (the loss group: data x context); `grad_average_factor`
    tells the step to multiply the loss by that group's size so that what remains is sum(token losses) /
    global valid targets. Gradients are
    all-reduced once, after the last micro-batch, so ranks may run different numbers of micro-batches.
    """

    name = "ddp"
    shard_format = None

    def __init__(self, model: nn.Module, optimizer, scheduler, info: DistInfo, grad_clip: float, dtype: str,
                 tensor: Unsplit | None = None):
        """`tensor`: the model's tensor layout (trainer.distributed.tensor: `Unsplit`, or a `TensorParallel`
        that parallelize applied, DDP then averaging over the loss group, data x context, only); every state
        and gradient operation goes through it."""
        self.module = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip
        self.autocast_dtype = None if dtype == "fp32" else compute_dtype(dtype)
        self.device = info.device
        self.is_main = info.is_main
        self.tensor = tensor or Unsplit()
        self.gathers_weights = self.tensor.gathers
        self.writes = info.dims.loss_rank == 0
        """Whether this rank's tensor group holds rank 0, which writes checkpoints: only it gathers whole
        tensors."""
        replicas = info.dims.loss_size  # the ranks holding the same weights
        if replicas > 1:
            ids = [info.device.index] if info.device.type == "cuda" else None
            self.wrapped: nn.Module = nn.parallel.DistributedDataParallel(model, device_ids=ids,
                                                                          process_group=info.loss_group)
            self.grad_average_factor = replicas
        else:
            self.wrapped = model
            self.grad_average_factor = 1

    def micro_steps(self, own: int, busiest: int) -> int:
        """Ranks run their own number of micro-batches (at least one: the gradient all-reduce is
        collective)."""
        return max(1, own)

    def micro_step(self, inputs: dict, loss_scale: float,
                   sync: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Forward + backward of one micro-batch; gradients are all-reduced only when `sync`.

        Returns (objective sum, plain summed token loss, per-group sums or None): the objective is the
        weighted sum when the inputs carry loss_weights (trainer.run.step.loss_weights), else the plain sum.
        """
        no_sync = (self.wrapped.no_sync() if (not sync and self.wrapped is not self.module)
                   else contextlib.nullcontext())
        with no_sync:
            return forward_backward(self.wrapped, inputs, loss_scale, autocast=self._autocast)

    @torch.no_grad()
    def eval_forward(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Summed token loss, target count and per-group sums of one micro-batch, without gradients or DDP
        communication."""
        with self._autocast():
            out = self.module(**inputs, return_logits=False)
        return out.loss_sum, out.num_targets, out.group_loss_sums

    def clip_gradients(self) -> float:
        """The global gradient norm (before clipping); clips in place. Gradients are already all-reduced, so
        every rank computes the same norm."""
        limit = self.grad_clip if self.grad_clip > 0 else float("inf")
        return self.tensor.clip_gradients(list(self.module.named_parameters()), limit)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def state_dict(self) -> dict:
        """Model, optimizer and schedule state on rank 0 ({} on every other rank), the tensors the live ones
        or, under tensor parallelism, the whole ones its tensor group gathered onto it (one tensor at a time):
        the state is a one-rank run's and loads on any layout. Called on every rank (collective under tensor
        parallelism)."""
        if not self.writes:
            return {}
        model = self.tensor.full_state(self.module.state_dict(), everywhere=False)
        optimizer = self.tensor.full_optimizer_state(self.optimizer, everywhere=False)
        return {"model": model, "optimizer": optimizer, "scheduler": self.scheduler.state_dict()} \
            if self.is_main else {}

    def load_state_dict(self, state: dict) -> None:
        """Restore a whole state (`state_dict`'s, on every rank): each rank keeps its own part of every
        tensor."""
        self.module.load_state_dict(self.tensor.shard_state(state["model"]))
        self.optimizer.load_state_dict(self.tensor.shard_optimizer_state(self.optimizer, state["optimizer"]))
        self.scheduler.load_state_dict(state["scheduler"])

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The model's weights on the CPU, on rank 0 only (every rank has them: no communication; under tensor
        parallelism every rank calls it, and the tensor group gathers them)."""
        state = self.tensor.full_state(self.module.state_dict(), everywhere=False) if self.writes else {}
        if not self.is_main:
            return {}
        return {k: v.detach().cpu().contiguous() for k, v in state.items()}

    def save_shards(self, directory: Path) -> None:
        raise NotImplementedError(_REPLICATED)

    def load_shards(self, directory: Path, converted: bool = False) -> None:
        raise NotImplementedError(_REPLICATED)

    def converts_from(self, world_size: int) -> bool:
        return False  # replicated: engine.pt loads on any number of ranks

    def convert_shards(self, directory: Path, out: Path) -> None:
        raise NotImplementedError(_REPLICATED)
