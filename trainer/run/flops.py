"""The FLOPs of a training step, counted two ways: what the model needs and what the kernels computed.

    model FLOPs     the useful work of the step's documents: 6 N per real token, plus causal attention of each
                    document over itself, as if every document ran alone (layout, padding and kernel left out)
    hardware FLOPs  what this layout and attention kernel computed: 6 N per allocated position (padding
                    included), the attention pairs the kernel really evaluates, and any activation recompute

`mfu` divides the first by the devices' peak FLOP/s, `hfu` the second. The same documents give the same model
FLOPs in every layout (so mfu is proportional to documents per second); the hardware FLOPs show what packing,
padding and the kernel's granularity cost, which 6 N alone hides.

Conventions:
    N         the matmul parameters: every parameter but the learned position table (a lookup, not a matmul),
              the tied embedding counted once, as the output head it also is (`matmul_params`).
    6 N       per position, forward (2 N: each weight multiplies each position once) and backward (4 N).
    attention per layer and per (query, key) pair evaluated: q.k (2 d) and p.v (2 d) forward, twice that
              backward: 12 d, d = n_embd (all heads). A causal sequence of length L has L^2 / 2 pairs (the
              diagonal's extra L / 2 ignored, as in the usual 12 n_layer d L^2 for a full, non-causal one), so
              one document costs 6 n_layer d L^2.
    not counted  softmax, norms, activations, the loss (elementwise, not matmuls); the part of a diagonal tile
              a causal kernel computes and masks (flex's tiles, which it skips or computes whole,
              are counted).
    isolation off (attention.isolate_documents=false): documents of a packed row attend to earlier ones; that
              cross-document attention is hardware work, not model work, so mfu stays comparable across both.
The trainer counted 6 x all parameters per real token before (no attention); dropping the position table
matches bench/gpu_train.py, whose model FLOPs are these.

Worked example: n_layer 2, d 4, N 100; one packed row of seq_len 8 holding documents [3, 2] and 3 padding
positions (cu_seqlens [0, 3, 5, 8]):
    model                     6*100*5 + 6*2*4*(3^2 + 2^2)        = 3000 + 624   = 3624
    hardware, flash           6*100*8 + 6*2*4*(3^2 + 2^2 + 3^2)  = 4800 + 1056  = 5856  (padding is a segment)
    hardware, isolation off   6*100*8 + 6*2*4*8^2                = 4800 + 3072  = 7872  (one causal row)
    the same two documents unpacked, rows padded to seq_len 8:
    hardware                  6*100*16 + 6*2*4*(8^2 + 8^2)       = 9600 + 6144  = 15744; model still 3624
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from trainer.data.feed import Batch, imbalance
from trainer.distributed.context import rank_pairs, split_chunks
from trainer.model import GPT, compute_dtype
from trainer.model.attention import (
    FLEX_BLOCK_SIZE,
    AttentionConfig,
    auto_choice,
    document_block_mask,
    document_ids,
)

PAIR_FLOPS_PER_DIM = 12
"""FLOPs per (query, key) pair, per layer and per unit of width: 4 forward + 8 backward."""
VARLEN_KERNELS = ("flash", "torch_varlen", "sdpa_docs")
"""Kernels that run each segment of cu_seqlens causally on its own (the padding segment included)."""


@dataclass(frozen=True)
class FlopModel:
    """What one run's steps cost: the model's sizes, the attention kernel that runs, and what backward
    recomputes."""

    matmul_params: int
    """N: the parameters that multiply every position (see `matmul_params`)."""
    n_layer: int
    n_embd: int
    kernel: str
    """The attention kernel packed rows run: flash | torch_varlen | flex | sdpa_docs | dense (`auto`
    resolved)."""
    isolate_documents: bool = True
    """attention.isolate_documents: False runs packed rows as one causal row each (the padded path)."""
    recompute_params: int = 0
    """Parameters whose forward backward reruns per position (train.activation_checkpointing): the blocks' for
    'full', the MLPs' for 'selective', 0 for 'none'."""
    recompute_attention: bool = False
    """Whether backward reruns the attention forward too ('full')."""

    def model_flops(self, doc_lengths: Iterable[int]) -> float:
        """Useful work of documents of these lengths, each attending causally to itself alone.

        Example (the module's): lengths [3, 2], N 100, n_layer 2, d 4 -> 600 * 5 + 48 * 13 = 3624.
        """
        lengths = list(doc_lengths)
        pairs = sum(n * n for n in lengths) / 2
        return 6 * self.matmul_params * sum(lengths) + self._attention(pairs, recompute=False)

    def hardware_flops(self, batch: Batch) -> float:
        """What the kernels computed for one micro-batch: every position (padding too) and the attention pairs
        the kernel evaluates (`attention_pairs`), with the recompute of activation checkpointing.

        Example (the module's): the packed row [3, 2 | pad 3] on flash -> 4800 + 48 * 11 = 5856.
        """
        positions = batch.num_allocated
        pairs = attention_pairs(batch, self.kernel, self.isolate_documents)
        dense = (6 * self.matmul_params + 2 * self.recompute_params) * positions
        return dense + self._attention(pairs, recompute=self.recompute_attention)

    def step_flops(self, rows: Iterable[Iterable], batches: Iterable[Batch]) -> tuple[float, float]:
        """(model FLOPs, hardware FLOPs) of one rank's step: its rows of documents, laid out as `batches`."""
        model = self.model_flops(len(doc) for row in rows for doc in row)
        return model, sum(self.hardware_flops(mb) for mb in batches)

    def context_imbalance(self, batches: Iterable[Batch], size: int, split: str = "zigzag") -> float:
        """How unevenly a context-parallel group of `size` shares the step's work (max / mean - 1 over its
        ranks): each rank computes the dense 6 N of its 1/size of the positions and the attention pairs of its
        own queries (trainer.distributed.context.rank_pairs under `split`, whole-row segments). Host
        arithmetic only."""
        work = [0.0] * size
        for mb in batches:
            rows, row_len = mb.shape
            pad = (-row_len) % split_chunks(split, size)
            row_len += pad
            if mb.layout == "packed" and self.isolate_documents and not pad:
                cu = mb.cu_seqlens.to(torch.int64).numpy()
            else:
                cu = np.arange(0, rows * row_len + 1, row_len)
            pairs = rank_pairs(cu, rows, row_len, size, split)
            for r in range(size):
                work[r] += 6 * self.matmul_params * rows * row_len / size + self._attention(pairs[r], False)
        return imbalance(work)

    def _attention(self, pairs: float, recompute: bool) -> float:
        """fwd + bwd FLOPs of `pairs` (query, key) pairs in every layer; a recomputed forward adds a third."""
        per_pair = PAIR_FLOPS_PER_DIM * (4 / 3 if recompute else 1) * self.n_layer * self.n_embd
        return per_pair * pairs


