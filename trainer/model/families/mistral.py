"""MistralForCausalLM without its sliding window (sliding_window: null, as Mistral-7B-v0.2 and later ship):
Llama's model and tensor names, no biases; a config with a window is refused (packtrain's attention has
none)."""

from __future__ import annotations

from trainer.model.families.llama import Llama
from trainer.model.gpt import GPTConfig


class Mistral(Llama):
    model_type, hf_class = "mistral", "MistralForCausalLM"

    def computes(self, cfg: GPTConfig) -> bool:
        return super().computes(cfg) and not cfg.bias

    def hf_config(self, cfg: GPTConfig) -> dict:
        return {**self.llama_fields(cfg), "sliding_window": None}

    def variants(self, config: dict) -> dict:
        return {**super().variants(config), "sliding_window": (config.get("sliding_window"), (None,))}

    def biases(self, config: dict) -> dict:
        return {"bias": False, "qkv_bias": None}


FAMILY = Mistral()
