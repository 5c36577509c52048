"""The proof that packing does not change the objective (CPU, fp32).

The same random documents go through `collate_rows` twice: packed (several per row, boundaries in
cu_seqlens) and unpacked (one per padded row). Every real token's logits, the summed loss, the target
count and every parameter's gradient must agree, for each CPU backend. Then the parts are checked one
by one: isolation, positions, labels, and a few optimizer steps.

FlexAttention has no backward on CPU in PyTorch, so flex is checked forward-only here (compiled, on a
fixed packed shape so it compiles once) and forward + backward in tests/test_gpu.py.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from trainer.data.batch import IGNORE_INDEX, Batch, Document, collate_rows, valid_targets
from trainer.model import AttentionConfig, BackendUnavailable, GPTConfig, build_model, model_inputs
from trainer.model.gpt import GPT
from trainer.model.loss import shifted_cross_entropy

VOCAB = 61
PAD_ID = 0
EOS_ID = 1
ROW_LEN = 32
FLEX_ROWS, FLEX_ROW_LEN = 2, 64  # flex always sees N = 128 flat tokens: one compiled graph for the file
LOGIT_TOL = 1e-5
FLEX_LOGIT_TOL = 1e-4
GRAD_RTOL = 1e-5

ONE_TO_THREE = st.integers(1, 3)  # rows per batch
CPU_TRAIN_BACKENDS = ("sdpa_docs", "dense")
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.cache
def tiny_model(backend: str = "sdpa_docs", pos_emb: str = "learned", isolate: bool = True,
               seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    cfg = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64, max_seq_len=64, pos_emb=pos_emb)
    return build_model(cfg, AttentionConfig(backend=backend, isolate_documents=isolate))


@st.composite
def packed_rows(draw, num_rows=ONE_TO_THREE, row_len: int = ROW_LEN,
                max_docs: int = 4) -> list[list[Document]]:
    """Rows of 1..max_docs documents (lengths 1..row_len, EOS-terminated, random tokens) that fit row_len."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    rows = []
    for r in range(draw(num_rows)):
        space, row = row_len, []
        while space > 0 and len(row) < max_docs:
            n = draw(st.integers(1, space))
            tokens = rng.integers(EOS_ID + 1, VOCAB, n)
            tokens[-1] = EOS_ID
            row.append(Document(f"r{r}d{len(row)}", tokens))
            space -= n
            if draw(st.booleans()):
                break
        rows.append(row)
    return rows


def both_layouts(rows: list[list[Document]], row_len: int,
                 reset_positions: bool = True) -> tuple[Batch, Batch]:
    packed = collate_rows(rows, row_len, PAD_ID, "packed", reset_positions=reset_positions)
    unpacked = collate_rows([[doc] for row in rows for doc in row], row_len, PAD_ID, "unpacked")
    return packed, unpacked


def packed_spans(rows: list[list[Document]]) -> list[tuple[int, int, int]]:
    """(row, start, end) of every document in the packed layout, in document order."""
    spans = []
    for r, row in enumerate(rows):
        start = 0
        for doc in row:
            spans.append((r, start, start + len(doc)))
            start += len(doc)
    return spans


def unpacked_spans(rows: list[list[Document]]) -> list[tuple[int, int, int]]:
    return [(i, 0, len(doc)) for i, doc in enumerate(doc for row in rows for doc in row)]


