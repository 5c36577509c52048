"""The `distributed` section of the config: which engine wraps the model, on which backend and device."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

ENGINES = ("ddp", "deepspeed", "fsdp2")
BACKENDS = ("auto", "nccl", "gloo")
DEVICES = ("auto", "cpu", "cuda")
CP_STRATEGIES = ("allgather", "ulysses")
CP_SPLITS = ("balanced", "zigzag", "documents")
ALLGATHER_KERNELS = ("flash", "sdpa_docs", "dense")
"""The attention kernels the allgather strategy runs: they take separate query and key lengths (bottom-right
causal)."""
ENGINE_MODULES = {"deepspeed": "deepspeed"}
"""The module an engine needs installed (checked, not imported, when the config is built)."""


@dataclass
class DistributedConfig:
    engine: str = "ddp"
    """'ddp' (torch DistributedDataParallel), 'deepspeed' (ZeRO, trainer/distributed/deepspeed.py) or 'fsdp2'
    (torch's fully_shard over the run's DeviceMesh, trainer/distributed/fsdp.py)."""
    backend: str = "auto"
    """'auto' (nccl on CUDA, gloo on CPU), 'nccl' or 'gloo'."""
    device: str = "auto"
    """'auto', 'cpu' or 'cuda'."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage: 1 shards optimizer state, 2 also gradients, 3 also weights (0 with ddp)."""
    offload: bool = False
    """DeepSpeed: keep the optimizer state (and its step) on the CPU; FSDP2: keep the parameter, gradient and
    optimizer shards on the CPU (CPUOffloadPolicy). Saves accelerator memory, costs speed."""
    reshard_after_forward: bool = True
    """FSDP2: free each block's gathered weights after its forward and gather them again for its backward
    (ZeRO-3's memory); false keeps them until the backward (ZeRO-2's memory, one all-gather fewer per
    block)."""
    context_parallel: int = 1
    """Ranks that share each row (context parallelism, trainer/distributed/context.py): the world is
    data-parallel x context-parallel, the N ranks of a group train the same rows, each holding 1/N of every
    row's positions."""
    tensor_parallel: int = 1
    """Ranks that share each layer's weights (tensor parallelism with sequence parallelism,
    trainer/distributed/tensor.py): whole heads and MLP columns per rank, the vocabulary padded to a multiple
    of N and split, the loss computed on the vocabulary shards. The world is data x context x tensor."""
    context_parallel_strategy: str = "allgather"
    """How attention crosses the group: 'allgather' (keys and values all-gathered; any head count; flash,
    sdpa_docs, dense or auto) or 'ulysses' (all-to-all to whole rows of n_head / N heads; any attention
    backend)."""
    context_parallel_split: str = "balanced"
    """How each row's positions are dealt to the group: 'balanced' (8N chunks dealt by attention work, row by
    row: even work on rows packed with many documents) or 'zigzag' (chunks r and 2N - 1 - r of 2N: even for
    one long document per row) or 'documents' (a document no longer than a rank's share stays whole on one
    rank, dealt by its work; only longer ones are split, zigzag: under allgather only the split documents'
    keys and values cross the group). Each gives each rank as many positions;
    trainer.distributed.context.row_positions."""

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"distributed.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.engine == "deepspeed" and self.zero_stage not in (1, 2, 3):
            raise ValueError("distributed.zero_stage must be 1, 2 or 3 with engine=deepspeed, "
                             f"got {self.zero_stage}")
        if self.engine == "ddp" and (self.zero_stage != 0 or self.offload):
            raise ValueError("distributed.zero_stage / offload need engine=deepspeed or fsdp2 (try "
                             "distributed=deepspeed_zero2 or distributed=fsdp2)")
        if self.engine == "fsdp2" and self.zero_stage != 0:
            raise ValueError("distributed.zero_stage is DeepSpeed's; FSDP2 always shards parameters, "
                             "gradients and optimizer state (distributed.reshard_after_forward=false keeps "
                             "the gathered weights from forward to backward, as ZeRO-2)")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"distributed.reshard_after_forward must be true or false, got "
                             f"{self.reshard_after_forward!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"distributed.backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.device not in DEVICES:
            raise ValueError(f"distributed.device must be one of {DEVICES}, got {self.device!r}")
        if not isinstance(self.context_parallel, int) or self.context_parallel < 1:
            raise ValueError("distributed.context_parallel must be an integer >= 1, "
                             f"got {self.context_parallel!r}")
        if not isinstance(self.tensor_parallel, int) or isinstance(self.tensor_parallel, bool) \
                or self.tensor_parallel < 1:
            raise ValueError("distributed.tensor_parallel must be an integer >= 1, "
                             f"got {self.tensor_parallel!r}")
        if self.tensor_parallel > 1 and self.engine == "deepspeed":
            raise ValueError("distributed.tensor_parallel > 1 runs under distributed.engine=ddp or fsdp2: "
                             "DeepSpeed wraps the whole model itself (use distributed=ddp or "
                             "distributed=fsdp2 with distributed.tensor_parallel=N)")
        if self.context_parallel_split not in CP_SPLITS:
            raise ValueError(f"distributed.context_parallel_split must be one of {CP_SPLITS}, got "
                             f"{self.context_parallel_split!r}")
        if self.context_parallel_strategy not in CP_STRATEGIES:
            raise ValueError(f"distributed.context_parallel_strategy must be one of {CP_STRATEGIES}, got "
                             f"{self.context_parallel_strategy!r}")


def launched_world_size() -> int:
    """The number of ranks the launcher started (WORLD_SIZE, as torchrun, the deepspeed launcher and Slurm's
    torchrun set it); 1 for a plain process."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def missing_engine_package(cfg: DistributedConfig) -> str | None:
    """Why distributed.engine cannot run here (its package is not installed), or None. Checked when the run's
    config is built (trainer.train.build_config), before anything is started."""
    module = ENGINE_MODULES.get(cfg.engine)
    if module is not None and importlib.util.find_spec(module) is None:
        return (f"distributed.engine={cfg.engine} needs the {module!r} package, which is not installed here: "
                f"pip install -e '.[{cfg.engine}]', or use distributed=ddp")
    return None
