"""loss.normalization: each mode's loss and gradient equal an independent reference of its definition.

The reference is plain PyTorch written here: every document runs alone through a copy of the model,
its token losses come from F.cross_entropy, and the definitions are applied to those numbers using only
which documents share a row or a micro-batch. The trainer's step (per-token weights, one all-reduce)
must give the same loss and gradient. Then: global_tokens and document_mean do not depend on the
layout; micro_batch_mean and row_mean do, and these tests show by how much they move.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import MODEL, PAD, SEQ_LEN, make_steps
from trainer.config import NORMALIZATIONS
from trainer.data.batch import Document, collate_rows
from trainer.data.config import PackingConfig
from trainer.data.packing import OnlinePacker
from trainer.data.pipeline import micro_batches
from trainer.distributed.config import DistributedConfig
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo
from trainer.model import AttentionConfig, build_model, model_inputs
from trainer.run.step import loss_weights, train_step

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
MB_TOKENS = 2 * SEQ_LEN


def fresh_model():
    torch.manual_seed(0)
    return build_model(MODEL, AttentionConfig(backend="sdpa_docs"))


def laid_out(docs: list[Document], layout: str):
    """(micro-batches, rows as lists of document keys) of one logical batch in `layout`."""
    packer_rows = list(OnlinePacker(SEQ_LEN, buffer_size=8).pack(docs))
    mbs = micro_batches(packer_rows, PackingConfig(layout=layout), SEQ_LEN, MB_TOKENS, PAD)
    if layout == "packed":
        rows = [[d.key for d in row] for row in packer_rows]
    else:  # one document per row
        rows = [[key] for mb in mbs for key in mb.doc_keys]
    return mbs, rows


class GradRecorder(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it was given (the engine zeroes them after the step)."""

    def step(self, closure=None):
        self.grads = [p.grad.detach().clone() for group in self.param_groups for p in group["params"]]
        return super().step(closure)


def trainer_step(docs: list[Document], layout: str, normalization: str) -> tuple[float, dict]:
    """The step's loss and the gradient its optimizer received."""
    model = fresh_model()
    opt = GradRecorder(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    engine = parallelize(model, opt, sched, CPU, DistributedConfig(device="cpu"), grad_clip=0.0, dtype="fp32")
    mbs, _ = laid_out(docs, layout)
    stats = train_step(engine, mbs, CPU, PAD, normalization)
    return stats.loss, dict(zip([k for k, _ in model.named_parameters()], opt.grads, strict=True))


def reference(docs: list[Document], layout: str, normalization: str) -> tuple[float, dict]:
    """The definition, applied to per-document token losses computed one document at a time."""
    model = fresh_model()
    ce = {}  # key -> (n - 1,) token losses of the document alone
    for doc in docs:
        ids = torch.as_tensor(doc.tokens, dtype=torch.long)[None]
        logits = model(ids).logits[0]
        ce[doc.key] = F.cross_entropy(logits[:-1], ids[0, 1:], reduction="none")
    mbs, rows = laid_out(docs, layout)

    # mean of each group's token losses, then of groups
    def mean_over(groups: list[list[str]]) -> torch.Tensor:
        return torch.stack([torch.cat([ce[k] for k in g]).mean() for g in groups]).mean()

    if normalization == "global_tokens":
        loss = torch.cat(list(ce.values())).sum() / sum(len(v) for v in ce.values())
    elif normalization == "document_mean":
        loss = mean_over([[k] for k in ce])
    elif normalization == "micro_batch_mean":
        loss = mean_over([list(mb.doc_keys) for mb in mbs])
    else:
        loss = mean_over(rows)
    loss.backward()
    return loss.item(), {k: p.grad.detach() for k, p in model.named_parameters()}


def max_rel_diff(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).abs().max() / b[k].abs().max().clamp(min=1e-12)).item() for k in a)


@pytest.fixture(scope="module")
def docs() -> list[Document]:
    return make_steps(num_steps=1, docs_per_step=12, seed=3)[0]


