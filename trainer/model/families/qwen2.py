"""Qwen2ForCausalLM: Llama's model with biases on q, k and v alone (qkv_bias=true, bias=false);
no sliding window."""

from __future__ import annotations

from trainer.model.families.llama import Llama
from trainer.model.gpt import GPTConfig


class Qwen2(Llama):
    model_type, hf_class = "qwen2", "Qwen2ForCausalLM"

    def computes(self, cfg: GPTConfig) -> bool:
        qkv_bias = cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias
        return (cfg.pos_emb, cfg.norm, cfg.mlp) == ("rope", "rmsnorm", "swiglu") and qkv_bias and not cfg.bias

    def hf_config(self, cfg: GPTConfig) -> dict:
        return {**self.llama_fields(cfg), "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": cfg.n_layer}

    def biases(self, config: dict) -> dict:
        return {"bias": False, "qkv_bias": True}


FAMILY = Qwen2()
