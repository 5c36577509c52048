"""train.activation_checkpointing: recomputing blocks in backward changes memory and compute, not gradients.

For each mode and layout (packed rows with cu_seqlens, padded rows), with and without dropout, the loss and
every gradient equal those of the model without checkpointing (CPU, fp32). Then what each mode recomputes
(forward calls counted by hooks) and keeps (bytes autograd saves), and what it leaves alone.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.config import TrainConfig, _build
from trainer.data.batch import Batch, Document, collate_rows
from trainer.errors import ConfigError
from trainer.model import (
    AttentionConfig,
    GPTConfig,
    KVCache,
    apply_activation_checkpointing,
    build_model,
    model_inputs,
)
from trainer.model.gpt import GPT

VOCAB, ROW_LEN = 61, 24
REL_TOL = 1e-6  # measured: 0 (bitwise equal) in every case here, bf16 included
MODES = ("full", "selective")


def tiny(mode: str = "none", chunk_tokens: int = 0, **overrides) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(**{**dict(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, max_seq_len=64), **overrides})
    model = build_model(cfg, AttentionConfig(backend="sdpa_docs"), loss_chunk_tokens=chunk_tokens)
    return apply_activation_checkpointing(model, mode)


def batch(layout: str) -> Batch:
    """Three documents (lengths 9, 7, 20), packed into 2 rows or one per padded row."""
    rng = np.random.default_rng(0)
    a, b, c = (Document(k, rng.integers(1, VOCAB, n)) for k, n in (("a", 9), ("b", 7), ("c", 20)))
    return collate_rows([[a, b], [c]] if layout == "packed" else [[a], [b], [c]], ROW_LEN, 0, layout)


def loss_and_grads(model: GPT, inputs: dict, seed: int = 123) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the dropout masks
    out = model(**inputs)
    out.loss_sum.backward()
    return out.loss_sum.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def max_rel_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-30)) for k in a)


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("layout", ["packed", "unpacked"])
@pytest.mark.parametrize("mode", MODES)
def test_same_loss_and_gradients_as_without(mode, layout, dropout):
    inputs = model_inputs(batch(layout))
    loss, grads = loss_and_grads(tiny(dropout=dropout), inputs)
    ckpt_loss, ckpt_grads = loss_and_grads(tiny(mode, dropout=dropout), inputs)
    assert abs(ckpt_loss - loss) <= REL_TOL * abs(loss)
    assert max_rel_err(ckpt_grads, grads) <= REL_TOL
    if dropout:  # the masks matter, so the recompute really drew the same ones
        other_loss, other_grads = loss_and_grads(tiny(mode, dropout=dropout), inputs, seed=124)
        assert abs(other_loss - loss) > 1e-3 and max_rel_err(other_grads, grads) > 1e-2


@pytest.mark.parametrize("mode", MODES)
def test_rope_bf16_and_chunked_loss_together(mode):
    """RoPE's (cos, sin) passed into the checkpoint, bf16 autocast replayed in the recompute, chunked loss."""
    inputs = model_inputs(batch("packed"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, grads = loss_and_grads(tiny(chunk_tokens=16, pos_emb="rope"), inputs)
        ckpt_loss, ckpt_grads = loss_and_grads(tiny(mode, chunk_tokens=16, pos_emb="rope"), inputs)
    assert abs(ckpt_loss - loss) <= REL_TOL * abs(loss)
    assert max_rel_err(ckpt_grads, grads) <= REL_TOL


@pytest.mark.parametrize("mode, attn_calls, mlp_calls", [("none", 1, 1), ("full", 2, 2), ("selective", 1, 2)])
def test_what_each_mode_recomputes(mode, attn_calls, mlp_calls):
    model = tiny(mode)
    calls = {"attn": 0, "mlp": 0}
    # pre-hooks: a recompute stops once the last stored tensor is remade (early stop)
    for block in model.blocks:
        block.attn.register_forward_pre_hook(lambda *_: calls.__setitem__("attn", calls["attn"] + 1))
        block.mlp.register_forward_pre_hook(lambda *_: calls.__setitem__("mlp", calls["mlp"] + 1))
    loss_and_grads(model, model_inputs(batch("packed")))
    n = len(model.blocks)
    assert calls == {"attn": attn_calls * n, "mlp": mlp_calls * n}


def saved_bytes(model: GPT, inputs: dict) -> int:
    """Bytes of the non-parameter tensors autograd keeps for backward outside checkpointed regions."""
    params = {p.data_ptr() for p in model.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(**inputs).loss_sum.backward()
    return total


def test_each_mode_keeps_fewer_activations():
    inputs = model_inputs(batch("packed"))
    kept = {mode: saved_bytes(tiny(mode, chunk_tokens=16), inputs) for mode in ("none", "selective", "full")}
    assert kept["full"] < kept["selective"] < 0.6 * kept["none"], kept


@pytest.mark.parametrize("mode", MODES)
def test_eval_and_decoding_are_unchanged(mode):
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    plain, ckpt = tiny().eval(), tiny(mode).eval()
    with torch.no_grad():
        assert torch.equal(ckpt(ids).logits, plain(ids).logits)
    cache = KVCache(len(ckpt.blocks))  # the cache path never checkpoints, with gradients enabled or not
    pieces = [ckpt(ids[:, :6], cache=cache).logits, ckpt(ids[:, 6:], cache=cache).logits]
    assert torch.allclose(torch.cat(pieces, dim=1), plain(ids).logits, atol=1e-5)


def test_parameters_and_config_keys():
    assert [n for n, _ in tiny("full").named_parameters()] == [n for n, _ in tiny().named_parameters()]
    assert tiny("full").state_dict().keys() == tiny().state_dict().keys()  # checkpoints load either way
    with pytest.raises(ValueError, match="one of"):
        apply_activation_checkpointing(tiny(), "some")
    assert TrainConfig().activation_checkpointing == "none"
    assert (_build(TrainConfig, {"activation_checkpointing": "selective"}, "train").activation_checkpointing
            == "selective")
    with pytest.raises(ConfigError, match=r"train.activation_checkpointing must be one of "
                                          r"\('none', 'full', 'selective'\)"):
        _build(TrainConfig, {"activation_checkpointing": "true"}, "train")
