"""Context parallelism: one packed row split over the N ranks of a context-parallel group, documents still
exact.

Every rank of the group holds the same rows (the data ranks are the groups, not the ranks) and 1/N of each
row's positions, dealt by attention cost (`row_positions`): `balanced` cuts a row into 8N chunks and deals
them by the work of their queries (which depends on where they sit inside their documents), `zigzag` gives
rank r chunks r and 2N - 1 - r of 2N (even for one long document: rank 0 of 2 holds [0 1 6 7] of a row of 8,
rank 1 [2 3 4 5]).

Everything a position needs that depends on its neighbours is computed on the whole row first and then cut:
positions (reset per document), targets (labels shifted left on the whole row, so the target of a chunk's last
position is the first label of the next chunk, and -100 at each document start holds wherever the chunk
lands), loss weights and groups. The model then scores each local position against its own pre-shifted target
(`targets`). Attention is the only layer that sees other positions, and does so in one of two ways:

    allgather  K and V all-gathered over the group (differentiable: the backward reduce-scatters their
               gradients to their owners); each local query attends to the keys of its own document up to
               itself. A run of local queries inside one document is one (query piece, key piece) pair:
               queries [a, b) of a document starting at s attend to keys [s, b), causally aligned at the
               bottom right (query i sees keys up to s + (a - s) + i). flash-attn takes the pieces as
               cu_seqlens_q != cu_seqlens_k; on CPU SDPA runs once per piece with that mask. Any number of
               heads.
    ulysses    all-to-all turns (local positions, all H heads) into (the whole row, H / N heads); the document
               kernel of trainer.model.attention runs on whole rows with the row's own cu_seqlens, and an
               all-to-all turns the result back. Needs H % N == 0; any attention backend.

torch's `torch.distributed.tensor.experimental.context_parallel` (ring attention over SDPA / Flex) is not
used: it shards plain causal attention (its SDPA path takes no document mask, `is_causal` only), so packed
documents would attend across their boundaries; its load balancer is the same zigzag as here.

The gradients of a rank's parameters are then its share of the full gradient: summed over the group (the data
parallel all-reduce runs over data x context ranks) they are the CP = 1 gradient, given that each target is
counted once in the step's denominator (trainer.run.step counts the targets of the whole rows on one rank of
each group).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

from trainer.data.batch import Batch
from trainer.distributed.collectives import all_gather_along, reduce_scatter_along
from trainer.distributed.config import ALLGATHER_KERNELS, CP_SPLITS, CP_STRATEGIES
from trainer.model import flash
from trainer.model.attention import Segments, document_ids, resolve_backend, segment_attention
from trainer.model.loss import next_token_targets


def zigzag_positions(seq_len: int, size: int, rank: int) -> np.ndarray:
    """The positions of a row of `seq_len` that rank `rank` of a group of `size` holds, in order: chunk
    `rank`, then chunk 2 * size - 1 - rank. Example: zigzag_positions(8, 2, 0) -> [0 1 6 7]."""
    if seq_len % (2 * size):
        raise ValueError(f"a row of {seq_len} positions cannot be cut into 2 x {size} equal chunks")
    chunk = seq_len // (2 * size)
    first, second = rank * chunk, (2 * size - 1 - rank) * chunk
    return np.concatenate([np.arange(first, first + chunk), np.arange(second, second + chunk)])


BALANCED_CHUNKS = 8
"""Chunks per rank of the `balanced` split: each row is cut into 8N chunks, dealt 8 to a rank."""


def split_chunks(split: str, size: int) -> int:
    """What a row's length must be a multiple of: 2N chunks (zigzag), BALANCED_CHUNKS x N (balanced), or N
    equal shares (documents: cut at any position)."""
    return {"zigzag": 2 * size, "documents": size}.get(split, BALANCED_CHUNKS * size)


def row_positions(cu_seqlens: np.ndarray, batch: int, seq_len: int, size: int,
                  split: str = "zigzag") -> np.ndarray:
    """(size, batch, seq_len / size): the positions of each row that each rank holds, sorted within the row.

    zigzag    chunks r and 2N - 1 - r of 2N: the same positions in every row; even for one document per row
    balanced  8N chunks per row, dealt 8 to a rank by attention work (the pairs of their queries,
              `query_pairs`): the dearest chunk first, each to the rank with the least work that still has
              room. Every rank holds as many positions (so the same matmul work and activations); the
              attention work is evened row by row. Example, one row of documents [12, 4] over 2 ranks (16
              chunks of one position, pairs 1..12 and 1..4): 44 pairs each (zigzag: 20 and 68).
    """
    chunks = split_chunks(split, size)
    if seq_len % chunks:
        raise ValueError(f"a row of {seq_len} positions cannot be cut into {chunks} equal chunks "
                         f"({split} split over {size} ranks)")
    width = seq_len // chunks
    if split == "documents":
        return np.stack([document_positions(cu_seqlens[(cu_seqlens >= b * seq_len)
                                                       & (cu_seqlens <= (b + 1) * seq_len)]
                                            - b * seq_len, seq_len, size) for b in range(batch)], axis=1)
    if split == "zigzag":
        one = np.stack([zigzag_positions(seq_len, size, r) for r in range(size)])
        return np.broadcast_to(one[:, None, :], (size, batch, seq_len // size)).copy()
    flat = np.arange(batch * seq_len)
    seg = np.searchsorted(cu_seqlens[1:], flat, side="right")
    pairs = (flat - cu_seqlens[seg] + 1).reshape(batch, chunks, width).sum(-1)  # (B, chunks)
    per_rank = chunks // size
    out = np.empty((size, batch, seq_len // size), dtype=np.int64)
    for b in range(batch):
        work, owned = np.zeros(size), [[] for _ in range(size)]
        for c in np.argsort(-pairs[b], kind="stable"):
            open_ranks = [r for r in range(size) if len(owned[r]) < per_rank]
            r = min(open_ranks, key=lambda r: (work[r], r))
            owned[r].append(int(c))
            work[r] += pairs[b, c]
        for r in range(size):
            out[r, b] = np.concatenate([np.arange(c * width, (c + 1) * width) for c in sorted(owned[r])])
    return out


WHOLE_SLACK = 0.05
"""The `documents` split keeps a document whole on one rank only if that rank's attention work stays within
this fraction above the group's mean; a dearer one is zigzagged over every rank instead (its work even)."""


