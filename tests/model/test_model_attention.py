"""The attention adapter on its own: masks, block masks, backend agreement, backend resolution."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.model import attention
from trainer.model.attention import (
    AttentionConfig,
    BackendUnavailable,
    block_diagonal_mask,
    document_block_mask,
    document_ids,
    resolve_backend,
    to_additive_mask,
    varlen_attention,
)

CPU = torch.device("cpu")
CUDA = torch.device("cuda")  # a device object only: nothing here runs on it
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
H, D = 4, 16
FLEX_N = 128  # the shape the model tests compile flex for: no second compile


def seed_mask(seq_lens: list[int]) -> torch.Tensor:
    """The seed's build_block_diagonal_mask, loop by loop: the oracle for the vectorized one."""
    total = sum(seq_lens)
    mask = torch.zeros(total, total, dtype=torch.bool)
    offset = 0
    for n in seq_lens:
        mask[offset : offset + n, offset : offset + n] = torch.tril(torch.ones(n, n, dtype=torch.bool))
        offset += n
    return mask


def cu_of(seq_lens: list[int]) -> torch.Tensor:
    return F.pad(torch.tensor(seq_lens).cumsum(0), (1, 0)).to(torch.int32)


def naive_attention(q_NHD, k_NHD, v_NHD, mask_NN) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) masked) v written out, the textbook definition."""
    scores_HNN = torch.einsum("qhd,khd->hqk", q_NHD, k_NHD) / math.sqrt(q_NHD.shape[-1])
    weights_HNN = scores_HNN.masked_fill(~mask_NN, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", weights_HNN, v_NHD)


def qkv(n: int, seed: int = 0, requires_grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, H, D, generator=g).requires_grad_(requires_grad) for _ in range(3)]


segment_lengths = st.lists(st.integers(1, 40), min_size=1, max_size=6)


def lengths_summing_to(total: int):
    """Segment lengths that tile exactly `total` positions (cut points drawn at random)."""
    return st.sets(st.integers(1, total - 1), max_size=6).map(
        lambda cuts: [b - a for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), total], strict=True)]
    )


# ---------------------------------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------------------------------


def test_block_diagonal_mask_worked_example():
    expected = torch.tensor(
        [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]],
        dtype=torch.bool
    )
    assert torch.equal(block_diagonal_mask([3, 2]), expected)
    assert (document_ids(torch.tensor([0, 3, 5, 10], dtype=torch.int32), 10).tolist()
            == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2])


@given(seq_lens=segment_lengths)
@settings(max_examples=30, **SETTINGS)
def test_block_diagonal_mask_matches_the_seed_construction(seq_lens):
    mask = block_diagonal_mask(seq_lens)
    assert mask.dtype == torch.bool
    assert torch.equal(mask, seed_mask(seq_lens))
    assert torch.equal(block_diagonal_mask(cu_seqlens=cu_of(seq_lens)), mask)


def test_additive_mask_is_zero_or_minus_inf_and_a_zero_one_float_mask_is_not_equivalent():
    seq_lens = [3, 2, 5, 2]
    bool_mask = block_diagonal_mask(seq_lens)
    additive = to_additive_mask(bool_mask, torch.float32)
    assert additive.dtype == torch.float32
    assert torch.all(additive[bool_mask] == 0) and torch.all(additive[~bool_mask] == float("-inf"))

    q, k, v = (t.transpose(0, 1)[None] for t in qkv(sum(seq_lens)))  # (1, H, N, D)
    with_bool = F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask)
    with_additive = F.scaled_dot_product_attention(q, k, v, attn_mask=additive)
    with_zero_one = F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask.float())
    assert torch.allclose(with_bool, with_additive, atol=1e-6)
    assert (with_bool - with_zero_one).abs().max() > 1e-2, (
        "a 0/1 float mask blocks nothing: it is added to scores")


# ---------------------------------------------------------------------------------------------------
# Flex block mask, built tile by tile
# ---------------------------------------------------------------------------------------------------


@given(data=st.data(), total=st.sampled_from([5, 128, 200, 256, 300]))
@settings(max_examples=15, **SETTINGS)
def test_document_block_mask_equals_flex_create_block_mask(data, total):
    from torch.nn.attention.flex_attention import create_block_mask

    seq_lens = data.draw(lengths_summing_to(total)) if total > 1 else [1]
    doc_N = document_ids(cu_of(seq_lens), total)
    ours = document_block_mask(doc_N)
    reference = create_block_mask(  # materializes the N x N mask: fine at these sizes
        lambda b, h, q, kv: (doc_N[q] == doc_N[kv]) & (q >= kv), None, None, total, total, device="cpu"
    )
    assert torch.equal(ours.to_dense(), reference.to_dense())
    for name in ("kv_num_blocks", "full_kv_num_blocks", "q_num_blocks", "full_q_num_blocks"):
        assert torch.equal(getattr(ours, name), getattr(reference, name)), name


# ---------------------------------------------------------------------------------------------------
# Backends agree, forward and backward
# ---------------------------------------------------------------------------------------------------


@given(seq_lens=segment_lengths, seed=st.integers(0, 1000))
@settings(max_examples=15, **SETTINGS)
def test_sdpa_docs_and_dense_agree_with_naive_attention_forward_and_backward(seq_lens, seed):
    n = sum(seq_lens)
    cu = cu_of(seq_lens)
    grad_out = torch.randn(n, H, D, generator=torch.Generator().manual_seed(seed + 1))
    results = {}
    for backend in ("naive", "sdpa_docs", "dense"):
        q, k, v = qkv(n, seed, requires_grad=True)
        if backend == "naive":
            out = naive_attention(q, k, v, seed_mask(seq_lens))
        else:
            out = varlen_attention(q, k, v, cu, max(seq_lens), backend=backend)
        (out * grad_out).sum().backward()
        results[backend] = (out.detach(), q.grad, k.grad, v.grad)
    for backend in ("sdpa_docs", "dense"):
        for got, want, what in zip(results[backend], results["naive"], ("out", "dq", "dk", "dv"),
                                   strict=True):
            assert (got - want).abs().max() <= 1e-5, f"{backend} {what}"


@given(seq_lens=lengths_summing_to(FLEX_N), seed=st.integers(0, 1000))
@settings(max_examples=4, **SETTINGS)
def test_compiled_flex_agrees_with_sdpa_docs_forward(seq_lens, seed):
    q, k, v = qkv(FLEX_N, seed)
    cu = cu_of(seq_lens)
    with torch.no_grad():
        flex = varlen_attention(q, k, v, cu, max(seq_lens), backend="flex", flex_compile=True)
        reference = varlen_attention(q, k, v, cu, max(seq_lens), backend="sdpa_docs")
    assert (flex - reference).abs().max() <= 1e-5


def test_eager_flex_agrees_with_sdpa_docs_forward():
    seq_lens = [30, 1, 70, 27]
    q, k, v = qkv(sum(seq_lens))
    with torch.no_grad():
        flex = varlen_attention(q, k, v, cu_of(seq_lens), 70, backend="flex", flex_compile=False)
        reference = varlen_attention(q, k, v, cu_of(seq_lens), 70, backend="sdpa_docs")
    assert (flex - reference).abs().max() <= 1e-5


def test_segments_of_one_padded_row_attend_only_within_themselves():
    """Padding is its own segment: the real tokens' outputs do not depend on the padding's values."""
    q, k, v = qkv(12)
    cu = cu_of([3, 5, 4])  # the last 4 stand for padding
    out = varlen_attention(q, k, v, cu, 5, backend="sdpa_docs")
    v2 = v.clone()
    v2[8:] += 100.0
    out2 = varlen_attention(q, k, v2, cu, 5, backend="sdpa_docs")
    assert torch.equal(out[:8], out2[:8]) and not torch.equal(out[8:], out2[8:])


# ---------------------------------------------------------------------------------------------------
# Resolution and clear errors
# ---------------------------------------------------------------------------------------------------


def test_auto_on_cpu_is_sdpa_docs_for_training_and_inference():
    assert resolve_backend("auto", CPU, torch.float32, requires_grad=True) == "sdpa_docs"
    assert resolve_backend("auto", CPU, torch.float32, requires_grad=False) == "sdpa_docs"


def test_auto_prefers_flash_then_torch_varlen_then_flex_then_sdpa_docs(monkeypatch):
    available: set[str] = set()
    monkeypatch.setattr(
        attention, "backend_unavailable_reason",
        lambda backend, device, dtype, requires_grad=True: None if backend in available else "missing",
    )
    expected_order = [({"flash", "torch_varlen", "flex"}, "flash"),
                      ({"torch_varlen", "flex"}, "torch_varlen"), ({"flex"}, "flex"), (set(), "sdpa_docs")]
    for names, expected in expected_order:
        available.clear()
        available.update(names)
        assert resolve_backend("auto", CUDA, torch.bfloat16) == expected


@pytest.mark.parametrize(
    "backend, device, dtype, needle",
    [
        ("flash", CPU, torch.bfloat16, "CUDA"),
        ("torch_varlen", CPU, torch.bfloat16, "CUDA"),
        ("torch_varlen", CUDA, torch.float32, "float16/bfloat16"),
        ("flex", CPU, torch.float32, "no backward on CPU"),
    ],
)
def test_unavailable_backends_say_what_is_missing(backend, device, dtype, needle):
    with pytest.raises(BackendUnavailable, match=needle):
        resolve_backend(backend, device, dtype, requires_grad=True)


def test_torch_varlen_on_cpu_raises_through_the_adapter():
    q, k, v = qkv(8)
    with pytest.raises(BackendUnavailable, match="torch_varlen.*CUDA"):
        varlen_attention(q, k, v, cu_of([3, 5]), 5, backend="torch_varlen")


def test_attention_config_rejects_unknown_backends():
    assert AttentionConfig().backend == "auto" and AttentionConfig().isolate_documents
    with pytest.raises(ValueError, match="unknown attention backend"):
        AttentionConfig(backend="xformers")
