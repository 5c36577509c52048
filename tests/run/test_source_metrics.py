"""Token loss and counts by source of a mixture (`token_loss_by_source`, ...): against plain PyTorch, in every
layout, on one rank and two, in the eval, and in the two marginal tables of one source x length-bucket table.

The reference runs every document alone through a copy of the model and takes its token losses from
F.cross_entropy written here, then sums them by the document's source and length bucket. The trainer's step
(and its eval) must report the same losses per group, per source and per bucket, and the same tokens and
documents per source, whatever the layout, while documents are isolated.
"""

from __future__ import annotations

import logging
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from tests.harness import run_distributed
from tests.helpers import (
    MODEL,
    PAD,
    SEQ_LEN,
    doc_keys,
    make_trainer,
    metrics,
    mixture_corpora,
    sources_override,
)
from trainer.data.batch import Document, LossGroups, collate_rows, length_bucket_names, source_counts
from trainer.data.config import DataConfig, PackingConfig
from trainer.data.feed import load_eval_docs
from trainer.data.packing import OnlinePacker
from trainer.data.pipeline import micro_batches
from trainer.data.sources import ShardSourceError
from trainer.data.tokenizer import load_tokenizer, special_ids
from trainer.distributed.config import DistributedConfig
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo, init_distributed
from trainer.model import AttentionConfig, build_model
from trainer.run.evals import Evaluator
from trainer.run.metrics import by_group, by_source
from trainer.run.step import train_step

CPU = DistInfo(0, 1, 0, torch.device("cpu"))
EDGES = (4, 12, 24)
SOURCES = ("code", "prose")
WEIGHTS = (3.0, 1.0)
GROUPS = LossGroups(EDGES, SOURCES)
LENGTHS = {0: [2, 3, 4, 6, 9, 12, 13, 17, 24, 25, 29, 32], 1: [2, 4, 5, 11, 12, 14, 20, 23, 26, 31, 32, 3]}
"""Per source, document lengths covering every bucket of EDGES (2..32 tokens, SEQ_LEN 32)."""


@pytest.fixture(scope="module")
def docs() -> list[Document]:
    """24 random documents, sources 0 and 1 interleaved, so packed rows hold both."""
    rng = np.random.default_rng(3)
    out = []
    for i, (a, b) in enumerate(zip(LENGTHS[0], LENGTHS[1], strict=True)):
        for source, n in ((0, a), (1, b)):
            tokens = np.append(rng.integers(2, MODEL.vocab_size, size=n - 1), 0)
            out.append(Document(key=f"s{source}d{i}", tokens=tokens, source=source))
    return out


def model_for(isolate: bool = True):
    torch.manual_seed(0)
    return build_model(MODEL, AttentionConfig(backend="sdpa_docs", isolate_documents=isolate))


def engine_for(info: DistInfo, isolate: bool = True):
    model = model_for(isolate)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    return parallelize(model, opt, sched, info, DistributedConfig(device="cpu"), grad_clip=0.0, dtype="fp32")


def reference(docs: list[Document]) -> dict:
    """Plain PyTorch: each document alone, its summed cross-entropy and its targets added to its (source,
    bucket) cell; the by-source and by-length tables are the cells' row and column sums; tokens and documents
    by source."""
    model = model_for()
    names = length_bucket_names(EDGES)
    sums, targets = np.zeros((2, len(names))), np.zeros((2, len(names)), dtype=int)
    with torch.no_grad():
        for doc in docs:
            ids = torch.as_tensor(doc.tokens, dtype=torch.long)[None]
            bucket = sum(len(doc) > e for e in EDGES)
            sums[doc.source, bucket] += F.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:],
                                                        reduction="sum").item()
            targets[doc.source, bucket] += len(doc) - 1
    assert (targets > 0).all()  # every source x bucket cell holds documents
    return {
        "cells": sums / targets,
        "token_loss_by_source": dict(zip(SOURCES, sums.sum(1) / targets.sum(1), strict=True)),
        "targets_by_source": dict(zip(SOURCES, targets.sum(1).tolist(), strict=True)),
        "token_loss_by_length": dict(zip(names, sums.sum(0) / targets.sum(0), strict=True)),
        "targets_by_length": dict(zip(names, targets.sum(0).tolist(), strict=True)),
        "tokens_by_source": {n: sum(len(d) for d in docs if d.source == s) for s, n in enumerate(SOURCES)},
        "docs_by_source": {n: sum(d.source == s for d in docs) for s, n in enumerate(SOURCES)},
    }


