"""Optimizer and learning-rate schedule from `OptimConfig`."""

from __future__ import annotations

import importlib
import inspect
import math

import torch
from torch import nn

from trainer.config import OptimConfig
from trainer.errors import ConfigError

OPTIMIZER_ARGS = ("lr", "betas", "eps", "weight_decay")
"""What build_optimizer passes to optim._target_ (weight_decay per parameter group): the classes of
torch.optim that take them all are Adam, AdamW, Adamax, NAdam and RAdam."""


def build_optimizer(model: nn.Module, cfg: OptimConfig,
                    device: torch.device | None = None) -> torch.optim.Optimizer:
    """`cfg.target` over two groups: weight matrices decay, norms / biases (1-D tensors) do not.

    optim.fused decides by the device the parameters train on (`use_fused`): `device`, else the parameters'
    own (a model built on the meta device, materialized later by parallelize, names its run's device).
    """
    module_name, _, class_name = cfg.target.rpartition(".")
    optimizer_cls = getattr(importlib.import_module(module_name), class_name)
    check_optimizer_args(optimizer_cls, cfg.target)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    extra = {"fused": True} if use_fused(optimizer_cls, cfg.fused, device or params[0].device) else {}
    try:
        return optimizer_cls(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, **extra)
    except RuntimeError as e:  # torch refuses fused=True for a device without the kernel
        if not extra:
            raise
        raise ConfigError(f"optim.fused=true: {cfg.target} has no fused kernel for these parameters ({e}); "
                          "set optim.fused=auto or false") from e


def check_optimizer_args(optimizer_cls: type, target: str) -> None:
    """Refuse, with a ConfigError, an optimizer class that does not take every argument of OPTIMIZER_ARGS.

    Example: torch.optim.SGD (no betas, no eps) ->
    "optim._target_=torch.optim.SGD does not take betas, eps: ...".
    """
    params = inspect.signature(optimizer_cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    missing = [name for name in OPTIMIZER_ARGS if name not in params]
    if missing:
        raise ConfigError(f"optim._target_={target} does not take {', '.join(missing)}: the optimizer gets "
                          f"{', '.join(OPTIMIZER_ARGS)}, so use a class that takes them all "
                          "(torch.optim.AdamW, Adam, Adamax, NAdam or RAdam)")


def use_fused(optimizer_cls: type, setting: bool | str, device: torch.device) -> bool:
    """Whether to pass fused=True. 'auto': on CUDA, if the class takes `fused` (AdamW, Adam, SGD, ...), so CPU
    runs keep the default (foreach) implementation; True: always (an error if the class has no `fused`);
    False: never. Example: use_fused(torch.optim.AdamW, "auto", torch.device("cpu")) -> False."""
    takes_fused = "fused" in inspect.signature(optimizer_cls).parameters
    if setting == "auto":
        return takes_fused and device.type == "cuda"
    if setting and not takes_fused:
        raise ConfigError(f"optim.fused=true: {optimizer_cls.__name__} takes no `fused` argument; "
                          "set optim.fused=auto")
    return bool(setting)


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of the peak LR at `step`: linear warm-up, then cosine down to `min_ratio`.

    Example, warmup 10, max 110, min 0.1: step 0 -> 0.1, step 9 -> 1.0, step 60 -> 0.55, step 110 -> 0.1.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
    )
