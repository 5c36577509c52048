"""loss.chunk_tokens: the head and the loss chunk by chunk give the plain path's loss and gradients
(CPU, fp32).

Two yardsticks: the model's own plain path (whole logits, plain_cross_entropy), and an independent
reference written here: F.cross_entropy over the full logits of the model's final hidden states (ln_f's
output, captured by a hook) times the tied head. Then: the logits never exist whole, bf16 autocast, eval, and
the config keys.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.config import LossConfig, _build
from trainer.data.batch import IGNORE_INDEX, Batch, Document, collate_rows
from trainer.errors import ConfigError
from trainer.model import AttentionConfig, GPTConfig, build_model, chunked_cross_entropy, model_inputs
from trainer.model.gpt import GPT
from trainer.model.loss import plain_cross_entropy

VOCAB, ROW_LEN = 61, 24
REL_TOL = 1e-6  # measured: chunked vs plain or reference <= 8.1e-7 (worst tensor); plain vs reference 4.9e-7
CHUNKS = (1, 5, 16, 72, 500)  # one position; not a divisor of N; a divisor; N = 3 rows x 24; more than N


def tiny(chunk_tokens: int = 0, **overrides) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(**{**dict(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, max_seq_len=64), **overrides})
    return build_model(cfg, AttentionConfig(backend="sdpa_docs"), loss_chunk_tokens=chunk_tokens)


def batch(layout: str) -> Batch:
    """Three documents (lengths 9, 7, 20), packed into 2 rows or one per padded row;
    with padding either way."""
    rng = np.random.default_rng(0)
    a, b, c = (Document(k, rng.integers(1, VOCAB, n)) for k, n in (("a", 9), ("b", 7), ("c", 20)))
    rows = [[a, b], [c]] if layout == "packed" else [[a], [b], [c]]
    return collate_rows(rows, ROW_LEN, 0, layout)


def weights_like(labels: torch.Tensor) -> torch.Tensor:
    return torch.rand(labels.shape, generator=torch.Generator().manual_seed(1)) * (labels != IGNORE_INDEX)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst element error relative to the tensor's largest magnitude."""
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def run(model: GPT, inputs: dict, weighted: bool):
    """(loss sum, targets, weighted sum, parameter gradients) of the objective a train step backpropagates."""
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    objective = out.weighted_loss_sum if weighted else out.loss_sum
    objective.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return out.loss_sum.detach(), out.num_targets, out.weighted_loss_sum, grads


def reference(model: GPT, inputs: dict, weighted: bool):
    """The same four, from F.cross_entropy over the full logits of the hidden states
    (written independently)."""
    model.zero_grad(set_to_none=True)
    captured = {}
    handle = model.ln_f.register_forward_hook(lambda mod, args, out: captured.update(h=out))
    model(**{**inputs, "labels": None, "loss_weights": None})
    handle.remove()
    h_BLC, labels = captured["h"], inputs["labels"]
    logits_NV = (h_BLC[:, :-1] @ model.wte.weight.T).reshape(-1, VOCAB)
    targets_N = labels[:, 1:].reshape(-1)
    ce_N = F.cross_entropy(logits_NV, targets_N, ignore_index=IGNORE_INDEX, reduction="none")
    wsum = (ce_N * inputs["loss_weights"][:, 1:].reshape(-1)).sum() if weighted else None
    (wsum if weighted else ce_N.sum()).backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return ce_N.sum().detach(), (targets_N != IGNORE_INDEX).sum(), wsum, grads


def assert_same(got, want, tol: float = REL_TOL) -> None:
    loss, count, wsum, grads = got
    assert rel_err(loss, want[0]) <= tol and int(count) == int(want[1])
    assert (wsum is None) == (want[2] is None)
    if wsum is not None:
        assert rel_err(wsum, want[2]) <= tol
    assert grads.keys() == want[3].keys()
    for name, g in grads.items():
        assert rel_err(g, want[3][name]) <= tol, (name, rel_err(g, want[3][name]))


@pytest.mark.parametrize("weighted", [False, True], ids=["sum", "weighted"])
@pytest.mark.parametrize("layout", ["packed", "unpacked"])
@pytest.mark.parametrize("chunk", CHUNKS)
def test_chunked_loss_and_gradients_match_the_plain_path_and_a_reference(chunk, layout, weighted):
    inputs = model_inputs(batch(layout))
    if weighted:
        inputs["loss_weights"] = weights_like(inputs["labels"])
    plain = run(tiny(), inputs, weighted)
    assert_same(plain, reference(tiny(), inputs, weighted))  # the yardsticks agree with each other
    assert_same(run(tiny(chunk), inputs, weighted), plain)
    assert_same(run(tiny(chunk), inputs, weighted), reference(tiny(), inputs, weighted))


def test_both_sums_backpropagated_together():
    """a * loss_sum + b * weighted_sum: each stored gradient is scaled by its own incoming gradient."""
    inputs = model_inputs(batch("packed"))
    inputs["loss_weights"] = weights_like(inputs["labels"])
    grads = []
    for model in (tiny(), tiny(16)):
        out = model(**inputs)
        (0.3 * out.loss_sum - 2.0 * out.weighted_loss_sum).backward()
        grads.append({name: p.grad for name, p in model.named_parameters()})
    for name, g in grads[1].items():
        assert rel_err(g, grads[0][name]) <= REL_TOL, name


