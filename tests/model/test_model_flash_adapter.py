"""The flash-attn and torch varlen adapters without their kernels: arguments and dispatch.

flash-attn cannot be installed on the CPU test machine. These tests check what the adapter would pass;
tests/test_gpu.py runs the real kernels on CUDA.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trainer.model import attention, flash
from trainer.model.attention import BackendUnavailable, torch_varlen_args, varlen_attention
from trainer.model.flash import flash_varlen_args, flash_varlen_attention


def flat_qkv(n: int = 12, heads: int = 2, head_dim: int = 8):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(n, heads, head_dim, generator=g) for _ in range(3)]


def test_flash_varlen_args_have_the_kernels_types():
    q, k, v = flat_qkv()
    cu = torch.tensor([0, 3, 5, 12], dtype=torch.int64)  # int64 on purpose: the adapter casts
    args = flash_varlen_args(q, k, v, cu, np.int64(7))
    assert set(args) == {"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                         "causal"}
    assert args["q"] is q and args["k"] is k and args["v"] is v
    assert args["q"].shape == (12, 2, 8)  # (total_tokens, heads, head_dim)
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        assert args[name].dtype == torch.int32 and args[name].device == q.device
        assert args[name].tolist() == [0, 3, 5, 12]
    assert (type(args["max_seqlen_q"]) is int and type(args["max_seqlen_k"]) is int
            and args["max_seqlen_q"] == 7)
    assert args["causal"] is True


def test_flash_varlen_args_reject_mismatched_shapes():
    q, k, v = flat_qkv()
    with pytest.raises(ValueError, match="one \\(N, H, D\\) shape"):
        flash_varlen_args(q, k[:5], v, torch.tensor([0, 12]), 12)
    with pytest.raises(ValueError, match="cu_seqlens"):
        flash_varlen_args(q, k, v, torch.tensor([12]), 12)


def fake_flash_module(calls: list):
    def flash_attn_varlen_func(**kwargs):
        calls.append(kwargs)
        return kwargs["q"] * 2
    return SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func)


def test_flash_adapter_calls_the_kernel_with_exactly_those_args(monkeypatch):
    calls: list[dict] = []
    monkeypatch.setattr(flash, "_import_flash_attn", lambda: (fake_flash_module(calls), None))
    q, k, v = flat_qkv()
    cu = torch.tensor([0, 3, 5, 12], dtype=torch.int32)
    out = flash_varlen_attention(q, k, v, cu, 7)
    assert torch.equal(out, q * 2) and len(calls) == 1
    expected = flash_varlen_args(q, k, v, cu, 7)
    assert calls[0].keys() == expected.keys()
    for name, value in expected.items():
        got = calls[0][name]
        assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value, name


def test_flash_backend_dispatches_through_varlen_attention(monkeypatch):
    """With flash 'available' (device check patched away), the adapter routes to the flash kernel."""
    calls: list[dict] = []
    monkeypatch.setattr(flash, "_import_flash_attn", lambda: (fake_flash_module(calls), None))
    monkeypatch.setattr(flash, "flash_unavailable_reason", lambda device, dtype: None)
    q, k, v = flat_qkv()
    varlen_attention(q, k, v, torch.tensor([0, 3, 5, 12], dtype=torch.int32), 7, backend="flash")
    assert len(calls) == 1 and calls[0]["causal"] is True and calls[0]["max_seqlen_k"] == 7


@pytest.mark.skipif(flash.flash_attn_import_error() is None, reason="flash-attn is installed here")
def test_flash_requested_without_flash_attn_names_what_is_missing():
    reason = flash.flash_unavailable_reason(torch.device("cuda"), torch.bfloat16)
    assert "flash-attn" in reason and "packtrain[flash]" in reason
    with pytest.raises(RuntimeError, match="flash-attn package"):
        flash_varlen_attention(*flat_qkv(), torch.tensor([0, 12], dtype=torch.int32), 12)
    with pytest.raises(BackendUnavailable, match="'flash'"):
        attention.resolve_backend("flash", torch.device("cuda"), torch.bfloat16)


def test_torch_varlen_args_bind_to_the_installed_signature():
    varlen_attn = attention._torch_varlen_fn()
    if varlen_attn is None:
        pytest.skip(f"torch {torch.__version__} has no torch.nn.attention.varlen")
    q, k, v = flat_qkv()
    args = torch_varlen_args(q, k, v, torch.tensor([0, 3, 12]), 9, varlen_attn)
    bound = inspect.signature(varlen_attn).bind(**args)  # raises if a name is wrong for this torch
    assert (bound.arguments["cu_seq_q"].dtype == torch.int32
            and bound.arguments["cu_seq_q"] is args["cu_seq_k"])
    assert bound.arguments["max_q"] == bound.arguments["max_k"] == 9
    causal = args.get("is_causal") is True or args.get("window_size") == (-1, 0)
    assert causal, args


def test_torch_varlen_args_follow_the_older_is_causal_spelling():
    def old_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False):
        raise AssertionError("not called")

    args = torch_varlen_args(*flat_qkv(), torch.tensor([0, 12]), 12, old_varlen_attn)
    assert args["is_causal"] is True and "window_size" not in args


def test_flash_qk_args_take_separate_int32_segments_and_maxima():
    """The allgather strategy's flash call (context parallelism): cu_seqlens_q != cu_seqlens_k, int32 on the
    tokens' device, host-int maxima, causal (bottom-right aligned in flash-attn >= 2.1)."""
    q, k = torch.zeros(4, 2, 8), torch.zeros(9, 2, 8)
    args = flash.flash_varlen_qk_args(q, k, k.clone(), torch.tensor([0, 3, 4]), torch.tensor([0, 5, 9]), 3, 5)
    assert args["cu_seqlens_q"].dtype == args["cu_seqlens_k"].dtype == torch.int32
    assert args["cu_seqlens_q"].tolist() == [0, 3, 4] and args["cu_seqlens_k"].tolist() == [0, 5, 9]
    assert (args["max_seqlen_q"], args["max_seqlen_k"], args["causal"]) == (3, 5, True)
    assert type(args["max_seqlen_q"]) is int
    with pytest.raises(ValueError, match="both be"):
        flash.flash_varlen_qk_args(q, k, k, torch.tensor([0, 4]), torch.tensor([0, 5, 9]), 4, 5)
    with pytest.raises(ValueError, match=r"q \(M, H, D\)"):
        flash.flash_varlen_qk_args(q, torch.zeros(9, 3, 8), torch.zeros(9, 3, 8), torch.tensor([0, 4]),
                                   torch.tensor([0, 9]), 4, 9)