def layout_batches(docs: list[Document], layout: str):
    rows = list(OnlinePacker(SEQ_LEN, buffer_size=8).pack(docs))
    return micro_batches(rows, PackingConfig(layout=layout), SEQ_LEN, 2 * SEQ_LEN, PAD)


def step_metrics(docs: list[Document], layout: str, info: DistInfo = CPU, isolate: bool = True) -> dict:
    stats = train_step(engine_for(info, isolate), layout_batches(docs, layout), info, PAD, groups=GROUPS)
    return {"stats": stats, **by_group(GROUPS, stats.group_loss_sums, stats.group_targets),
            **by_source(SOURCES, WEIGHTS, stats.source_tokens, stats.source_docs)}


def assert_matches(got: dict, expected: dict, tol: float = 1e-5) -> None:
    for table in ("token_loss_by_source", "token_loss_by_length"):
        assert got[table].keys() == expected[table].keys()
        for name, loss in expected[table].items():
            assert got[table][name] == pytest.approx(loss, abs=tol), (table, name)
    for table in ("targets_by_source", "targets_by_length"):
        assert got[table] == expected[table], table


@pytest.fixture(scope="module")
def expected(docs) -> dict:
    return reference(docs)


@pytest.mark.parametrize("layout", ["packed", "unpacked", "bucketed"])
def test_step_per_source_and_bucket_equal_each_document_alone(docs, expected, layout):
    got = step_metrics(docs, layout)
    assert_matches(got, expected)
    stats = got["stats"]
    cells = np.asarray(stats.group_loss_sums).reshape(2, -1) / np.asarray(stats.group_targets).reshape(2, -1)
    np.testing.assert_allclose(cells, expected["cells"], atol=1e-5)  # each source x bucket group on its own
    assert got["tokens_by_source"] == expected["tokens_by_source"]
    assert got["docs_by_source"] == expected["docs_by_source"]


def test_marginals_partition_the_step(docs):
    stats = step_metrics(docs, "packed")["stats"]
    got = by_group(GROUPS, stats.group_loss_sums, stats.group_targets)
    loss_sum = stats.token_loss * stats.valid_tokens
    for by in ("source", "length"):
        losses, targets = got[f"token_loss_by_{by}"], got[f"targets_by_{by}"]
        assert sum(targets.values()) == stats.valid_tokens, by
        assert sum(losses[n] * targets[n] for n in losses) == pytest.approx(loss_sum, rel=1e-6), by
    assert sum(stats.source_tokens) == stats.real_tokens and sum(stats.source_docs) == stats.docs
    shares = by_source(SOURCES, WEIGHTS, stats.source_tokens, stats.source_docs)
    assert sum(shares["token_share_by_source"].values()) == pytest.approx(1.0)
    assert shares["target_share_by_source"] == {"code": 0.75, "prose": 0.25}


def test_packed_equals_unpacked_per_source_with_isolation_and_differs_without(docs):
    unpacked = step_metrics(docs, "unpacked")["token_loss_by_source"]
    isolated = step_metrics(docs, "packed")["token_loss_by_source"]
    mixed = step_metrics(docs, "packed", isolate=False)["token_loss_by_source"]
    assert max(abs(isolated[s] - unpacked[s]) for s in SOURCES) <= 1e-5
    assert max(abs(mixed[s] - unpacked[s]) for s in SOURCES) > 1e-4  # documents reading their neighbours show


def two_rank_step(rank: int, world_size: int, docs: list[Document]) -> dict:
    info = init_distributed(DistributedConfig(device="cpu"))
    got = step_metrics(docs[rank::world_size], "packed", info)
    return {k: v for k, v in got.items() if k != "stats"}


def test_two_ranks_give_the_global_tables(docs, expected):
    results = run_distributed(two_rank_step, 2, args=(docs,))
    assert results[0] == results[1]
    assert_matches(results[0], expected)
    assert results[0]["tokens_by_source"] == expected["tokens_by_source"]
    assert results[0]["docs_by_source"] == expected["docs_by_source"]


@pytest.mark.parametrize("layout", ["packed", "unpacked"])
def test_eval_per_source_equals_each_document_alone(docs, expected, layout):
    evaluator = Evaluator(docs, CPU, SEQ_LEN, layout, 2 * SEQ_LEN, PAD, groups=GROUPS)
    result = evaluator.run(engine_for(CPU))
    got = {k.removeprefix("val_"): v for k, v in result.metrics().items()}
    assert_matches(got, expected)
    assert result.val_loss == pytest.approx(sum(got["token_loss_by_source"][s] * got["targets_by_source"][s]
                                                for s in SOURCES) / result.val_tokens, rel=1e-6)


