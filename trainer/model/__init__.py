"""The model: a single-device GPT that takes packed or padded rows and knows nothing about ranks.

    gpt        the GPT, GPT-2 or Llama family (LayerNorm/RMSNorm, GELU/SwiGLU, learned/RoPE positions, GQA,
               tied or untied head), KV cache for decoding, activation checkpointing
    attention  the one attention interface over every backend (flash, torch varlen, flex, per-document SDPA,
               dense masks); `resolve_backend` says which runs here and why not
    flash      the flash-attn adapter, the only place flash_attn is imported
    loss       summed token cross entropy over unshifted labels: plain, weighted, chunked (logits never whole)
    compile    torch.compile of each block with the attention call left outside the graph
    families/  the Hugging Face classes the GPT computes, one file each: the class, which settings,
               config.json both ways, the tensor names (trainer.checkpoint.hf applies them); `gpt.tensor_plan`
               is how tensor parallelism splits the modules (trainer.distributed.tensor applies it)

It reads the data layer's batch format (trainer.data.batch) and nothing else of the package. Must not
import: torch.distributed, deepspeed, or the distributed, checkpoint, run or config modules.
"""

from trainer.model.attention import (
    BACKENDS,
    AttentionConfig,
    BackendUnavailable,
    Segments,
    block_diagonal_mask,
    document_block_mask,
    document_ids,
    resolve_backend,
    segment_attention,
    to_additive_mask,
    varlen_attention,
)
from trainer.model.flash import flash_varlen_args
from trainer.model.gpt import (
    GPT,
    GPTConfig,
    KVCache,
    ModelOutput,
    apply_activation_checkpointing,
    build_model,
    compute_dtype,
    model_inputs,
)
from trainer.model.loss import chunked_cross_entropy, shifted_cross_entropy

__all__ = [
    "BACKENDS",
    "GPT",
    "AttentionConfig",
    "BackendUnavailable",
    "GPTConfig",
    "KVCache",
    "ModelOutput",
    "Segments",
    "apply_activation_checkpointing",
    "block_diagonal_mask",
    "build_model",
    "chunked_cross_entropy",
    "compute_dtype",
    "document_block_mask",
    "document_ids",
    "flash_varlen_args",
    "model_inputs",
    "resolve_backend",
    "segment_attention",
    "shifted_cross_entropy",
    "to_additive_mask",
    "varlen_attention",
]