def attention_pairs(batch: Batch, kernel: str, isolate_documents: bool = True) -> float:
    """(query, key) pairs per layer that `kernel` evaluates on `batch`, as it runs (trainer.model.gpt).

        unpacked / bucketed rows, or packed rows with isolate_documents=False: causal SDPA over each row,
            rows * L^2 / 2 (padding included: it is part of the row)
        flash, torch_varlen, sdpa_docs: each segment of cu_seqlens causally, sum of L_s^2 / 2, the padding
            segment of a row's tail included (the kernels run it like a document)
        flex: the BlockMask's non-empty tiles of FLEX_BLOCK_SIZE^2, each computed whole (masked after), so
            documents much shorter than a tile cost a tile
        dense: SDPA with one (B*L, B*L) mask: every pair, (B*L)^2, nothing skipped
    Example: segments [3, 2, 3] in one row of 8 -> flash 11, isolation off 32, dense 64, flex 128^2 = 16384.
    """
    rows, row_len = batch.shape
    if batch.layout != "packed" or not isolate_documents:
        return rows * row_len * row_len / 2
    if kernel in VARLEN_KERNELS:
        bounds = batch.cu_seqlens.tolist()
        return sum((end - start) ** 2 for start, end in itertools.pairwise(bounds)) / 2
    if kernel == "flex":
        return flex_tiles(batch.cu_seqlens, rows * row_len) * FLEX_BLOCK_SIZE**2
    if kernel == "dense":
        return float((rows * row_len) ** 2)
    raise ValueError(f"no FLOP count for attention kernel {kernel!r}")


def flex_tiles(cu_seqlens: torch.Tensor, num_tokens: int) -> int:
    """Tiles FlexAttention computes for these boundaries: partial and full blocks of the model's own
    BlockMask.

    Example: segments [100, 100, 56] (tiles of 128) -> 3: both diagonal tiles, and (1, 0), which shares the
    second document.
    """
    mask = document_block_mask(document_ids(cu_seqlens.to(torch.int32), num_tokens))
    return int(mask.kv_num_blocks.sum() + mask.full_kv_num_blocks.sum())


def matmul_params(model: GPT) -> int:
    """Parameters that multiply every position: all but the learned position table (a lookup); the tied
    embedding counted once (it is the output head). Count before any parallel wrapping (ZeRO-3 partitions)."""
    position_table = model.wpe.weight.numel() if model.wpe is not None else 0
    return model.num_params() - position_table


def recomputed_params(model: GPT, mode: str) -> int:
    """Parameters whose forward backward reruns per position under train.activation_checkpointing=`mode`."""
    if mode == "full":
        return sum(p.numel() for block in model.blocks for p in block.parameters())
    if mode == "selective":  # ln_2 and the MLP (trainer.model.gpt.apply_activation_checkpointing)
        return sum(p.numel() for block in model.blocks
                   for p in [*block.ln_2.parameters(), *block.mlp.parameters()])
    return 0


def flop_model(model: GPT, attention: AttentionConfig, activation_checkpointing: str, device: torch.device,
               dtype: str) -> FlopModel:
    """The run's FlopModel, from the model before wrapping. `auto` is resolved as the model resolves it for
    training on (device, dtype), dtype being train.dtype as run ('bf16' or 'fp32')."""
    kernel = attention.backend
    if kernel == "auto":
        kernel = auto_choice(device, compute_dtype(dtype))[0]
    return FlopModel(
        matmul_params=matmul_params(model), n_layer=model.cfg.n_layer, n_embd=model.cfg.n_embd, kernel=kernel,
        isolate_documents=attention.isolate_documents,
        recompute_params=recomputed_params(model, activation_checkpointing),
        recompute_attention=activation_checkpointing == "full",
    )


def flop_metrics(model_flops: float, hardware_flops: float, seconds: float, peak_flops: float | None) -> dict:
    """A step's FLOP metrics: both counts, and with a known peak (FLOP/s of all devices together) both
    utilizations. Example: 3e14 model, 4e14 hardware, 1 s, peak 1e15 -> mfu 0.3, hfu 0.4."""
    metrics = {"model_flops": model_flops, "hardware_flops": hardware_flops}
    if peak_flops:
        metrics.update(mfu=model_flops / seconds / peak_flops, hfu=hardware_flops / seconds / peak_flops)
    return metrics
