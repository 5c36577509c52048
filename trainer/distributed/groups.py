"""Process groups and named reductions: the only place a process group is set up.

Wrapping a model for several ranks is `trainer.distributed.engine.parallelize` (the `Engine` interface, with DDP in
trainer/distributed/ddp.py, DeepSpeed in trainer/distributed/deepspeed.py and FSDP2 in trainer/distributed/fsdp.py);
they import this module, never the reverse. The world's DeviceMesh is built here too (`DistInfo.mesh`).
The model itself never imports torch.distributed.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from trainer.distributed.config import DistributedConfig, context_world_problem
from trainer.distributed.context import ContextGroup
from trainer.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    context: ContextGroup | None = None
    """This rank's context-parallel group (distributed.context_parallel > 1), else None. The world is a
    (data, context) DeviceMesh: rank = data_rank * N + context rank, so a group is N consecutive ranks."""
    data_group: dist.ProcessGroup | None = None
    """The ranks with this rank's context rank, one per data rank (None: the whole world)."""
    mesh: DeviceMesh | None = None
    """The world as a DeviceMesh with named dimensions, ("data",) or ("data", "context") under context
    parallelism; built for engines and strategies that address its dimensions (FSDP2 shards over it, context
    parallelism takes its groups from it), else None."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def context_size(self) -> int:
        return 1 if self.context is None else self.context.size

    @property
    def data_rank(self) -> int:
        """Which data stream this rank reads: the ranks of one context group read the same one."""
        return self.rank // self.context_size

    @property
    def data_world(self) -> int:
        """Data streams (data-parallel ranks): world size / context-parallel size."""
        return self.world_size // self.context_size

    @property
    def counts_data(self) -> bool:
        """Whether this rank's rows count in sums over the world (one rank per context group: each token once)."""
        return self.context is None or self.context.rank == 0


def init_distributed(cfg: DistributedConfig) -> DistInfo:
    """Join the process group torchrun / the deepspeed launcher describe in the environment (if any).

    A plain `python -m trainer.train` has no WORLD_SIZE and runs as rank 0 of 1 without a group, except
    under DeepSpeed and FSDP2, which want one even then: a group of one over an in-memory store.
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
    elif cfg.engine in ("deepspeed", "fsdp2") and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    info = DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device)
    if cfg.context_parallel > 1:
        return _with_context(info, cfg)
    if cfg.engine == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh

        return dataclasses.replace(info, mesh=init_device_mesh(device.type, (world_size,), mesh_dim_names=("data",)))
    return info


def _with_context(info: DistInfo, cfg: DistributedConfig) -> DistInfo:
    """`info` on a (data, context) DeviceMesh of distributed.context_parallel ranks per group."""
    from torch.distributed.device_mesh import init_device_mesh

    size = cfg.context_parallel
    if (problem := context_world_problem(size, info.world_size)) is not None:
        raise ConfigError(problem)
    mesh = init_device_mesh(info.device.type, (info.world_size // size, size), mesh_dim_names=("data", "context"))
    context = ContextGroup(mesh.get_group("context"), size, info.rank % size, cfg.context_parallel_strategy,
                           cfg.context_parallel_split)
    return dataclasses.replace(info, context=context, data_group=mesh.get_group("data"), mesh=mesh)


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


def dist_sum(values: list[float], device: torch.device, group: dist.ProcessGroup | None = None) -> list[float]:
    """Sum a few numbers over all ranks (or `group`'s) in one all-reduce (float64, so token counts stay exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
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
