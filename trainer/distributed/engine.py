"""The engine: what the training step, the eval and the checkpoint code see of a wrapped model.

`parallelize` is the one place a built model (single-device code) is split and wrapped for several ranks
(tensor parallelism first, then activation checkpointing, then compile, then the data-parallel engine); it
returns an `Engine`, implemented by `DDPEngine` (trainer/distributed/ddp.py), `DeepSpeedEngine`
(trainer/distributed/deepspeed.py, imported only when configured, so plain runs never import deepspeed) and
`FSDP2Engine` (trainer/distributed/fsdp.py). Process groups are set up before, by
`trainer.distributed.groups.init_distributed`; the engines only use them.

An engine returns its state; it never chooses a file name. The checkpoint store (trainer.checkpoint.store, the
one description of the layout) writes a replicated engine's `state_dict()` and everyone's `full_weights()`
itself, and hands a sharded engine the one directory its `save_shards` / `load_shards` may use.

How the step drives an engine, for one optimizer step over k micro-batches:

    for i, mb in enumerate(micro_batches):       # engine.micro_steps(k, busiest) of them; synced on the last
        engine.micro_step(inputs(mb), loss_scale, sync=i == k - 1)
    norm, applied = engine.step_if_finite(loss)  # clip, then step or drop the gradients
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
from torch import nn

from trainer.distributed.config import DistributedConfig
from trainer.distributed.ddp import DDPEngine, repoint_optimizer
from trainer.distributed.groups import DistInfo
from trainer.distributed.tensor import Unsplit, apply_tensor_parallel
from trainer.model.compile import compile_blocks
from trainer.model.gpt import apply_activation_checkpointing, init_weights


@runtime_checkable
class Engine(Protocol):
    """Model + optimizer + LR schedule, wrapped for the configured parallelism."""

    name: str
    """'ddp', 'deepspeed_zero2', ... (recorded in every checkpoint; resuming needs the same one)."""
    module: nn.Module
    """The model as built (single-device code), for eval mode switches and weight reads."""
    grad_average_factor: int
    """What the step multiplies the loss by to undo the engine's averaging of gradients over ranks."""
    shard_format: str | None
    """None: every rank holds the same state, which `state_dict` returns whole (the store saves rank 0's), and
    which loads on any number of ranks. Else each rank holds a part, which only the engine can write and read
    (`save_shards` / `load_shards`), into the directory the checkpoint store names by it: 'deepspeed'
    (DeepSpeed's own files) or 'dcp' (torch.distributed.checkpoint)."""
    gathers_weights: bool
    """Whether the whole model exists on no rank (FSDP2's shards, tensor parallelism's), so that writing its
    weights (`full_weights`, model.safetensors) gathers every tensor: the loop then writes them less often."""

    def micro_step(self, inputs: dict, loss_scale: float,
                   sync: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Forward + backward of one micro-batch (backward of objective_sum * loss_scale); gradients are
        reduced over ranks only when `sync`. Returns (objective_sum, plain summed token loss, summed token
        loss per loss group or None: the inputs carry no loss_groups), detached."""
        ...

    def eval_forward(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(summed token loss, number of targets, per loss group summed token loss or None) of one
        micro-batch, without gradients."""
        ...

    def micro_steps(self, own: int, busiest: int) -> int:
        """How many micro-steps this rank runs when it holds `own` micro-batches and the busiest rank
        `busiest` (the step adds empty ones, without targets): its own under DDP, the busiest's where every
        forward is collective (FSDP2, ZeRO); at least one (the gradient reduction is collective)."""
        ...

    def step_if_finite(self, loss: float) -> tuple[float, bool]:
        """After the step's last micro-batch: clip and apply the update (optimizer, schedule, gradients
        zeroed) unless `loss` (the step's global loss) or the gradient norm is not finite, when this step's
        gradients are dropped and nothing else changes. Returns (the global gradient norm, whether the update
        was applied). An engine that clips and steps in one call (DeepSpeed) raises NonFiniteError on a
        non-finite loss."""
        ...

    def optimizer_step(self) -> float:
        """Clip, step, advance the schedule, zero the gradients, whatever the norm;
        the global gradient norm."""
        ...

    def lr(self) -> float:
        """The current learning rate of the first parameter group."""
        ...

    def local_state(self) -> dict:
        """Not collective: this rank's live weights and optimizer state (its shards), {'model': ...,
        'optimizer': ...} keyed by name, not copied; what a checkpoint load checks for non-finite values."""
        ...

    def state_dict(self) -> dict:
        """Model, optimizer and LR schedule as plain data and tensors, whole (shard_format None). Called on
        every rank; collective under tensor parallelism (the whole tensors gathered onto rank 0, {}
        elsewhere)."""
        ...

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned, its tensors already on this rank's device
        (shard_format None)."""
        ...

    def save_shards(self, directory: Path) -> None:
        """Collective: every rank writes its part of the state into `directory`, which the caller names and
        which need not exist (a sharded engine)."""
        ...

    def load_shards(self, directory: Path, converted: bool = False) -> None:
        """Collective: every rank restores its part from a `directory` that save_shards wrote on as many
        ranks, or (`converted`) that convert_shards wrote from the parts of any number (a sharded engine)."""
        ...

    def converts_from(self, world_size: int) -> bool:
        """Whether the shards save_shards wrote on `world_size` ranks must go through convert_shards before
        load_shards reads them on this run's ranks: DeepSpeed's on another number of ranks; never DCP's, which
        reshards as it reads, nor a replicated engine's."""
        ...

    def convert_shards(self, directory: Path, out: Path) -> None:
        """Not collective: the parts that save_shards wrote into `directory`, on any number of ranks,
        rewritten into a new directory `out` that load_shards(out, converted=True) reads on this run's ranks
        (a sharded engine)."""
        ...

    def full_weights(self) -> dict[str, torch.Tensor]:
        """Collective (every rank calls it): the whole model's weights as CPU tensors, under the keys of
        `module.state_dict()`, on rank 0; the other ranks get {} (as FSDP's rank0_only full state dict)."""
        ...


def parallelize(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler, info: DistInfo,
                cfg: DistributedConfig, grad_clip: float, dtype: str, compile: bool = False,
                activation_checkpointing: str = "none") -> Engine:
    """Wrap a built model (already on its device), its optimizer and LR schedule into the configured engine,
    in one order: tensor parallelism (distributed.tensor_parallel, trainer/distributed/tensor.py), activation
    checkpointing (train.activation_checkpointing: trainer.model.apply_activation_checkpointing), compile,
    then the data-parallel engine (DDP over the loss group, FSDP2: `fsdp.apply_fsdp`, or DeepSpeed). Context
    parallelism needs no wrapping: each micro-batch carries this rank's share of its positions (Batch.plan:
    trainer.distributed.context.RowPlan).

    The DeepSpeed engine takes the same client optimizer and schedule, so DDP and ZeRO runs compare.
    dtype: 'fp32' or 'bf16', train.dtype as the run resolved it (trainer.config.resolve_dtype). compile
    (train.compile): each transformer block is compiled first, before any wrapping (trainer/model/compile.py);
    the config has already refused it under ZeRO-3 (trainer.config.cross_section_rules).
    """
    if dtype not in ("fp32", "bf16"):
        raise ValueError("parallelize takes a resolved dtype, 'fp32' or 'bf16' "
                         f"(trainer.config.resolve_dtype), got {dtype!r}")
    on_meta = any(p.is_meta for p in model.parameters())
    if on_meta and cfg.engine == "deepspeed":
        raise ValueError("DeepSpeed takes a materialized model: build it with build_model(..., meta=False)")
    # the model's tensor layout: every engine's state and gradient operations go through it
    tensor = Unsplit()
    # first: the layers split over the tensor group, the optimizer given the shards
    if info.tensor_size > 1:
        names = {id(p): name for name, p in model.named_parameters()}
        tensor = apply_tensor_parallel(model, info.dims.group("tensor"), info.tensor_size,
                                       info.dims.tensor_rank, info.dims.world_mesh)
        repoint_optimizer(optimizer, model, names)
    if activation_checkpointing != "none":  # "none": the blocks as built
        apply_activation_checkpointing(model, activation_checkpointing)
    if compile:
        compile_blocks(model)
    if cfg.engine == "ddp":
        if on_meta:  # before DDP, which broadcasts the weights
            materialize(model, info.device, tensor)
        return DDPEngine(model, optimizer, scheduler, info, grad_clip, dtype, tensor)
    if cfg.engine == "deepspeed":
        from trainer.distributed.deepspeed import (
            DeepSpeedEngine,  # only here: plain runs never import deepspeed
        )

        return DeepSpeedEngine(model, optimizer, scheduler, info, cfg, grad_clip, dtype)
    if cfg.engine == "fsdp2":
        from trainer.distributed.fsdp import FSDP2Engine, apply_fsdp

        apply_fsdp(model, optimizer, info, cfg, dtype)
        if on_meta:  # after fully_shard: each rank draws the whole tensors and keeps its shards
            materialize(model, info.device, tensor)
        return FSDP2Engine(model, optimizer, scheduler, info, grad_clip, tensor)
    raise ValueError(f"distributed.engine must be 'ddp', 'deepspeed' or 'fsdp2', got {cfg.engine!r}")


def materialize(model: nn.Module, device: torch.device, tensor: Unsplit | None = None) -> None:
    """Give a model built on the meta device (build_model(meta=True)), already split (tensor parallelism) or
    sharded (FSDP2), its storage on `device` and this rank's part of the one-rank weights: trainer.model.gpt.
    init_weights draws each whole tensor on the CPU, in the one-rank order, from the RNG state the build began
    in, and keeps this rank's slice (the tensor-parallel Layout, then FSDP2's shard of it). The same seed
    gives the same weights, bit for bit, on every layout; no rank ever holds more than one whole tensor.

    The Parameters stay the same objects (swapped in place), so the optimizer built on the meta model and the
    tied head keep theirs.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not torch.equal(torch.get_rng_state(), model.init_rng):
        raise RuntimeError("the CPU RNG drew between the meta build and materialize: the weights would not "
                           "be the one-rank build's; draw nothing between build_model(meta=True) and "
                           "parallelize")
    params = dict(model.named_parameters(remove_duplicate=False))
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)

    def shard(name: str, whole: torch.Tensor) -> torch.Tensor:
        whole = (tensor or Unsplit()).shard(name, whole).to(device)
        p = params[name]
        if isinstance(p, DTensor):  # FSDP2: this rank's rows of the (tensor-parallel) whole, no communication
            return distribute_tensor(whole, p.device_mesh, p.placements, src_data_rank=None)
        return whole

    init_weights(model, shard)
