"""Tensor parallelism with sequence parallelism (Megatron-LM's layout), applied to a built model in place.

The N ranks of a tensor group (trainer/distributed/dims.py) share every layer's weights; rank t holds

    attn.c_attn   column-parallel: the q rows of heads [t H/N, (t+1) H/N) and the k and v rows of kv heads
                  [t KV/N, (t+1) KV/N): each part of the fused q | k | v projection is split, never the whole
    attn.c_proj   row-parallel: the input columns of its heads; the partial outputs are reduce-scattered
    mlp.c_fc      column-parallel (under SwiGLU gate and up are each split)
    mlp.c_proj    row-parallel
    wte, lm_head  vocab-parallel: rows [t Vp/N, (t+1) Vp/N) of the vocabulary padded to Vp, a multiple of N
                  (a tied head is the same Parameter again); the padding rows are zero and never exported
    the norms, wpe, the row-parallel biases: whole

Sequence parallelism: outside the split layers the residual stream (B, L, C) is split by position, each rank
holding L/N positions of every row (rows padded at their end to a multiple of N, `_pad`), so the norms,
residual adds and dropouts run on 1/N of the positions. A column-parallel layer all-gathers its input
(backward: the gradients reduce-scattered), a row-parallel one reduce-scatters its output (backward:
all-gathered). Attention sees every position of its own heads: cu_seqlens, positions and documents are the
rows' own, so packing needs no rule here.

The loss is computed on the vocabulary shards (`VocabShard.cross_entropy`, Megatron's vocab-parallel cross
entropy): the max, the sum of exponentials and the target's logit are all-reduced over the group, the logits
stay (B * L, Vp/N) on each rank, and the padded columns are -inf (never a target, nothing in the softmax).
Every rank of the group gets the same token losses, so the step's sums over the loss group count each once.
Under loss.chunk_tokens the chunked head (trainer.model.loss) makes each chunk's logit shards and joins them
with `VocabShard.chunk_stats`, the same sums without autograd.

Gradients: a split weight's gradient is its own rows'. A whole weight used on this rank's positions only (the
norms, the row-parallel biases) holds a partial gradient, summed over the group (`reduce_partial_grads`)
before the norm; the norm sums the split weights' squares over the group and counts the whole ones once.

Which modules split how is the model's declaration (trainer.model.gpt `tensor_plan`: column, row and
vocabulary modules, the head counts divided, where sequence parallelism starts and ends); this module applies
it and names no module of the model.

Checkpoints hold whole tensors (`full_state` gathers, `shard_state` slices, by each parameter's `Layout`): a
run saved at N = 2 resumes at N = 1 or 4, and model.safetensors is the single-rank model's. Every engine holds
a layout adapter and calls it unconditionally: `Unsplit` (no tensor parallelism: every method the identity,
clipping torch's own) or `TensorParallel`, so no engine, the store, the loss or the loop branches on tensor
parallelism (tests/test_architecture.py counts). Under FSDP2 (applied after the split,
trainer/distributed/fsdp.py) each gradient is a DTensor: the partial sums and the norm use its local rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trainer.data.batch import IGNORE_INDEX
from trainer.distributed.collectives import all_gather_along, reduce_scatter_along
from trainer.model.gpt import tensor_plan


def tensor_parallel_problems(model_cfg, size: int) -> list[str]:
    """Why the model (a GPTConfig) or the run cannot be split over `size` tensor ranks, one line each."""
    problems = []
    kv = model_cfg.n_kv_head or model_cfg.n_head
    hidden = model_cfg.mlp_hidden or 4 * model_cfg.n_embd
    shapes = [(f"model.n_head ({model_cfg.n_head})", model_cfg.n_head),
              (f"the key/value heads (model.n_kv_head: {kv})", kv),
              (f"the MLP width (model.mlp_hidden: {hidden})", hidden)]
    for what, n in shapes[:1] + shapes[1 + (kv == model_cfg.n_head):]:
        if n % size:
            problems.append(f"distributed.tensor_parallel={size} gives each rank whole heads and MLP "
                            f"columns: {what} must be a multiple of {size}")
    return problems


# ---------------------------------------------------------------------------------------------------
# Collectives with their backward (the tensor group)
# ---------------------------------------------------------------------------------------------------


def _pad(x_BLC: torch.Tensor, size: int) -> torch.Tensor:
    """Rows padded at their end to a multiple of `size` positions."""
    return F.pad(x_BLC, (0, 0, 0, -x_BLC.shape[1] % size))


class _AllReduce(torch.autograd.Function):
    """Forward: sum over the group. Backward: the gradient as it is (every rank's input got the same)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ToSequenceShard(torch.autograd.Function):
    """(B, L, C) whole on every rank -> this rank's (B, Lp/N, C). Backward: the shards' gradients
    all-gathered."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.length = group, x.shape[1]
        size = dist.get_world_size(group)
        return _pad(x, size).chunk(size, dim=1)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, 1, ctx.group)[:, :ctx.length], None


class _GatherSequence(torch.autograd.Function):
    """(B, Lp/N, C) shards -> (B, L, C) whole on every rank. Backward: the gradients summed over the group and
    cut to this rank's positions (each rank's use of the whole input contributes)."""

    @staticmethod
    def forward(ctx, x, group, length: int):
        ctx.group = group
        return all_gather_along(x, 1, group)[:, :length]

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_along(_pad(grad, dist.get_world_size(ctx.group)), 1, ctx.group), None, None


class _ReduceToSequenceShard(torch.autograd.Function):
    """(B, L, C) partial sums on every rank -> their sum, this rank's (B, Lp/N, C). Backward: all-gathered."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.length = group, x.shape[1]
        return reduce_scatter_along(_pad(x, dist.get_world_size(group)), 1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_along(grad, 1, ctx.group)[:, :ctx.length], None


class SequenceShards:
    """The sequence-parallel state one forward shares between the model's split layers: the group, and the
    length L of the rows being split (set where the residual stream is cut, read where it is joined)."""

    def __init__(self, group) -> None:
        self.group = group
        self.length = 0

    def split(self, x_BLC: torch.Tensor) -> torch.Tensor:
        self.length = x_BLC.shape[1]
        return _ToSequenceShard.apply(x_BLC, self.group)

    def gather(self, x_BlC: torch.Tensor) -> torch.Tensor:
        return _GatherSequence.apply(x_BlC, self.group, self.length)

    def reduce_split(self, x_BLC: torch.Tensor) -> torch.Tensor:
        return _ReduceToSequenceShard.apply(x_BLC, self.group)


# ---------------------------------------------------------------------------------------------------
# Split layers (the parameter names stay `weight` and `bias`: checkpoints keep their keys)
# ---------------------------------------------------------------------------------------------------


class _SplitLinear(nn.Module):
    """A Linear holding this rank's slice of the weight (and its bias), and the forward's sequence state."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, seq: SequenceShards) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.bias = None if bias is None else nn.Parameter(bias)
        self.seq = seq


class ColumnParallelLinear(_SplitLinear):
    """This rank's output rows of a Linear; the input's positions gathered first."""

    def forward(self, x_BlC: torch.Tensor) -> torch.Tensor:
        return F.linear(self.seq.gather(x_BlC), self.weight, self.bias)


class RowParallelLinear(_SplitLinear):
    """This rank's input columns of a Linear; the partial outputs summed and split by position, then the
    (whole) bias added once."""

    def forward(self, x_BLh: torch.Tensor) -> torch.Tensor:
        y = self.seq.reduce_split(F.linear(x_BLh, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the padded vocabulary; ids outside them look up zeros, summed over the
    group."""

    def __init__(self, weight: torch.Tensor, start: int, group) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(mine, local, 0), self.weight) * mine[..., None].to(self.weight.dtype)
        return _AllReduce.apply(x, self.group)