def document_positions(cu_row: np.ndarray, seq_len: int, size: int) -> np.ndarray:
    """(size, seq_len / size): the positions of one row (its segments' boundaries `cu_row`, from 0 to seq_len)
    each rank holds under the `documents` split. Segments go dearest first (length); one stays whole on the
    rank with the least attention work that has room for it, if that rank's work then stays within WHOLE_SLACK
    of the group's mean (the row's pairs over the ranks); else (longer than a rank's share, or too dear) it is
    cut into 2N nearly equal pieces, rank r taking pieces r and 2N - 1 - r (zigzag: its work even). Where the
    rooms left do not take a segment that way, it fills them, largest first. Only split segments' keys and
    values cross the group.

    Example: segments [3, 3, 1, 1] over 2 ranks of 4 positions -> [0 1 2 6] and [3 4 5 7] (each 3-token
    document whole on its own rank); one segment of 8 -> zigzag's [0 1 6 7] and [2 3 4 5]."""
    share = seq_len // size
    segments = sorted(itertools.pairwise(cu_row.tolist()), key=lambda se: (-(se[1] - se[0]), se[0]))
    limit = (1 + WHOLE_SLACK) * sum((e - s) * (e - s + 1) / 2 for s, e in segments) / size
    owned: list[list[np.ndarray]] = [[] for _ in range(size)]
    room, work = np.full(size, share), np.zeros(size)

    def give(r: int, positions: np.ndarray, start: int) -> None:
        owned[r].append(positions)
        room[r] -= len(positions)
        work[r] += float((positions - start + 1).sum())

    for s, e in segments:
        n = e - s
        fits = [r for r in range(size) if room[r] >= n]
        r = min(fits, key=lambda r: (work[r], r)) if fits else None
        if r is not None and work[r] + n * (n + 1) / 2 <= limit:
            give(r, np.arange(s, e), s)
            continue
        pieces = np.array_split(np.arange(s, e), 2 * size)
        shares = [np.concatenate([pieces[r], pieces[2 * size - 1 - r]]) for r in range(size)]
        if all(room[r] >= len(shares[r]) for r in range(size)):
            for r in range(size):
                give(r, shares[r], s)
            continue
        start = s  # the rooms left, largest first
        for r in sorted(range(size), key=lambda r: (-room[r], r)):
            take = int(min(room[r], e - start))
            if take:
                give(r, np.arange(start, start + take), s)
                start += take
    return np.stack([np.sort(np.concatenate(parts)) for parts in owned])


