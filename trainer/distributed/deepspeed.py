"""DeepSpeed ZeRO (stage 1, 2 or 3) behind the `Engine` interface (trainer.distributed.engine).

Imported by `parallelize` only when distributed.engine=deepspeed, so plain runs never import deepspeed.
DeepSpeed gets the client optimizer and LR schedule (trainer.run.optim), so DDP and ZeRO runs are comparable.

How the objective survives DeepSpeed. The step scales each micro-batch's summed loss by
grad_average_factor / global valid targets; DeepSpeed would then change it in three ways, each undone:
  * it divides the loss by gradient_accumulation_steps: the config says 1 and backward() is told
    scale_wrt_gas=False, since the step already divides by the targets of all micro-batches;
  * it averages gradients over the data-parallel ranks: grad_average_factor = that world size, as for DDP;
  * it counts micro-batches to find the accumulation boundary: the step says which micro-batch is the
    last one (set_gradient_accumulation_boundary), since the count varies from step to step and by rank.
ZeRO-2/3 reduce gradients in every micro-batch and ZeRO-3 gathers weights in every forward, so all ranks
must run the same number of micro-batches: `micro_steps` makes the step pad the shorter ranks
with empty micro-batches (no targets, so no gradient). For example, 3 micro-batches on rank 0 and 1 on
rank 1: rank 1 runs its batch and two empty ones, and the third micro-batch is the boundary on both.

Checkpoints: ZeRO's state is sharded, so DeepSpeed writes and reads its own files (`save_shards`,
`load_shards`), in the one directory the checkpoint store names and after the store has checked them
(trainer.checkpoint.store describes the files); the whole weights are gathered and returned (`full_weights`)
for the store to write. A write of DeepSpeed's that fails (a full disk) is raised only once DeepSpeed's save
has ended, so that no rank is left waiting in its collectives (`save_shards`).

On another number of ranks. ZeRO partitions the optimizer state (and, at stage 3, the weights) by
data-parallel rank, and DeepSpeed refuses to load shards written by another number. They go through
DeepSpeed's universal checkpoint instead: `convert_shards` runs deepspeed/checkpoint/ds_to_universal.py (in
this process, no worker processes) into a copy that holds each parameter whole (fp32 weights, exp_avg,
exp_avg_sq, step), and `load_shards(..., converted=True)` reads it with DeepSpeed's
`checkpoint.load_universal`, which each rank partitions for the running world size. Chosen over a conversion
of our own because it is DeepSpeed's supported path for all three stages and reads its shard format itself; it
works on CPU/gloo with DeepSpeed 0.19.8. It needs no setting at initialize: DeepSpeed consults load_universal
only while loading, so `load_shards` sets it for that call alone, and a resume on the same number of ranks
loads the shards exactly as before. Both the converter and DeepSpeed's loader unpickle with
weights_only=False: the store checks the shards before the conversion and the copy before the load
(trainer.checkpoint.store), and decides where the copy goes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import math
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trainer.distributed.config import DistributedConfig
from trainer.distributed.ddp import forward_backward, optimizer_state_by_name
from trainer.distributed.groups import DistInfo
from trainer.errors import NonFiniteError


def deepspeed_config(cfg: DistributedConfig, grad_clip: float, dtype: str, device: torch.device) -> dict:
    """The DeepSpeed config dict for a run; batch sizes are placeholders because the step owns batching.

    Example: zero_stage=2, grad_clip=1.0, dtype='bf16' -> {'zero_optimization': {'stage': 2},
    'gradient_clipping': 1.0, 'bf16': {'enabled': True}, 'gradient_accumulation_steps': 1, ...}.
    bf16 is DeepSpeed's own mixed precision (bf16 weights and gradients, fp32 master weights in the
    optimizer), not DDP's autocast over fp32 weights.
    """
    zero: dict = {"stage": cfg.zero_stage}
    if cfg.offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    return {
        "train_micro_batch_size_per_gpu": 1,  # DeepSpeed's sample counter only
        "gradient_accumulation_steps": 1,  # no loss division; the step marks the boundary itself
        "gradient_clipping": grad_clip,  # same rule as torch's clip_grad_norm_; 0 disables
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == "bf16"},
        "zero_allow_untested_optimizer": True,  # any torch optimizer (the client's) under ZeRO
        "zero_force_ds_cpu_optimizer": False,  # offload keeps the client optimizer, not DeepSpeedCPUAdam
        "steps_per_print": 2**31 - 1,  # packtrain logs its own metrics
    }


_SHARDED = ("ZeRO's state is sharded over the ranks: DeepSpeed saves it itself (save_shards); "
            "shard_format is 'deepspeed'")


class DeepSpeedEngine:
    """Model + client optimizer + client LR schedule under a DeepSpeed ZeRO engine."""

    shard_format = "deepspeed"  # even ZeRO-1 partitions the optimizer state
    gathers_weights = False  # model.safetensors at every save (no tensor parallelism under DeepSpeed)

    def __init__(self, model: nn.Module, optimizer, scheduler, info: DistInfo, cfg: DistributedConfig,
                 grad_clip: float, dtype: str):
        deepspeed = _import_deepspeed(info.device)
        if not dist.is_initialized():
            raise RuntimeError("DeepSpeed needs a process group, even for one process: call "
                               "trainer.distributed.groups.init_distributed(cfg) with "
                               "distributed.engine=deepspeed first")
        self.name = f"deepspeed_zero{cfg.zero_stage}"
        self.zero_stage = cfg.zero_stage
        self.module = model
        self.ds, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler,
            config=deepspeed_config(cfg, grad_clip, dtype, info.device),
        )
        self.grad_average_factor = self.ds.dp_world_size

    def micro_step(self, inputs: dict, loss_scale: float,
                   sync: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Forward + backward of one micro-batch; `sync` marks the step's last one (the ZeRO boundary)."""
        self.ds.set_gradient_accumulation_boundary(sync)
        return forward_backward(self.ds, inputs, loss_scale,
                                lambda loss: self.ds.backward(loss, scale_wrt_gas=False))

    @torch.no_grad()
    def eval_forward(self, inputs: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Summed token loss, target count and per-group sums; collective under ZeRO-3 (weights are gathered
        per forward)."""
        out = self.ds(**inputs, return_logits=False)
        return out.loss_sum, out.num_targets, out.group_loss_sums

    def optimizer_step(self) -> float:
        """Clip, step, advance the schedule, zero the gradients (all inside DeepSpeed); the global grad
        norm."""
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def step_if_finite(self, loss: float) -> tuple[float, bool]:
        """DeepSpeed clips and applies the update in one call, so a step cannot be dropped once its gradients
        are looked at: a non-finite `loss` stops the run before the step (NonFiniteError); a non-finite
        gradient norm is reported (False) after it."""
        if not math.isfinite(loss):
            raise NonFiniteError(f"non-finite loss {loss} (stopped before DeepSpeed's step; "
                                 "train.on_nonfinite=skip needs distributed.engine=ddp or fsdp2)")
        norm = self.optimizer_step()
        return norm, math.isfinite(norm)

    def micro_steps(self, own: int, busiest: int) -> int:
        """The busiest rank's number of micro-batches: ZeRO communicates inside every one."""
        return max(1, busiest)

    def lr(self) -> float:
        return self.ds.get_lr()[0]

    def local_state(self) -> dict:
        """The module's parameters (empty placeholders under ZeRO-3) and this rank's partition of the
        optimizer: its fp32 master weights and their state (flat partitions, named by position)."""
        # ZeRO's wrapper holds torch's optimizer
        base = getattr(self.ds.optimizer, "optimizer", self.ds.optimizer)
        return {"model": dict(self.module.named_parameters()),
                "master": [p for group in base.param_groups for p in group["params"]],
                "optimizer": optimizer_state_by_name(base, self.module)}

    def state_dict(self) -> dict:
        raise NotImplementedError(_SHARDED)

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError(_SHARDED)

    def save_shards(self, directory: Path) -> None:
        """Collective: every rank writes its ZeRO shard (and rank 0 the module and schedule) into `directory`.

        DeepSpeed writes a checkpoint into `save_dir/tag/`: here `directory.parent/directory.name` (it also
        copies its recovery scripts, zero_to_fp32.py and zero_to_torch.py, into `directory.parent`).

        A write that fails (a full disk, a quota) is raised only after DeepSpeed's save has ended on this
        rank, that is after every collective of it: DeepSpeed's save writes its files between a barrier before
        and collectives after (ZeRO-3's gather of its persistent parameters, a closing barrier), so a rank
        that raised from a write would leave the others waiting there. While it saves, its file writes
        (`checkpoint_engine.save`: the module file, each rank's optimizer partition) and rank 0's copy of the
        recovery scripts record their OSError or RuntimeError (torch.save's "unexpected pos" on a full disk)
        instead of raising it; DeepSpeed goes on through the rest of its save, and the first failure is raised
        at the end, for the store to agree on over the ranks (trainer.checkpoint.store.save_checkpoint).
        Not covered: an error DeepSpeed raises outside those writes (in 0.19.8, the creation of directories it
        already catches itself, and NVMe offload's copy, which packtrain's offload=cpu does not use)."""
        failures: list[BaseException] = []
        with _failures_recorded(failures, (self.ds.checkpoint_engine, "save"),
                                (self.ds, "_copy_recovery_script")):
            self.ds.save_checkpoint(str(directory.parent), tag=directory.name, save_latest=False)
        if failures:
            raise failures[0]

    def load_shards(self, directory: Path, converted: bool = False) -> None:
        """Collective. DeepSpeed unpickles with weights_only=False: the caller checks the files first.

        `converted`: `directory` is what convert_shards wrote (DeepSpeed's universal checkpoint), read with
        DeepSpeed's load_universal on for this call only; else the shards save_shards wrote on this many
        ranks."""
        config = self.ds._config  # load_universal is read from here, and only by load_checkpoint
        base = self.ds.optimizer.optimizer
        own = [{k: v for k, v in group.items() if k != "params"} for group in base.param_groups]
        config.load_universal_checkpoint = converted
        try:
            path, _ = self.ds.load_checkpoint(str(directory.parent), tag=directory.name,
                                              load_optimizer_states=True, load_lr_scheduler_states=True)
        finally:
            config.load_universal_checkpoint = False
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint under {directory}")
        if converted and self.zero_stage == 3:
            # DeepSpeed 0.19.8's ZeRO-3 universal load (load_hp_checkpoint_state_from_checkpoint_dir_stage3)
            # gives every parameter group the first group's settings, so the norms and biases would decay like
            # the weight matrices: each group gets its own back, as this run built it, with its LR from the
            # schedule. It also hands every group one and the same step tensor, which AdamW increments in
            # place once per group (the second group's bias correction would be a step ahead): each gets its
            # own copy.
            for group, settings, lr in zip(base.param_groups, own, self.ds.lr_scheduler.get_last_lr(),
                                           strict=True):
                group.update(settings, lr=lr)
            for state in base.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()

    def converts_from(self, world_size: int) -> bool:
        """Shards written on another number of ranks go through convert_shards (DeepSpeed's universal
        checkpoint) first."""
        return world_size != dist.get_world_size()

    def convert_shards(self, directory: Path, out: Path) -> None:
        """Not collective (one rank runs it): the shards that save_shards wrote into `directory`, on any
        number of ranks, as DeepSpeed's universal checkpoint in `out` (a new directory; DeepSpeed also writes
        a `latest_universal` file beside it), for load_shards(out, converted=True) on this run's ranks.

        ds_to_universal's options as its command line would set them, but: one process for the extraction and
        the merge (no worker processes forked from a rank that holds a process group), and the
        universal-checkpoint info that packtrain's models do not declare (no tensor or pipeline parallelism)
        filled in. Its progress output is kept off the run's console."""
        from deepspeed.checkpoint import ds_to_universal

        args = argparse.Namespace(input_folder=str(directory), output_folder=str(out), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True,
                                  inject_missing_state=True)
        chatter = io.StringIO()
        with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):
            ds_to_universal.main(args)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The whole model's weights in fp32 on the CPU, on rank 0 ({} elsewhere); under ZeRO-3 every rank
        takes part in gathering them."""
        import deepspeed

        params = list(self.module.parameters())
        gather = deepspeed.zero.GatheredParameters(params, modifier_rank=None) if self.zero_stage == 3 \
            else contextlib.nullcontext()
        with gather:
            if self.ds.global_rank != 0:
                return {}
            return {k: v.detach().float().cpu().clone().contiguous()
                    for k, v in self.module.state_dict().items()}


@contextlib.contextmanager
def _failures_recorded(failures: list[BaseException], *methods: tuple[object, str]) -> Iterator[None]:
    """Within the block, each `(obj, name)` method appends an OSError or RuntimeError it raises to `failures`
    and returns None instead (a method `obj` lacks is left out); afterwards the methods are as before."""

    def recorded(method: Callable) -> Callable:
        @functools.wraps(method)
        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except (OSError, RuntimeError) as e:
                failures.append(e)
                return None

        return call

    patched = [(obj, name, vars(obj).get(name)) for obj, name in methods if hasattr(obj, name)]
    for obj, name, _ in patched:
        setattr(obj, name, recorded(getattr(obj, name)))
    try:
        yield
    finally:
        for obj, name, own in patched:  # an instance's own attribute back, or the class's method again
            if own is None:
                delattr(obj, name)
            else:
                setattr(obj, name, own)


def _import_deepspeed(device: torch.device):
    """deepspeed, set up for `device`: its accelerator matches, and on CPU plain gloo carries the collectives.

    On CPU DeepSpeed would JIT-compile a shared-memory all-reduce kernel (35-80 s, needs g++ and the
    Python headers) the first time it sets up communication, unless the install built it
    (DS_BUILD_SHM_COMM=1). Only its inference all-reduce uses that kernel; training goes through
    torch.distributed, so an install without it marks it unavailable instead of compiling it.
    """
    if device.type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
    except ImportError as e:
        raise ImportError("distributed.engine=deepspeed needs deepspeed: pip install -e '.[deepspeed]' "
                          "(see the Makefile for the CPU flags)") from e
    accelerator = get_accelerator().device_name()
    if accelerator != device.type:
        raise RuntimeError(f"DeepSpeed's accelerator is {accelerator!r} but distributed.device is "
                           f"{device.type!r}; set DS_ACCELERATOR={device.type}")
    if device.type == "cpu" and not installed_ops.get("deepspeed_shm_comm", False):
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed
