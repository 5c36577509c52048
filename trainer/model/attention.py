"""Document-causal attention over packed rows: one interface, several kernels.

Every packed layout reaches attention the same way: q, k, v flattened to (N, H, D) over all B * L
positions of the micro-batch, plus int32 `cu_seqlens` (leading 0, ending at N) and a host int
`max_seqlen`. A position may attend to itself and to earlier positions of its own segment, nothing else.

Worked example, segments [3, 2] (N = 5), cu_seqlens = [0, 3, 5]; True = may attend (PyTorch's convention):

    document_ids = [0 0 0 1 1]
    mask         = 1 . . . .
                   1 1 . . .
                   1 1 1 . .
                   . . . 1 .
                   . . . 1 1

Backends (`AttentionConfig.backend`):
    flash         flash-attn's `flash_attn_varlen_func` (CUDA, fp16/bf16; imported only in flash.py)
    torch_varlen  PyTorch's `torch.nn.attention.varlen.varlen_attn` (CUDA, fp16/bf16)
    flex          FlexAttention with a document-causal BlockMask built block by block (no N x N tensor);
                  CUDA for training: PyTorch has no FlexAttention backward on CPU (forward only there)
    sdpa_docs     scaled_dot_product_attention once per segment: exact, no mask; the CPU reference
    dense         one explicit (N, N) Boolean block-diagonal mask with SDPA: O(N^2) memory, small N only
    auto          the fastest that runs here: flash > torch_varlen > flex (CUDA) > sdpa_docs; logs its choice
                  and why, once per process for each device and dtype (logger `trainer.model.attention`)
"""

from __future__ import annotations

import inspect
import itertools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from trainer.errors import UserError
from trainer.model import flash

BACKENDS = ("auto", "flash", "torch_varlen", "flex", "sdpa_docs", "dense")
AUTO_ORDER = ("flash", "torch_varlen", "flex", "sdpa_docs")
VARLEN_DTYPES = (torch.float16, torch.bfloat16)
FLEX_BLOCK_SIZE = 128

log = logging.getLogger(__name__)
_AUTO_LOGGED: set[tuple[str, torch.dtype, str]] = set()
"""(device type, dtype, kernel) of every `auto` choice logged so far: each is logged once per process."""