def softmax_stats(logits_Nv: torch.Tensor, targets_N: torch.Tensor, start: int, vocab_size: int,
                  group) -> tuple[torch.Tensor, ...]:
    """Collective, no autograd: fp32 (N, Vp/N) logit shards of the columns from `start`, and (N,) global
    targets (-100: ignored) -> (the shards with the padding columns (>= vocab_size) -inf; the logsumexp over
    the whole vocabulary (N,); the target's logit (N,), 0 where ignored), the max, the sum of exponentials and
    the target's logit all-reduced over the group. Every rank of the group gets the same two vectors."""
    cols = start + torch.arange(logits_Nv.shape[1], device=logits_Nv.device)
    # the padding: no probability, never a target
    x = logits_Nv.masked_fill(cols >= vocab_size, float("-inf"))
    m = x.max(dim=1).values
    dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    local = targets_N - start
    mine = (targets_N != IGNORE_INDEX) & (local >= 0) & (local < x.shape[1])
    picked = torch.where(mine, x.gather(1, torch.where(mine, local, 0)[:, None]).squeeze(1), 0.0)
    both = torch.stack([(x - m[:, None]).exp().sum(dim=1), picked])
    dist.all_reduce(both, group=group)
    return x, m + both[0].log(), both[1]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """(N,) fp32 cross entropy of (N, Vp/N) logit shards against (N,) global targets (-100: ignored, 0)."""

    @staticmethod
    def forward(ctx, logits_Nv, targets_N, start: int, vocab_size: int, group):
        x, lse, target = softmax_stats(logits_Nv.float(), targets_N, start, vocab_size, group)
        valid = targets_N != IGNORE_INDEX
        local = targets_N - start
        mine = valid & (local >= 0) & (local < x.shape[1])
        ctx.save_for_backward(x.sub_(lse[:, None]).exp_(),  # softmax
                              mine, torch.where(mine, local, 0), valid)
        ctx.dtype = logits_Nv.dtype
        return torch.where(valid, lse - target, 0.0)

    @staticmethod
    def backward(ctx, grad_N):
        softmax, mine, local, valid = ctx.saved_tensors
        grad = softmax.clone()
        grad[mine.nonzero().squeeze(1), local[mine]] -= 1.0
        grad.mul_((grad_N * valid)[:, None])
        return grad.to(ctx.dtype), None, None, None, None


