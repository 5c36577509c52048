"""The streaming reader over real WebDataset shards: splits, determinism, resume, bad input."""

from __future__ import annotations

import collections
import io
import itertools
import tarfile
from pathlib import Path

import numpy as np
import pytest
import tokenizers
import webdataset as wds

from trainer.data.config import PackingConfig
from trainer.data.loader import DocumentLoader
from trainer.data.pipeline import RowStream
from trainer.data.reader import DataStreamError
from trainer.data.stream import DocumentStream

EOS = 0  # id of <|endoftext|> in the fixture tokenizer (first special token)


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "packing", "tokens", "row", "mask", "é", "λ", "\n"]
    return ["doc " + " ".join(rng.choice(words, size=int(rng.integers(0, 60)))) for _ in range(n)]


def _write_shard(path: Path, samples: list[dict]) -> None:
    with wds.TarWriter(str(path)) as sink:
        for sample in samples:
            sink.write(sample)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """6 shards x 25 documents and a small byte-level BPE tokenizer, as trainer.prepare lays them out."""
    root = tmp_path_factory.mktemp("stream")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    texts = _texts(150)
    tok.train_from_iterator(texts, trainer)
    (root / "tokenizer").mkdir()
    tok.save(str(root / "tokenizer" / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == EOS
    shards, by_key = [], {}
    for s in range(6):
        samples = []
        for i in range(25):
            key = f"doc{s:02d}_{i:03d}"
            by_key[key] = texts[s * 25 + i]
            samples.append({"__key__": key, "txt": by_key[key].encode()})
        path = root / f"train-{s:06d}.tar"
        _write_shard(path, samples)
        shards.append(str(path))
    return {"root": root, "shards": shards, "texts": by_key, "tokenizer": tok}


def _stream(corpus, **kw) -> DocumentStream:
    kw.setdefault("shuffle_buffer", 8)
    kw.setdefault("chunk_docs", 4)
    return DocumentStream(kw.pop("shards", corpus["shards"]), corpus["root"] / "tokenizer", EOS, **kw)


def _keys(docs) -> list[str]:
    return [d.key for d in docs]


def test_documents_are_tokenized_with_eos_appended(corpus):
    docs = list(DocumentLoader(_stream(corpus, epochs=1)))
    assert len(docs) == 150
    for doc in docs:
        expected = corpus["tokenizer"].encode(corpus["texts"][doc.key], add_special_tokens=False).ids
        assert doc.tokens.tolist() == expected + [EOS]


@pytest.mark.parametrize("world_size,num_workers", [(1, 0), (2, 0), (2, 2), (3, 2)])
def test_every_document_read_exactly_once_per_epoch(corpus, world_size, num_workers):
    seen = collections.Counter()
    for rank in range(world_size):
        stream = _stream(corpus, rank=rank, world_size=world_size, epochs=2, seed=3)
        seen.update(_keys(DocumentLoader(stream, num_workers=num_workers)))
    assert set(seen) == set(corpus["texts"])
    assert set(seen.values()) == {2}  # two epochs, once each


@pytest.mark.parametrize("world_size,num_workers", [(2, 0), (2, 2)])
def test_readers_balanced_by_skewed_tokens_still_read_every_document_once(corpus, world_size, num_workers):
    tokens = [9_000, 10, 40, 3_000, 25, 700]  # rank 0 takes the 9,000 alone, or with the smallest
    seen = collections.Counter()
    for rank in range(world_size):
        stream = _stream(corpus, rank=rank, world_size=world_size, epochs=2, seed=3, shard_tokens=tokens)
        seen.update(_keys(DocumentLoader(stream, num_workers=num_workers)))
    assert set(seen) == set(corpus["texts"]) and set(seen.values()) == {2}


def test_ranks_read_disjoint_documents(corpus):
    per_rank = [set(_keys(DocumentLoader(_stream(corpus, rank=r, world_size=2, epochs=1)))) for r in range(2)]
    assert per_rank[0] and per_rank[1] and not per_rank[0] & per_rank[1]


def test_order_is_deterministic_for_a_seed_and_shuffled(corpus):
    a = _keys(DocumentLoader(_stream(corpus, seed=1, epochs=1), num_workers=2))
    b = _keys(DocumentLoader(_stream(corpus, seed=1, epochs=1), num_workers=2))
    c = _keys(DocumentLoader(_stream(corpus, seed=2, epochs=1), num_workers=2))
    assert a == b
    assert a != c and sorted(a) == sorted(c)
    assert a != sorted(a)  # buffered sample shuffling is on


def test_epochs_reshuffle_shard_order(corpus):
    keys = _keys(DocumentLoader(_stream(corpus, seed=5, epochs=2)))
    assert keys[:150] != keys[150:] and sorted(keys[:150]) == sorted(keys[150:])


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("stop_after", [1, 37, 149, 151, 230])
def test_resume_mid_stream_continues_exactly(corpus, num_workers, stop_after):
    def make():
        return DocumentLoader(_stream(corpus, seed=7, epochs=2), num_workers=num_workers)

    uninterrupted = _keys(make())
    first = make()
    head = _keys(itertools.islice(iter(first), stop_after))
    state = first.state_dict()
    second = make()
    second.load_state_dict(state)
    assert head + _keys(second) == uninterrupted


def test_resume_through_the_packer(corpus):
    cfg = PackingConfig(buffer_size=16)

    def make():
        return RowStream(DocumentLoader(_stream(corpus, seed=11, epochs=1), num_workers=2), 32, cfg)

    def row_keys(rows):
        return [tuple(d.key for d in row) for row in rows]

    uninterrupted = make()
    whole = row_keys(uninterrupted.take(10_000))
    first = make()
    head = row_keys(first.take(9))
    resumed = make()
    resumed.load_state_dict(first.state_dict())
    assert head + row_keys(resumed.take(10_000)) == whole
    stats = uninterrupted.stats
    assert stats.docs_in == 150 and stats.docs_split > 0  # some documents are longer than the row
    assert sum(len(r) for r in whole) == stats.docs_in - stats.docs_split + stats.chunks_from_splits


def test_a_stream_is_exhausted_only_once_the_rows_of_its_last_flush_are_handed_out(corpus):
    """The flush at the end of the documents can leave more rows than a take asks for: until those are handed
    out the stream is not exhausted (with lockstep, its rank has not finished the epoch)."""
    rows = RowStream(DocumentLoader(_stream(corpus, seed=11, epochs=1)), 32, PackingConfig(buffer_size=16))
    taken, ended_not_exhausted = [], 0
    while not rows.exhausted:
        taken.append(len(rows.take(1)))
        ended_not_exhausted += rows.state_dict()["exhausted"] and not rows.exhausted
    assert set(taken) == {1}  # every take got its row: the stream was never exhausted with rows left
    assert ended_not_exhausted > 1 and rows.take(1) == []


def test_resume_rejects_a_different_worker_count(corpus):
    loader = DocumentLoader(_stream(corpus), num_workers=2)
    next(iter(loader))
    with pytest.raises(ValueError, match="DataLoader workers"):
        DocumentLoader(_stream(corpus), num_workers=1).load_state_dict(loader.state_dict())


def test_too_few_shards_for_the_readers_is_a_clear_error(corpus):
    with pytest.raises(DataStreamError, match="6 shards cannot feed 8 readers"):
        list(DocumentLoader(_stream(corpus, world_size=4, epochs=1), num_workers=2))


# -- bad input ------------------------------------------------------------------------------------


@pytest.fixture
def bad_shards(tmp_path, corpus) -> dict[str, str]:
    good = [{"__key__": f"ok{i}", "txt": f"fine text number {i}".encode()} for i in range(5)]
    paths = {}
    for name, extra in {
        "missing_text": {"__key__": "notext", "json": b"{}"},
        "not_utf8": {"__key__": "badbytes", "txt": b"caf\xe9 \xff"},
        "empty": {"__key__": "blank", "txt": b"   \n "},
    }.items():
        path = tmp_path / f"{name}.tar"
        _write_shard(path, good[:2] + [extra] + good[2:])
        paths[name] = str(path)
    whole = tmp_path / "whole.tar"
    _write_shard(whole, good)
    data = whole.read_bytes()  # 5 members of 512-byte header + 512-byte data block each
    (tmp_path / "truncated.tar").write_bytes(data[: 3 * 1024 + 600])  # cut inside the 4th member's data
    paths["truncated"] = str(tmp_path / "truncated.tar")
    paths["missing"] = str(tmp_path / "no-such-shard.tar")
    return paths


@pytest.mark.parametrize(
    "case,pattern",
    [
        ("missing_text", r"missing_text\.tar: sample 'notext' has no 'txt' field"),
        ("not_utf8", r"not_utf8\.tar: sample 'badbytes' is not valid UTF-8"),
        ("empty", r"empty\.tar: sample 'blank' is an empty document"),
        ("truncated", r"truncated\.tar: cannot read shard"),
        ("missing", r"no-such-shard\.tar: cannot read shard"),
    ],
)
@pytest.mark.parametrize("num_workers", [0, 1])
def test_bad_input_raises_naming_shard_and_sample(corpus, bad_shards, case, pattern, num_workers):
    stream = _stream(corpus, shards=[bad_shards[case]], epochs=1)
    with pytest.raises(DataStreamError, match=pattern):
        list(DocumentLoader(stream, num_workers=num_workers))


@pytest.mark.parametrize(
    "case,reason,delivered",
    [("missing_text", "missing_text", 5), ("not_utf8", "not_utf8", 5), ("empty", "empty", 5),
     ("missing", "unreadable_shard", 0)],
)
def test_bad_input_skipped_and_counted(corpus, bad_shards, case, reason, delivered):
    loader = DocumentLoader(_stream(corpus, shards=[bad_shards[case]], epochs=1, on_error="skip"))
    docs = list(loader)
    assert len(docs) == delivered
    assert loader.skipped() == {reason: 1}


def test_truncated_shard_skip_keeps_what_was_readable_and_counts(corpus, bad_shards):
    loader = DocumentLoader(_stream(corpus, shards=[bad_shards["truncated"]], epochs=1, on_error="skip"))
    docs = list(loader)
    assert 0 < len(docs) < 5
    assert loader.skipped() == {"unreadable_shard": 1}


def test_shard_cut_at_a_member_boundary_is_caught_by_the_manifest_count(tmp_path, corpus):
    path = tmp_path / "cut.tar"
    _write_shard(path, [{"__key__": f"k{i}", "txt": b"some text"} for i in range(4)])
    with tarfile.open(path) as tar:  # rewrite with only the first 3 members, a clean but short tar
        members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()[:3]]
    with tarfile.open(path, "w") as tar:
        for member, data in members:
            tar.addfile(member, io.BytesIO(data))
    stream = _stream(corpus, shards=[str(path)], epochs=1, expected_docs={"cut.tar": 4})
    with pytest.raises(DataStreamError, match=r"cut\.tar: read 3 samples but the manifest lists 4"):
        list(DocumentLoader(stream))
