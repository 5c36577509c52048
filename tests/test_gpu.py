"""GPU-only checks: the real varlen kernels against the per-document SDPA reference, and packing on CUDA.

Skips itself without CUDA. Run with scripts/gpu_check.sh on a CUDA machine. flash-attn is checked only
when it imports; torch_varlen needs torch >= 2.9. Both run in fp16/bf16 only, so fp32 is covered by
flex and dense, and the half-precision kernels are compared with an fp32 reference on the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from trainer.data.batch import Document, collate_rows  # noqa: E402
from trainer.model import AttentionConfig, GPTConfig, build_model, model_inputs  # noqa: E402
from trainer.model.attention import backend_unavailable_reason, resolve_backend, varlen_attention  # noqa: E402

CUDA = torch.device("cuda")
SEQ_LENS = [1, 37, 128, 300, 5, 512, 40, 1]  # N = 1024: single tokens, tile-aligned and ragged documents
H, D = 4, 64
# relative-norm tolerances (output, input gradients) against an fp32 reference on the same inputs
TOLERANCES = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 5e-3), torch.float32: (1e-4, 1e-4)}


def cu_seqlens(seq_lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(seq_lens)], dtype=torch.int32, device=CUDA)


def attention_with_grads(backend: str, dtype: torch.dtype, seed: int = 0):
    """Output and (dq, dk, dv) in fp32, for inputs drawn in fp32 and rounded to dtype (same values for all)."""
    g = torch.Generator(device=CUDA).manual_seed(seed)
    n = sum(SEQ_LENS)
    q, k, v, grad_out = (torch.randn(n, H, D, device=CUDA, generator=g).to(dtype) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)
    out = varlen_attention(q, k, v, cu_seqlens(SEQ_LENS), max(SEQ_LENS), backend=backend)
    out.backward(grad_out)
    return [t.float() for t in (out.detach(), q.grad, k.grad, v.grad)]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def reference(seed: int = 0):
    """sdpa_docs in fp32 on the half-precision inputs' values."""
    return attention_with_grads("sdpa_docs", torch.float32, seed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", ["torch_varlen", "flash", "flex", "sdpa_docs"])
def test_half_precision_kernels_match_the_fp32_reference(backend, dtype):
    reason = backend_unavailable_reason(backend, CUDA, dtype)
    if reason is not None:
        pytest.skip(reason)
    out_tol, grad_tol = TOLERANCES[dtype]
    g = torch.Generator(device=CUDA).manual_seed(0)
    n = sum(SEQ_LENS)
    inputs = [torch.randn(n, H, D, device=CUDA, generator=g).to(dtype) for _ in range(4)]
    results = {}
    for name, run_dtype in ((backend, dtype), ("sdpa_docs", torch.float32)):
        q, k, v = (t.detach().to(run_dtype).clone().requires_grad_(True) for t in inputs[:3])
        out = varlen_attention(q, k, v, cu_seqlens(SEQ_LENS), max(SEQ_LENS), backend=name)
        out.backward(inputs[3].to(run_dtype))
        results[run_dtype] = [t.float() for t in (out.detach(), q.grad, k.grad, v.grad)]
    got, want = results[dtype], results[torch.float32]
    assert relative_error(got[0], want[0]) <= out_tol, "forward"
    for what, a, b in zip(("dq", "dk", "dv"), got[1:], want[1:], strict=True):
        assert relative_error(a, b) <= grad_tol, what


@pytest.mark.parametrize("backend", ["flex", "dense"])
def test_fp32_backends_match_sdpa_docs_forward_and_backward(backend):
    got, want = attention_with_grads(backend, torch.float32), reference()
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert relative_error(a, b) <= TOLERANCES[torch.float32][0], what


def test_varlen_kernels_refuse_fp32_with_a_clear_error():
    for backend in ("torch_varlen", "flash"):
        reason = backend_unavailable_reason(backend, CUDA, torch.float32)
        assert reason is not None and ("float16" in reason or "flash-attn" in reason or "torch" in reason)


def test_auto_picks_a_varlen_kernel_in_bf16_and_a_fp32_capable_one_in_fp32():
    bf16 = resolve_backend("auto", CUDA, torch.bfloat16)
    if backend_unavailable_reason("torch_varlen", CUDA, torch.bfloat16) is None:
        assert bf16 in ("flash", "torch_varlen")
    assert resolve_backend("auto", CUDA, torch.float32) in ("flex", "sdpa_docs")


# ---------------------------------------------------------------------------------------------------
# Packed vs unpacked on CUDA
# ---------------------------------------------------------------------------------------------------


def gpu_batches(row_len: int = 256):
    rng = np.random.default_rng(0)
    lengths = [[100, 37, 1, 90], [256], [3, 200, 40]]
    rows = [[Document(f"r{r}d{i}", rng.integers(2, 500, n)) for i, n in enumerate(row)] for r, row in enumerate(lengths)]
    packed = collate_rows(rows, row_len, 0, "packed").to(CUDA)
    unpacked = collate_rows([[d] for row in rows for d in row], row_len, 0, "unpacked").to(CUDA)
    starts = [np.cumsum([0, *map(len, row)])[:-1].tolist() for row in rows]
    spans_p = [(r, s, s + len(d)) for r, row in enumerate(rows) for s, d in zip(starts[r], row, strict=True)]
    spans_u = [(i, 0, len(d)) for i, d in enumerate(d for row in rows for d in row)]
    return packed, unpacked, spans_p, spans_u


def run_model(model, batch, autocast_dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model(**model_inputs(batch))
    out.loss_sum.backward()
    return out, {n: p.grad.float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "backend, autocast_dtype, logit_tol, loss_rtol, grad_rtol",
    [
        ("sdpa_docs", None, 1e-4, 1e-5, 1e-4),
        ("flex", None, 1e-4, 1e-5, 1e-4),
        ("auto", torch.bfloat16, 5e-2, 1e-2, 5e-2),  # flash or torch_varlen under bf16 autocast
    ],
)
def test_packed_matches_unpacked_on_cuda(backend, autocast_dtype, logit_tol, loss_rtol, grad_rtol):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, n_layer=2, n_head=4, n_embd=256, max_seq_len=256)
    model = build_model(cfg, AttentionConfig(backend=backend)).to(CUDA)
    packed, unpacked, spans_p, spans_u = gpu_batches()
    out_p, grads_p = run_model(model, packed, autocast_dtype)
    out_u, grads_u = run_model(model, unpacked, autocast_dtype)

    for (rp, sp, ep), (ru, su, eu) in zip(spans_p, spans_u, strict=True):
        diff = (out_p.logits[rp, sp:ep].float() - out_u.logits[ru, su:eu].float()).abs().max().item()
        assert diff <= logit_tol, f"document at row {rp} offset {sp}: {diff:.3g}"
    assert out_p.num_targets.item() == out_u.num_targets.item() == packed.num_valid_targets
    loss_p, loss_u = out_p.loss_sum.item(), out_u.loss_sum.item()
    assert abs(loss_p - loss_u) <= loss_rtol * abs(loss_u)
    for name, g_u in grads_u.items():
        assert relative_error(grads_p[name], g_u) <= grad_rtol, name
