"""A real round trip: prepare -> shards on disk -> stream -> packer -> batches in every layout."""

from __future__ import annotations

import collections

import numpy as np
import pytest
import webdataset as wds

from trainer.data.batch import IGNORE_INDEX, valid_targets
from trainer.data.config import PackingConfig
from trainer.data.loader import DocumentLoader
from trainer.data.pipeline import RowStream, micro_batches
from trainer.data.shards import load_manifest, shard_paths
from trainer.data.stream import DocumentStream
from trainer.data.tokenizer import load_tokenizer, special_ids

SEQ_LEN = 256


@pytest.fixture(scope="module")
def rows_and_truth(demo_data):
    manifest = load_manifest(demo_data)
    tok = load_tokenizer(demo_data / "tokenizer")
    ids = special_ids(tok)
    shards = shard_paths(demo_data, "train")
    truth = {}
    for shard in shards:
        for sample in wds.tariterators.tarfile_samples([{"url": shard}]):
            text = sample["txt"].decode()
            truth[sample["__key__"]] = tok.encode(text, add_special_tokens=False).ids + [ids.eos]
    stream = DocumentStream(shards, demo_data / "tokenizer", ids.eos, seed=0, epochs=1,
                            expected_docs={s["name"]: s["docs"]
                                           for s in manifest["splits"]["train"]["shards"]})
    row_stream = RowStream(DocumentLoader(stream, num_workers=2), SEQ_LEN, PackingConfig(buffer_size=128))
    rows = row_stream.take(10**9)
    return manifest, truth, rows, row_stream.stats, ids


def test_every_document_arrives_once_with_its_tokens(rows_and_truth):
    manifest, truth, rows, stats, _ = rows_and_truth
    assert len(truth) == manifest["splits"]["train"]["docs"]
    pieces = collections.defaultdict(list)
    for row in rows:
        assert sum(map(len, row)) <= SEQ_LEN
        for doc in row:
            base, _, chunk = doc.key.partition("#")
            pieces[base].append((int(chunk or 0), doc.tokens.tolist()))
    assert set(pieces) == set(truth)
    for key, chunks in pieces.items():
        assert [i for i, _ in sorted(chunks)] == list(range(len(chunks)))
        assert sum((t for _, t in sorted(chunks)), []) == truth[key]  # split chunks re-assemble the document
    assert stats.tokens_in == manifest["splits"]["train"]["tokens"] == sum(map(len, truth.values()))
    assert stats.docs_split > 0  # the demo corpus has documents longer than a row


def test_packed_rows_are_nearly_full(rows_and_truth):
    _, _, rows, _, _ = rows_and_truth
    used = sum(len(d) for row in rows for d in row)
    assert used / (len(rows) * SEQ_LEN) > 0.97


@pytest.mark.parametrize("layout", ["packed", "unpacked", "bucketed"])
def test_batches_in_every_layout_hold_the_same_targets(rows_and_truth, layout):
    _, _, rows, _, ids = rows_and_truth
    cfg = PackingConfig(layout=layout)
    step = rows[:32]
    batches = micro_batches(step, cfg, SEQ_LEN, 4 * SEQ_LEN, ids.pad)
    assert sum(b.num_valid_targets for b in batches) == sum(valid_targets(d) for row in step for d in row)
    assert sorted(k for b in batches for k in b.doc_keys) == sorted(d.key for row in step for d in row)
    for b in batches:
        assert b.num_allocated <= 4 * SEQ_LEN
        real = b.labels != IGNORE_INDEX
        assert not (b.input_ids[real] == ids.pad).any()  # no padding position is ever a target
        assert int(b.cu_seqlens[-1]) == b.num_allocated
        assert np.all(np.diff(b.cu_seqlens.numpy()) > 0)
