"""The loss's per-group sums (the step's metrics) are reductions of the objective's own token losses.

`trainer.model.loss` computes the token losses once, over the contiguous (B * L, V) logits, and takes the
objective, the weighted sum and the per-group sums from that one tensor. Proven here: the loss and every
gradient are the same bit for bit with and without groups (the metrics cannot change or slow the objective's
kernel), the group sums are the token losses of that same tensor and agree with F.log_softmax written here,
and the loss reads the logits in place (no sliced or transposed copy of them). Per bucket against each
document alone: tests/run/test_length_buckets.py; per source: tests/run/test_source_metrics.py.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.data.batch import IGNORE_INDEX, Batch, Document, LossGroups, collate_rows
from trainer.distributed.config import DistributedConfig
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo
from trainer.model import AttentionConfig, GPTConfig, build_model, model_inputs
from trainer.model.gpt import GPT
from trainer.model.loss import group_sums, token_losses
from trainer.run.step import train_step, with_loss_groups

VOCAB, ROW_LEN = 97, 32
GROUPS = LossGroups((4, 12), ("a", "b"))  # 2 sources x 3 length buckets
CPU = DistInfo(0, 1, 0, torch.device("cpu"))


def tiny(chunk_tokens: int = 0, vocab: int = VOCAB) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab, n_layer=2, n_head=4, n_embd=32, max_seq_len=64)
    return build_model(cfg, AttentionConfig(backend="sdpa_docs"), loss_chunk_tokens=chunk_tokens)


def documents() -> list[Document]:
    """Nine documents of 2..20 tokens from both sources: every group of GROUPS holds some."""
    rng = np.random.default_rng(3)
    lengths = (3, 20, 9, 2, 14, 6, 11, 17, 4)
    return [Document(f"d{i}", rng.integers(1, VOCAB, n), source=i % 2) for i, n in enumerate(lengths)]


def batch(layout: str) -> Batch:
    docs = documents()
    rows, row = [], []
    for doc in docs if layout == "packed" else []:  # first fit in order, rows of ROW_LEN
        if sum(map(len, row)) + len(doc) > ROW_LEN:
            rows, row = rows + [row], []
        row.append(doc)
    rows = rows + [row] if layout == "packed" else [[d] for d in docs]
    return collate_rows(rows, ROW_LEN, 0, layout)


def forward_backward(model: GPT, inputs: dict) -> tuple[dict, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    out = model(**inputs)
    (out.loss_sum if out.weighted_loss_sum is None else out.loss_sum + out.weighted_loss_sum).backward()
    values = {"loss_sum": out.loss_sum.detach(), "num_targets": out.num_targets,
              "weighted": out.weighted_loss_sum, "groups": out.group_loss_sums}
    return values, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("chunk", [0, 8])
@pytest.mark.parametrize("layout", ["packed", "unpacked"])
@pytest.mark.parametrize("weighted", [False, True])
def test_groups_leave_the_loss_and_gradients_bit_for_bit(chunk, layout, weighted):
    """With and without the metrics' groups, the same loss, weighted sum and gradients, exactly: the groups
    only add a reduction of the token losses, never another loss computation."""
    b = batch(layout)
    if weighted:
        b = replace(b, loss_weights=torch.rand(b.shape, generator=torch.Generator().manual_seed(1)))
    grouped, _ = with_loss_groups(b, GROUPS)
    plain_values, plain_grads = forward_backward(tiny(chunk), model_inputs(b))
    values, grads = forward_backward(tiny(chunk), model_inputs(grouped))
    assert plain_values["groups"] is None and values["groups"].shape == (GROUPS.size,)
    assert torch.equal(values["loss_sum"], plain_values["loss_sum"])
    assert int(values["num_targets"]) == int(plain_values["num_targets"])
    if weighted:
        assert torch.equal(values["weighted"], plain_values["weighted"])
    for name, grad in grads.items():
        assert torch.equal(grad, plain_grads[name]), name


@pytest.mark.parametrize("chunk", [0, 8])
@pytest.mark.parametrize("layout", ["packed", "unpacked"])
def test_group_sums_are_the_token_losses_of_the_objective(chunk, layout):
    """The group sums are the loss's own token losses summed by group: they partition the loss sum, and each
    equals the cross entropy of its targets taken here with F.log_softmax from the model's logits."""
    grouped, counts = with_loss_groups(batch(layout), GROUPS)
    inputs = model_inputs(grouped)
    model = tiny(chunk)
    with torch.no_grad():
        out = model(**inputs)
        logits = model(**inputs, return_logits=True).logits  # the plain path's logits, same weights
    assert min(counts) > 0  # every group holds targets
    # The partition: every target has a group, so the groups sum to the loss (float order aside).
    assert float(out.group_loss_sums.sum()) == pytest.approx(float(out.loss_sum), rel=1e-6)
    # The same tensor: the fast path's token losses, grouped, give the sums (plain path: exactly).
    targets_groups = F.pad(grouped.loss_groups[:, 1:], (0, 1), value=-1)
    from_tokens = group_sums(token_losses(logits, grouped.labels), targets_groups, GROUPS.size)
    if chunk == 0:
        assert torch.equal(out.group_loss_sums, from_tokens)
    # Independent: log-probabilities of each target, position by position, summed by group here.
    logp = F.log_softmax(logits.double(), dim=-1)
    want = torch.zeros(GROUPS.size, dtype=torch.float64)
    B, L = grouped.shape
    for b in range(B):
        for t in range(1, L):
            label = int(grouped.labels[b, t])
            if label != IGNORE_INDEX:
                want[int(grouped.loss_groups[b, t])] -= logp[b, t - 1, label]
    assert torch.allclose(out.group_loss_sums.double(), want, rtol=1e-5, atol=1e-5)


class LargeStorages(TorchDispatchMode):
    """The distinct storages of at least `numel` elements that ops produce (views of one storage count
    once)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.storages = numel, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                self.storages.add(t.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("with_groups", [False, True])
def test_the_loss_reads_the_logits_in_place(with_groups):
    """Forward of the plain loss makes two logits-sized tensors, the logits and their log-softmax: no copy of
    the logits without each row's last position (a slice, then reshape) nor of a transposed (B, V, L) view."""
    b = batch("unpacked")
    if with_groups:
        b, _ = with_loss_groups(b, GROUPS)
    vocab = 4096  # (L - 1) x vocab per row is more than any other tensor (activations of L x 128 per row)
    model = tiny(vocab=vocab)
    B, L = b.shape
    with torch.no_grad(), LargeStorages(B * (L - 1) * vocab) as mode:
        model(**model_inputs(b))
    assert len(mode.storages) == 2, len(mode.storages)


def test_a_step_with_metrics_trains_exactly_as_one_without():
    """train_step with the loss groups of a mixture with length buckets and without any: the same loss and the
    same parameters after the update, bit for bit."""
    params = {}
    for name, groups in (("off", LossGroups()), ("on", GROUPS)):
        model = tiny()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
        engine = parallelize(model, opt, sched, CPU, DistributedConfig(device="cpu"), grad_clip=1.0,
                             dtype="fp32")
        stats = train_step(engine, [batch("packed"), batch("unpacked")], CPU, 0, groups=groups)
        params[name] = (stats.loss, stats.grad_norm,
                        {n: p.detach().clone() for n, p in model.named_parameters()})
    (loss_off, norm_off, p_off), (loss_on, norm_on, p_on) = params["off"], params["on"]
    assert loss_on == loss_off and norm_on == norm_off
    assert all(torch.equal(p_on[n], p_off[n]) for n in p_off)
