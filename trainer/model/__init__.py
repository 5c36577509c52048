"""The GPT model and its attention adapter: single-device code, no ranks."""

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
    chunked_cross_entropy,
    model_inputs,
    shifted_cross_entropy,
)

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
