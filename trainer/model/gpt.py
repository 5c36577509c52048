"""A decoder-only transformer, GPT-2 or Llama family, that takes padded rows or packed rows with document
boundaries.

One model class, two families chosen by GPTConfig's fields (presets in configs/model/):
    GPT-2   LayerNorm, GELU MLP, learned positions, biases, multi-head attention, head tied to the embedding
    Llama   RMSNorm, SwiGLU MLP, rotary positions (HF's rotate-half layout, the config's theta and scaling),
            grouped-query attention (n_kv_head < n_head), untied head; Qwen2 adds q/k/v biases (qkv_bias)
The parameter names are the same in both (trainer.checkpoint.hf maps them to each family's Hugging Face
names).

Single-device code: no ranks, no process groups. Parallel wrapping happens after `build_model`.

Two layouts reach `GPT.forward`:
    padded  (cu_seqlens=None)  one sequence per row, causal attention within each row.
    packed  (cu_seqlens given) several documents per row; the (B, L) positions are flattened to B * L
            tokens and attention stays inside each segment of cu_seqlens (see trainer.model.attention).
Labels arrive unshifted (-100 at each segment start and on padding) and are shifted here, so the loss is
the same sum over the same targets in both layouts; the caller divides by its own count of targets.

Decoding (trainer.generate) passes a `KVCache` on the padded path: each forward appends its keys and values,
and the next one attends to them instead of recomputing the prefix.

Two memory options, neither of which changes the loss or the gradients: `loss_chunk_tokens`
(loss.chunk_tokens) computes the head and the loss a chunk of positions at a time, never holding all
(B * L, V) logits (trainer.model.loss.chunked_cross_entropy); `apply_activation_checkpointing`
(train.activation_checkpointing) makes the blocks recompute their activations in backward instead of storing
them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer.data.batch import Batch
from trainer.errors import ConfigError, require_range
from trainer.model.attention import AttentionConfig, AttentionContext, Segments, TreeSegments, attend_within
from trainer.model.loss import WHOLE_VOCAB, chunked_cross_entropy_sums, cross_entropy_sums, next_token_targets

POS_EMBS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
ROPE_SCALINGS = ("default", "linear", "llama3")
"""rope_scaling types computed here (transformers' rope_type names); any other is refused."""
COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""train.dtype as run ('auto' resolved) -> the dtype matmuls and attention compute in: bf16 is autocast over
fp32 weights and optimizer state. The one place that mapping is written."""
ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


@dataclass
class GPTConfig:
    """Model shape. Sizes live in configs/model/*.yaml with the same keys."""

    vocab_size: int | None = None
    """Embedding rows; None = take the tokenizer's vocabulary size at build time (see `build_model`)."""
    n_layer: int = 12
    """Transformer blocks."""
    n_head: int = 12
    """Attention heads per block; n_embd must divide by it."""
    n_embd: int = 768
    """Width of the residual stream."""
    max_seq_len: int = 1024
    """Longest row length L the model accepts; sizes the learned position table."""
    dropout: float = 0.0
    """Dropout on embeddings and residual branches (none inside attention: varlen kernels differ in
    support)."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers, as in GPT-2."""
    pos_emb: str = "learned"
    """'learned' absolute position embeddings (GPT-2) or 'rope' rotary embeddings applied to q and k."""
    rope_theta: float = 10000.0
    """RoPE base: frequencies are theta^(-2i / head_dim). Unused with learned embeddings."""
    init_std: float = 0.02
    """Std of the normal init; residual output projections get init_std / sqrt(2 * n_layer)."""
    norm: str = "layernorm"
    """'layernorm' (GPT-2; its bias follows `bias`) or 'rmsnorm' (Llama; no bias), before each sub-block and
    the head."""
    norm_eps: float = 1e-5
    """The norms' epsilon (GPT-2 1e-5; Llama-family configs say theirs: rms_norm_eps)."""
    mlp: str = "gelu"
    """'gelu' (GPT-2: c_proj(gelu_tanh(c_fc(x)))) or 'swiglu' (Llama: down(silu(gate(x)) * up(x)), gate and up
    fused in c_fc)."""
    mlp_hidden: int | None = None
    """The MLP's inner width (Llama's intermediate_size); None = 4 * n_embd."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention: each serves n_head / n_kv_head query heads);
    None = n_head."""
    qkv_bias: bool | None = None
    """Biases on the q/k/v projection alone (Qwen2: true with bias false); None = `bias`."""
    tie_embeddings: bool = True
    """The output head shares the token embedding's weights (GPT-2, SmolLM2, Qwen2.5-0.5B); false = its own
    (Llama-2/3 at 7B+, and what `lm_head.weight` in a checkpoint then holds)."""
    rope_scaling: dict | None = None
    """RoPE frequency scaling as transformers' config states it ({"rope_type": "llama3", "factor": 32.0, ...},
    or "linear"); None = plain RoPE. Only with pos_emb=rope."""
    family: str | None = None
    """The Hugging Face family the model is exported as (trainer.model.families: 'gpt2', 'llama', 'qwen2',
    'mistral'), set when it was imported from one; None = the first family that computes it. Names a class,
    not a weight: the model it builds is the same."""

    def __post_init__(self) -> None:
        for key, allowed in (("pos_emb", POS_EMBS), ("norm", NORMS), ("mlp", MLPS)):
            if getattr(self, key) not in allowed:
                raise ValueError(f"model.{key} must be one of {allowed}, got {getattr(self, key)!r}")
        if self.vocab_size is not None:
            require_range("model.vocab_size", self.vocab_size, 1)
        for key in ("n_layer", "n_head", "n_embd", "max_seq_len"):
            require_range(f"model.{key}", getattr(self, key), 1)
        require_range("model.dropout", self.dropout, 0, 1, high_open=True)
        require_range("model.rope_theta", self.rope_theta, 0, low_open=True)
        require_range("model.init_std", self.init_std, 0, low_open=True)
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd={self.n_embd} is not divisible by model.n_head={self.n_head}")
        if self.pos_emb == "rope" and (self.n_embd // self.n_head) % 2:
            raise ValueError("model.pos_emb=rope needs an even head dimension, got "
                             f"model.n_embd / model.n_head = {self.n_embd // self.n_head}")
        require_range("model.norm_eps", self.norm_eps, 0, low_open=True)
        if self.family is not None and not isinstance(self.family, str):
            raise ValueError(f"model.family must be a family's name or null, got {self.family!r}")
        if self.mlp_hidden is not None:
            require_range("model.mlp_hidden", self.mlp_hidden, 1)
        if self.n_kv_head is not None:
            require_range("model.n_kv_head", self.n_kv_head, 1)
            if self.n_head % self.n_kv_head:
                raise ValueError(f"model.n_head={self.n_head} is not divisible by "
                                 f"model.n_kv_head={self.n_kv_head}")
        if self.rope_scaling is not None:
            if self.pos_emb != "rope":
                raise ValueError("model.rope_scaling scales rotary positions: it needs model.pos_emb=rope, "
                                 f"got {self.pos_emb!r}")
            rope_inv_freq(self)  # the scaling's own checks, one line each

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads: n_kv_head, or n_head without grouped-query attention."""
        return self.n_kv_head or self.n_head

    @property
    def hidden(self) -> int:
        """The MLP's inner width."""
        return self.mlp_hidden or 4 * self.n_embd


@dataclass
class ModelOutput:
    logits: torch.Tensor | None
    """(B, L, V) next-token logits, or None with return_logits=False (and by default when the loss is
    chunked)."""
    loss_sum: torch.Tensor | None
    """fp32 scalar: summed cross entropy over valid targets (labels given), else None."""
    num_targets: torch.Tensor | None
    """int64 scalar: how many targets were summed, for the caller's denominator."""
    weighted_loss_sum: torch.Tensor | None = None
    """fp32 scalar: sum of loss_weights[t] * cross entropy of target t (loss_weights given), else None."""
    group_loss_sums: torch.Tensor | None = None
    """(G,) fp32, detached: the summed cross entropy of each loss group's targets (loss_groups given), else
    None."""


# ---------------------------------------------------------------------------------------------------
# Rotary position embeddings
# ---------------------------------------------------------------------------------------------------


def rope_inv_freq(cfg: GPTConfig, device: torch.device | str | None = None) -> torch.Tensor:
    """The (head_dim / 2,) fp32 rotation frequencies theta^(-2i / head_dim), scaled as cfg.rope_scaling says.

    'linear' divides every frequency by `factor`; 'llama3' (Llama-3.1/3.2) divides the low frequencies
    (wavelength above original_max_position_embeddings / low_freq_factor) by `factor`, keeps the high ones
    (wavelength below .../ high_freq_factor) and interpolates between: transformers'
    _compute_llama3_parameters, written again. Computed where it is used (`device`), in each forward: D / 2
    numbers, never a buffer that model.to(bf16) rounds.
    """
    D = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.int64, device=device).float() / D))
    scaling = dict(cfg.rope_scaling or {})
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"model.rope_scaling: rope_type {kind!r} is not supported; "
                         f"supported: {ROPE_SCALINGS}")
    if kind == "default":
        return inv_freq

    def number(key: str) -> float:
        value = scaling.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ValueError(f"model.rope_scaling: rope_type {kind!r} needs a positive number {key}, "
                             f"got {value!r}")
        return float(value)

    factor = number("factor")
    if kind == "linear":
        return inv_freq / factor
    low, high, old = (number("low_freq_factor"), number("high_freq_factor"),
                      number("original_max_position_embeddings"))
    if high <= low:
        raise ValueError(f"model.rope_scaling: high_freq_factor ({high}) must exceed low_freq_factor ({low})")
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the rotation angles, each (B, L, 1, head_dim / 2) in fp32, from (B, L) positions.

    Positions may reset at each document: with isolated attention only differences of positions within
    one document enter q . k, so a constant offset per document changes nothing (up to rounding).
    """
    angles_BLF = position_ids.to(torch.float32)[..., None] * inv_freq  # (B, L, D/2)
    return angles_BLF.cos()[:, :, None, :], angles_BLF.sin()[:, :, None, :]


def apply_rope(x_BLHD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) by the position's angle (the GPT-NeoX / Llama "rotate half" layout)."""
    x1, x2 = x_BLHD.float().chunk(2, dim=-1)  # (B, L, H, D/2) each
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x_BLHD.dtype)


# ---------------------------------------------------------------------------------------------------
# Key/value cache for incremental decoding
# ---------------------------------------------------------------------------------------------------


class LayerCache:
    """One block's keys and values of every position decoded so far, each (B, T, H, D)."""

    def __init__(self) -> None:
        self.k_BTHD: torch.Tensor | None = None
        self.v_BTHD: torch.Tensor | None = None

    def append(self, k_BLHD: torch.Tensor, v_BLHD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the L new positions; returns the keys and values of all T positions, new ones last."""
        if self.k_BTHD is not None:
            k_BLHD, v_BLHD = torch.cat([self.k_BTHD, k_BLHD], dim=1), torch.cat([self.v_BTHD, v_BLHD], dim=1)
        self.k_BTHD, self.v_BTHD = k_BLHD, v_BLHD
        return k_BLHD, v_BLHD


class KVCache:
    """Keys and values of the positions seen so far, one `LayerCache` per block, for the padded path.

    The first forward with a fresh cache (the prompt, "prefill") is the ordinary causal forward; each later
    one appends its positions, which attend to every cached position and causally among themselves. Position
    ids continue from `length`. Example, a prompt of 5 tokens, then one token at a time:
        model(ids_B5, cache=c)         positions 0..4, c.length == 5
        model(next_B1, cache=c)        position 5, attends to 0..5, c.length == 6
    """

    def __init__(self, n_layer: int) -> None:
        self.layers = [LayerCache() for _ in range(n_layer)]
        self.length = 0
        """Positions cached (every layer holds this many)."""


def cached_attention(q_BLHD: torch.Tensor, k_BTHD: torch.Tensor, v_BTHD: torch.Tensor) -> torch.Tensor:
    """Attention of L new positions over T = past + L keys (the last L are the new ones); (B, L, H, D).

    New position i sits at past + i and sees keys 0..past + i. Example, past 3, L 2: query 0 sees keys
    0..3, query 1 sees 0..4. SDPA's is_causal aligns the mask top-left, right only when T == L (prefill).
    """
    L, T = q_BLHD.shape[1], k_BTHD.shape[1]
    q, k, v = q_BLHD.transpose(1, 2), k_BTHD.transpose(1, 2), v_BTHD.transpose(1, 2)  # (B, H, ·, D)
    if T == L:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:  # one new token (L == 1) sees every key: no mask needed
        mask_LT = None if L == 1 else torch.ones(L, T, dtype=torch.bool, device=q.device).tril(T - L)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_LT)
    return y.transpose(1, 2)


# ---------------------------------------------------------------------------------------------------
# Blocks
# ---------------------------------------------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    attend = staticmethod(attend_within)
    """The document-causal attention call; train.compile sets an instance's to a torch.compiler.disable'd one
    (trainer/model/compile.py)."""

    def __init__(self, cfg: GPTConfig, attention: AttentionConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.attention = attention
        # q | k | v fused, in that order, each head-major: (n_head + 2 n_kv_head) * head_dim outputs.
        qkv_bias = cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias
        self.c_attn = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=qkv_bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None,
        segments: AttentionContext | None, cache: LayerCache | None = None,
    ) -> torch.Tensor:
        H, KV, D = self.n_head, self.n_kv_head, self.head_dim
        qkv = self.c_attn(x)
        # under sequence parallelism x holds 1/N of the positions, c_attn gathers them all
        B, L = qkv.shape[:2]
        q, k, v = qkv.split([H * D, KV * D, KV * D], dim=-1)
        q, k, v = q.view(B, L, H, D), k.view(B, L, KV, D), v.view(B, L, KV, D)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:  # decoding: attend to the cached positions too (padded path only)
            k, v = cache.append(k, v)  # the cache holds the KV heads, not their copies
        # Grouped-query attention: query head h reads kv head h // (H / KV), as transformers' repeat_kv. The
        # copies let every backend and context-parallel strategy run unchanged (ulysses then splits H heads,
        # never KV).
        k, v = repeat_kv(k, H // KV), repeat_kv(v, H // KV)
        if cache is not None:
            y = cached_attention(q, k, v)
        elif segments is None:
            # Padded rows, or packed rows under one causal mask (isolate_documents=False).
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            y = y.transpose(1, 2)  # (B, H, L, D) -> (B, L, H, D)
        else:
            flat = (B * L, H, D)
            y = self.attend(
                q.reshape(flat), k.reshape(flat), v.reshape(flat), segments,
                self.attention.backend, self.attention.flex_compile,
            )  # (B * L, H, D)
        return self.resid_dropout(self.c_proj(y.reshape(B, L, H * D)))


def repeat_kv(x_BLKD: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, L, KV, D) -> (B, L, KV * n_rep, D), each kv head repeated n_rep times in place
    (head h <- h // n_rep)."""
    return x_BLKD if n_rep == 1 else x_BLKD.repeat_interleave(n_rep, dim=2)


class MLP(nn.Module):
    """'gelu': c_proj(gelu_tanh(c_fc(x))). 'swiglu': c_fc holds gate | up (2 * hidden outputs, gate first);
    c_proj(silu(gate) * up)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        self.c_fc = nn.Linear(cfg.n_embd, (2 if self.swiglu else 1) * cfg.hidden, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.hidden, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = self.c_fc(x).chunk(2, dim=-1)
            return self.dropout(self.c_proj(F.silu(gate) * up))
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32 and cast back before the weight (transformers'
    LlamaRMSNorm, so bf16 rounds where it does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.n_embd, cfg.norm_eps)
    return nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig, attention: AttentionConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg, attention)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.recompute = "none"
        """What backward recomputes instead of storing: 'none', 'full' (the block) or 'selective' (ln_2 +
        MLP); set by `apply_activation_checkpointing`."""

    def forward(
        self, x: torch.Tensor, rope, segments: AttentionContext | None, cache: LayerCache | None = None
    ) -> torch.Tensor:
        if self.recompute == "full" and cache is None and torch.is_grad_enabled():
            return checkpoint(self._forward, x, rope, segments, use_reentrant=False)
        return self._forward(x, rope, segments, cache)

    def _forward(self, x: torch.Tensor, rope, segments: AttentionContext | None,
                 cache: LayerCache | None = None):
        x = x + self.attn(self.ln_1(x), rope, segments, cache)
        if self.recompute == "selective" and torch.is_grad_enabled():
            return x + checkpoint(self._mlp, x, use_reentrant=False)
        return x + self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_2(x))


# ---------------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------------


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, attention: AttentionConfig | None = None,
                 loss_chunk_tokens: int = 0) -> None:
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size is None: build through "
                             "build_model(..., vocab_size=tokenizer size)")
        self.cfg = cfg
        self.init_rng = torch.get_rng_state()
        """The CPU RNG's state when the build began: the init draws from it (`init_weights`), on any
        device."""
        self.attention = attention or AttentionConfig()
        self.loss_chunk_tokens = loss_chunk_tokens
        """> 0: the loss is computed this many flat positions at a time, without logits (see
        chunked_cross_entropy). A training setting, not part of the weights or the config saved with them."""
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.max_seq_len, cfg.n_embd) if cfg.pos_emb == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, self.attention) for _ in range(cfg.n_layer))
        self.ln_f = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight  # tied input and output embeddings
        self.vocab = WHOLE_VOCAB
        """Which columns of the vocabulary the head's logits are, the loss computed on them: all of them
        (trainer.model.loss.WholeVocab), or under tensor parallelism this rank's
        (a trainer.distributed.tensor.
        VocabShard, set by apply_tensor_parallel)."""
        self.init_plan = init_plan(self)
        """(parameter name, 'normal' | 'fill', std or value), in the order the init draws them
        (`init_weights`)."""
        self.whole_shapes = {name: tuple(p.shape)
                             for name, p in self.named_parameters(remove_duplicate=False)}
        """Each parameter's shape in this, the unsplit model (a split one holds a slice of it)."""
        # what the modules' own constructors drew is dropped: the plan alone draws
        torch.set_rng_state(self.init_rng)
        # on the meta device this draws nothing: trainer.distributed.engine.materialize does
        init_weights(self)

    def num_params(self) -> int:
        """Parameters, the tied embedding counted once."""
        return sum(p.numel() for p in self.parameters())

    @property
    def tied_keys(self) -> tuple[str, ...]:
        """Parameter names that name another one's tensor (the tied head, under tie_embeddings), left out of
        saved weights."""
        first = {name for name, _ in self.named_parameters()}
        return tuple(name for name, _ in self.named_parameters(remove_duplicate=False) if name not in first)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        return_logits: bool | None = None,
        loss_weights: torch.Tensor | None = None,
        cache: KVCache | None = None,
        loss_groups: torch.Tensor | None = None,
        num_loss_groups: int = 0,
        attention_context: AttentionContext | None = None,
        targets: torch.Tensor | None = None,
    ) -> ModelOutput:
        """input_ids, position_ids, labels: (B, L). cu_seqlens: (S + 1,) int32 over the B * L flat positions.

        cu_seqlens=None: padded rows, causal within each row. Given: packed rows, causal within each
        segment (or within each row when AttentionConfig.isolate_documents is False); max_seqlen is then
        required, a host int from the Batch. position_ids=None means 0..L-1 in every row.
        loss_weights (B, L), aligned with labels: also return the weighted sum of the token losses.
        loss_groups (B, L) int64, aligned with labels (-1: none): also return the summed token loss of each of
        the num_loss_groups groups (a metric: per source x document-length bucket,
        trainer.data.batch.LossGroups).
        return_logits: None returns them unless the loss is chunked (loss_chunk_tokens > 0 and labels given)
        or split over tensor ranks (`vocab`), where they never exist whole; True always returns them (the
        plain loss path; gathered over the tensor group); False never does.
        cache: decode on the padded path, appending to (and attending over) the cache; position_ids=None
        then means cache.length .. cache.length + L - 1 (see `KVCache`).
        attention_context: what each attention layer attends within when the boundaries are not the rows'
        cu_seqlens (trainer.model.attention.AttentionContext: its `attend(q, k, v, backend, flex_compile)`),
        e.g. this rank's share of whole rows under context parallelism, which a micro-batch's row plan puts
        into these kwargs (`model_inputs`), with `targets` instead of labels.
        targets (B, L): what each position predicts, already aligned with the positions (trainer.model.loss.
        next_token_targets, made on whole rows before a shard cuts them), with loss_weights and loss_groups
        aligned the same way; give labels or targets, not both. The model itself imports no torch.distributed.
        """
        if labels is not None:  # the one shift: position t predicts labels[t + 1]
            if targets is not None:
                raise ValueError("give labels (unshifted) or targets (aligned with the positions), not both")
            targets, loss_weights, loss_groups = next_token_targets(labels, loss_weights, loss_groups)
        B, L = input_ids.shape
        past = 0 if cache is None else cache.length
        if past + L > self.cfg.max_seq_len:
            what = f"{past} cached + {L} new positions" if cache is not None else f"rows of length {L}"
            raise ValueError(f"{what} exceed max_seq_len={self.cfg.max_seq_len}")
        if cache is not None and cu_seqlens is not None:
            raise ValueError("a KVCache decodes padded rows: pass cu_seqlens=None")
        if position_ids is None:
            position_ids = torch.arange(past, past + L, device=input_ids.device).expand(B, L)
        segments = attention_context
        if attention_context is not None and (cu_seqlens is not None or cache is not None):
            raise ValueError("an attention_context carries its own boundaries: "
                             "pass cu_seqlens=None, no cache")
        if attention_context is None and cu_seqlens is not None and self.attention.isolate_documents:
            if max_seqlen is None:
                raise ValueError("packed rows need max_seqlen (a Python int computed with cu_seqlens)")
            segments = Segments(cu_seqlens, max_seqlen)

        x = self.wte(input_ids)  # (B, L, C)
        if self.wpe is not None:
            x = x + self.wpe(position_ids)
        rope = None
        if self.cfg.pos_emb == "rope":
            rope = rope_cos_sin(position_ids, rope_inv_freq(self.cfg, input_ids.device))
        x = self.drop(x)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, segments, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.length += L
        h = self.ln_f(x)  # (B, L, C)

        # the logits never exist whole
        if self.loss_chunk_tokens and targets is not None and not return_logits:
            loss_sum, num_targets, weighted, grouped = chunked_cross_entropy_sums(
                h, self.lm_head.weight, targets, loss_weights, self.loss_chunk_tokens, loss_groups,
                num_loss_groups, self.vocab)
            return ModelOutput(logits=None, loss_sum=loss_sum, num_targets=num_targets,
                               weighted_loss_sum=weighted, group_loss_sums=grouped)
        logits = self.lm_head(h)  # (B, L, V), or (B, L, V / N) under tensor parallelism
        loss_sum = num_targets = weighted = grouped = None
        if targets is not None:  # one token-loss tensor; the weighted and per-group sums are reductions of it
            loss_sum, num_targets, weighted, grouped = cross_entropy_sums(
                logits, targets, loss_weights, loss_groups, num_loss_groups, self.vocab)
        return ModelOutput(logits=self.vocab.returned(logits, return_logits), loss_sum=loss_sum,
                           num_targets=num_targets, weighted_loss_sum=weighted, group_loss_sums=grouped)


@dataclass(frozen=True)
class TensorPlan:
    """How tensor parallelism splits this model: declared here, beside the modules it names, and applied by
    trainer/distributed/tensor.py, which names no module itself. N is the tensor group's size.

    Example (2 layers, GPT-2 MLP, 4 heads of 16, 2 kv heads): column {"blocks.0.attn.c_attn": (64, 32, 32),
    "blocks.0.mlp.c_fc": (256,), ...}, row {"blocks.0.attn.c_proj": (64,), "blocks.0.mlp.c_proj": (256,),
    ...}."""

    column: dict[str, tuple[int, ...]]
    """Linear modules split by output rows; the parts of the rows (fused q | k | v: three), each cut N ways,
    so that rank t holds slice t of every part (its heads' q, k and v), and its bias with them."""
    row: dict[str, tuple[int, ...]]
    """Linear modules split by input columns (the parts, as `column`'s); their partial outputs are summed,
    their bias whole."""
    vocab: tuple[str, str]
    """(the token embedding, the output head): their rows, the vocabulary padded to a multiple of N, cut N
    ways; a head tied to the embedding stays tied."""
    counts: dict[str, tuple[str, ...]]
    """Module -> the attributes that count what a column split divides (attention's heads): each divided by
    N."""
    positions: tuple[str, str]
    """(the module after whose output the residual stream is split by position, the one after whose output it
    is whole again): the modules between run on 1/N of the positions, their whole weights' gradients partial
    sums."""

    def split_modules(self) -> dict[str, tuple[int, ...]]:
        return {**self.column, **self.row}


def tensor_plan(cfg: GPTConfig) -> TensorPlan:
    """The `TensorPlan` of a GPT of `cfg`: attention and MLP in Megatron-LM's layout (q|k|v and gate|up each
    split by part, so a rank holds whole heads and whole MLP columns), the vocabulary split, the blocks and
    the final norm sequence-parallel."""
    H, KV, D, hidden = cfg.n_head, cfg.kv_heads, cfg.head_dim, cfg.hidden
    fc = (hidden, hidden) if cfg.mlp == "swiglu" else (hidden,)  # gate | up
    column, row, counts = {}, {}, {}
    for i in range(cfg.n_layer):
        block = f"blocks.{i}."
        column[block + "attn.c_attn"], row[block + "attn.c_proj"] = (H * D, KV * D, KV * D), (H * D,)
        column[block + "mlp.c_fc"], row[block + "mlp.c_proj"] = fc, (hidden,)
        counts[block + "attn"] = ("n_head", "n_kv_head")
    return TensorPlan(column=column, row=row, vocab=("wte", "lm_head"), counts=counts,
                      positions=("drop", "ln_f"))


def init_plan(model: GPT) -> list[tuple[str, str, float]]:
    """The init of every parameter, in the order it draws from the RNG: each module after its children (as
    nn.Module.apply visits them) -- Linear weights normal(0, init_std) and biases zero, embeddings normal,
    norms one (and their biases zero) -- then every residual output projection (c_proj.weight) drawn again
    with init_std / sqrt(2 n_layer) (GPT-2). A tied head is drawn again over the embedding, as GPT-2's init
    does."""
    std = model.cfg.init_std
    plan: list[tuple[str, str, float]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            visit(f"{prefix}{name}.", child)
        if isinstance(module, nn.Linear | nn.Embedding):
            plan.append((prefix + "weight", "normal", std))
        elif isinstance(module, nn.LayerNorm | RMSNorm):
            plan.append((prefix + "weight", "fill", 1.0))
        if getattr(module, "bias", None) is not None:
            plan.append((prefix + "bias", "fill", 0.0))

    visit("", model)
    plan += [(name, "normal", std / math.sqrt(2 * model.cfg.n_layer)) for name, _ in model.named_parameters()
             if name.endswith("c_proj.weight")]
    covered = {name for name, _, _ in plan}
    missing = [name for name, _ in model.named_parameters(remove_duplicate=False) if name not in covered]
    if missing:
        raise RuntimeError(f"init_plan has no init for {missing}: add their module type to it")
    return plan


def init_weights(model: GPT, shard=None) -> None:
    """Draw every parameter as `model.init_plan` says, one whole tensor at a time on the CPU, from the global
    RNG.

    shard(name, whole) -> what this rank holds of it (a slice under tensor parallelism or FSDP2), copied into
    the parameter; None: the whole. Any layout then holds exactly the one-rank model's weights (the same
    draws, the same order), and no more than one whole tensor ever exists at once.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, kind, value in model.init_plan:
            whole = params[name] if shard is None else torch.empty(model.whole_shapes[name])  # drawn in place
            whole.normal_(0.0, value) if kind == "normal" else whole.fill_(value)
            if shard is not None:
                params[name].copy_(shard(name, whole))


def compute_dtype(train_dtype: str) -> torch.dtype:
    """What the model computes in under train.dtype `train_dtype` ('fp32' or 'bf16', 'auto' resolved first by
    trainer.config.resolve_dtype). Example: compute_dtype("bf16") -> torch.bfloat16."""
    if train_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"train.dtype as run must be one of {tuple(COMPUTE_DTYPES)}, got {train_dtype!r}")
    return COMPUTE_DTYPES[train_dtype]


def build_model(cfg: GPTConfig, attention: AttentionConfig, vocab_size: int | None = None,
                loss_chunk_tokens: int | None = 0, meta: bool = False) -> GPT:
    """The model for `cfg`, with `cfg.vocab_size = None` filled from `vocab_size` (the tokenizer's).

    loss_chunk_tokens (loss.chunk_tokens; 0 or None = off): compute the loss without materializing the logits.
    meta: build it on the meta device (shapes, no storage, no RNG drawn);
    trainer.distributed.engine.parallelize materializes each rank's part after splitting it, with the weights
    a CPU build would have drawn.

    A set cfg.vocab_size wins (e.g. padded up to a multiple of 64 for faster matmuls) but must hold the
    tokenizer's ids.
    """
    if cfg.vocab_size is None:
        if vocab_size is None:
            raise ValueError("vocab_size is null in the model config: "
                             "pass the tokenizer's vocab_size to build_model")
        cfg = dataclasses.replace(cfg, vocab_size=vocab_size)
    elif vocab_size is not None and cfg.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={cfg.vocab_size} cannot hold the tokenizer's {vocab_size} ids: "
                          f"set model.vocab_size=null (the tokenizer's size) or >= {vocab_size}")
    if meta:
        with torch.device("meta"):
            return GPT(cfg, attention, loss_chunk_tokens=loss_chunk_tokens or 0)
    return GPT(cfg, attention, loss_chunk_tokens=loss_chunk_tokens or 0)


def apply_activation_checkpointing(model: GPT, mode: str) -> GPT:
    """Trade compute for memory: each block's activations are recomputed in backward instead of stored.

    'none'       everything stored (the default).
    'full'       each block stores only its input and reruns its whole forward in backward (~+1/3 compute).
    'selective'  each block's MLP sub-block (ln_2, c_fc, GELU, c_proj, dropout) is recomputed; attention's
                 activations are kept. The MLP holds most of a block's activations (its 4C-wide c_fc and GELU
                 outputs), and rerunning it is plain matmuls, never an attention kernel (the per-document loop
                 of sdpa_docs, flash, varlen): about half the saving of 'full' for about half its extra
                 compute.
    torch.utils.checkpoint (use_reentrant=False) restores the RNG state for the recompute, so dropout masks
    and gradients are the same as without. Applied in place, before any parallel wrapping; parameter names
    (and so checkpoints) are unchanged. Returns the model.
    """
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation checkpointing must be one of {ACTIVATION_CHECKPOINTING}, got {mode!r}")
    for block in model.blocks:
        block.recompute = mode
    return model


def model_inputs(batch: Batch, packed: bool | None = None) -> dict:
    """Forward kwargs for a Batch: packed layouts pass their boundaries, the others go the padded path.

    packed=None follows batch.layout ('packed' -> cu_seqlens/max_seqlen; 'unpacked'/'bucketed' -> None).
    Example: model(**model_inputs(batch)).loss_sum / batch.num_valid_targets
    A batch with a row plan (Batch.plan: context parallelism) gives this rank's share of its positions
    instead.
    """
    if batch.layout == "tree":  # scoring: each tree's branches see its trunk and themselves (TreeSegments)
        return dict(input_ids=batch.input_ids, position_ids=batch.position_ids,
                    attention_context=TreeSegments(batch.cu_seqlens, batch.max_seqlen,
                                                   batch.branches.reshape(-1)))
    if packed is None:
        packed = batch.layout == "packed"
    inputs = dict(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        labels=batch.labels,
        cu_seqlens=batch.cu_seqlens if packed else None,
        max_seqlen=batch.max_seqlen if packed else None,
    )
    if batch.loss_weights is not None:
        inputs["loss_weights"] = batch.loss_weights
    if batch.loss_groups is not None:
        inputs["loss_groups"], inputs["num_loss_groups"] = batch.loss_groups, batch.num_loss_groups
    return inputs if batch.plan is None else batch.plan.cut(inputs)  # this rank's positions (Batch.plan)
