"""Tensor collectives along a dimension, the one place their backend differences are handled: context
parallelism (trainer/distributed/context.py) and tensor parallelism (trainer/distributed/tensor.py) build
their differentiable gathers and reduce-scatters on these."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Every rank's `x` of `group`, concatenated along `dim` in rank order (one all_gather_into_tensor)."""
    size = dist.get_world_size(group)
    x = x.movedim(dim, 0).contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, x, group=group)
    return out.movedim(0, dim)


def reduce_scatter_along(x: torch.Tensor, dim: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """The sum of `x` over `group`, this rank's 1/N of it along `dim`: NCCL's reduce-scatter where the backend
    has one, else an all-reduce and a slice (gloo has no reduce-scatter). torch 2.13 renamed the tensor
    collectives (*_single); older versions (pyproject accepts them) have the old names."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if dist.get_backend(group) == "nccl":
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
        (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, x, group=group)
        return out.movedim(0, dim)
    summed = x.contiguous().clone()
    dist.all_reduce(summed, group=group)
    return summed.chunk(size, dim=dim)[rank].contiguous()