def test_gradient_reaches_the_tied_embedding_through_the_head():
    """Rows of tokens that are never inputs get a gradient only through the (tied) output head."""
    model = tiny(16)
    assert model.lm_head.weight is model.wte.weight
    inputs = model_inputs(batch("packed"))
    model(**inputs).loss_sum.backward()
    unused = sorted(set(range(VOCAB)) - set(inputs["input_ids"].flatten().tolist()))
    assert unused and model.wte.weight.grad[unused].abs().sum(dim=1).min() > 0


@settings(deadline=None, max_examples=40)
@given(st.integers(1, 3), st.integers(2, 12), st.integers(1, 40), st.booleans(), st.integers(0, 2**31 - 1))
def test_chunked_cross_entropy_is_the_shifted_cross_entropy(rows, length, chunk, weighted, seed):
    """Any shape, chunk size and target mask (ignored positions included): values and both input gradients."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, length, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(13, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (rows, length), generator=g)
    labels[torch.rand(rows, length, generator=g) < 0.3] = IGNORE_INDEX
    weights = torch.rand(rows, length, generator=g, dtype=torch.float64) if weighted else None
    loss, count, wsum, _ = chunked_cross_entropy(h, w, labels, weights, chunk)
    logits = h @ w.T
    ref_loss, ref_count, ref_wsum, _ = plain_cross_entropy(logits, labels, weights)
    assert int(count) == int(ref_count) and torch.allclose(loss, ref_loss, rtol=1e-6, atol=1e-6)
    if weighted:
        assert torch.allclose(wsum.double(), ref_wsum, rtol=1e-6, atol=1e-6)
    objective, ref_objective = (wsum, ref_wsum) if weighted else (loss, ref_loss)
    got = torch.autograd.grad(objective, (h, w)) if count else None
    if count:  # with no target the plain sum is a constant 0: nothing to differentiate
        want = torch.autograd.grad(ref_objective, (h, w))
        for a, b in zip(got, want, strict=True):
            # The chunked path takes the softmax in fp32 by design (the loss is fp32 on every path), so fp64
            # inputs agree to fp32 precision: an element summed over positions, with logits of magnitude ~10,
            # carries ~1e-6 of absolute error (rows=2, length=10, chunk=1, seed=2336: 1.9e-6, also before the
            # loss groups existed).
            assert torch.allclose(a, b.to(a.dtype), rtol=1e-5, atol=1e-5)


class LargestTensor(TorchDispatchMode):
    """Records the most elements of any tensor an op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_the_logits_never_exist_whole():
    """Forward + backward of a 48-position micro-batch: the largest tensor is one chunk's logits,
    not all of them."""
    inputs = model_inputs(batch("packed"))  # 2 rows x 24 = 48 positions
    vocab = 4096  # 40 x vocab is more than any other tensor (the head's 32 x vocab, activations of 48 x 128)
    for chunk, bound in ((0, 48 * vocab), (40, 40 * vocab)):
        model = tiny(chunk, vocab_size=vocab)
        with LargestTensor() as mode:
            model(**inputs).loss_sum.backward()
        assert mode.numel == bound, (chunk, mode.numel)


def test_logits_only_when_asked():
    model = tiny(16)
    inputs = model_inputs(batch("packed"))
    assert model(**inputs).logits is None  # the default when the loss is chunked
    plain = tiny()(**inputs)
    asked = model(**inputs, return_logits=True)  # falls back to the plain path
    assert torch.equal(asked.logits, plain.logits) and torch.equal(asked.loss_sum, plain.loss_sum)
    assert model(inputs["input_ids"]).logits.shape == (2, ROW_LEN, VOCAB)  # no labels: logits, as always
    lean = model(**inputs, return_logits=False)
    assert lean.logits is None and rel_err(lean.loss_sum, plain.loss_sum) <= REL_TOL


def test_eval_without_gradients_gives_the_same_loss():
    model, inputs = tiny(16), model_inputs(batch("unpacked"))
    with torch.no_grad():
        lean = model(**inputs, return_logits=False)
        plain = tiny()(**inputs, return_logits=False)
    assert not lean.loss_sum.requires_grad and rel_err(lean.loss_sum, plain.loss_sum) <= REL_TOL


def test_bf16_autocast_is_as_close_to_fp32_as_the_plain_path():
    """Under autocast the head runs in bf16 and the loss in fp32, as on the plain path: the chunked path's
    error against the fp32 result is the plain path's (measured: loss 1.3e-6, gradients 8.4e-3, both
    paths)."""
    inputs = model_inputs(batch("packed"))
    exact = run(tiny(), inputs, weighted=False)
    results = {}
    for chunk in (0, 16):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results[chunk] = run(tiny(chunk), inputs, weighted=False)
    errors = {chunk: max(rel_err(g, exact[3][n]) for n, g in r[3].items()) for chunk, r in results.items()}
    assert results[16][0].dtype == torch.float32
    assert rel_err(results[16][0], results[0][0]) <= 1e-3
    assert errors[16] <= 2 * errors[0] + 1e-3, errors


def test_config_key():
    assert LossConfig().chunk_tokens == 0 and LossConfig(chunk_tokens=None).chunk_tokens is None
    assert _build(LossConfig, {"chunk_tokens": 1024}, "loss").chunk_tokens == 1024
    with pytest.raises(ConfigError, match=r"loss.chunk_tokens must be >= 0"):
        _build(LossConfig, {"chunk_tokens": -1}, "loss")
    with pytest.raises(ConfigError, match=r"loss.chunk_tokens must be an integer or null"):
        _build(LossConfig, {"chunk_tokens": 1.5}, "loss")
    assert build_model(GPTConfig(vocab_size=8, n_layer=1, n_head=1, n_embd=4, max_seq_len=4),
                       AttentionConfig(), loss_chunk_tokens=None).loss_chunk_tokens == 0
