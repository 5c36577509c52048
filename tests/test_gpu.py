"""GPU-only checks: the real varlen kernels against fp32 references, document isolation through the whole
model, and packing on CUDA. scripts/gpu_check.sh runs them and turns their JUnit report into its verdict.

Skips itself without CUDA. flash-attn is checked only when it imports; torch_varlen needs torch >= 2.9. Both
run in fp16/bf16 only, so they are compared with fp32 references on the same inputs and weights. Each
tolerance that is not a plain float bound is measured in the same test: run-to-run noise for isolation,
unpacked bf16 rows as the yardstick for packed bf16 rows. Variants with a planted cross-document leak show
that those tolerances catch one (they must fail the check). The model-level helpers take a device, so
tests/test_gpu_scripts.py runs the same checks on CPU (sdpa_docs under bf16 autocast).

A test's kernel is the first parameter id naming one (scripts/gpu_report.py reads them): keep the kernel
names in the ids.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from trainer.data.batch import Batch, Document, collate_rows  # noqa: E402
from trainer.model import AttentionConfig, GPTConfig, build_model, flash, model_inputs  # noqa: E402
from trainer.model import attention as attention_module  # noqa: E402
from trainer.model.attention import (  # noqa: E402
    backend_unavailable_reason,
    resolve_backend,
    varlen_attention,
)

CUDA = torch.device("cuda")
SEQ_LENS = [1, 37, 128, 300, 5, 512, 40, 1]  # N = 1024: single tokens, tile-aligned and ragged documents
H, D = 4, 64
# relative-norm tolerances (output, input gradients) against an fp32 reference on the same inputs
TOLERANCES = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 5e-3), torch.float32: (1e-4, 1e-4)}
KERNELS = ["torch_varlen", "flash", "sdpa_docs", "flex"]  # flex last: its first call compiles
VARLEN_KERNELS = ["torch_varlen", "flash"]
YARDSTICK_FACTOR = 3.0
"""Packed bf16 rows may be at most this many times further from the fp32 reference than unpacked bf16 rows."""


def cu_seqlens(seq_lens: list[int], device: torch.device = CUDA) -> torch.Tensor:
    return torch.tensor([0, *np.cumsum(seq_lens)], dtype=torch.int32, device=device)


def skip_unless_available(backend: str, dtype: torch.dtype, device: torch.device = CUDA) -> None:
    reason = backend_unavailable_reason(backend, device, dtype)
    if reason is not None:
        pytest.skip(reason)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


def worst_position_error(got_ND: torch.Tensor, want_ND: torch.Tensor) -> float:
    """max over positions n of |got[n] - want[n]|, divided by the RMS over positions of |want[n]|: a leak into
    a few positions shows here even when it vanishes in the norm over all of them. (N, ...) tensors. (Not
    divided by |want[n]| itself: some rows are exactly 0, e.g. dq of a one-token document.)"""
    got, want = got_ND.flatten(1), want_ND.flatten(1)
    scale = want.norm(dim=1).square().mean().sqrt().clamp_min(1e-12)
    return ((got - want).norm(dim=1).max() / scale).item()


# ---------------------------------------------------------------------------------------------------
# Each kernel alone, forward and backward, against sdpa_docs in fp32 on the same values
# ---------------------------------------------------------------------------------------------------


def kernel_inputs(dtype: torch.dtype, device: torch.device = CUDA) -> list[torch.Tensor]:
    """q, k, v and the output gradient, (N, H, D), drawn in fp32 and rounded to dtype: the same values each
    call."""
    g = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(sum(SEQ_LENS), H, D, device=device, generator=g).to(dtype) for _ in range(4)]


def run_kernel(backend: str, inputs: list[torch.Tensor], dtype: torch.dtype,
               backward: bool) -> list[torch.Tensor]:
    """fp32 copies of out (and dq, dk, dv if backward) of `backend` run in `dtype` on `inputs`."""
    q, k, v = (t.detach().to(dtype).clone().requires_grad_(True) for t in inputs[:3])
    out = varlen_attention(q, k, v, cu_seqlens(SEQ_LENS, q.device), max(SEQ_LENS), backend=backend)
    results = [out.detach()]
    if backward:
        out.backward(inputs[3].to(dtype))
        results += [q.grad, k.grad, v.grad]
    return [t.float() for t in results]


def compare_kernel(backend: str, dtype: torch.dtype, backward: bool,
                   device: torch.device = CUDA) -> list[str]:
    """What is off in `backend`'s output (or gradients): the relative norm error against the fp32 reference
    above TOLERANCES, or a position further from it than YARDSTICK_FACTOR x the worst position of sdpa_docs
    run in the same dtype (its rounding alone, documents isolated by construction)."""
    inputs = kernel_inputs(dtype, device)
    got = run_kernel(backend, inputs, dtype, backward)
    yardstick = run_kernel("sdpa_docs", inputs, dtype, backward)
    want = run_kernel("sdpa_docs", inputs, torch.float32, backward)
    names = ("dq", "dk", "dv") if backward else ("out",)
    tolerance = TOLERANCES[dtype][1 if backward else 0]
    problems = []
    offset = 1 if backward else 0
    for what, a, y, w in zip(names, got[offset:], yardstick[offset:], want[offset:], strict=True):
        if (err := relative_error(a, w)) > tolerance:
            problems.append(f"{what}: relative error {err:.3g} > {tolerance:g}")
        worst, bound = worst_position_error(a, w), YARDSTICK_FACTOR * worst_position_error(y, w) + 1e-6
        if worst > bound:
            problems.append(f"{what}: a position is {worst:.3g} off, above {bound:.3g} "
                            f"(sdpa_docs in {dtype}: x{YARDSTICK_FACTOR:g})")
    return problems


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", KERNELS)
def test_kernel_forward_matches_fp32_reference(backend, dtype):
    skip_unless_available(backend, dtype)
    problems = compare_kernel(backend, dtype, backward=False)
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("backend", KERNELS)
def test_kernel_backward_matches_fp32_reference(backend, dtype):
    skip_unless_available(backend, dtype)
    problems = compare_kernel(backend, dtype, backward=True)
    assert not problems, "; ".join(problems)


def test_varlen_kernels_refuse_fp32_with_a_clear_error():
    for backend in VARLEN_KERNELS:
        reason = backend_unavailable_reason(backend, CUDA, torch.float32)
        assert reason is not None and ("float16" in reason or "flash-attn" in reason or "torch" in reason)


# ---------------------------------------------------------------------------------------------------
# attention=auto: the documented choice, and a log line saying why
# ---------------------------------------------------------------------------------------------------


def expected_auto(dtype: torch.dtype) -> str:
    """The documented order on CUDA: flash when it imports, else torch's varlen_attn (torch >= 2.9) for
    fp16/bf16, else flex (torch has had FlexAttention since 2.5, the oldest torch packtrain supports)."""
    if dtype in (torch.float16, torch.bfloat16):
        if flash.flash_attn_import_error() is None:
            return "flash"
        if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 9):
            return "torch_varlen"
    return "flex"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_auto_picks_the_documented_kernel_and_says_why(dtype, caplog, monkeypatch):
    monkeypatch.setattr(attention_module, "_AUTO_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="trainer.model.attention"):
        picked = resolve_backend("auto", CUDA, dtype)
        resolve_backend("auto", CUDA, dtype)
    assert picked == expected_auto(dtype)
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.model.attention"]
    assert len(lines) == 1, lines  # once per process, not once per call
    assert f"picked {picked} on cuda" in lines[0]
    if picked != "flash":  # it names why each faster kernel was passed over
        assert "flash:" in lines[0]


# ---------------------------------------------------------------------------------------------------
# The whole model: documents isolated, and packed bf16 as close to fp32 as unpacked bf16
# ---------------------------------------------------------------------------------------------------

ROW_LENGTHS = [[100, 37, 1, 90], [256], [3, 200, 40]]
"""Three packed rows of 256 positions: documents of 1 to 256 tokens, a full row, row-tail padding."""
VOCAB = 512


LLAMA = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", mlp_hidden=512, bias=False, n_kv_head=2,
             tie_embeddings=False)
"""The Llama family (RMSNorm, SwiGLU, RoPE, GQA with 2 kv heads for 4 query heads, untied head) at the same
size."""


def small_model(device: torch.device, backend: str, isolate_documents: bool = True, seed: int = 0,
                family: str = "gpt2"):
    torch.manual_seed(seed)
    shape = LLAMA if family == "llama" else {}
    # head_dim 64
    cfg = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=256, max_seq_len=256, **shape)
    return build_model(cfg, AttentionConfig(backend=backend, isolate_documents=isolate_documents)).to(device)


def make_rows(seed: int = 0) -> list[list[Document]]:
    rng = np.random.default_rng(seed)
    return [[Document(f"r{r}d{i}", rng.integers(2, VOCAB - 2, n)) for i, n in enumerate(row)]
            for r, row in enumerate(ROW_LENGTHS)]


def spans(rows: list[list[Document]]) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document in the packed layout. Example: [[A(3), B(2)]] ->
    [(0, 0, 3), (0, 3, 5)]."""
    out = []
    for r, row in enumerate(rows):
        start = 0
        for doc in row:
            out.append((r, start, start + len(doc)))
            start += len(doc)
    return out


