"""trainer.checkpoint.tensors: the non-finite scan (a sum as the fast path, the exact check when it overflows)
and the parameter count a config describes, from two small builds on the meta device."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trainer.checkpoint.tensors import config_params, first_nonfinite
from trainer.model import AttentionConfig, GPTConfig, build_model


def test_the_first_nan_or_inf_is_named_by_its_path_and_huge_finite_values_are_not():
    finite = {"a": torch.ones(3), "b": [torch.zeros(2, 2), {"c": torch.arange(4)}]}
    assert first_nonfinite(finite) is None
    overflowing = torch.full((10,), 3e38)  # its sum is inf: the exact check must clear it
    assert first_nonfinite({"w": overflowing, "bf16": overflowing.to(torch.bfloat16)}) is None
    for value, kind in ((float("nan"), "NaN"), (float("inf"), "inf"), (-float("inf"), "inf")):
        state = {"model": {"x": torch.ones(4)}, "optimizer": {"w": {"exp_avg": torch.ones(2, 3)}}}
        state["optimizer"]["w"]["exp_avg"][1, 2] = value
        assert first_nonfinite(state) == ("optimizer.w.exp_avg", kind)
    both = torch.tensor([float("inf"), -float("inf")])  # their sum is NaN; no element is
    assert first_nonfinite([torch.ones(1), both]) == ("1", "inf")


@pytest.mark.parametrize("cfg", [
    GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, max_seq_len=1024),  # gpt2-124m
    GPTConfig(vocab_size=49152, n_layer=30, n_head=9, n_kv_head=3, n_embd=576, mlp_hidden=1536,
              norm="rmsnorm", mlp="swiglu", pos_emb="rope", tie_embeddings=True,
              max_seq_len=2048),  # SmolLM2-135M's shape
    GPTConfig(vocab_size=61, n_layer=3, n_head=2, n_embd=32, max_seq_len=32, tie_embeddings=False),
])
def test_the_described_count_is_the_built_models_without_building_it(cfg):
    built = build_model(cfg, AttentionConfig(backend="sdpa_docs"), meta=True).num_params()
    assert config_params(cfg) == built
    assert config_params(dataclasses.replace(cfg, n_layer=1_000_000)) > 1000 * built  # counted, not built
