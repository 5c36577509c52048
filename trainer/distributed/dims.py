"""The parallel dimensions of a run: data x context x tensor ranks, and the named groups every collective
uses.

Always built, plain DDP included (its 1 x 1 case). The world is laid out tensor-innermost (torchtitan's order:
the ranks of a tensor-parallel group are neighbours, on one node, where their per-layer collectives are
cheapest):

    rank = (data_rank * context + context_rank) * tensor + tensor_rank

Example, 8 ranks as data 2 x context 2 x tensor 2: rank 5 is data rank 1, context rank 0, tensor rank 1; its
tensor group is ranks {4, 5}, its context group {5, 7}, its data group {1, 5}.

Which group a question is asked over:

    data     ranks that read different data, one per data rank (and this rank's context and tensor rank): the
             counts of the rows (targets, tokens, documents, micro-batches) are summed here, each row once
    loss     data x context: the ranks holding different positions of the rows; the sums of what the model
             computes per position (the loss) and the gradient all-reduce of replicated weights run over it
    fsdp     the group FSDP2 shards parameters over: the same ranks as `loss` (torchtitan's dp_shard_cp;
             FSDP2 takes the flattened `loss_mesh`)
    context  the ranks sharing each row (trainer/distributed/context.py)
    tensor   the ranks sharing each layer's weights (trainer/distributed/tensor.py)

A group is None when no process group exists (one process without a launcher): the collectives then return
their inputs (trainer.distributed.groups.dist_sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

DIMS = ("data", "context", "tensor")
GROUPS = ("data", "loss", "fsdp", "context", "tensor")


def stream_ranks(world_size: int, context: int = 1, tensor: int = 1) -> list[int]:
    """The first rank of each data rank of a world_size = data x context x tensor world, in data-rank order:
    the ranks whose checkpointed state holds each data stream (the context and tensor ranks of a data rank
    read the same rows). Example: 8 ranks as context 2 x tensor 2 -> [0, 4]."""
    inner = context * tensor
    return [data_rank * inner for data_rank in range(world_size // inner)]


def dims_problem(world_size: int, context: int = 1, tensor: int = 1) -> str | None:
    """Why `context` x `tensor` ranks per data rank cannot tile `world_size` ranks, or None."""
    inner = context * tensor
    if world_size % inner == 0:
        return None
    named = [f"distributed.{k}={v}" for k, v in (("context_parallel", context), ("tensor_parallel", tensor))
             if v > 1]
    what = named[0] if len(named) == 1 else f"{' x '.join(named)} = {inner} ranks per data rank"
    return (f"{what} must divide the number of ranks ({world_size}): launch a multiple of {inner} "
            f"processes, or choose a divisor of {world_size}")


@dataclass(frozen=True)
class ParallelDims:
    """This rank's place in the data x context x tensor world, and its groups by name."""

    world_size: int
    rank: int
    context: int = 1
    tensor: int = 1
    mesh: DeviceMesh | None = None
    """The world as a ("data", "context", "tensor") DeviceMesh, with "loss" (data x context) flattened on it;
    None without a process group."""
    groups: dict = field(default_factory=dict)
    """Group name -> torch ProcessGroup (every name of GROUPS when a mesh exists, else empty)."""
    loss_mesh: DeviceMesh | None = None
    """The loss (= fsdp) group as a 1-D DeviceMesh: data x context flattened, what FSDP2 shards over."""
    world_mesh: DeviceMesh | None = None
    """Every rank as a 1-D DeviceMesh, in rank order (FSDP2 x TP checkpoints split whole tensors over it)."""

    def __post_init__(self) -> None:
        if (problem := dims_problem(self.world_size, self.context, self.tensor)) is not None:
            raise ValueError(problem)

    @property
    def data(self) -> int:
        """Data-parallel ranks (streams of rows): world / (context x tensor)."""
        return self.world_size // (self.context * self.tensor)

    @property
    def data_rank(self) -> int:
        return self.rank // (self.context * self.tensor)

    @property
    def context_rank(self) -> int:
        return self.rank // self.tensor % self.context

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor

    @property
    def loss_rank(self) -> int:
        """This rank's place in its loss group (data x context)."""
        return self.rank // self.tensor

    @property
    def loss_size(self) -> int:
        """Ranks of the loss group: data x context."""
        return self.data * self.context

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The named group holding this rank (GROUPS); None without a process group."""
        if name not in GROUPS:
            raise KeyError(f"no parallel group {name!r}: the groups are {GROUPS}")
        return self.groups.get(name)

    @classmethod
    def build(cls, world_size: int, rank: int, device_type: str, context: int = 1,
              tensor: int = 1) -> ParallelDims:
        """The dims of an initialized world (its DeviceMesh and groups), or of one process without a group."""
        if (problem := dims_problem(world_size, context, tensor)) is not None:
            raise ValueError(problem)
        if not dist.is_initialized():
            return cls(world_size, rank, context, tensor)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device_type, (world_size // (context * tensor), context, tensor),
                                mesh_dim_names=DIMS)
        loss = mesh["data", "context"]._flatten("loss")  # torchtitan flattens its dp_shard_cp the same way
        world = mesh["data", "context", "tensor"]._flatten("world")
        groups = {name: mesh.get_group(name) for name in DIMS}
        groups["loss"] = groups["fsdp"] = loss.get_group()
        return cls(world_size, rank, context, tensor, mesh, groups, loss, world)
