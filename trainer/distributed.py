"""Process groups, named reductions, and the one place where a model gets wrapped for several ranks.

The training step talks to an engine: `micro_step` (forward + backward of one micro-batch, gradient
sync only on the last one) and `optimizer_step`; the checkpoint code calls `save(dir)` / `load(dir)`.
`parallelize` builds the engine for the configured backend: `DDPEngine` here, or the DeepSpeed engine
(trainer/deepspeed_engine.py, imported only then). The model itself never imports torch.distributed.

What every engine has:
    name                   'ddp', 'deepspeed_zero2', ... (recorded in the checkpoint's conventions.json)
    module                 the model as built (single-device code)
    grad_average_factor    what the step multiplies the loss by to undo the engine's gradient averaging
    equal_micro_batches    True if every rank must run the same number of micro-batches per step
    micro_step(inputs, loss_scale, sync) -> (objective_sum, loss_sum)   backward of objective_sum * loss_scale
    eval_forward(inputs) -> (loss_sum, num_targets)                     no gradient (the caller sets eval mode)
    optimizer_step() -> grad_norm;  lr();  save(directory);  load(directory)
    can_discard            True if clip_gradients() / apply_gradients() / discard_gradients() split the step
                           (DDP), so a non-finite step can be dropped; DeepSpeed steps in one call
"""

from __future__ import annotations

import contextlib
import datetime
import os
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from trainer.config import DistributedConfig
from trainer.errors import ConfigError
from trainer.safe_io import load_state, save_state


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(cfg: DistributedConfig) -> DistInfo:
    """Join the process group torchrun / the deepspeed launcher describe in the environment (if any).

    A plain `python -m trainer.train` has no WORLD_SIZE and runs as rank 0 of 1 without a group.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(cfg.device, local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        timeout = datetime.timedelta(minutes=10)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # launched by torchrun
            store = _attempt_store(rank, world_size, timeout)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)


def shutdown_distributed() -> None:
    """Leave the process group together: a barrier, then destroy it on every rank. Without it the ranks tear
    down gloo's connections (and rank 0 its store) in whatever order they exit, and a rank still reading one
    can abort ("terminate called without an active exception")."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _attempt_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's store, with keys prefixed by the restart attempt.

    After an elastic restart (`torchrun --max-restarts`), the restarted ranks meet in the same TCPStore as the
    failed attempt (torch 2.13's agent keeps it); without a prefix, gloo reads the dead ranks' addresses from
    the previous attempt and fails with "Connection refused" (seen on every other restart here).
    """
    use_agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
        is_master=not use_agent_store and rank == 0, timeout=timeout, multi_tenant=not use_agent_store,
    )
    return dist.PrefixStore(f"packtrain/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def _pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("distributed.device=cuda but no CUDA device is visible: use distributed.device=auto or cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if choice != "cpu":
        raise ConfigError(f"distributed.device must be auto, cpu or cuda, got {choice!r}")
    return torch.device("cpu")


def dist_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few numbers over all ranks in one all-reduce (float64, so token counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def dist_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s value of a picklable object, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


class DDPEngine:
    """Model + optimizer + LR schedule under DistributedDataParallel (plain module for one process).

    DDP averages gradients over ranks; `grad_average_factor` tells the step to multiply the loss by
    the world size so that what remains is sum(token losses) / global valid targets. Gradients are
    all-reduced once, after the last micro-batch, so ranks may run different numbers of micro-batches.
    """

    name = "ddp"
    equal_micro_batches = False
    can_discard = True
    """The step can look at the gradient norm before applying it (and drop a non-finite one)."""

    def __init__(self, model: nn.Module, optimizer, scheduler, info: DistInfo, grad_clip: float, dtype: str):
        self.module = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.grad_clip = grad_clip
        self.autocast_dtype = torch.bfloat16 if dtype == "bf16" else None
        self.device = info.device
        self.is_main = info.is_main
        if info.world_size > 1:
            ids = [info.device.index] if info.device.type == "cuda" else None
            self.wrapped: nn.Module = nn.parallel.DistributedDataParallel(model, device_ids=ids)
            self.grad_average_factor = info.world_size
        else:
            self.wrapped = model
            self.grad_average_factor = 1

    def micro_step(self, inputs: dict, loss_scale: float, sync: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward + backward of one micro-batch; gradients are all-reduced only when `sync`.

        Returns (objective sum, plain summed token loss): the objective is the weighted sum when the
        inputs carry loss_weights (trainer.step.loss_weights), else the plain sum.
        """
        no_sync = self.wrapped.no_sync() if (not sync and self.wrapped is not self.module) else contextlib.nullcontext()
        with no_sync:
            with self._autocast():
                out = self.wrapped(**inputs)
            objective = out.loss_sum if out.weighted_loss_sum is None else out.weighted_loss_sum
            (objective * loss_scale).backward()
        return objective.detach(), out.loss_sum.detach()

    @torch.no_grad()
    def eval_forward(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed token loss and target count of one micro-batch, without gradients or DDP communication."""
        with self._autocast():
            out = self.module(**inputs, return_logits=False)
        return out.loss_sum, out.num_targets

    def optimizer_step(self) -> float:
        """Clip, step, advance the schedule, zero the gradients; returns the global grad norm."""
        norm = self.clip_gradients()
        self.apply_gradients()
        return norm

    def clip_gradients(self) -> float:
        """The global gradient norm (before clipping); clips in place. Gradients are already all-reduced, so
        every rank computes the same norm."""
        limit = self.grad_clip if self.grad_clip > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(self.module.parameters(), limit))

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

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype)

    def state_dict(self) -> dict:
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def save(self, directory: Path) -> None:
        """Collective. The state is replicated, so rank 0 alone writes `engine.pt`."""
        state = self.state_dict()
        if self.is_main:
            save_state(state, directory / "engine.pt")
            save_file({k: v.detach().cpu().contiguous() for k, v in self.module.state_dict().items()
                       if k != "lm_head.weight"},  # tied to wte.weight; safetensors refuses shared storage
                      directory / "model.safetensors")

    def load(self, directory: Path) -> None:
        self.load_state_dict(load_state(directory / "engine.pt", map_location=self.device))


def parallelize(model: nn.Module, optimizer, scheduler, info: DistInfo, cfg: DistributedConfig, grad_clip: float, dtype: str):
    """Wrap a built model (already on its device), its optimizer and LR schedule into the configured engine.

    The DeepSpeed engine takes the same client optimizer and schedule, so DDP and ZeRO runs compare.
    """
    if cfg.engine == "ddp":
        return DDPEngine(model, optimizer, scheduler, info, grad_clip, dtype)
    if cfg.engine == "deepspeed":
        from trainer.deepspeed_engine import DeepSpeedEngine  # only here: plain runs never import deepspeed

        return DeepSpeedEngine(model, optimizer, scheduler, info, cfg, grad_clip, dtype)
    raise ValueError(f"distributed.engine must be 'ddp' or 'deepspeed', got {cfg.engine!r}")
