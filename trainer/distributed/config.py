"""The `distributed` section of the config: which engine wraps the model, on which backend and device."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

ENGINES = ("ddp", "deepspeed")
BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cpu", "cuda")
ENGINE_MODULES = {"deepspeed": "deepspeed"}
"""The module an engine needs installed (checked, not imported, when the config is built)."""


@dataclass
class DistributedConfig:
    engine: str = "ddp"
    """'ddp' (torch DistributedDataParallel) or 'deepspeed' (ZeRO, see trainer/distributed/deepspeed.py)."""
    backend: str = "auto"
    """'auto' (nccl on CUDA, gloo on CPU), 'nccl' or 'gloo'."""
    device: str = "auto"
    """'auto', 'cpu' or 'cuda'."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also weights (0 with ddp)."""
    offload: bool = False
    """DeepSpeed: keep the optimizer state (and its step) on the CPU; saves accelerator memory, costs speed."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"distributed.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine == "deepspeed" and self.zero_stage not in (1, 2, 3):
            raise ValueError(f"distributed.zero_stage must be 1, 2 or 3 with engine=deepspeed, got {self.zero_stage}")
        if self.engine == "ddp" and (self.zero_stage != 0 or self.offload):
            raise ValueError("distributed.zero_stage / offload need engine=deepspeed (try distributed=deepspeed_zero2)")
        if self.backend not in BACKENDS:
            raise ValueError(f"distributed.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device not in DEVICES:
            raise ValueError(f"distributed.device must be one of {DEVICES}, got {self.device!r}")


def missing_engine_package(cfg: DistributedConfig) -> str | None:
    """Why distributed.engine cannot run here (its package is not installed), or None. Checked when the run's
    config is built (trainer.train.build_config), before anything is started."""
    module = ENGINE_MODULES.get(cfg.engine)
    if module is not None and importlib.util.find_spec(module) is None:
        return (f"distributed.engine={cfg.engine} needs the {module!r} package, which is not installed here: "
                f"pip install -e '.[{cfg.engine}]', or use distributed=ddp")
    return None
