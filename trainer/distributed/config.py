"""The `distributed` section of the config: which engine wraps the model, on which backend and device."""

from __future__ import annotations

from dataclasses import dataclass

ENGINES = ("ddp", "deepspeed")


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