def test_no_mixture_no_source_keys_and_the_same_length_tables(docs):
    """Without data.sources (every document source 0) only the length tables: those of the mixture's step,
    whose by-length marginal sums over sources."""
    single = [Document(d.key, d.tokens) for d in docs]
    groups = LossGroups(EDGES)
    stats = train_step(engine_for(CPU), layout_batches(single, "packed"), CPU, PAD, groups=groups)
    got = {**by_group(groups, stats.group_loss_sums, stats.group_targets),
           **by_source((), (), stats.source_tokens, stats.source_docs)}
    assert set(got) == {"token_loss_by_length", "targets_by_length"}
    assert stats.source_tokens is None and len(stats.group_targets) == len(EDGES) + 1
    mixture = step_metrics(docs, "packed")
    assert got["targets_by_length"] == mixture["targets_by_length"]
    for name, loss in mixture["token_loss_by_length"].items():
        assert got["token_loss_by_length"][name] == pytest.approx(loss, abs=1e-6)
    evaluation = Evaluator(single, CPU, SEQ_LEN, "packed", 2 * SEQ_LEN, PAD,
                           groups=groups).run(engine_for(CPU))
    assert not [k for k in evaluation.metrics() if "source" in k]
    assert LossGroups().size == 0  # no mixture, no buckets: no groups, the plain loss path


def test_group_ids_and_source_counts_by_hand():
    a, b = Document("a", np.array([5, 6, 0]), source=1), Document("b", np.array([7, 0]), source=0)
    batch = collate_rows([[a, b]], 6, PAD, "packed")
    assert batch.segment_sources == (1, 0, -1)
    assert LossGroups((2,), ("x", "y")).ids(batch).tolist() == [[3, 3, 3, 0, 0, -1]]
    assert LossGroups((), ("x", "y")).ids(batch).tolist() == [[1, 1, 1, 0, 0, -1]]
    assert LossGroups((2,)).size == 2 and LossGroups((2,), ("x", "y")).size == 4
    assert source_counts(batch, 2) == ([2, 3], [1, 1])
    with pytest.raises(ValueError, match="a document of source 1 in a run of 1 source"):
        LossGroups((2,)).ids(batch)


def mixture_config(*sources: dict, **extra) -> DataConfig:
    return DataConfig(sources=list(sources), **extra)


def test_eval_docs_of_a_mixture_are_tagged_and_capped_per_source(demo_data):
    ids = special_ids(load_tokenizer(demo_data / "tokenizer"))
    alone = load_eval_docs(demo_data, demo_data / "tokenizer", ids.eos, SEQ_LEN, max_docs=5)
    cfg = mixture_config({"name": "a", "path": str(demo_data)},
                         {"name": "b", "path": str(demo_data), "weight": 2})
    docs = load_eval_docs(cfg, demo_data / "tokenizer", ids.eos, SEQ_LEN, max_docs=5)
    assert [(d.key, d.source) for d in docs] == ([(f"a/{d.key}", 0) for d in alone]
                                                 + [(f"b/{d.key}", 1) for d in alone])


def test_a_source_without_held_out_shards_is_left_out_with_a_warning(demo_data, tmp_path, caplog):
    shard = next(iter(sorted(demo_data.glob("train-*.tar"))))
    bare = tmp_path / "bare"  # a shard without manifest: no val split, no val_urls
    bare.mkdir()
    shutil.copy(shard, bare / shard.name)
    tok = demo_data / "tokenizer"
    ids = special_ids(load_tokenizer(tok))
    cfg = mixture_config({"name": "a", "urls": str(bare / shard.name)}, {"name": "b", "path": str(demo_data)},
                         tokenizer=str(tok))
    with caplog.at_level(logging.WARNING, logger="trainer.run.evals"):
        docs = load_eval_docs(cfg, tok, ids.eos, SEQ_LEN, max_docs=3)
    assert {d.source for d in docs} == {1}
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "data.sources a: no held-out shards" in warnings[0]
    none = mixture_config({"name": "a", "urls": str(bare / shard.name)}, tokenizer=str(tok))
    with pytest.raises(ShardSourceError,
                       match=r"no held-out shards for the eval in any of data.sources \(a\)"):
        load_eval_docs(none, tok, ids.eos, SEQ_LEN, max_docs=3)


# ---------------------------------------------------------------------------------------------------
# A real run on a mixture of two prepared directories
# ---------------------------------------------------------------------------------------------------


