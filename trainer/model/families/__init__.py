"""Model families: each Hugging Face class packtrain's GPT computes, declared in one place
(trainer.checkpoint.hf and trainer.export apply them; the tensor-parallel plan is the model's own,
trainer.model.gpt `tensor_plan`).

    family   `Family`: what a family declares (its class, which GPTConfig settings it computes, its
             config.json both ways, its tensor names as `Piece`s), and the config checks families share
    gpt2     GPT2LMHeadModel
    llama    LlamaForCausalLM (and the config reading the Llama-shaped classes share)
    qwen2    Qwen2ForCausalLM
    mistral  MistralForCausalLM, without a sliding window

Adding a family: a file here with its `FAMILY`, one line in `FAMILIES`, and its tests (docs/architecture.md,
"Adding a model family"). Must not import: torch.distributed, or the distributed, checkpoint, run or config
modules.
"""

from __future__ import annotations

from trainer.model.families import gpt2, llama, mistral, qwen2
from trainer.model.families.family import Family, Piece
from trainer.model.gpt import GPTConfig

FAMILIES: dict[str, Family] = {f.model_type: f
                               for f in (gpt2.FAMILY, llama.FAMILY, qwen2.FAMILY, mistral.FAMILY)}
"""model_type -> family, in the order a config without `model.family` is matched (llama before mistral: a
bias-free Llama-shaped model is exported as LlamaForCausalLM unless its config names mistral)."""


def family_of(cfg: GPTConfig) -> Family:
    """The family of `cfg`: the one its `family` names (which must compute it), else the first that computes
    it; a ValueError naming what each class needs when none does."""
    if cfg.family is not None:
        if cfg.family not in FAMILIES:
            raise ValueError(f"model.family={cfg.family!r} is not a family packtrain knows; families: "
                             f"{', '.join(FAMILIES)} (or null: the first that computes the model)")
        chosen = FAMILIES[cfg.family]
        if not chosen.computes(cfg):
            raise ValueError(f"model.family={cfg.family}: {chosen.hf_class} does not compute this model "
                             f"({_settings(cfg)})")
        return chosen
    for family in FAMILIES.values():
        if family.computes(cfg):
            return family
    raise ValueError(
        f"no Hugging Face class computes this model ({_settings(cfg)}): GPT2LMHeadModel needs "
        "pos_emb=learned, norm=layernorm, mlp=gelu, a tied head and no GQA; LlamaForCausalLM, "
        "Qwen2ForCausalLM and MistralForCausalLM need pos_emb=rope, norm=rmsnorm, mlp=swiglu "
        "(configs/model/llama-tiny.yaml)")


def _settings(cfg: GPTConfig) -> str:
    return (f"pos_emb={cfg.pos_emb}, norm={cfg.norm}, mlp={cfg.mlp}, tie_embeddings={cfg.tie_embeddings}, "
            f"n_kv_head={cfg.n_kv_head}, bias={cfg.bias}, qkv_bias={cfg.qkv_bias}")


__all__ = ["FAMILIES", "Family", "Piece", "family_of"]
