"""Token ids stored by trainer.prepare and read by the stream instead of tokenizing: the same rows either way.

The stored ids are checked against the tokenizer itself (tokenizers' `encode`, tar members read with the
standard library's tarfile), and rows read from them against rows tokenized from the text, for the demo corpus
and a chat corpus (loss on the assistant's turns: the stored token ranges against the mask from the text's
offsets)."""

from __future__ import annotations

import hashlib
import itertools
import json
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.shards import assert_same_rows, members_of, rewrite_shard, rows_of, stored_of, stored_stream
from trainer.checkpoint.safe_io import load_state, save_state
from trainer.data.loader import DocumentLoader
from trainer.data.reader import DataStreamError
from trainer.data.shards import StoredIds, load_manifest, shard_paths, stored_ids
from trainer.data.tokenizer import load_tokenizer, tokenizer_hash
from trainer.prepare import prepare

SEQ_LEN = 256


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("stored") / "chat"
    prepare("demo-chat", out, vocab_size=512, max_docs=120, docs_per_shard=30, val_fraction=0.05)
    return out


@pytest.mark.parametrize("which", ["demo", "chat"])
def test_stored_ids_are_the_tokenizers_encoding_of_the_text(which, demo_data, chat_data):
    data = demo_data if which == "demo" else chat_data
    manifest = json.loads((data / "manifest.json").read_text())
    tok_file = data / "tokenizer" / "tokenizer.json"
    assert manifest["ids"]["tokenizer_sha256"] == hashlib.sha256(tok_file.read_bytes()).hexdigest()
    assert manifest["ids"]["dtype"] == "<u2"  # a 512-token vocabulary
    assert manifest["ids"]["check"] == "crc32"
    tok = load_tokenizer(tok_file)
    checked = 0
    for split in ("train", "val"):
        for shard in shard_paths(data, split):
            for key, fields in members_of(shard).items():
                text = fields["txt"].decode()
                ids, check = fields["ids"][:-4], fields["ids"][-4:]  # the ids, then their check (ids_check)
                assert (np.frombuffer(ids, dtype="<u2").tolist()
                        == tok.encode(text, add_special_tokens=False).ids), key
                txt = fields["txt"]
                ends = len(txt).to_bytes(8, "little") + txt[:64] + txt[-64:]
                assert int.from_bytes(check, "little") == zlib.crc32(ids, zlib.crc32(ends)), key
                assert ("assistant" in fields) == (which == "chat")
                checked += 1
    assert checked == sum(s["docs"] for s in manifest["splits"].values())


@pytest.mark.parametrize("num_workers", [0, 2])
def test_rows_from_stored_ids_equal_rows_from_the_text(demo_data, num_workers):
    assert_same_rows(rows_of(stored_stream(demo_data, None), num_workers),
                      rows_of(stored_stream(demo_data, stored_of(demo_data)), num_workers))


@pytest.mark.parametrize("loss_on", ["all", "assistant"])
def test_chat_rows_and_assistant_masks_from_stored_ids_equal_those_from_the_text(chat_data, loss_on):
    stored = stored_of(chat_data, assistant=loss_on == "assistant")
    text_rows = rows_of(stored_stream(chat_data, None, loss_on))
    assert_same_rows(text_rows, rows_of(stored_stream(chat_data, stored, loss_on)))
    if loss_on == "assistant":  # the masks compared are not empty: some tokens are targets, some not
        masks = np.concatenate([d.loss_mask for row in text_rows for d in row])
        assert 0 < masks.mean() < 1


def test_which_runs_read_stored_ids(demo_data, chat_data):
    manifest, sha = load_manifest(demo_data), tokenizer_hash(demo_data / "tokenizer")
    assert stored_ids(manifest, sha, assistant=False) == StoredIds(dtype="<u2", checked=True, vocab_size=512)
    assert stored_ids(manifest, "0" * 64, assistant=False) is None  # another tokenizer (tokenizer.add_tokens)
    assert stored_ids(manifest, sha, assistant=True) is None  # no assistant ranges in plain text data
    assert stored_ids({k: v for k, v in manifest.items() if k != "ids"}, sha, assistant=False) is None
    chat = load_manifest(chat_data)
    assert stored_ids(chat, tokenizer_hash(chat_data / "tokenizer"), True) == StoredIds(
        dtype="<u2", assistant=True, checked=True, vocab_size=chat["tokenizer"]["vocab_size"])