def chunk_tokens(data: Path, seq_len: int) -> dict[str, int]:
    """{chunk key: tokens} of `data`'s train split, made without the trainer's reader: each `<key>.txt` of
    each shard encoded by the `tokenizers` library, + 1 for the EOS, cut into chunks of seq_len named `key#k`
    beyond it."""
    tokenizer = Tokenizer.from_file(str(data / "tokenizer" / "tokenizer.json"))
    out = {}
    for shard in sorted(data.glob("train-*.tar")):
        with tarfile.open(shard) as tar:
            for member in (m for m in tar.getmembers() if m.isfile() and m.name.endswith(".txt")):
                text = tar.extractfile(member).read().decode("utf-8")
                n = len(tokenizer.encode(text, add_special_tokens=False).ids) + 1
                key = member.name.rsplit("/", 1)[-1].split(".", 1)[0]
                pieces = [n] if n <= seq_len else [min(seq_len, n - k * seq_len)
                                                   for k in range(-(-n // seq_len))]
                out.update({key: n} if n <= seq_len else {f"{key}#{k}": p for k, p in enumerate(pieces)})
    return out


def test_a_mixture_run_logs_its_sources_every_step_and_eval(tmp_path, caplog):
    short, long = mixture_corpora(tmp_path)
    sources = (f"data.sources=[{{name:short,path:'{short}',val_urls:'{short}/train-000000.tar',weight:0.7}},"
               f"{{name:long,path:'{long}',weight:0.3}}]")
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.WARNING, logger="trainer.run.evals"):
        trainer = make_trainer(short, run_dir, "data.path=null", sources, "train.max_steps=3",
                               "train.eval_every=3", "train.eval_docs=20", "logging.record_doc_keys=true",
                               "logging.length_buckets=[16,64]")
    summary = trainer.fit()
    assert any("data.sources long: no held-out shards" in r.getMessage() for r in caplog.records)
    lengths = {**chunk_tokens(short, 128), **chunk_tokens(long, 128)}  # SMALL: train.seq_len=128
    keys = doc_keys(run_dir)[0]
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3]
    totals = {"short": 0, "long": 0}
    for m in lines:
        # Keys are "<source>/<sample key>"; trainer.prepare names a sample by its source file ("short--17").
        trained = {name: [k.split("/", 1)[1] for k in keys[m["step"]] if k.startswith(f"{name}/{name}--")]
                   for name in totals}
        assert sum(map(len, trained.values())) == m["docs"]  # every key names its source
        assert m["tokens_by_source"] == {name: sum(lengths[k] for k in ks) for name, ks in trained.items()}
        assert m["docs_by_source"] == {name: len(ks) for name, ks in trained.items()}
        assert sum(m["token_share_by_source"].values()) == pytest.approx(1.0)
        assert m["target_share_by_source"] == {"short": 0.7, "long": 0.3}
        for by in ("source", "length"):
            targets, losses = m[f"targets_by_{by}"], m[f"token_loss_by_{by}"]
            assert sum(targets.values()) == m["valid_tokens"], by
            known = sum(losses[n] * targets[n] for n in losses if losses[n] is not None)
            assert known / m["valid_tokens"] == pytest.approx(m["token_loss"], rel=1e-5), by
        totals = {name: totals[name] + m["tokens_by_source"][name] for name in totals}
    last = lines[-1]
    assert last["val_token_loss_by_source"]["long"] is None and last["val_targets_by_source"]["long"] == 0
    assert last["val_targets_by_source"]["short"] == last["val_tokens"] > 0
    assert summary["final_val_token_loss_by_source"] == last["val_token_loss_by_source"]
    assert summary["token_share_by_source"] == {n: t / sum(totals.values()) for n, t in totals.items()}
    assert summary["target_share_by_source"] == {"short": 0.7, "long": 0.3}
    assert set(summary["mixture"]) == {"short", "long"}


def test_the_whole_run_token_share_survives_a_resume(tmp_path):
    short, long = mixture_corpora(tmp_path)
    common = ["data.path=null", sources_override(("short", short, 0.7), ("long", long, 0.3)),
              "train.max_steps=4"]
    whole = make_trainer(short, tmp_path / "whole", *common).fit()
    make_trainer(short, tmp_path / "cut", *common, "train.max_steps=2", "train.checkpoint_every=2").fit()
    resumed = make_trainer(short, tmp_path / "cut", *common, "train.resume=true").fit()
    assert resumed["token_share_by_source"] == whole["token_share_by_source"]
    steps = metrics(tmp_path / "whole")
    totals = {n: sum(m["tokens_by_source"][n] for m in steps) for n in ("short", "long")}
    assert whole["token_share_by_source"] == {n: t / sum(totals.values()) for n, t in totals.items()}
