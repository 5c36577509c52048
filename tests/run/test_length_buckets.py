"""Token loss by document-length bucket (`token_loss_by_length`): against plain PyTorch, across layouts, in a
run.

The reference runs every document alone through a copy of the model and takes its token losses from
F.cross_entropy written here, then sums them by the document's length bucket. The trainer's step must report
the same per-bucket token losses (from the forward that computes the objective, without changing it), in the
packed and the unpacked layout alike while documents are isolated; with `attention.isolate_documents=false`
the packed documents read their row neighbours, and the buckets show it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.helpers import MODEL, PAD, SEQ_LEN, make_steps, make_trainer, metrics
from trainer.data.batch import Document, LossGroups, length_bucket_names
from trainer.data.config import PackingConfig
from trainer.data.packing import OnlinePacker
from trainer.data.pipeline import micro_batches
from trainer.distributed.config import DistributedConfig
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo
from trainer.model import AttentionConfig, build_model
from trainer.run.metrics import by_group
from trainer.run.step import train_step

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
EDGES = [4, 12, 24]  # documents of 2..32 tokens: four buckets, each with several documents


def model_for(isolate: bool = True, chunk: int = 0):
    torch.manual_seed(0)
    return build_model(MODEL, AttentionConfig(backend="sdpa_docs", isolate_documents=isolate),
                       loss_chunk_tokens=chunk)


def step_by_length(docs: list[Document], layout: str, isolate: bool = True, chunk: int = 0) -> dict:
    model = model_for(isolate, chunk)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    engine = parallelize(model, opt, sched, CPU, DistributedConfig(device="cpu"), grad_clip=0.0, dtype="fp32")
    rows = list(OnlinePacker(SEQ_LEN, buffer_size=8).pack(docs))
    mbs = micro_batches(rows, PackingConfig(layout=layout), SEQ_LEN, 2 * SEQ_LEN, PAD)
    stats = train_step(engine, mbs, CPU, PAD, groups=LossGroups(tuple(EDGES)))
    return {"stats": stats, **by_group(LossGroups(tuple(EDGES)), stats.group_loss_sums, stats.group_targets)}


def reference_by_length(docs: list[Document]) -> tuple[dict, dict]:
    """Per bucket: (mean token loss, targets) of its documents, each run alone."""
    model = model_for()
    sums, counts = {}, {}
    with torch.no_grad():
        for doc in docs:
            ids = torch.as_tensor(doc.tokens, dtype=torch.long)[None]
            ce = F.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="sum")
            bucket = length_bucket_names(EDGES)[sum(len(doc) > e for e in EDGES)]
            sums[bucket] = sums.get(bucket, 0.0) + ce.item()
            counts[bucket] = counts.get(bucket, 0) + len(doc) - 1
    return {b: sums[b] / counts[b] for b in sums}, counts


@pytest.fixture(scope="module")
def docs() -> list[Document]:
    return make_steps(num_steps=1, docs_per_step=24, seed=5)[0]


@pytest.mark.parametrize("layout", ["packed", "unpacked"])
def test_per_bucket_token_loss_equals_each_document_alone(docs, layout):
    got = step_by_length(docs, layout)
    expected, targets = reference_by_length(docs)
    assert len(expected) == len(EDGES) + 1  # every bucket holds documents
    assert got["targets_by_length"] == targets
    for bucket, loss in expected.items():
        assert got["token_loss_by_length"][bucket] == pytest.approx(loss, abs=1e-5), bucket
    # The buckets partition the step's targets: their weighted mean is the step's token loss.
    stats = got["stats"]
    assert sum(stats.group_loss_sums) / sum(stats.group_targets) == pytest.approx(stats.token_loss, abs=1e-6)


def test_the_chunked_loss_gives_the_same_buckets(docs):
    plain, chunked = step_by_length(docs, "packed"), step_by_length(docs, "packed", chunk=7)
    for bucket, loss in plain["token_loss_by_length"].items():
        assert chunked["token_loss_by_length"][bucket] == pytest.approx(loss, abs=1e-5), bucket
    assert chunked["stats"].loss == pytest.approx(plain["stats"].loss, abs=1e-6)


def test_packed_equals_unpacked_per_bucket_with_isolation_and_differs_without(docs):
    unpacked = step_by_length(docs, "unpacked")["token_loss_by_length"]
    isolated = step_by_length(docs, "packed")["token_loss_by_length"]
    mixed = step_by_length(docs, "packed", isolate=False)["token_loss_by_length"]
    assert max(abs(isolated[b] - unpacked[b]) for b in unpacked) <= 1e-5
    deltas = {b: abs(mixed[b] - unpacked[b]) for b in unpacked}
    assert max(deltas.values()) > 1e-3, deltas  # documents that read their neighbours score differently


def test_a_run_logs_them_every_step_and_eval(demo_data, tmp_path):
    trainer = make_trainer(demo_data, tmp_path / "run", "train.max_steps=3", "train.eval_every=3",
                           "train.eval_docs=40", "logging.length_buckets=[16,64]",
                           "logging.position_buckets=[64,256,1024]")
    summary = trainer.fit()
    lines = metrics(tmp_path / "run")
    names = ["<=16", "<=64", ">64"]
    for m in lines:
        assert (list(m["token_loss_by_length"]) == names
                and sum(m["targets_by_length"].values()) == m["valid_tokens"])
        known = {b: v for b, v in m["token_loss_by_length"].items() if v is not None}
        mean = sum(v * m["targets_by_length"][b] for b, v in known.items()) / m["valid_tokens"]
        assert mean == pytest.approx(m["token_loss"], rel=1e-5)
    for m in lines:  # the position buckets, as the isolation and positions ablations set them
        assert list(m["token_loss_by_position"]) == ["<=64", "<=256", "<=1024", ">1024"]
        assert sum(m["targets_by_position"].values()) == m["valid_tokens"]
    last = lines[-1]
    assert sum(last["val_targets_by_position"].values()) == last["val_tokens"]
    assert summary["final_val_token_loss_by_position"] == last["val_token_loss_by_position"]
    assert sum(last["val_targets_by_length"].values()) == last["val_tokens"]
    assert summary["final_val_token_loss_by_length"] == last["val_token_loss_by_length"]
    assert all(v is not None for v in last["val_token_loss_by_length"].values())


# ---------------------------------------------------------------------------------------------------
# By position in the document (`token_loss_by_position`, logging.position_buckets)
# ---------------------------------------------------------------------------------------------------

POSITIONS = [2, 8, 16]  # targets at indices 1..2, 3..8, 9..16, 17.. of their document


def step_by_position(docs: list[Document], layout: str, isolate: bool = True, reset: bool = True) -> dict:
    model = model_for(isolate)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    engine = parallelize(model, opt, sched, CPU, DistributedConfig(device="cpu"), grad_clip=0.0, dtype="fp32")
    rows = list(OnlinePacker(SEQ_LEN, buffer_size=8).pack(docs))
    packing = PackingConfig(layout=layout, reset_positions=reset)
    mbs = micro_batches(rows, packing, SEQ_LEN, 2 * SEQ_LEN, PAD)
    groups = LossGroups(tuple(EDGES), positions=tuple(POSITIONS))
    stats = train_step(engine, mbs, CPU, PAD, groups=groups)
    return {"stats": stats, **by_group(groups, stats.group_loss_sums, stats.group_targets)}


def reference_by_position(docs: list[Document]) -> tuple[dict, dict]:
    """Per position bucket: (mean token loss, targets) of the targets at those indices of their document, each
    document run alone (plain cross entropy of its logits, written here)."""
    model = model_for()
    sums, counts = {}, {}
    names = length_bucket_names(POSITIONS)
    with torch.no_grad():
        for doc in docs:
            ids = torch.as_tensor(doc.tokens, dtype=torch.long)[None]
            ce = F.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:], reduction="none")
            for index, loss in enumerate(ce.tolist(), start=1):  # the target is the token at `index`
                bucket = names[sum(index > e for e in POSITIONS)]
                sums[bucket] = sums.get(bucket, 0.0) + loss
                counts[bucket] = counts.get(bucket, 0) + 1
    return {b: sums[b] / counts[b] for b in sums}, counts


def test_loss_groups_place_each_position_by_its_index_in_its_segment():
    """The docstring's row, by hand: [a0 a1 a2 | b0 b1 | pad], a of source 1 (length 3 > 2), b of source 0."""
    from trainer.data.batch import collate_rows

    a = Document("a", np.arange(3), source=1)
    b = Document("b", np.arange(3, 5), source=0)
    batch = collate_rows([[a, b]], 6, PAD, "packed")
    groups = LossGroups((2,), ("x", "y"), positions=(1,))
    assert groups.size == 8
    assert groups.ids(batch).tolist() == [[6, 6, 7, 0, 0, -1]]