def packed_logits(model, rows: list[list[Document]], device: torch.device,
                  dtype: torch.dtype | None) -> torch.Tensor:
    batch = collate_rows(rows, 256, 0, "packed").to_device(device)
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype or torch.float32,
                                         enabled=dtype is not None):
        return model(**model_inputs(batch)).logits.float()


def isolation_diffs(model, device: torch.device, dtype: torch.dtype | None) -> tuple[float, float]:
    """(noise, change) in the logits of every document but A = row 0's first (100 tokens, before three
    others).

    noise: the largest move of those logits (A's included) between two runs of the same batch, and when a
    document in another row (row 2's 200 tokens) is replaced: neither may touch them under any correct kernel.
    change: the largest move of the logits outside A when every token of A is replaced by another.
    Isolated documents give change <= noise (0 wherever the kernels are deterministic); one causal mask per
    row does not, since row 0's later documents read A.
    """
    rows = make_rows()
    base = packed_logits(model, rows, device, dtype)
    rerun = packed_logits(model, rows, device, dtype)
    noise = (rerun - base).abs().max().item()

    def replaced(row: int, index: int, shift_N: np.ndarray) -> tuple[list[list[Document]], torch.Tensor]:
        """The rows with every token of rows[row][index] replaced by another, and a mask of the other
        positions."""
        new_rows = [list(r) for r in rows]
        doc = new_rows[row][index]
        new_rows[row][index] = Document(doc.key, 2 + (doc.tokens - 2 + shift_N) % (VOCAB - 4))
        assert (new_rows[row][index].tokens != doc.tokens).all()
        outside = torch.ones(base.shape[:2], dtype=torch.bool, device=base.device)
        start = sum(len(d) for d in rows[row][:index])
        outside[row, start : start + len(doc)] = False
        return new_rows, outside

    other_row, outside = replaced(2, 1, np.full(len(rows[2][1]), 7))  # row 2's 200 tokens
    moved = packed_logits(model, other_row, device, dtype)
    noise = max(noise, (moved - base)[outside].abs().max().item())

    shift_N = np.random.default_rng(1).integers(1, VOCAB - 4, len(rows[0][0]))
    changed, outside_a = replaced(0, 0, shift_N)  # A
    change = (packed_logits(model, changed, device, dtype) - base)[outside_a].abs().max().item()
    return noise, change