def query_pairs(cu_seqlens: np.ndarray, positions: np.ndarray) -> float:
    """(query, key) pairs of causal document attention whose query is one of `positions` (flat, sorted):
    each query at position p of a segment starting at s attends to p - s + 1 keys.
    Example: segments [0, 4, 8], queries [2, 3, 4] -> 3 + 4 + 1 = 8."""
    seg = np.searchsorted(cu_seqlens[1:], positions, side="right")
    return float((positions - cu_seqlens[seg] + 1).sum())


def rank_pairs(cu_seqlens: np.ndarray, batch: int, seq_len: int, size: int,
               split: str = "zigzag") -> list[float]:
    """Each rank's attention pairs of a micro-batch under `split` (`query_pairs` of its positions)."""
    positions = row_positions(cu_seqlens, batch, seq_len, size, split)
    return [query_pairs(cu_seqlens, flat_index(positions[r], seq_len)) for r in range(size)]


def flat_index(positions_BP: np.ndarray, seq_len: int) -> np.ndarray:
    """(B, P) positions of each row -> flat (row * seq_len + position) indices, row by row."""
    return (np.arange(positions_BP.shape[0])[:, None] * seq_len + positions_BP).reshape(-1)


@dataclass
class ContextGroup:
    """The context-parallel group a rank belongs to, and how attention crosses it."""

    group: dist.ProcessGroup | None
    size: int
    rank: int
    strategy: str = "allgather"
    split: str = "zigzag"
    """How each row's positions are dealt: 'zigzag' or 'balanced' (`row_positions`)."""

    def __post_init__(self) -> None:
        if self.strategy not in CP_STRATEGIES:
            raise ValueError(f"context-parallel strategy must be one of {CP_STRATEGIES}, "
                             f"got {self.strategy!r}")
        if self.split not in CP_SPLITS:
            raise ValueError(f"context-parallel split must be one of {CP_SPLITS}, got {self.split!r}")


class RowPlan:
    """This rank's share of one micro-batch's positions (a trainer.data.batch.RowShare), planned on the host
    when the micro-batch is laid out (trainer.run.inputs.StepInputs: in the prefetch thread under
    data.prefetch), so the step never copies boundaries back from the device: which positions of each row are
    this rank's (`row_positions`), and the `ContextShard` attention joins them with (the pieces or the
    gathered order its strategy needs, computed here). `cut` then applies it to the forward kwargs, on any
    device.

    The targets, weights and groups are shifted on the whole rows, then cut with the inputs. Rows whose length
    does not divide into the split's chunks (an unpacked or bucketed layout) are padded at their end first:
    padding has no target and attends only within its own row, so nothing changes.
    """

    def __init__(self, batch: Batch, cp: ContextGroup, isolate_documents: bool = True) -> None:
        B, L = batch.shape
        self.per_row = batch.layout != "packed" or not isolate_documents
        chunks = split_chunks(cp.split, cp.size)
        self.pad = (-L) % chunks
        if self.pad and not self.per_row:
            raise ValueError(f"packed rows of {L} positions cannot be cut into {chunks} chunks "
                             f"({cp.split} split): train.seq_len must be a multiple of {chunks}")
        L += self.pad
        cu = torch.arange(0, B * L + 1, L, dtype=torch.int32) if self.per_row else batch.cu_seqlens
        if cu.device.type != "cpu":
            raise ValueError("a RowPlan is made on the host, from the micro-batch before it is moved "
                             "to a device")
        self.shard = ContextShard(cp, cu, B, L)
        self.index = torch.as_tensor(self.shard.positions[cp.rank])  # (B, L / N)
        self.shard.gathered_order()  # what attention needs, made here rather than in the first layer's call
        if cp.strategy == "ulysses":
            self.shard.segments()
        else:
            self.shard.pieces()

    def received_rows(self) -> int:
        return self.shard.received_rows()

    def cut(self, inputs: dict) -> dict:
        """The model's forward kwargs of the whole micro-batch (trainer.model.model_inputs) -> this rank's
        share, with the ContextShard as `attention_context` and the shifted `targets` instead of labels."""
        input_ids, pad = inputs["input_ids"], self.pad
        B, L = input_ids.shape
        position_ids = inputs.get("position_ids")
        if position_ids is None:
            position_ids = torch.arange(L, device=input_ids.device).expand(B, L)
        targets, weights, groups = next_token_targets(inputs["labels"], inputs.get("loss_weights"),
                                                      inputs.get("loss_groups"))
        if pad:
            input_ids = F.pad(input_ids, (0, pad), value=0)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + torch.arange(
                1, pad + 1, device=position_ids.device)], 1)
            targets = F.pad(targets, (0, pad), value=-100)
            weights = None if weights is None else F.pad(weights, (0, pad), value=0.0)
            groups = None if groups is None else F.pad(groups, (0, pad), value=-1)
        index = self.index.to(input_ids.device, non_blocking=True)

        def cut(x: torch.Tensor) -> torch.Tensor:
            return torch.gather(x, 1, index)

        out = {"input_ids": cut(input_ids), "position_ids": cut(position_ids), "targets": cut(targets),
               "attention_context": self.shard}
        if weights is not None:
            out["loss_weights"] = cut(weights)
        if groups is not None:
            out["loss_groups"], out["num_loss_groups"] = cut(groups), inputs["num_loss_groups"]
        return out