@dataclass
class VocabShard:
    """This rank's columns [start, start + n) of the logits over a vocabulary of `vocab_size` ids (the model's
    `vocab`: trainer.model.loss computes the token losses with it, as with its WholeVocab)."""

    group: object
    start: int
    vocab_size: int

    def cross_entropy(self, logits_Nv: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        return _VocabParallelCrossEntropy.apply(logits_Nv, targets_N, self.start, self.vocab_size, self.group)

    def chunk_stats(self, logits_nv: torch.Tensor, targets_n: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`softmax_stats` of these columns (for a loss that computes its own gradient: trainer.model.loss's
        chunked head)."""
        return softmax_stats(logits_nv, targets_n, self.start, self.vocab_size, self.group)

    def returned(self, logits_BLv: torch.Tensor, asked: bool | None) -> torch.Tensor | None:
        """The logits a forward returns: only when asked for (True), then the whole (B, L, V) on every rank,
        gathered (the loss never needs them)."""
        return _GatherVocab.apply(logits_BLv, self.group)[..., :self.vocab_size] if asked else None


class _GatherVocab(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_along(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None


# ---------------------------------------------------------------------------------------------------
# Layouts: which rows or columns of each whole tensor a rank holds
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """How a whole tensor is split: along `dim`, each of `parts` (consecutive sizes along it, summing to the
    whole, after padding to `padded`) cut into N equal slices; rank t holds slice t of every part, in order.
    Example: c_attn of 4 heads, 2 kv heads, head_dim 8 at N = 2: dim 0, parts (32, 16, 16): rank 0 holds rows
    0-15 (q heads 0, 1), 32-39 (k head 0), 48-55 (v head 0)."""

    dim: int
    parts: tuple[int, ...]
    padded: int | None = None
    """The length along `dim` after padding (the vocabulary padded to a multiple of N); None: no padding."""

    def shard(self, full: torch.Tensor, size: int, rank: int) -> torch.Tensor:
        if self.padded is not None and self.padded > full.shape[self.dim]:
            pad = [0, 0] * (full.dim() - 1 - self.dim) + [0, self.padded - full.shape[self.dim]]
            full = F.pad(full, pad)
        pieces = [part.chunk(size, dim=self.dim)[rank] for part in full.split(list(self.parts), dim=self.dim)]
        return torch.cat(pieces, dim=self.dim).contiguous()

    def join(self, shards: list[torch.Tensor], whole: int) -> torch.Tensor:
        """The whole tensor (`whole` long along dim, the padding dropped) from every rank's shard, in rank
        order: each rank's slice of each part copied once into place."""
        size = len(shards)
        shape = list(shards[0].shape)
        shape[self.dim] = whole
        out = shards[0].new_empty(shape)
        at = mine = 0  # where the next slice goes in the whole tensor, where it starts in a shard
        for part in self.parts:
            n = part // size
            for shard in shards:
                take = min(n, whole - at)  # the padding, at the end, dropped
                if take > 0:
                    out.narrow(self.dim, at, take).copy_(shard.narrow(self.dim, mine, take))
                at += take
            mine += n
        return out


def padded_vocab(vocab_size: int, size: int) -> int:
    """The vocabulary rounded up to a multiple of `size`. Example: padded_vocab(61, 2) -> 62."""
    return math.ceil(vocab_size / size) * size


def layouts(model_cfg, size: int) -> dict[str, Layout]:
    """Parameter name -> its Layout, for every split parameter of a GPT of `model_cfg` (a GPTConfig) over
    `size` tensor ranks, from the model's own plan (trainer.model.gpt.tensor_plan); the parameters not named
    are whole on every rank."""
    plan = tensor_plan(model_cfg)
    vp = padded_vocab(model_cfg.vocab_size, size)
    out = {f"{module}.weight": Layout(0, (vp,), vp) for module in plan.vocab}
    for module, parts in plan.column.items():
        out[f"{module}.weight"] = out[f"{module}.bias"] = Layout(0, parts)
    for module, parts in plan.row.items():
        out[f"{module}.weight"] = Layout(1, parts)
    return out


# ---------------------------------------------------------------------------------------------------
# Applying it
# ---------------------------------------------------------------------------------------------------


class Unsplit:
    """The tensor layout of a model that is not split (distributed.tensor_parallel=1): what every engine asks
    of a layout, each the identity or torch's own. Engines hold one layout (this, or `TensorParallel`) and
    call it without asking which: no engine, checkpoint or loss code branches on tensor parallelism."""

    size, rank = 1, 0
    gathers = False
    """Whether the whole model exists on no rank, so that writing it (model.safetensors) gathers every
    tensor."""

    def is_split(self, name: str) -> bool:
        return False

    def shard(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part of the whole tensor named `name`."""
        return whole

    def shard_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Whole tensors (a model state dict) -> this rank's, by name."""
        return {k: self.shard(k, v) for k, v in state.items()}

    def full_state(self, state: dict[str, torch.Tensor], everywhere: bool = True) -> dict[str, torch.Tensor]:
        """This rank's tensors (a model state dict) -> the whole ones (`TensorParallel.full_state`)."""
        return state

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer, everywhere: bool = True) -> dict:
        """optimizer.state_dict() as one rank's optimizer would hold it
        (`TensorParallel.full_optimizer_state`)."""
        return optimizer.state_dict()

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        """A whole optimizer state -> this rank's."""
        return state

    def clip_gradients(self, named: list[tuple[str, nn.Parameter]], max_norm: float, shards=None) -> float:
        """The whole model's gradient norm before clipping; clips to `max_norm` in place (inf: never). FSDP2's
        gradients are DTensors: their norm is reduced over their own mesh (`shards` is for
        `TensorParallel`)."""
        from torch.distributed.tensor import DTensor

        params = [p for _, p in named if p.grad is not None]
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if isinstance(norm, DTensor):  # a partial sum of squares per rank: reduced here
            norm = norm.full_tensor()
        if math.isfinite(max_norm):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return float(norm)

    def saved_dcp_state(self, model: dict, optimizer: dict) -> tuple[dict, dict]:
        """Collective: FSDP2's model and optimizer state dicts (DCP's helpers') as a checkpoint holds them."""
        return model, optimizer

    def dcp_load_targets(self, model: dict, optimizer: dict):
        """What DCP reads a checkpoint into (laid out as `saved_dcp_state` writes it), and the collective
        function that turns what was read back into the layout of `model` and `optimizer`."""
        return model, optimizer, lambda read_model, read_optimizer: (read_model, read_optimizer)


class TensorParallel(Unsplit):
    """A model split over a tensor group (see the module docstring); built by `apply_tensor_parallel`."""

    gathers = True

    def __init__(self, model: nn.Module, group, size: int, rank: int, world_mesh=None) -> None:
        self.model, self.group, self.size, self.rank = model, group, size, rank
        self.world_mesh = world_mesh
        """Every rank, in order: under FSDP2 a checkpoint holds each whole tensor's rows split over it."""
        self.layouts = layouts(model.cfg, size)
        self.partial: list[str] = []
        """The names of the whole parameters used on this rank's positions only: their gradients are summed
        over the group. Names, not Parameters: FSDP2 replaces every Parameter after the split."""

    def is_split(self, name: str) -> bool:
        return name in self.layouts

    def shard(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        return self.layouts[name].shard(whole, self.size, self.rank) if name in self.layouts else whole

    def full_state(self, state: dict[str, torch.Tensor], everywhere: bool = True) -> dict[str, torch.Tensor]:
        """Collective over the group: this rank's tensors (a model state dict) -> the whole ones, by name, on
        every rank of the group; `everywhere=False`: on its first rank alone (gathered there, one whole tensor
        at a time), the others get {} (a checkpoint's writer is one rank: the others never hold the whole
        model)."""
        out = {}
        first = dist.get_global_rank(self.group, 0)
        for k, v in state.items():
            if k in self.layouts:
                v = v.detach().contiguous()
                if everywhere:
                    parts = [torch.empty_like(v) for _ in range(self.size)]
                    dist.all_gather(parts, v, group=self.group)
                else:
                    parts = [torch.empty_like(v) for _ in range(self.size)] if self.rank == 0 else None
                    dist.gather(v, parts, dst=first, group=self.group)
                whole = self.model.whole_shapes[k][self.layouts[k].dim]  # the unsplit model's length along it
                v = self.layouts[k].join(parts, whole) if parts is not None else None
            if everywhere or self.rank == 0:
                out[k] = v
        return out

    def full_optimizer_state(self, optimizer: torch.optim.Optimizer, everywhere: bool = True) -> dict:
        """Collective over the group: optimizer.state_dict() with every split parameter's state tensors
        (Adam's moments, shaped like it) whole, as one rank's optimizer would hold them (`everywhere=False`:
        on the group's first rank alone, {} on the others, as `full_state`)."""
        state = optimizer.state_dict()
        names = _optimizer_names(optimizer, self.model)
        out = {}
        for index, entry in state["state"].items():
            name = names[index]
            out[index] = {k: self.full_state({name: v}, everywhere).get(name) if self._moment(v, name) else v
                          for k, v in entry.items()}
        return {**state, "state": out} if everywhere or self.rank == 0 else {}

    def shard_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> dict:
        """A whole optimizer state (as `full_optimizer_state` or one rank's optimizer wrote it) -> this
        rank's."""
        names = _optimizer_names(optimizer, self.model)
        out = {}
        for index, entry in state["state"].items():
            name = names[int(index)]
            out[index] = {k: self.shard(name, v) if self._moment(v, name) else v for k, v in entry.items()}
        return {**state, "state": out}

    def _moment(self, value, name: str) -> bool:
        """Whether an optimizer state entry is a per-element tensor of a split parameter (not a step
        count)."""
        return isinstance(value, torch.Tensor) and value.dim() > 0 and self.is_split(name)

    def reduce_partial_grads(self) -> None:
        """Sum the partial gradients of the whole parameters over the group (once per step, before the norm).
        Under FSDP2 each rank's gradient is a DTensor: its local shard is summed (the ranks of a tensor group
        hold the same rows of it)."""
        params = dict(self.model.named_parameters())
        grads = [_local(params[name].grad) for name in self.partial if params[name].grad is not None]
        if grads:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=self.group)
            with torch.no_grad():
                for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
                    g.copy_(part.view_as(g))

    def clip_gradients(self, named: list[tuple[str, nn.Parameter]], max_norm: float, shards=None) -> float:
        """The partial gradients summed (`reduce_partial_grads`), then torch.nn.utils.clip_grad_norm_ of the
        whole model's gradients: the split ones' squares summed over the group, the whole ones (already
        summed, the same on every rank) counted once. `shards`: the group whose ranks hold different rows of
        every gradient (FSDP2's), over which both sums are summed first."""
        self.reduce_partial_grads()
        sq = torch.zeros(2, dtype=torch.float64)  # split, whole
        for name, p in named:
            if p.grad is not None:
                sq[0 if self.is_split(name) else 1] += _local(p.grad).detach().double().pow(2).sum().cpu()
        device = next(self.model.parameters()).device
        sq = sq.to(device)
        if shards is not None:
            dist.all_reduce(sq, group=shards)
        split_sq = sq[:1].clone()
        dist.all_reduce(split_sq, group=self.group)
        total = float((split_sq + sq[1:]).sqrt().cpu())
        coef = max_norm / (total + 1e-6)
        if coef < 1.0:
            for _, p in named:
                if p.grad is not None:
                    p.grad.detach().mul_(coef)
        return total

    # Under FSDP2 (trainer/distributed/fsdp.py) what the ranks of a tensor group hold under one name differs,
    # and a checkpoint must load on any tensor size: DCP writes each whole tensor, its rows split over every
    # rank of the world mesh, one whole tensor held at a time.

    def saved_dcp_state(self, model: dict, optimizer: dict) -> tuple[dict, dict]:
        model, optimizer = _copied(model, optimizer)
        for entries, key, name in _dtensors(model, optimizer):
            entries[key] = self._to_whole(name, entries[key])
        return model, optimizer

    def dcp_load_targets(self, model: dict, optimizer: dict):
        live = list(_dtensors(model, optimizer))
        model, optimizer = _copied(model, optimizer)
        for entries, key, name in _dtensors(model, optimizer):
            entries[key] = self._empty_whole(name, entries[key])

        def back(read_model: dict, read_optimizer: dict) -> tuple[dict, dict]:
            for (entries, key, name), (was, was_key, _) in zip(_dtensors(read_model, read_optimizer), live,
                                                                strict=True):
                entries[key] = self._from_whole(name, entries[key], was[was_key])
            return read_model, read_optimizer

        return model, optimizer, back

    def _to_whole(self, name: str, shard):
        """Collective: this rank's FSDP2 shard of its tensor-parallel shard -> the whole tensor's rows for
        this rank of the world mesh."""
        from torch.distributed.tensor import distribute_tensor

        whole = shard.full_tensor()  # the tensor-parallel shard, whole over the fsdp group
        if self.is_split(name):
            whole = self.full_state({name: whole})[name]
        return _owned(distribute_tensor(whole, self.world_mesh, _rows(), src_data_rank=None))

    def _from_whole(self, name: str, rows, like):
        """Collective: the inverse of `_to_whole`, placed as `like` (the live FSDP2 DTensor) is."""
        from torch.distributed.tensor import distribute_tensor

        whole = self.shard(name, rows.full_tensor())
        return _owned(distribute_tensor(whole, like.device_mesh, like.placements, src_data_rank=None))

    def _empty_whole(self, name: str, shard):
        """An empty DTensor laid out as `_to_whole` writes the tensor `shard` is a part of (DCP reads into
        it)."""
        import torch.distributed.tensor as dt

        shape = self.model.whole_shapes[name] if self.is_split(name) else shard.shape
        return dt.empty(shape, dtype=shard.dtype, device_mesh=self.world_mesh, placements=_rows())


def _rows() -> list:
    from torch.distributed.tensor import Shard

    return [Shard(0)]  # rows split over every rank, in rank order


def _copied(model: dict, optimizer: dict) -> tuple[dict, dict]:
    """Shallow copies of a model and an optimizer state dict (as get_state_dict gives them), to replace
    entries of without touching the optimizer's own."""
    return dict(model), {**optimizer,
                         "state": {fqn: dict(entry) for fqn, entry in optimizer["state"].items()}}


def _dtensors(model: dict, optimizer: dict):
    """(dict, key, parameter name) of every DTensor in a model and an optimizer state dict, in one order."""
    from torch.distributed.tensor import DTensor

    for name, v in model.items():
        if isinstance(v, DTensor):
            yield model, name, name
    for name, entry in optimizer["state"].items():
        for key, v in entry.items():
            if isinstance(v, DTensor):
                yield entry, key, name


def _owned(t):
    """A DTensor whose local part owns its storage (not a view keeping a whole tensor alive)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(t.to_local().clone(), t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (a view of its storage); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def apply_tensor_parallel(model: nn.Module, group, size: int, rank: int, world_mesh=None) -> TensorParallel:
    """Split a built GPT (trainer.model.gpt) over the tensor group in place, as its `tensor_plan` says: every
    rank holds the same whole weights (the same seed, or the same checkpoint) and keeps its shards. Parameter
    names are unchanged; the Parameters are new (an optimizer built before must take them:
    trainer.distributed.engine.
    parallelize). `world_mesh`: every rank, for FSDP2's checkpoints of the split model."""
    cfg = model.cfg
    if problems := tensor_parallel_problems(cfg, size):
        raise ValueError(problems[0])
    plan = tensor_plan(cfg)
    tp = TensorParallel(model, group, size, rank, world_mesh)
    local = tp.shard_state({k: v.detach() for k, v in model.state_dict().items()})
    seq = SequenceShards(group)
    for name, style in [*((n, ColumnParallelLinear) for n in plan.column),
                        *((n, RowParallelLinear) for n in plan.row)]:
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).set_submodule(child, style(local[f"{name}.weight"],
                                                               local.get(f"{name}.bias"), seq))
    for name, attributes in plan.counts.items():
        module = model.get_submodule(name)
        for attribute in attributes:
            setattr(module, attribute, getattr(module, attribute) // size)
    embedding, head = plan.vocab
    tied = model.get_submodule(head).weight is model.get_submodule(embedding).weight
    shard_rows = padded_vocab(cfg.vocab_size, size) // size
    model.set_submodule(embedding,
                        VocabParallelEmbedding(local[f"{embedding}.weight"], rank * shard_rows, group))
    new_embedding = model.get_submodule(embedding).weight
    model.get_submodule(head).weight = new_embedding if tied else nn.Parameter(local[f"{head}.weight"])
    model.vocab = VocabShard(group, rank * shard_rows, cfg.vocab_size)
    split, whole = plan.positions
    model.get_submodule(split).register_forward_hook(lambda _m, _i, out: seq.split(out))  # split by position
    model.get_submodule(whole).register_forward_hook(lambda _m, _i, out: seq.gather(out))  # and whole again
    inside = [name for name, _ in model.named_modules() if _between(model, name, split, whole)]
    tp.partial = [name for name in model.whole_shapes if name not in tp.layouts
                  and any(name.startswith(module + ".") for module in inside)]
    return tp


def _between(model: nn.Module, name: str, split: str, whole: str) -> bool:
    """Whether top-level module `name` runs after `split` and up to `whole`, in the model's order of children
    (the modules that see 1/N of the positions)."""
    order = [n for n, _ in model.named_children()]
    return name in order and order.index(split) < order.index(name) <= order.index(whole)


def _optimizer_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """The parameter name of each index of optimizer.state_dict()["state"] (its parameters in group order)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