@dataclass
class AttentionConfig:
    """How packed rows attend. The model sees only this section of the config."""

    backend: str = "auto"
    """Kernel for packed rows: auto | flash | torch_varlen | flex | sdpa_docs | dense (see module
    docstring)."""
    isolate_documents: bool = True
    """True: each document attends only to itself (block-diagonal causal). False: one causal mask per row,
    documents read earlier documents of the row (the "concatenate documents" pretraining choice)."""
    flex_compile: bool = True
    """Run FlexAttention through torch.compile (fused kernel). Eager flex materializes the scores."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {self.backend!r}; expected one of {BACKENDS}")


class BackendUnavailable(UserError, RuntimeError):
    """The requested attention backend cannot run on this device / dtype / installation."""


# ---------------------------------------------------------------------------------------------------
# Boundaries in the forms the kernels want
# ---------------------------------------------------------------------------------------------------


def document_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """(N,) segment index of every flattened position, on cu_seqlens' device, without a host sync.

    Example: cu_seqlens = [0, 3, 5, 10], num_tokens = 10 -> [0 0 0 1 1 2 2 2 2 2].
    """
    positions = torch.arange(num_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True)


def block_diagonal_mask(
    seq_lens: Sequence[int] | None = None,
    *,
    cu_seqlens: torch.Tensor | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """(N, N) Boolean document-causal mask, True = may attend (scaled_dot_product_attention's convention).

    Give either segment lengths or cu_seqlens. Example: seq_lens [2, 1] (cu_seqlens [0, 2, 3]) ->
        [[1 0 0]
         [1 1 0]
         [0 0 1]]
    Allocates N^2 bytes: 67 M elements for N = 8192. Use it for small N and as a test oracle.
    """
    if (seq_lens is None) == (cu_seqlens is None):
        raise ValueError("give exactly one of seq_lens or cu_seqlens")
    if cu_seqlens is None:
        lens = torch.as_tensor(list(seq_lens), dtype=torch.int64, device=device)
        cu_seqlens = F.pad(torch.cumsum(lens, 0), (1, 0))
    elif device is not None:
        cu_seqlens = cu_seqlens.to(device)
    num_tokens = int(cu_seqlens[-1])
    doc_N = document_ids(cu_seqlens, num_tokens)
    positions = torch.arange(num_tokens, device=cu_seqlens.device)
    same_doc_NN = doc_N[:, None] == doc_N[None, :]
    causal_NN = positions[:, None] >= positions[None, :]
    return same_doc_NN & causal_NN


def to_additive_mask(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Boolean mask (True = attend) -> additive mask: 0 where allowed, -inf where blocked.

    A float mask is ADDED to the attention scores, so a 0/1 float matrix is not the same mask: it
    nudges allowed scores by +1 and blocks nothing. Example: [[1, 0], [1, 1]] -> [[0, -inf], [0, 0]].
    """
    if mask.dtype != torch.bool:
        raise TypeError(f"expected a Boolean mask, got {mask.dtype}")
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def document_block_mask(doc_N: torch.Tensor, block_size: int = FLEX_BLOCK_SIZE):
    """FlexAttention BlockMask for document-causal attention, built per (block, block) tile: no N x N tensor.

    Positions are cut into tiles of `block_size`; since document ids never decrease along the row, a tile
    is described by its first and last document. For q tile i and kv tile j:
        j > i                       -> empty (entirely in the future)
        j == i                      -> partial (the causal diagonal)
        j < i and last_doc[j] >= first_doc[i] -> they share a document: full when both tiles lie in that
                                       single document (and are not cut by the end of the row), else partial
    Example, block_size 2, doc ids [0 0 | 0 1 | 1 1]: tile 1 shares doc 0 with tile 0 (partial), tile 2
    shares doc 1 with tile 1 (partial) and nothing with tile 0 (empty). Costs O((N / block_size)^2).
    """
    from torch.nn.attention.flex_attention import BlockMask

    num_tokens = doc_N.numel()
    num_blocks = math.ceil(num_tokens / block_size)
    starts = torch.arange(num_blocks, device=doc_N.device) * block_size
    ends = torch.clamp(starts + block_size, max=num_tokens) - 1  # last position inside each tile
    first_doc, last_doc = doc_N[starts], doc_N[ends]
    whole = (ends - starts + 1) == block_size
    q_i, kv_j = starts[:, None], starts[None, :]
    below = kv_j < q_i
    share = last_doc[None, :] >= first_doc[:, None]
    any_QK = (kv_j == q_i) | (below & share)
    single = (first_doc == last_doc) & whole
    full_QK = below & single[:, None] & single[None, :] & (first_doc[:, None] == first_doc[None, :])
    partial_QK = any_QK & ~full_QK

    def mask_mod(b, h, q_idx, kv_idx):
        return (doc_N[q_idx] == doc_N[kv_idx]) & (q_idx >= kv_idx)

    kv_num, kv_idx = _dense_to_ordered(partial_QK)
    full_num, full_idx = _dense_to_ordered(full_QK)
    return BlockMask.from_kv_blocks(
        kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod,
        seq_lengths=(num_tokens, num_tokens),
    )


def _dense_to_ordered(tiles_QK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Tile matrix -> BlockMask's (count per q tile, kv tile indices with the used ones first),
    (1, 1, ...)."""
    tiles = tiles_QK.to(torch.int32)[None, None]
    num = tiles.sum(-1, dtype=torch.int32)
    idx = torch.argsort(tiles, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


class Segments:
    """The boundaries of one forward pass, with each backend's view built on first use and shared by all
    layers.

    `cu_seqlens` (int32, leading 0) and `max_seqlen` (host int) come from the Batch. The host list for the
    per-segment loop costs one device-to-host copy per forward pass, not one per layer.
    """

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int) -> None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must be (S + 1,) with a leading 0, "
                             f"got shape {tuple(cu_seqlens.shape)}")
        self.cu_seqlens = cu_seqlens
        self.max_seqlen = int(max_seqlen)
        self._cache: dict = {}

    def attend(self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, backend: str = "auto",
               flex_compile: bool = True) -> torch.Tensor:
        """`segment_attention` within these segments (an AttentionContext)."""
        return segment_attention(q_NHD, k_NHD, v_NHD, self, backend, flex_compile)

    def cu_on(self, device: torch.device) -> torch.Tensor:
        """int32 cu_seqlens on `device` (what the varlen kernels take)."""
        key = ("cu", device)
        if key not in self._cache:
            self._cache[key] = self.cu_seqlens.to(device=device, dtype=torch.int32)
        return self._cache[key]

    def host(self) -> list[int]:
        """cu_seqlens as a Python list: one device-to-host copy per forward pass at most."""
        if "host" not in self._cache:
            self._cache["host"] = self.cu_seqlens.tolist()
        return self._cache["host"]

    def block_mask(self, num_tokens: int, device: torch.device):
        key = ("flex", num_tokens, device)
        if key not in self._cache:
            self._cache[key] = document_block_mask(document_ids(self.cu_on(device), num_tokens))
        return self._cache[key]

    def dense_mask(self, device: torch.device) -> torch.Tensor:
        key = ("dense", device)
        if key not in self._cache:
            self._cache[key] = block_diagonal_mask(cu_seqlens=self.cu_on(device))
        return self._cache[key]


# ---------------------------------------------------------------------------------------------------
# Backend resolution
# ---------------------------------------------------------------------------------------------------


def _torch_varlen_fn():
    """PyTorch's varlen_attn, or None on a torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _flex_fn():
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:
        return None
    return flex_attention


def backend_unavailable_reason(
    backend: str, device: torch.device, dtype: torch.dtype, requires_grad: bool = True
) -> str | None:
    """Why `backend` cannot run on (device, dtype) (with a backward pass if requires_grad), or None if it
    can."""
    if backend == "flash":
        return flash.flash_unavailable_reason(device, dtype)
    if backend == "torch_varlen":
        if device.type != "cuda":
            return f"torch.nn.attention.varlen.varlen_attn runs on CUDA only, got {device.type!r}"
        if _torch_varlen_fn() is None:
            return f"this torch ({torch.__version__}) has no torch.nn.attention.varlen; it needs torch >= 2.9"
        if dtype not in VARLEN_DTYPES:
            return (f"varlen_attn runs in float16/bfloat16 only, got {dtype} "
                    "(train under bf16 autocast: train.dtype=bf16)")
        return None
    if backend == "flex":
        if _flex_fn() is None:
            return f"this torch ({torch.__version__}) has no FlexAttention"
        if device.type == "cpu" and requires_grad:
            return ("FlexAttention has no backward on CPU in PyTorch "
                    "(forward only, e.g. under torch.no_grad())")
        return None
    if backend in ("sdpa_docs", "dense"):
        return None
    raise ValueError(f"unknown attention backend {backend!r}; expected one of {BACKENDS}")


def auto_choice(device: torch.device, dtype: torch.dtype, requires_grad: bool = True) -> tuple[str, str]:
    """(the kernel `auto` picks on (device, dtype), why): the first of AUTO_ORDER that runs here, and why
    each one before it does not.

    flex is taken only on CUDA: on CPU it has no backward and compiles for tens of seconds, so training and
    evaluation would run different kernels. Example, CPU fp32: ("sdpa_docs", "flash: flash-attn needs a CUDA
    device, got 'cpu'; torch_varlen: ... runs on CUDA only, got 'cpu'; flex: not picked off CUDA (...)").
    """
    passed_over = []
    for candidate in AUTO_ORDER:
        if candidate == "flex" and device.type != "cuda":
            passed_over.append("flex: not picked off CUDA "
                               "(no backward on CPU; compiling takes tens of seconds)")
            continue
        reason = backend_unavailable_reason(candidate, device, dtype, requires_grad)
        if reason is None:
            return candidate, "; ".join(passed_over) or "the first choice, and it runs here"
        passed_over.append(f"{candidate}: {reason}")
    return "sdpa_docs", "; ".join(passed_over)


def _log_auto_choice(device: torch.device, dtype: torch.dtype, kernel: str, why: str) -> None:
    key = (device.type, dtype, kernel)
    if key in _AUTO_LOGGED:
        return
    _AUTO_LOGGED.add(key)
    order = " > ".join(AUTO_ORDER)
    log.info(f"attention=auto picked {kernel} on {device.type} {str(dtype).removeprefix('torch.')} "
             f"(order {order}): {why}")


def resolve_backend(
    backend: str, device: torch.device, dtype: torch.dtype, requires_grad: bool = True
) -> str:
    """The concrete kernel for `backend` on (device, dtype); raises BackendUnavailable saying what is missing.

    `auto` takes `auto_choice` and logs it with its reason, once per process for each device, dtype and
    kernel. An explicit backend is honoured or refused, never swapped for another: every backend `auto` can
    pick isolates documents, and the error names the one it would pick here.
    """
    if backend == "auto":
        kernel, why = auto_choice(device, dtype, requires_grad)
        _log_auto_choice(device, dtype, kernel, why)
        return kernel
    reason = backend_unavailable_reason(backend, device, dtype, requires_grad)
    if reason is not None:
        instead, _ = auto_choice(device, dtype, requires_grad)
        raise BackendUnavailable(
            f"attention backend {backend!r} is unavailable: {reason}; use attention=auto, which picks the "
            f"fastest backend that runs here and keeps documents isolated ({instead} on this machine)"
        )
    return backend


# ---------------------------------------------------------------------------------------------------
# The kernels, all (N, H, D) in and out
# ---------------------------------------------------------------------------------------------------


def torch_varlen_args(
    q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    varlen_fn=None,
) -> dict:
    """Keyword arguments for `torch.nn.attention.varlen.varlen_attn`, causal within each segment.

    torch 2.9/2.10 spell causality `is_causal=True`; later versions `window_size=(-1, 0)`. Read it off
    the signature of the installed function. Example: segments [3, 2] -> cu_seq_q = cu_seq_k = [0, 3, 5].
    """
    varlen_fn = varlen_fn or _torch_varlen_fn()
    cu = cu_seqlens.to(device=q_NHD.device, dtype=torch.int32)
    args = dict(query=q_NHD, key=k_NHD, value=v_NHD, cu_seq_q=cu, cu_seq_k=cu,
                max_q=int(max_seqlen), max_k=int(max_seqlen))
    params = inspect.signature(varlen_fn).parameters if varlen_fn is not None else {}
    if "is_causal" in params:
        args["is_causal"] = True
    else:
        args["window_size"] = (-1, 0)
    return args


def _sdpa_docs(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor,
               bounds: list[int]) -> torch.Tensor:
    """Causal SDPA once per segment [bounds[i], bounds[i + 1]): exact, no mask materialized.

    `split` (not slicing) cuts the segments, so backward concatenates the segment gradients once instead
    of zero-filling a full (N, H, D) gradient per segment.
    """
    lengths = [end - start for start, end in itertools.pairwise(bounds)]
    outs = []
    for q_THD, k_THD, v_THD in zip(q_NHD.split(lengths), k_NHD.split(lengths), v_NHD.split(lengths),
                                   strict=True):
        q_1HTD, k_1HTD, v_1HTD = (t.transpose(0, 1).unsqueeze(0) for t in (q_THD, k_THD, v_THD))
        out_1HTD = F.scaled_dot_product_attention(q_1HTD, k_1HTD, v_1HTD, is_causal=True)
        outs.append(out_1HTD.squeeze(0).transpose(0, 1))  # (T, H, D)
    return torch.cat(outs, dim=0)


def _dense(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor,
           mask_NN: torch.Tensor) -> torch.Tensor:
    q_1HND, k_1HND, v_1HND = (t.transpose(0, 1).unsqueeze(0) for t in (q_NHD, k_NHD, v_NHD))
    out_1HND = F.scaled_dot_product_attention(q_1HND, k_1HND, v_1HND, attn_mask=mask_NN)
    return out_1HND.squeeze(0).transpose(0, 1)


_COMPILED_FLEX = None


def _flex(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, block_mask,
          compile: bool) -> torch.Tensor:
    global _COMPILED_FLEX
    flex_attention = _flex_fn()
    if compile:
        if _COMPILED_FLEX is None:  # one compiled function per process; dynamo caches a graph per shape
            _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
        flex_attention = _COMPILED_FLEX
    q_1HND, k_1HND, v_1HND = (t.transpose(0, 1).unsqueeze(0) for t in (q_NHD, k_NHD, v_NHD))
    out_1HND = flex_attention(q_1HND, k_1HND, v_1HND, block_mask=block_mask)
    return out_1HND.squeeze(0).transpose(0, 1)


class AttentionContext(Protocol):
    """What the attention layers of one forward pass attend within: `Segments` (the documents of this rank's
    rows), or a share of rows split over ranks (trainer.distributed.context.ContextShard, which joins the
    other ranks' keys). Built once per forward, shared by every layer."""

    def attend(self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, backend: str = "auto",
               flex_compile: bool = True) -> torch.Tensor:
        """Document-causal attention of flat (N, H, D) queries; (N, H, D)."""
        ...


TREE_KERNELS = ("sdpa_docs", "dense", "flex")
"""The kernels that express a tree's mask (TreeSegments); the varlen kernels attend within whole segments
only."""


def tree_kernel(backend: str, device: torch.device, dtype: torch.dtype) -> str:
    """The kernel a tree layout runs on for `backend`: `auto` takes flex on CUDA (else sdpa_docs); an explicit
    varlen kernel is refused naming the ones that work."""
    if backend == "auto":
        return "flex" if backend_unavailable_reason("flex", device, dtype, requires_grad=False) is None \
            and device.type == "cuda" else "sdpa_docs"
    if backend not in TREE_KERNELS:
        raise BackendUnavailable(f"attention backend {backend!r} cannot score the tree layout: it attends "
                                 "within whole segments, and a tree's branches must not see each other; "
                                 f"use one of {', '.join(TREE_KERNELS)} (or auto), "
                                 "or score in the packed layout")
    return resolve_backend(backend, device, dtype, requires_grad=False)


class TreeSegments:
    """The attention context of a tree batch (trainer.data.batch.collate_trees): within a segment (a tree) a
    position attends causally to the trunk and to its own branch, never to a sibling branch; segments are
    isolated as in `Segments`. Forward only (scoring).

        mask[q, k] = same segment and k <= q and (branch[k] == 0 or branch[k] == branch[q])
    """

    def __init__(self, cu_seqlens: torch.Tensor, max_seqlen: int, branch_N: torch.Tensor) -> None:
        self.segments = Segments(cu_seqlens, max_seqlen)
        self.branch_N = branch_N
        self._cache: dict = {}

    def dense_mask(self, device: torch.device) -> torch.Tensor:
        key = ("dense", device)
        if key not in self._cache:
            branch_N = self.branch_N.to(device)
            siblings = (branch_N[None, :] == 0) | (branch_N[None, :] == branch_N[:, None])
            self._cache[key] = self.segments.dense_mask(device) & siblings
        return self._cache[key]

    def block_mask(self, num_tokens: int, device: torch.device):
        key = ("flex", num_tokens, device)
        if key not in self._cache:
            from torch.nn.attention.flex_attention import create_block_mask

            doc_N = document_ids(self.segments.cu_on(device), num_tokens)
            branch_N = self.branch_N.to(device)

            def mask_mod(b, h, q_idx, kv_idx):
                same = (doc_N[q_idx] == doc_N[kv_idx]) & (q_idx >= kv_idx)
                return same & ((branch_N[kv_idx] == 0) | (branch_N[kv_idx] == branch_N[q_idx]))

            self._cache[key] = create_block_mask(mask_mod, None, None, num_tokens, num_tokens, device=device,
                                                 BLOCK_SIZE=FLEX_BLOCK_SIZE)
        return self._cache[key]

    def attend(self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, backend: str = "auto",
               flex_compile: bool = True) -> torch.Tensor:
        kernel = tree_kernel(backend, q_NHD.device, q_NHD.dtype)
        if kernel == "flex":
            return _flex(q_NHD, k_NHD, v_NHD, self.block_mask(q_NHD.shape[0], q_NHD.device), flex_compile)
        if kernel == "dense":
            return _dense(q_NHD, k_NHD, v_NHD, self.dense_mask(q_NHD.device))
        return self._per_tree(q_NHD, k_NHD, v_NHD)

    def _per_tree(self, q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor) -> torch.Tensor:
        """sdpa_docs for trees: per segment, the trunk causal, then each branch's queries over the trunk's
        keys and its own (causal within the branch), each an SDPA call; no (N, N) mask."""
        if "host" not in self._cache:
            self._cache["host"] = self.branch_N.reshape(-1).tolist()
        branch = self._cache["host"]
        outs = []
        for start, end in itertools.pairwise(self.segments.host()):
            ids = branch[start:end]
            trunk = next((i for i, b in enumerate(ids) if b), len(ids))
            outs.append(_sdpa_docs(q_NHD[start:start + trunk], k_NHD[start:start + trunk],
                                   v_NHD[start:start + trunk], [0, trunk]) if trunk else q_NHD[start:start])
            at = start + trunk
            while at < end:
                stop = at + 1
                while stop < end and branch[stop] == branch[at]:
                    stop += 1
                m = stop - at
                keys = torch.cat([k_NHD[start:start + trunk], k_NHD[at:stop]])
                values = torch.cat([v_NHD[start:start + trunk], v_NHD[at:stop]])
                mask = torch.ones(m, trunk + m, dtype=torch.bool, device=q_NHD.device)
                mask[:, trunk:] = torch.ones(m, m, dtype=torch.bool, device=q_NHD.device).tril()
                q_1HMD, k_1HKD, v_1HKD = (t.transpose(0, 1).unsqueeze(0)
                                          for t in (q_NHD[at:stop], keys, values))
                out = F.scaled_dot_product_attention(q_1HMD, k_1HKD, v_1HKD, attn_mask=mask)
                outs.append(out.squeeze(0).transpose(0, 1))
                at = stop
        return torch.cat(outs, dim=0)


def attend_within(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, context: AttentionContext,
                  backend: str = "auto", flex_compile: bool = True) -> torch.Tensor:
    """The model's attention call per layer (CausalSelfAttention.attend; train.compile keeps it eager, see
    `segment_attention`): `context.attend`."""
    return context.attend(q_NHD, k_NHD, v_NHD, backend, flex_compile)


def segment_attention(
    q_NHD: torch.Tensor,
    k_NHD: torch.Tensor,
    v_NHD: torch.Tensor,
    segments: Segments,
    backend: str = "auto",
    flex_compile: bool = True,
) -> torch.Tensor:
    """Document-causal attention of flat (N, H, D) tokens; returns (N, H, D). The model calls this per layer.

    Runs outside torch.compile's graphs (train.compile: trainer/model/compile.py wraps each layer's call in
    torch.compiler.disable): the boundaries change with every batch, and outside the graph they are never
    guarded on, so no backend recompiles per batch. Not decorated here: torch.compiler.disable imports dynamo,
    ~1 s of every process's start, also of the runs that never compile.
    """
    requires_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q_NHD, k_NHD, v_NHD))
    kernel = resolve_backend(backend, q_NHD.device, q_NHD.dtype, requires_grad)
    if kernel == "flash":
        return flash.flash_varlen_attention(q_NHD, k_NHD, v_NHD, segments.cu_on(q_NHD.device),
                                            segments.max_seqlen)
    if kernel == "torch_varlen":
        varlen_attn = _torch_varlen_fn()
        cu = segments.cu_on(q_NHD.device)
        return varlen_attn(**torch_varlen_args(q_NHD, k_NHD, v_NHD, cu, segments.max_seqlen, varlen_attn))
    if kernel == "flex":
        block_mask = segments.block_mask(q_NHD.shape[0], q_NHD.device)
        return _flex(q_NHD, k_NHD, v_NHD, block_mask, flex_compile)
    if kernel == "sdpa_docs":
        return _sdpa_docs(q_NHD, k_NHD, v_NHD, segments.host())
    return _dense(q_NHD, k_NHD, v_NHD, segments.dense_mask(q_NHD.device))


def varlen_attention(
    q_NHD: torch.Tensor,
    k_NHD: torch.Tensor,
    v_NHD: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    backend: str = "auto",
    flex_compile: bool = True,
) -> torch.Tensor:
    """Causal attention within each segment of cu_seqlens over flat (N, H, D) q, k, v; returns (N, H, D).

    Example: cu_seqlens = [0, 3, 5], max_seqlen = 3: tokens 0-2 attend causally among themselves, tokens
    3-4 among themselves. For many calls with the same boundaries, build one `Segments` and call
    `segment_attention` so the block mask / host copy is made once.
    """
    return segment_attention(q_NHD, k_NHD, v_NHD, Segments(cu_seqlens, max_seqlen), backend, flex_compile)