@pytest.mark.parametrize("backend", VARLEN_KERNELS)
def test_changing_one_document_leaves_every_other_logit_unchanged(backend):
    """bf16, the whole model on `backend`; tolerance: the noise measured here. The same model with one causal
    mask per row (isolate_documents=False) must show a change: the test can tell a leak from noise."""
    skip_unless_available(backend, torch.bfloat16)
    model = small_model(CUDA, backend).eval()
    noise, change = isolation_diffs(model, CUDA, torch.bfloat16)
    assert change <= noise, (f"document A moved other documents' logits by {change:.3g} "
                             f"(run-to-run noise {noise:.3g})")
    leaky = small_model(CUDA, backend, isolate_documents=False).eval()
    leaky.load_state_dict(model.state_dict())
    _, leak_change = isolation_diffs(leaky, CUDA, torch.bfloat16)
    assert leak_change > noise, "the check cannot see a leak: one causal mask per row passed it"


@dataclass
class Deviation:
    """How far a bf16 run is from the fp32 reference (same weights, one document per row, fp32)."""

    logits: float
    """The worst document position: max of |logits - ref| over positions / RMS of |ref|
    (`worst_position_error`)."""
    loss: float
    """|loss_sum - ref| / |ref|."""
    grads: float
    """|grads - ref| / |ref|, all parameters as one vector."""


