"""Process groups and named reductions: the only place a process group is set up.

Wrapping a model for several ranks is `trainer.distributed.engine.parallelize` (the `Engine` interface, with
DDP in trainer/distributed/ddp.py, DeepSpeed in trainer/distributed/deepspeed.py and FSDP2 in
trainer/distributed/fsdp.py); they import this module, never the reverse. The world's layout (data x context x
tensor, a DeviceMesh with named groups: trainer/distributed/dims.py) is built here too, for every run
(`DistInfo.dims`). The model itself never imports torch.distributed.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from trainer.distributed.config import DistributedConfig
from trainer.distributed.context import ContextGroup
from trainer.distributed.dims import ParallelDims, dims_problem
from trainer.errors import ConfigError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    dims: ParallelDims | None = None
    """The data x context x tensor layout and its named groups (trainer/distributed/dims.py); always set by
    init_distributed (None only for an info built by hand: the 1 x 1 x 1 world of `rank` alone)."""
    context: ContextGroup | None = None
    """This rank's context-parallel group (distributed.context_parallel > 1), else None."""

    def __post_init__(self) -> None:
        if self.dims is None:
            object.__setattr__(self, "dims", ParallelDims(self.world_size, self.rank))

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def context_size(self) -> int:
        return self.dims.context

    @property
    def tensor_size(self) -> int:
        return self.dims.tensor

    @property
    def data_rank(self) -> int:
        """Which data stream this rank reads: the ranks of one context and tensor group read the same one."""
        return self.dims.data_rank

    @property
    def data_world(self) -> int:
        """Data streams (data-parallel ranks): world size / (context x tensor)."""
        return self.dims.data

    @property
    def data_group(self) -> dist.ProcessGroup | None:
        """The ranks reading different data, one per data rank: where counts of rows are summed."""
        return self.dims.group("data")

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        """data x context: where sums of the model's per-position outputs (the loss) are taken."""
        return self.dims.group("loss")

    @property
    def mesh(self) -> DeviceMesh | None:
        """The world's ("data", "context", "tensor") DeviceMesh (None without a process group)."""
        return self.dims.mesh


def init_distributed(cfg: DistributedConfig) -> DistInfo:
    """Join the process group torchrun / the deepspeed launcher describe in the environment (if any), and lay
    the world out as data x context x tensor (`ParallelDims`: a DeviceMesh with named groups, always built).

    A plain `python -m trainer.train` has no WORLD_SIZE and runs as rank 0 of 1 without a group, except
    under DeepSpeed and FSDP2, which want one even then: a group of one over an in-memory store.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = _pick_device(cfg.device, local_rank)
    if (problem := dims_problem(world_size, cfg.context_parallel, cfg.tensor_parallel)) is not None:
        raise ConfigError(problem)
    if world_size > 1 and not dist.is_initialized():
        backend = cfg.backend if cfg.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        timeout = datetime.timedelta(minutes=10)
        if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # launched by torchrun
            store = _attempt_store(rank, world_size, timeout)
            dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size,
                                    timeout=timeout)
        else:
            dist.init_process_group(backend=backend, timeout=timeout)
    elif cfg.engine in ("deepspeed", "fsdp2") and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        os.environ.setdefault("LOCAL_RANK", str(local_rank))
    dims = ParallelDims.build(world_size, rank, device.type, cfg.context_parallel, cfg.tensor_parallel)
    context = None
    if cfg.context_parallel > 1:
        context = ContextGroup(dims.group("context"), cfg.context_parallel, dims.context_rank,
                               cfg.context_parallel_strategy, cfg.context_parallel_split)
    return DistInfo(rank=rank, world_size=world_size, local_rank=local_rank, device=device, dims=dims,
                    context=context)


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


def local_device(choice: str) -> torch.device:
    """distributed.device for this process (LOCAL_RANK's GPU under a launcher), without joining any group."""
    return _pick_device(choice, int(os.environ.get("LOCAL_RANK", "0")))


def _pick_device(choice: str, local_rank: int) -> torch.device:
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("distributed.device=cuda but no CUDA device is visible: "
                              "use distributed.device=auto or cpu")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    if choice != "cpu":
        raise ConfigError(f"distributed.device must be auto, cpu or cuda, got {choice!r}")
    return torch.device("cpu")


def dist_sum(values: list[float], device: torch.device,
             group: dist.ProcessGroup | None = None) -> list[float]:
    """Sum a few numbers over all ranks (or `group`'s) in one all-reduce (float64, so token counts stay
    exact)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.tolist()


def dist_max(value: float, device: torch.device, group: dist.ProcessGroup | None = None) -> float:
    """The largest `value` over all ranks (or `group`'s), as `dist_sum` sums."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_objects(obj, group: dist.ProcessGroup | None = None) -> list:
    """Every rank's `obj` of `group` (the world: None), in the group's rank order; [obj] without a process
    group."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank `src`'s value of a picklable object, on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