def test_a_sample_without_stored_ids_is_read_from_its_text(demo_data, tmp_path):
    shards = shard_paths(demo_data, "train")
    keys = list(members_of(shards[0]))
    mixed = tmp_path / "mixed.tar"  # every other sample of the first shard without its ids
    rewrite_shard(shards[0], mixed, lambda name, data: None if name.endswith(".ids") and
             keys.index(name.split(".")[0]) % 2 else (name, data))
    shards = [str(mixed), *shards[1:]]
    assert_same_rows(rows_of(stored_stream(demo_data, None, shards=shards)),
                      rows_of(stored_stream(demo_data, stored_of(demo_data), shards=shards)))


@pytest.mark.parametrize("damage", ["odd ids", "no ids bytes", "ranges past the end"])
def test_damaged_stored_ids_are_named_or_counted(chat_data, tmp_path, damage):
    shard = shard_paths(chat_data, "train")[0]
    victim = next(iter(members_of(shard)))
    bad = tmp_path / "bad.tar"

    def change(name, data):
        if name == f"{victim}.ids" and damage != "ranges past the end":
            return name, data[:-1] if damage == "odd ids" else b""
        if name == f"{victim}.assistant" and damage == "ranges past the end":
            return name, np.array([0, 10**6], dtype="<u4").tobytes()
        return name, data

    rewrite_shard(shard, bad, change)
    stored = stored_of(chat_data, assistant=True)
    with pytest.raises(DataStreamError, match=rf"bad\.tar: sample '{victim}': its .*the shard is damaged"):
        list(DocumentLoader(stored_stream(chat_data, stored, "assistant", shards=[str(bad)])))
    loader = DocumentLoader(stored_stream(chat_data, stored, "assistant", shards=[str(bad)], on_error="skip"))
    docs = list(loader)
    assert loader.skipped() == {"bad_ids": 1}
    assert len(docs) == len(members_of(shard)) - 1 and victim not in {d.key for d in docs}


@pytest.mark.parametrize("resumed_reads", ["ids", "text"])
@pytest.mark.parametrize("stop_after", [7, 500])
def test_resume_from_a_saved_state_holding_stored_ids_continues_exactly(demo_data, tmp_path, stop_after,
                                                                         resumed_reads):
    def make(stored):
        return DocumentLoader(stored_stream(demo_data, stored, shuffle_buffer=300))

    uninterrupted = [(d.key, d.tokens.tolist()) for d in make(None)]
    first = make(stored_of(demo_data))
    head = [(d.key, d.tokens.tolist()) for d in itertools.islice(iter(first), stop_after)]
    state = first.state_dict()
    buffered = [item[3] for slot in state["slot_states"].values() for item in slot["position"]["buffer"]]
    # the buffer (300) reaches past the first shard (200)
    assert any(isinstance(data, tuple) for data in buffered)
    save_state(state, tmp_path / "state.pt")  # the buffer's items of earlier shards hold their stored ids
    # The resumed run may read the text (e.g. shards prepared again with --text-only):
    # the buffered ids still work.
    second = make(stored_of(demo_data) if resumed_reads == "ids" else None)
    second.load_state_dict(load_state(tmp_path / "state.pt"))
    assert head + [(d.key, d.tokens.tolist()) for d in second] == uninterrupted


def test_text_only_shards_hold_the_same_documents_without_ids(demo_data, tmp_path):
    plain = prepare("demo", tmp_path / "plain", tokenizer=demo_data / "tokenizer", max_docs=1000,
                    docs_per_shard=200, val_fraction=0.05, seed=0, text_only=True)
    with_ids = load_manifest(demo_data)
    assert "ids" not in plain and "ids" not in plain["schema"] and plain["options"]["store_ids"] is False
    for split in ("train", "val"):
        assert [(s["name"], s["docs"], s["tokens"]) for s in plain["splits"][split]["shards"]] == \
            [(s["name"], s["docs"], s["tokens"]) for s in with_ids["splits"][split]["shards"]]
        for a, b in zip(shard_paths(tmp_path / "plain", split), shard_paths(demo_data, split), strict=True):
            text_only, both = members_of(a), members_of(b)
            assert {k: set(f) for k, f in text_only.items()} == {k: {"txt"} for k in both}
            assert {k: f["txt"] for k, f in text_only.items()} == {k: f["txt"] for k, f in both.items()}