def test_per_position_token_loss_equals_each_document_alone(docs):
    got = step_by_position(docs, "packed")
    expected, targets = reference_by_position(docs)
    assert len(expected) == len(POSITIONS) + 1
    assert got["targets_by_position"] == targets
    for bucket, loss in expected.items():
        assert got["token_loss_by_position"][bucket] == pytest.approx(loss, abs=1e-5), bucket
    # Length and position are two marginals of one table: each partitions the step's targets.
    assert got["targets_by_length"] == step_by_length(docs, "packed")["targets_by_length"]
    assert sum(targets.values()) == sum(got["targets_by_length"].values())


def test_continuous_positions_show_at_the_documents_later_positions(docs):
    """packing.reset_positions=false gives each packed document the positions of its place in the row: its
    early targets are read at positions the model gives other weights, and the position buckets show the
    change (the unpacked layout, each document at the start of its row, is the reference)."""
    unpacked = step_by_position(docs, "unpacked")["token_loss_by_position"]
    reset = step_by_position(docs, "packed")["token_loss_by_position"]
    continuous = step_by_position(docs, "packed", reset=False)["token_loss_by_position"]
    assert max(abs(reset[b] - unpacked[b]) for b in unpacked) <= 1e-5
    assert max(abs(continuous[b] - unpacked[b]) for b in unpacked) > 1e-3