def forward_backward(model: GPT, batch: Batch, backward: bool = True):
    model.zero_grad(set_to_none=True)
    with torch.set_grad_enabled(backward):
        out = model(**model_inputs(batch))
    if not backward:
        return out, {}
    out.loss_sum.backward()
    return out, {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def max_doc_logit_diff(rows, logits_a, spans_a, logits_b, spans_b) -> float:
    worst = 0.0
    for (ra, sa, ea), (rb, sb, eb) in zip(spans_a, spans_b, strict=True):
        worst = max(worst, (logits_a[ra, sa:ea] - logits_b[rb, sb:eb]).abs().max().item())
    return worst


def assert_same_objective(rows, packed_out, unpacked_out, tol: float) -> None:
    diff = max_doc_logit_diff(rows, packed_out.logits, packed_spans(rows), unpacked_out.logits,
                              unpacked_spans(rows))
    assert diff <= tol, f"per-token logits differ by {diff:.3g}"
    expected_targets = sum(valid_targets(doc) for row in rows for doc in row)
    assert packed_out.num_targets.item() == unpacked_out.num_targets.item() == expected_targets
    assert packed_out.loss_sum.dtype == torch.float32
    loss_p, loss_u = packed_out.loss_sum.item(), unpacked_out.loss_sum.item()
    assert abs(loss_p - loss_u) <= 1e-5 * max(1.0, abs(loss_u)), (loss_p, loss_u)


# ---------------------------------------------------------------------------------------------------
# Packed vs unpacked: logits, loss, count, gradients
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("backend", CPU_TRAIN_BACKENDS)
@settings(max_examples=8, **SETTINGS)
@given(rows=packed_rows())
def test_packed_matches_unpacked_logits_loss_and_every_gradient(backend, pos_emb, rows):
    assume(any(len(doc) > 1 for row in rows for doc in row))  # at least one target, so gradients are nonzero
    model = tiny_model(backend, pos_emb)
    packed, unpacked = both_layouts(rows, ROW_LEN)
    out_p, grads_p = forward_backward(model, packed)
    out_u, grads_u = forward_backward(model, unpacked)

    assert_same_objective(rows, out_p, out_u, LOGIT_TOL)
    assert grads_p.keys() == grads_u.keys() and len(grads_p) == len(list(model.parameters()))
    for name, g_u in grads_u.items():
        rel = (grads_p[name] - g_u).norm() / g_u.norm().clamp_min(1e-30)
        assert rel <= GRAD_RTOL, f"{name}: relative gradient difference {rel:.3g}"


@settings(max_examples=3, **SETTINGS)
@given(rows=packed_rows(num_rows=st.just(FLEX_ROWS), row_len=FLEX_ROW_LEN))
def test_packed_matches_unpacked_with_compiled_flex_forward(rows):
    model = tiny_model("flex")
    packed, unpacked = both_layouts(rows, FLEX_ROW_LEN)
    out_p, _ = forward_backward(model, packed, backward=False)
    out_u, _ = forward_backward(model, unpacked, backward=False)
    assert_same_objective(rows, out_p, out_u, FLEX_LOGIT_TOL)


def test_flex_refuses_to_train_on_cpu_with_a_clear_error():
    rows = [[Document("a", np.array([5, 6, EOS_ID])), Document("b", np.array([7, EOS_ID]))]]
    packed, _ = both_layouts(rows, 8)
    with pytest.raises(BackendUnavailable, match="no backward on CPU"):
        tiny_model("flex")(**model_inputs(packed)).loss_sum.backward()


@settings(max_examples=4, **SETTINGS)
@given(rows=packed_rows())
def test_backends_agree_on_the_packed_model_forward_and_backward(rows):
    assume(any(len(doc) > 1 for row in rows for doc in row))
    packed, _ = both_layouts(rows, ROW_LEN)
    out_ref, grads_ref = forward_backward(tiny_model("sdpa_docs"), packed)
    out_dense, grads_dense = forward_backward(tiny_model("dense"), packed)  # same seed -> same weights
    assert (out_ref.logits - out_dense.logits).abs().max() <= LOGIT_TOL  # every position, padding included
    for name, g in grads_ref.items():
        assert (grads_dense[name] - g).norm() <= GRAD_RTOL * g.norm().clamp_min(1e-30), name


# ---------------------------------------------------------------------------------------------------
# Isolation
# ---------------------------------------------------------------------------------------------------


@st.composite
def rows_and_edit(draw, num_rows=ONE_TO_THREE, row_len: int = ROW_LEN):
    """Rows with at least one two-document row, and an edit (row, doc, position, new token) to a non-last
    doc."""
    rows = draw(packed_rows(num_rows=num_rows, row_len=row_len)
                .filter(lambda rs: any(len(r) > 1 for r in rs)))
    r = draw(st.sampled_from([i for i, row in enumerate(rows) if len(row) > 1]))
    a = draw(st.integers(0, len(rows[r]) - 2))
    pos = draw(st.integers(0, len(rows[r][a]) - 1))
    new_token = draw(st.integers(EOS_ID + 1, VOCAB - 1).filter(lambda t: t != rows[r][a].tokens[pos]))
    return rows, (r, a, pos, new_token)


def edited(rows, edit):
    r, a, pos, new_token = edit
    rows = [list(row) for row in rows]
    tokens = rows[r][a].tokens.copy()
    tokens[pos] = new_token
    rows[r][a] = Document(rows[r][a].key, tokens)
    return rows


def isolation_diffs(model: GPT, rows, edit, row_len: int) -> tuple[float, float]:
    """(largest logit change over all OTHER documents, largest over later documents of the edited row)."""
    with torch.no_grad():
        before = model(**model_inputs(both_layouts(rows, row_len)[0])).logits
        after = model(**model_inputs(both_layouts(edited(rows, edit), row_len)[0])).logits
    r, a = edit[0], edit[1]
    spans = packed_spans(rows)
    edited_index = sum(len(row) for row in rows[:r]) + a
    others = [s for i, s in enumerate(spans) if i != edited_index]
    later_same_row = [s for i, s in enumerate(spans) if s[0] == r and i > edited_index]
    diff = lambda spans: max((after[r_, s:e] - before[r_, s:e]).abs().max().item()  # noqa: E731
                             for r_, s, e in spans)
    return diff(others), diff(later_same_row)


@pytest.mark.parametrize("backend", CPU_TRAIN_BACKENDS)
@settings(max_examples=6, **SETTINGS)
@given(case=rows_and_edit())
def test_editing_document_a_changes_no_logit_of_any_other_document(backend, case):
    rows, edit = case
    other_docs, _ = isolation_diffs(tiny_model(backend), rows, edit, ROW_LEN)
    assert other_docs <= 1e-6, f"an edit in one document moved another document's logits by {other_docs:.3g}"


@settings(max_examples=2, **SETTINGS)
@given(case=rows_and_edit(num_rows=st.just(FLEX_ROWS), row_len=FLEX_ROW_LEN))
def test_flex_isolates_documents(case):
    rows, edit = case
    other_docs, _ = isolation_diffs(tiny_model("flex"), rows, edit, FLEX_ROW_LEN)
    assert other_docs <= 1e-6, f"an edit in one document moved another document's logits by {other_docs:.3g}"


@settings(max_examples=6, **SETTINGS)
@given(case=rows_and_edit())
def test_without_isolation_later_documents_see_the_edit(case):
    rows, edit = case
    _, later_docs = isolation_diffs(tiny_model("sdpa_docs", isolate=False), rows, edit, ROW_LEN)
    assert later_docs > 1e-5, f"one causal mask per row, yet later documents moved only {later_docs:.3g}"


# ---------------------------------------------------------------------------------------------------
# Positions
# ---------------------------------------------------------------------------------------------------


multi_doc_rows = packed_rows().filter(lambda rs: any(len(row) > 1 for row in rs))


@settings(max_examples=5, **SETTINGS)
@given(rows=multi_doc_rows)
def test_learned_positions_without_reset_change_later_documents(rows):
    model = tiny_model("sdpa_docs", "learned")
    reset, _ = both_layouts(rows, ROW_LEN, reset_positions=True)
    continuous, _ = both_layouts(rows, ROW_LEN, reset_positions=False)
    with torch.no_grad():
        logits_reset, logits_cont = (model(**model_inputs(reset)).logits,
                                     model(**model_inputs(continuous)).logits)
    for r, start, end in packed_spans(rows):
        diff = (logits_reset[r, start:end] - logits_cont[r, start:end]).abs().max().item()
        if start == 0:  # the first document of a row has the same positions either way
            assert diff <= 1e-6
        else:
            assert diff > 1e-4, f"document at offset {start} ignores its learned positions"


@settings(max_examples=5, **SETTINGS)
@given(rows=multi_doc_rows)
def test_rope_with_isolation_is_invariant_to_a_constant_position_offset(rows):
    model = tiny_model("sdpa_docs", "rope")
    reset, _ = both_layouts(rows, ROW_LEN, reset_positions=True)
    continuous, _ = both_layouts(rows, ROW_LEN, reset_positions=False)
    assert not torch.equal(reset.position_ids, continuous.position_ids)
    with torch.no_grad():
        logits_reset, logits_cont = (model(**model_inputs(reset)).logits,
                                     model(**model_inputs(continuous)).logits)
    for r, start, end in packed_spans(rows):
        diff = (logits_reset[r, start:end] - logits_cont[r, start:end]).abs().max().item()
        assert diff <= 1e-4, f"offset {start} moved RoPE logits by {diff:.3g}"


def test_rope_positions_do_matter_when_not_a_constant_offset():
    """Control for the invariance test: RoPE is really applied, so a non-constant change is visible."""
    model = tiny_model("sdpa_docs", "rope")
    ids = torch.arange(2, 18).view(1, 16)
    with torch.no_grad():
        ordered = model(ids).logits
        shuffled = model(ids, position_ids=torch.randperm(
            16, generator=torch.Generator().manual_seed(0))[None]).logits
    assert (ordered - shuffled).abs().max() > 1e-4


# ---------------------------------------------------------------------------------------------------
# Labels
# ---------------------------------------------------------------------------------------------------


@settings(max_examples=10, **SETTINGS)
@given(rows=packed_rows())
def test_loss_targets_stay_inside_each_document_and_include_eos(rows):
    packed, _ = both_layouts(rows, ROW_LEN)
    logits = torch.randn(*packed.input_ids.shape, VOCAB, generator=torch.Generator().manual_seed(1))
    loss_sum, count = shifted_cross_entropy(logits, packed.labels)

    expected, expected_count = torch.zeros((), dtype=torch.float64), 0
    for (r, start, end), doc in zip(packed_spans(rows), [d for row in rows for d in row], strict=True):
        if end < ROW_LEN:  # A's last token (its EOS) must not be asked to predict the next segment's first
            assert packed.labels[r, end] == IGNORE_INDEX
        for t in range(start, end - 1):  # token t predicts token t + 1 of the same document; the last is EOS
            target = torch.tensor([int(doc.tokens[t - start + 1])])
            expected += F.cross_entropy(logits[r, t][None].double(), target, reduction="sum")
            expected_count += 1
        if len(doc) > 1:
            assert packed.labels[r, end - 1] == EOS_ID  # EOS is a target (of the token before it)
    assert count.item() == expected_count == packed.num_valid_targets
    assert abs(loss_sum.item() - expected.item()) <= 1e-4 * max(1.0, expected.item())


def test_without_the_boundary_label_the_loss_would_cross_documents():
    """Control: put B's first token back as a label (a naive labels = input_ids) and the loss changes."""
    rows = [[Document("a", np.array([5, 6, EOS_ID])), Document("b", np.array([7, 8, EOS_ID]))]]
    packed, _ = both_layouts(rows, 6)
    model = tiny_model("sdpa_docs")
    with torch.no_grad():
        out = model(**model_inputs(packed))
        naive = model(**{**model_inputs(packed), "labels": packed.input_ids})
    assert out.num_targets.item() == 4 and naive.num_targets.item() == 5
    assert abs(naive.loss_sum.item() - out.loss_sum.item()) > 1e-3


# ---------------------------------------------------------------------------------------------------
# A few optimizer steps
# ---------------------------------------------------------------------------------------------------


def test_a_few_optimizer_steps_on_packed_batches_reduce_the_loss():
    rng = np.random.default_rng(0)
    docs = []
    for i in range(12):  # short repeated patterns: learnable in a few steps
        pattern = rng.integers(2, VOCAB, 4)
        tokens = np.concatenate([np.tile(pattern, rng.integers(2, 5)), [EOS_ID]])
        docs.append(Document(f"d{i}", tokens))
    rows, row, used = [], [], 0
    for doc in docs:
        if used + len(doc) > ROW_LEN:
            rows.append(row)
            row, used = [], 0
        row.append(doc)
        used += len(doc)
    rows.append(row)
    batch = collate_rows(rows, ROW_LEN, PAD_ID, "packed")

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64, max_seq_len=64)
    model = build_model(cfg, AttentionConfig(backend="auto"))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        out = model(**model_inputs(batch))
        loss = out.loss_sum / batch.num_valid_targets  # the caller's denominator
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