def logits_loss_grads(model, batch: Batch, device: torch.device, dtype: torch.dtype | None,
                      cu: torch.Tensor | None = None):
    model.zero_grad(set_to_none=True)
    inputs = model_inputs(batch)
    if cu is not None:
        inputs["cu_seqlens"] = cu
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        out = model(**inputs)
    out.loss_sum.backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters()])
    return out.logits.detach().float(), out.loss_sum.item(), grads


def document_logits(logits: torch.Tensor, where: list[tuple[int, int, int]]) -> torch.Tensor:
    """(positions of all documents, V), document after document."""
    return torch.cat([logits[r, s:e] for r, s, e in where])


def _deviation(logits, loss, grads, where, ref_logits, ref_loss, ref_grads) -> Deviation:
    return Deviation(worst_position_error(document_logits(logits, where), ref_logits),
                     abs(loss - ref_loss) / abs(ref_loss), relative_error(grads, ref_grads))


@functools.lru_cache(maxsize=8)
def _reference(device: torch.device, dtype: torch.dtype, family: str):
    """((logits, loss, grads) of the fp32 reference, the yardstick): the padded path (plain causal SDPA per
    row) in fp32, and its deviation in `dtype`. The same for every kernel and planted leak (small_model draws
    the same weights), so computed once per device, dtype and family."""
    rows = make_rows()
    docs = [d for row in rows for d in row]
    unpacked = collate_rows([[d] for d in docs], 256, 0, "unpacked").to_device(device)
    where_unpacked = [(i, 0, len(d)) for i, d in enumerate(docs)]
    reference = small_model(device, "sdpa_docs", family=family)
    ref_logits, ref_loss, ref_grads = logits_loss_grads(reference, unpacked, device, None)
    ref_logits = document_logits(ref_logits, where_unpacked)
    yardstick = _deviation(*logits_loss_grads(reference, unpacked, device, dtype), where_unpacked, ref_logits,
                           ref_loss, ref_grads)
    return (ref_logits, ref_loss, ref_grads), yardstick


def reference_check(device: torch.device, backend: str, leak: str | None = None,
                    dtype: torch.dtype = torch.bfloat16,
                    family: str = "gpt2") -> tuple[list[str], Deviation, Deviation]:
    """(problems, packed, yardstick): packed rows on `backend` in `dtype` against the fp32 reference, with
    unpacked rows in `dtype` (the same weights, no packing) as the yardstick: packed may be at most
    YARDSTICK_FACTOR times further (the loss at least 1e-4 relative, as its rounding can cancel by chance).

    leak plants a cross-document leak the check must catch: "one_mask_per_row" (isolate_documents=False) or
    "boundary_off_by_one" (row 0's 1-token document starts a token early, seeing its neighbour's last token).
    """
    rows = make_rows()
    packed = collate_rows(rows, 256, 0, "packed").to_device(device)
    where_packed = spans(rows)

    model = small_model(device, backend, isolate_documents=leak != "one_mask_per_row", family=family)
    (ref_logits, ref_loss, ref_grads), yardstick = _reference(device, dtype, family)
    cu = None
    if leak == "boundary_off_by_one":
        cu = packed.cu_seqlens.clone()
        cu[2] -= 1  # [0, 100, 137, 138, ...] -> [0, 100, 136, 138, ...]
    got = _deviation(*logits_loss_grads(model, packed, device, dtype, cu), where_packed, ref_logits, ref_loss,
                     ref_grads)
    problems = []
    for what, floor in (("logits", 0.0), ("loss", 1e-4), ("grads", 0.0)):
        bound = max(YARDSTICK_FACTOR * getattr(yardstick, what), floor)
        if getattr(got, what) > bound:
            problems.append(f"{what}: {getattr(got, what):.3g} from the fp32 reference, above {bound:.3g} "
                            f"(unpacked {dtype}: {getattr(yardstick, what):.3g})")
    return problems, got, yardstick


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("backend", VARLEN_KERNELS)
def test_packed_bf16_is_as_close_to_the_fp32_reference_as_unpacked(backend, family):
    """Also the Llama family: RoPE, RMSNorm, SwiGLU and GQA's repeated kv heads through each varlen kernel."""
    skip_unless_available(backend, torch.bfloat16)
    problems, got, yardstick = reference_check(CUDA, backend, family=family)
    assert not problems, f"{'; '.join(problems)} (packed {got}, unpacked {yardstick})"