def with_row_plans(micro_batches: list[Batch], cp: ContextGroup,
                   isolate_documents: bool = True) -> list[Batch]:
    """Each micro-batch (on the host) with this rank's RowPlan (Batch.plan): what model_inputs then cuts."""
    return [replace(mb, plan=RowPlan(mb, cp, isolate_documents)) for mb in micro_batches]


class ContextShard:
    """One micro-batch's attention boundaries as a rank of a context-parallel group sees them: the segments
    (documents) of the whole rows, this rank's positions among them, and the collectives that join them. Built
    once per forward pass; what each strategy needs is computed on first use and shared by all layers."""

    def __init__(self, cp: ContextGroup, cu_seqlens: torch.Tensor, batch: int, seq_len: int) -> None:
        self.cp, self.batch, self.seq_len = cp, batch, seq_len
        self.cu = cu_seqlens.to(torch.int64).numpy()
        self.num_tokens = batch * seq_len
        self.positions = row_positions(self.cu, batch, seq_len, cp.size, cp.split)
        """(N, B, L / N): each rank's positions of each row (the same on every rank: computed from the
        rows)."""
        self.local = flat_index(self.positions[cp.rank], seq_len)
        self._cache: dict = {}

    # -- allgather ------------------------------------------------------------------------------------------

    def pieces(self) -> dict:
        """(query piece, key piece) pairs of the local queries: lengths, the key index into the whole rows,
        and cu_seqlens / max lengths as varlen kernels take them."""
        if "pieces" in self._cache:
            return self._cache["pieces"]
        seg = np.searchsorted(self.cu[1:], self.local, side="right")  # segment of each local query
        start = self.cu[seg]
        cut = np.flatnonzero((np.diff(self.local) != 1) | (np.diff(seg) != 0)) + 1
        bounds = [0, *cut.tolist(), len(self.local)]
        q_lens, k_lens, k_index = [], [], []
        for a, b in itertools.pairwise(bounds):
            s, end = int(start[a]), int(self.local[b - 1]) + 1
            q_lens.append(b - a)
            k_lens.append(end - s)
            k_index.append(np.arange(s, end))
        piece = {
            "q_lens": q_lens, "k_lens": k_lens, "k_index": torch.as_tensor(np.concatenate(k_index)),
            "cu_q": torch.as_tensor(np.concatenate([[0], np.cumsum(q_lens)]), dtype=torch.int32),
            "cu_k": torch.as_tensor(np.concatenate([[0], np.cumsum(k_lens)]), dtype=torch.int32),
            "max_q": max(q_lens), "max_k": max(k_lens),
        }
        self._cache["pieces"] = piece
        return piece

    def gathered_order(self) -> torch.Tensor:
        """Flat positions of the whole rows in the order an all-gather (or all-to-all) over the group lays
        them: rank 0's local positions, then rank 1's, ..."""
        if "order" not in self._cache:
            order = np.concatenate([flat_index(self.positions[r], self.seq_len) for r in range(self.cp.size)])
            self._cache["order"] = torch.as_tensor(order)
            self._cache["inverse"] = torch.as_tensor(np.argsort(order))
        return self._cache["order"]

    def _whole(self, local_NHD: torch.Tensor) -> torch.Tensor:
        """All-gather a local (N_loc, H, D) tensor into the whole rows' flat order, differentiably. Under the
        `documents` split only the positions of split documents cross the group (`exchange`): the others' rows
        of the result are zeros, which no local query attends to (their documents are on other ranks)."""
        if self.cp.split == "documents":
            return self._whole_documents(local_NHD)
        self.gathered_order()
        gathered = _AllGather.apply(local_NHD.contiguous(), self.cp.group)
        return gathered.index_select(0, self._cache["inverse"].to(local_NHD.device))

    def exchange(self) -> dict:
        """The `documents` split's exchange: the positions of segments held by several ranks (split documents)
        are the only ones other ranks attend to. `send`: indices into this rank's local positions of its such
        positions; `width`: the most any rank sends (each sends that many rows, padded, so the all-gather is
        even); `recv_pos` / `recv_rows`: the flat positions of the other ranks' sent rows and their rows in
        the gathered tensor."""
        if "exchange" in self._cache:
            return self._cache["exchange"]
        flats = [flat_index(self.positions[r], self.seq_len) for r in range(self.cp.size)]
        segs = [np.searchsorted(self.cu[1:], f, side="right") for f in flats]
        holders = np.zeros(len(self.cu) - 1, dtype=np.int64)
        for s in segs:
            holders[np.unique(s)] += 1
        sent = [np.flatnonzero(holders[s] > 1) for s in segs]
        width = max(len(x) for x in sent)
        others = [r for r in range(self.cp.size) if r != self.cp.rank]
        recv_pos = np.concatenate([flats[r][sent[r]] for r in others] + [np.zeros(0, np.int64)])
        recv_rows = np.concatenate([r * width + np.arange(len(sent[r])) for r in others]
                                   + [np.zeros(0, np.int64)])
        out = {"send": torch.as_tensor(sent[self.cp.rank]), "width": width,
               "own": torch.as_tensor(self.local), "recv_pos": torch.as_tensor(recv_pos),
               "recv_rows": torch.as_tensor(recv_rows)}
        self._cache["exchange"] = out
        return out

    def received_rows(self) -> int:
        """Rows of each exchanged tensor (K, V; their gradients the same back) this rank receives per layer:
        the other ranks' rows of the all-gather (`documents`: only their split documents' positions,
        padded)."""
        if self.cp.split == "documents" and self.cp.strategy == "allgather":
            return (self.cp.size - 1) * self.exchange()["width"]
        return (self.cp.size - 1) * self.num_tokens // self.cp.size

    def _whole_documents(self, local_NHD: torch.Tensor) -> torch.Tensor:
        ex = self.exchange()
        device = local_NHD.device
        whole = local_NHD.new_zeros((self.num_tokens, *local_NHD.shape[1:]))
        whole = whole.index_copy(0, ex["own"].to(device), local_NHD)
        if ex["width"] == 0:  # no document is split: nothing crosses the group (every rank knows it)
            return whole
        send = local_NHD.index_select(0, ex["send"].to(device))
        send = F.pad(send, (0, 0, 0, 0, 0, ex["width"] - send.shape[0]))
        gathered = _AllGather.apply(send.contiguous(), self.cp.group)
        return whole.index_copy(0, ex["recv_pos"].to(device),
                                gathered.index_select(0, ex["recv_rows"].to(device)))

    def allgather_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            kernel: str) -> torch.Tensor:
        k_all, v_all = self._whole(k), self._whole(v)
        if kernel == "dense":
            return _dense_local(q, k_all, v_all, self._dense_mask(q.device))
        p = self.pieces()
        index = p["k_index"].to(q.device)
        k_p, v_p = k_all.index_select(0, index), v_all.index_select(0, index)
        if kernel == "flash":
            return flash.flash_varlen_attention_qk(q, k_p, v_p, p["cu_q"].to(q.device),
                                                   p["cu_k"].to(q.device), p["max_q"], p["max_k"])
        return _sdpa_pieces(q, k_p, v_p, p["q_lens"], p["k_lens"])

    def _dense_mask(self, device: torch.device) -> torch.Tensor:
        """(N_loc, N) Boolean: local query i may attend to whole-row position j (same segment, j <= its
        position)."""
        key = ("dense", device)
        if key not in self._cache:
            cu = torch.as_tensor(self.cu)
            seg = document_ids(cu, self.num_tokens)
            local = torch.as_tensor(self.local)
            mask = ((seg[local][:, None] == seg[None, :])
                    & (torch.arange(self.num_tokens)[None, :] <= local[:, None]))
            self._cache[key] = mask.to(device)
        return self._cache[key]

    # -- ulysses --------------------------------------------------------------------------------------------

    def segments(self) -> Segments:
        """The whole rows' documents (ulysses attends within them on whole rows, H / N heads)."""
        if "segments" not in self._cache:
            cu = torch.as_tensor(self.cu, dtype=torch.int32)
            self._cache["segments"] = Segments(cu, int(np.diff(self.cu).max()))
        return self._cache["segments"]

    def ulysses_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str,
                          flex_compile: bool) -> torch.Tensor:
        size = self.cp.size
        n_loc, heads, dim = q.shape
        order = self.gathered_order().to(q.device)
        inverse = self._cache["inverse"].to(q.device)

        # (N_loc, H, D) -> (N, H / size, D), whole rows in order
        def to_rows(x: torch.Tensor) -> torch.Tensor:
            x = x.reshape(n_loc, size, heads // size, dim).transpose(0, 1).contiguous()
            out = _AllToAll.apply(x, self.cp.group)
            return out.reshape(size * n_loc, heads // size, dim).index_select(0, inverse)

        y = segment_attention(to_rows(q), to_rows(k), to_rows(v), self.segments(), backend, flex_compile)
        y = y.index_select(0, order).reshape(size, n_loc, heads // size, dim).contiguous()
        back = _AllToAll.apply(y, self.cp.group)
        return back.transpose(0, 1).reshape(n_loc, heads, dim)

    # -- the layer's call -----------------------------------------------------------------------------------

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto",
               flex_compile: bool = True) -> torch.Tensor:
        """Document-causal attention of this rank's (N_loc, H, D) queries over the whole rows; (N_loc, H,
        D)."""
        if self.cp.strategy == "ulysses":
            return self.ulysses_attention(q, k, v, backend, flex_compile)
        return self.allgather_attention(q, k, v, allgather_kernel(backend, q.device, q.dtype))


class _AllGather(torch.autograd.Function):
    """All-gather along dim 0 over `group`; backward sums every rank's gradient of the gathered tensor and
    keeps this rank's slice (a reduce-scatter, trainer.distributed.groups.reduce_scatter_along;
    torch.distributed.nn.
    functional.all_gather's fallback scatters from global rank 0, which fails on a group without it)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return all_gather_along(x, 0, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_scatter_along(grad, 0, ctx.group), None


class _AllToAll(torch.autograd.Function):
    """All-to-all of equal dim-0 slices over `group` (slice i goes to rank i); its backward is the same
    exchange of the gradients, back to where each slice came from."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    """dist.all_to_all_single into a fresh contiguous tensor (empty_like would copy a transposed input's
    strides, and the collective writes its output as contiguous)."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out, x.contiguous(), group=group)
    return out


def allgather_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel the allgather strategy runs for attention `backend`: flash where it runs (auto too), else
    the per-piece SDPA; a backend that cannot take separate query and key lengths is refused (ValueError)."""
    if backend == "auto":
        return "flash" if flash.flash_unavailable_reason(device, dtype) is None else "sdpa_docs"
    if backend not in ALLGATHER_KERNELS:
        raise ValueError("distributed.context_parallel_strategy=allgather needs an attention backend that "
                         f"takes separate query and key lengths ({', '.join(ALLGATHER_KERNELS)} or auto), "
                         f"got {backend!r}; use attention=auto, or the ulysses strategy (any backend)")
    return resolve_backend(backend, device, dtype)


def _sdpa_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: list[int],
                 k_lens: list[int]) -> torch.Tensor:
    """SDPA once per (query piece, key piece), causal aligned at the bottom right: the last query sees every
    key."""
    outs = []
    for q_t, k_t, v_t, m, n in zip(q.split(q_lens), k.split(k_lens), v.split(k_lens), q_lens, k_lens,
                                   strict=True):
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q_t, k_t, v_t))
        if m == n:
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
        else:
            mask = torch.ones(m, n, dtype=torch.bool, device=q.device).tril(n - m)
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)
        outs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outs, 0)


def _dense_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
    return F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask).squeeze(0).transpose(0, 1)