@pytest.mark.parametrize("layout", ["packed", "unpacked"])
@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_step_equals_the_reference_definition(docs, normalization, layout):
    loss, grads = trainer_step(docs, layout, normalization)
    ref_loss, ref_grads = reference(docs, layout, normalization)
    assert abs(loss - ref_loss) <= 1e-5 * max(1.0, ref_loss)
    assert max_rel_diff(grads, ref_grads) <= 1e-4


@pytest.mark.parametrize("normalization", ["global_tokens", "document_mean"])
def test_layout_invariant_modes_give_packed_equal_unpacked(docs, normalization):
    packed_loss, packed = trainer_step(docs, "packed", normalization)
    unpacked_loss, unpacked = trainer_step(docs, "unpacked", normalization)
    assert abs(packed_loss - unpacked_loss) <= 1e-5
    assert max_rel_diff(packed, unpacked) <= 1e-5


@pytest.mark.parametrize("normalization", ["micro_batch_mean", "row_mean"])
def test_layout_dependent_modes_change_with_the_layout(docs, normalization):
    packed_loss, packed = trainer_step(docs, "packed", normalization)
    unpacked_loss, unpacked = trainer_step(docs, "unpacked", normalization)
    assert abs(packed_loss - unpacked_loss) > 1e-4
    assert max_rel_diff(packed, unpacked) > 1e-2


def test_row_mean_unpacked_is_document_mean(docs):
    """One document per row: the row mean is the document mean (a check that the units are the rows)."""
    _, rows_unpacked = trainer_step(docs, "unpacked", "row_mean")
    _, per_doc = trainer_step(docs, "packed", "document_mean")
    assert max_rel_diff(rows_unpacked, per_doc) <= 1e-5


def test_loss_weights_worked_example():
    """The docstring's row [a0 a1 a2 | b0 b1 | pad]: labels [-100 a1 a2 -100 b1 -100]."""
    row = [Document("a", np.array([5, 6, 7])), Document("b", np.array([8, 9]))]
    batch = collate_rows([row], 6, PAD, "packed")
    expected = {
        "document_mean": ([0, 1 / 2, 1 / 2, 0, 1, 0], 2),
        "row_mean": ([0, 1 / 3, 1 / 3, 0, 1 / 3, 0], 1),
        "micro_batch_mean": ([0, 1 / 3, 1 / 3, 0, 1 / 3, 0], 1),
    }
    for mode, (weights, units) in expected.items():
        w, n = loss_weights(batch, mode)
        torch.testing.assert_close(w, torch.tensor([weights]), msg=mode)
        assert n == units
    assert loss_weights(batch, "global_tokens") == (None, 3)
    two_rows = collate_rows([row, [Document("c", np.array([1, 2, 3, 4]))]], 6, PAD, "packed")
    w, n = loss_weights(two_rows, "row_mean")
    assert n == 2 and torch.allclose(w[1], torch.tensor([0, 1 / 3, 1 / 3, 1 / 3, 0, 0]))
    w, n = loss_weights(two_rows, "micro_batch_mean")
    assert n == 1 and torch.allclose(w[w > 0], torch.full((6,), 1 / 6))


def test_unknown_normalization_is_rejected():
    from trainer.config import LossConfig

    with pytest.raises(ValueError, match="loss.normalization must be one of"):
        LossConfig(normalization="token_mean")


def test_model_weighted_sum_is_the_plain_sum_with_unit_weights(docs):
    model = fresh_model()
    mbs, _ = laid_out(docs, "packed")
    inputs = model_inputs(mbs[0])
    plain = model(**inputs)
    weighted = model(**inputs, loss_weights=torch.ones(mbs[0].shape))
    assert torch.allclose(weighted.weighted_loss_sum, plain.loss_sum, rtol=1e-6)
    assert torch.allclose(weighted.loss_sum, plain.loss_sum, rtol=1e-6) and plain.weighted_loss_sum is None