@pytest.mark.parametrize("leak", ["one_mask_per_row", "boundary_off_by_one"])
@pytest.mark.parametrize("backend", VARLEN_KERNELS)
def test_reference_check_catches_a_planted_leak(backend, leak):
    """The tolerance above discriminates: a cross-document leak fails it (in the logits at least)."""
    skip_unless_available(backend, torch.bfloat16)
    problems, got, yardstick = reference_check(CUDA, backend, leak)
    assert any(p.startswith("logits") for p in problems), (f"a {leak} leak passed the check: {got} "
                                                           f"vs {yardstick}")


# ---------------------------------------------------------------------------------------------------
# fp32 on CUDA (flex, dense, sdpa_docs): kernels and packed vs unpacked equal to float precision. Last in the
# file, so that flex's compiling comes after the varlen checks.
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["flex", "dense"])
def test_fp32_backends_match_sdpa_docs_forward_and_backward(backend):
    inputs = kernel_inputs(torch.float32)
    got, want = (run_kernel(backend, inputs, torch.float32, True),
                 run_kernel("sdpa_docs", inputs, torch.float32, True))
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want, strict=True):
        assert relative_error(a, b) <= TOLERANCES[torch.float32][0], what



def gpu_batches(row_len: int = 256):
    rows = make_rows()
    packed = collate_rows(rows, row_len, 0, "packed").to_device(CUDA)
    unpacked = collate_rows([[d] for row in rows for d in row], row_len, 0, "unpacked").to_device(CUDA)
    docs = [d for row in rows for d in row]
    return packed, unpacked, spans(rows), [(i, 0, len(d)) for i, d in enumerate(docs)]


def run_model(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(**model_inputs(batch))
    out.loss_sum.backward()
    return out, {n: p.grad.float().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["sdpa_docs", "flex"])
def test_packed_matches_unpacked_on_cuda_in_fp32(backend):
    model = small_model(CUDA, backend)
    packed, unpacked, spans_p, spans_u = gpu_batches()
    out_p, grads_p = run_model(model, packed)
    out_u, grads_u = run_model(model, unpacked)

    for (rp, sp, ep), (ru, su, eu) in zip(spans_p, spans_u, strict=True):
        diff = (out_p.logits[rp, sp:ep] - out_u.logits[ru, su:eu]).abs().max().item()
        assert diff <= 1e-4, f"document at row {rp} offset {sp}: {diff:.3g}"
    assert out_p.num_targets.item() == out_u.num_targets.item() == packed.num_valid_targets
    loss_p, loss_u = out_p.loss_sum.item(), out_u.loss_sum.item()
    assert abs(loss_p - loss_u) <= 1e-5 * abs(loss_u)
    for name, g_u in grads_u.items():
        assert relative_error(grads_p[name], g_u) <= 1e-4, name


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=str)
def test_flash_with_separate_query_and_key_segments_matches_the_per_piece_reference(dtype):
    """Context parallelism's allgather call (trainer/distributed/context.py): flash-attn's varlen kernel with
    cu_seqlens_q != cu_seqlens_k, causal aligned at the bottom right, forward and backward, against SDPA per
    piece in fp32. Pieces: 3 queries over 7 keys, 4 over 4, 1 over 9 (a document's last query sees it
    whole)."""
    skip_unless_available("flash", dtype)
    from trainer.distributed.context import _sdpa_pieces

    q_lens, k_lens = [3, 4, 1], [7, 4, 9]
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(sum(q_lens), 4, 64, generator=g)
    k, v = (torch.randn(sum(k_lens), 4, 64, generator=g) for _ in range(2))
    cu_q = torch.tensor([0, *np.cumsum(q_lens)], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(k_lens)], dtype=torch.int32)
    leaves = [t.to(CUDA, dtype).requires_grad_() for t in (q, k, v)]
    out = flash.flash_varlen_attention_qk(*leaves, cu_q, cu_k, max(q_lens), max(k_lens))
    ref_leaves = [t.to(CUDA).requires_grad_() for t in (q, k, v)]
    ref = _sdpa_pieces(*ref_leaves, q_lens, k_lens)
    assert relative_error(out.float(), ref) < 2e-2
    grad = torch.randn_like(ref)
    out.backward(grad.to(dtype))
    ref.backward(grad)
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert relative_error(got.grad.float(), want.grad) < 3e-2


# ---------------------------------------------------------------------------------------------------
# Downstream scoring (trainer.tasks.scoring) on packed rows through the real kernels
# ---------------------------------------------------------------------------------------------------


def scored(backend: str, layout: str, dtype: torch.dtype, device: torch.device = CUDA) -> torch.Tensor:
    """Per-sequence choice log-likelihoods of 64 synthetic (query, choice) pairs, scored in `layout` by the
    tiny model in `dtype` (weights rounded from the same fp32 init) on `backend`."""
    from trainer.tasks.scoring import Candidate, score

    rng = np.random.default_rng(0)
    sequences = [Candidate(tuple(rng.integers(1, VOCAB, int(rng.integers(4, 120))).tolist()),
                           tuple(rng.integers(1, VOCAB, int(rng.integers(1, 30))).tolist()))
                 for _ in range(64)]
    model = small_model(device, backend).to(dtype)
    return torch.tensor(score(model, sequences, layout, 0, 2048, device).loglikelihoods)


@pytest.mark.parametrize("backend", VARLEN_KERNELS)
def test_packed_scoring_in_bf16_is_as_close_to_fp32_as_unpacked(backend):
    """Every query + choice a document of packed rows through the kernel: the choices' log-likelihoods are as
    close to the fp32 reference (unpacked, sdpa_docs) as unpacked bf16 rows are (YARDSTICK_FACTOR), and packed
    scoring does not mix sequences (a leak would move them far past bf16 rounding)."""
    skip_unless_available(backend, torch.bfloat16)
    want = scored("sdpa_docs", "unpacked", torch.float32)
    yardstick = (scored("sdpa_docs", "unpacked", torch.bfloat16) - want).abs().max().item()
    got = (scored(backend, "packed", torch.bfloat16) - want).abs().max().item()
    assert got <= YARDSTICK_FACTOR * yardstick + 1e-3, (got, yardstick)


def _tp_rank(rank, world, store):
    """One rank of TP = 2 on its own GPU over NCCL: the losses of two steps."""
    import torch.distributed as dist

    from trainer.distributed.config import DistributedConfig
    from trainer.distributed.groups import init_distributed, shutdown_distributed

    shutdown_distributed()  # the harness's gloo group, for NCCL's over a file store
    dist.init_process_group("nccl", store=dist.FileStore(store, world), rank=rank, world_size=world)
    cfg = DistributedConfig(device="cuda", tensor_parallel=world)
    info = init_distributed(cfg)
    return _two_steps(info, cfg)


def _two_steps(info, cfg) -> list[float]:
    from trainer.distributed.engine import parallelize
    from trainer.run.step import train_step

    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=61, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, max_seq_len=64,
                                  pos_emb="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                                  tie_embeddings=False),
                        AttentionConfig(backend="sdpa_docs"), meta=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    engine = parallelize(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), info, cfg, 1.0,
                         "fp32")
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(2):
        docs = [Document(key=f"d{i}", tokens=rng.integers(2, 61, size=n))
                for i, n in enumerate([30, 1, 20, 9])]
        losses.append(train_step(engine, [collate_rows([docs], 63, 0, "packed")], info, 0).loss)
    return losses


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism needs two CUDA devices")
def test_tensor_parallel_step_on_two_gpus_matches_one(tmp_path):
    """distributed.tensor_parallel=2 over NCCL (Llama family, GQA, rows of 63 positions: the sequence shards
    padded): two steps' losses equal one GPU's, fp32 (TF32 off)."""
    from tests.harness import run_distributed
    from trainer.distributed.config import DistributedConfig
    from trainer.distributed.groups import DistInfo

    torch.backends.cuda.matmul.allow_tf32 = False
    want = _two_steps(DistInfo(0, 1, 0, torch.device("cuda", 0)), DistributedConfig(device="cuda"))
    got = run_distributed(_tp_rank, world_size=2, args=(str(tmp_path / "store"),))
    for losses in got:
        np.testing.assert_allclose(losses, want, rtol=1e-5)
