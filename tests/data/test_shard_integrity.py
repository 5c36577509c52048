"""Shards checked against their manifest entry, stored ids tied to their sample (issue 42; issue 46's uint32
ids).

Each case damages real shards of the demo dataset (tar members rewritten with tarfile) and reads them through
the real stream: one error naming the shard (and the sample), or under data.on_error=skip a counted skip.
"Forged" ids carry a check (a crc32) recomputed for their text (trainer.data.shards.ids_member), as a tool
that rewrote them would: the checks that do not rest on the crc32 (vocabulary, dtype, size, manifest counts)
still catch them."""

from __future__ import annotations

import itertools
import json
import shutil
import zlib
from pathlib import Path

import numpy as np
import pytest

from tests.shards import (
    assert_same_rows,
    damaged_shard,
    ids_of,
    members_of,
    read_stored,
    rewrite_shard,
    rows_of,
    stored_stream,
)
from trainer.checkpoint.safe_io import load_state, save_state
from trainer.data.config import DataConfig, PackingConfig
from trainer.data.feed import build_data
from trainer.data.reader import DataStreamError
from trainer.data.shards import ids_member, load_manifest, shard_paths, stored_ids
from trainer.data.tokenizer import tokenizer_hash
from trainer.prepare import prepare

SHARD = "train-000000.tar"
VICTIM = 5  # the sample of the first shard that a single-sample case damages


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory) -> Path:
    """The demo dataset's documents, shards and keys, encoded by another tokenizer (a 400-token BPE)."""
    out = tmp_path_factory.mktemp("integrity") / "other"
    prepare("demo", out, vocab_size=400, max_docs=1000, docs_per_shard=200, val_fraction=0.05, seed=0)
    return out


def _keys(shard: str) -> list[str]:
    return list(members_of(shard))


def _victim(demo_data: Path) -> str:
    return _keys(shard_paths(demo_data, "train")[0])[VICTIM]


def _raises(demo_data: Path, shards: list[str], pattern: str, stored=True, **kw) -> str:
    with pytest.raises(DataStreamError, match=pattern) as e:
        list(read_stored(demo_data, shards, stored, **kw))
    return str(e.value)


# -- every shard against its manifest entry ------------------------------------------------------------------


def test_a_shard_of_another_tokenizer_copied_into_the_dataset_is_one_line_naming_it(demo_data,
                                                                                     other_tokenizer,
                                                                                     tmp_path):
    """The issue's case, through the run's own data path (build_data): the other tokenizer's ids are all
    inside this vocabulary (400 < 512) and carry their own valid crc32; the manifest's token count names the
    shard."""
    data = Path(shutil.copytree(demo_data, tmp_path / "data"))
    shutil.copy(other_tokenizer / SHARD, data / SHARD)
    source = build_data(DataConfig(path=str(data), num_workers=0, prefetch=False, shuffle_buffer=50),
                        PackingConfig(), 256, seed=0, rank=0, world_size=1)
    with pytest.raises(DataStreamError, match=rf"{SHARD}: not the shard the manifest lists: "
                       r"(it is [\d,]+ bytes|its stored ids are [\d,]+ tokens \(EOS included\)), "
                       r"the manifest lists [\d,]+"):
        while source.rows.take(8):
            pass


def _padded(shard: str, out: Path) -> str:
    """The shard with 20 more zero blocks after its end: the same samples, another size."""
    out.write_bytes(Path(shard).read_bytes() + bytes(20 * 512))
    return str(out)


def _one_token_short(demo_data: Path, tmp_path: Path) -> str:
    """The victim's ids one token shorter (forged: crc32 recomputed), in a tar of the same size (its
    padding)."""
    victim = _victim(demo_data)

    def change(key, field, data, fields):
        if key == victim and field == "ids":
            assert len(data) % 512 not in (1, 2), "the shorter member would change the tar's size"
            return ids_member(ids_of(data)[:-1].tobytes(), fields["txt"])
        return data

    shard = damaged_shard(demo_data, tmp_path, change)
    assert Path(shard).stat().st_size == Path(shard_paths(demo_data, "train")[0]).stat().st_size
    return shard


@pytest.mark.parametrize("what", ["bytes", "tokens"])
def test_a_shard_that_is_not_its_manifest_entry_is_named_or_counted(demo_data, tmp_path, what):
    if what == "bytes":
        shard, found = _padded(shard_paths(demo_data, "train")[0], tmp_path / SHARD), r"it is [\d,]+ bytes"
    else:
        shard, found = (_one_token_short(demo_data, tmp_path),
                        r"its stored ids are [\d,]+ tokens \(EOS included\)")
    manifest = demo_data / "manifest.json"
    _raises(demo_data, [shard], rf"{SHARD}: not the shard the manifest lists: {found}, "
            r"the manifest lists [\d,]+", manifest=manifest)
    loader = read_stored(demo_data, [shard], manifest=manifest, on_error="skip")
    assert len(list(loader)) == 200 and loader.skipped() == {"shard_mismatch": 1}


def test_a_shard_resumed_midway_is_checked_at_its_end_with_the_samples_read_before(demo_data, tmp_path):
    """The counts are known at the shard's end only: a resume reads past the samples taken before and counts
    them."""
    manifest = demo_data / "manifest.json"
    good = [str(Path(shutil.copy(shard_paths(demo_data, "train")[0], tmp_path / SHARD)))]
    for shards, fails in ((good, False), ([_one_token_short(demo_data, tmp_path / "short")], True)):
        first = read_stored(demo_data, shards, manifest=manifest, shuffle_buffer=20)
        # mid-shard: a chunk of 64 and the buffer's 20 read
        head = [d.key for d in itertools.islice(first, 30)]
        save_state(first.state_dict(), tmp_path / "state.pt")
        second = read_stored(demo_data, shards, manifest=manifest, shuffle_buffer=20)
        second.load_state_dict(load_state(tmp_path / "state.pt"))
        if fails:
            with pytest.raises(DataStreamError,
                               match=r"not the shard the manifest lists: its stored ids are"):
                list(second)
        else:
            assert sorted(head + [d.key for d in second]) == sorted(_keys(shards[0]))


# -- stored ids tied to their sample -------------------------------------------------------------------------


def test_stored_ids_of_another_sample_are_bad_ids_of_that_sample(demo_data, tmp_path):
    """Every sample's ids member holds the next sample's (the issue: the model memorized one document)."""
    keys = _keys(shard_paths(demo_data, "train")[0])
    following = dict(zip(keys, keys[1:] + keys[:1], strict=True))
    members = members_of(shard_paths(demo_data, "train")[0])
    shard = damaged_shard(demo_data, tmp_path, lambda key, field, data, fields:
                     members[following[key]]["ids"] if field == "ids" else data)
    _raises(demo_data, [shard], rf"{SHARD}: sample '[^']+': its ids are not those prepare stored for its "
            r"text \(their check differs: the ids of another sample or text, or damaged bytes\); the shard "
            r"is damaged")
    loader = read_stored(demo_data, [shard], on_error="skip")
    assert list(loader) == [] and loader.skipped() == {"bad_ids": 200}


def _without_check(demo_data: Path, out: Path) -> Path:
    """The dataset as prepare wrote it before the crc32: ids members without it, a manifest without
    "check"."""
    shutil.copytree(demo_data, out)
    for shard in shard_paths(out, "train") + shard_paths(out, "val"):
        rewrite_shard(shard, Path(shard + ".new"),
                      lambda name, data: (name, data[:-4] if name.endswith(".ids") else data))
        Path(shard + ".new").replace(shard)
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["ids"]["check"]
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def test_shards_prepared_before_the_check_still_read_the_same_rows(demo_data, tmp_path):
    old = _without_check(demo_data, tmp_path / "old")
    stored = stored_ids(load_manifest(old), tokenizer_hash(old / "tokenizer"), False)
    assert stored is not None and not stored.checked
    assert_same_rows(rows_of(stored_stream(old, None)), rows_of(stored_stream(old, stored)))
    assert_same_rows(rows_of(stored_stream(demo_data, None)), rows_of(stored_stream(old, stored)))


# -- the text path's document checks on the ids path ---------------------------------------------------------


@pytest.mark.parametrize("text,reason", [(b"", "empty"), (b"  \n\t", "empty"), ("\u3000\n".encode(), "empty"),
                                         (b"caf\xe9 au lait", "not_utf8")])
def test_a_text_the_text_path_refuses_is_refused_alike_from_its_stored_ids(demo_data, tmp_path, text, reason):
    """The sample keeps its (valid) ids: the same error, or the same documents and counts under skip, either
    way."""
    victim = _victim(demo_data)
    shard = damaged_shard(demo_data, tmp_path, lambda key, field, data, fields:
                     text if key == victim and field == "txt" else data)
    errors = [_raises(demo_data, [shard], rf"{SHARD}: sample '{victim}'", stored=s) for s in (False, True)]
    assert errors[0] == errors[1]
    loaders = [read_stored(demo_data, [shard], stored=s, on_error="skip") for s in (False, True)]
    keys = [[d.key for d in loader] for loader in loaders]
    assert keys[0] == keys[1] and victim not in keys[1] and len(keys[1]) == 199
    assert loaders[0].skipped() == loaders[1].skipped() == {reason: 1}


def _large_ids(demo_data: Path, tmp_path: Path, tokens: int, victim: str | None = None,
               which: int = 0) -> str:
    """The victim's text made 10 bytes, its ids `tokens` (forged: their check recomputed)."""
    victim, text = victim or _victim(demo_data), b"short text"
    return damaged_shard(demo_data, tmp_path, lambda key, field, data, fields: data if key != victim else
                    text if field == "txt" else ids_member(np.full(tokens, 7, dtype="<u2").tobytes(),
                                                           text), which)


BOUND = 1 << 17
"""data.max_doc_mb=0.125 in bytes: every real document of the first shard is under it; <u2 ids: twice that."""


@pytest.mark.parametrize("tokens", [200_000, 5_000_000])
def test_stored_ids_over_data_max_doc_mb_are_too_large_whatever_their_text(demo_data, tmp_path, tokens):
    """A 10-byte text beside a large ids member: judged on the ids too, refused from the member's tar header,
    never read (5M tokens are 10 MB)."""
    shard = _large_ids(demo_data, tmp_path, tokens)
    _raises(demo_data, [shard], rf"{SHARD}: sample '{_victim(demo_data)}' has a 'ids' member of "
            rf"{2 * tokens + 4:,} bytes \(not read\), over data.max_doc_mb=0.125 .*: raise data.max_doc_mb",
            max_doc_bytes=BOUND)
    loader = read_stored(demo_data, [shard], max_doc_bytes=BOUND, on_error="skip")
    assert len(list(loader)) == 199 and loader.skipped() == {"too_large": 1}


def test_stored_ids_buffered_in_a_checkpoint_are_judged_by_the_resumed_runs_bound(demo_data, tmp_path):
    """A sample of an earlier shard sits in the saved shuffle buffer as its ids (not read again): counted by
    them."""
    # of the shard read first, the last: still buffered
    victim = _keys(shard_paths(demo_data, "train")[1])[-1]
    shards = [shard_paths(demo_data, "train")[0], _large_ids(demo_data, tmp_path, 200_000, victim, which=1)]
    first = read_stored(demo_data, shards, shuffle_buffer=300)
    list(itertools.islice(first, 1))  # one chunk: 364 samples read, the cursor in the second shard
    state = first.state_dict()
    buffered = [item[2] for slot in state["slot_states"].values() for item in slot["position"]["buffer"]
                if isinstance(item[3], tuple)]
    assert victim in buffered
    save_state(state, tmp_path / "state.pt")
    second = read_stored(demo_data, shards, shuffle_buffer=300, max_doc_bytes=BOUND)
    second.load_state_dict(load_state(tmp_path / "state.pt"))
    with pytest.raises(DataStreamError, match=rf"sample '{victim}' has 200,000 stored ids \(a token covers "
                       r"a byte of text at least\), over data.max_doc_mb=0.125"):
        list(second)


# -- ids the manifest's tokenizer cannot have written --------------------------------------------------------


def test_stored_ids_outside_the_vocabulary_are_bad_ids_of_that_sample(demo_data, tmp_path):
    """Forged (their crc32 matches): not the step's "tokenized with another tokenizer" naming micro-batch
    rows."""
    victim = _victim(demo_data)

    def change(key, field, data, fields):
        if key == victim and field == "ids":
            ids = ids_of(data).copy()
            ids[3] = 60_000
            return ids_member(ids.tobytes(), fields["txt"])
        return data

    shard = damaged_shard(demo_data, tmp_path, change)
    _raises(demo_data, [shard], rf"{SHARD}: sample '{victim}': its stored ids hold 60000, "
            r"outside the vocabulary \(512 tokens\) of the tokenizer the manifest says encoded them; "
            r"the shard is damaged")
    loader = read_stored(demo_data, [shard], on_error="skip")
    keys = [d.key for d in loader]
    assert len(keys) == 199 and victim not in keys and loader.skipped() == {"bad_ids": 1}


@pytest.mark.parametrize("written", ["forged", "without crc32", "before the check"])
def test_uint32_ids_under_a_manifest_saying_uint16_are_named(demo_data, tmp_path, written):
    """Issue 46: uint32 ids read as <u2 made every other token id 0 (EOS here), silently."""
    data = _without_check(demo_data, tmp_path / "old") if written == "before the check" else demo_data

    def change(key, field, member, fields):
        if field != "ids":
            return member
        wide = (ids_of(member) if data == demo_data else np.frombuffer(member, "<u2")).astype("<u4").tobytes()
        return ids_member(wide, fields["txt"]) if written == "forged" else wide

    src = shard_paths(data, "train")[0]
    members = members_of(src)
    shard = tmp_path / SHARD
    rewrite_shard(src, shard, lambda name, m: (name, change(*name.split(".", 1), m,
                                                            members[name.split(".")[0]])))
    pattern = (r"every second <u2 value 0 \(written as uint32; the manifest says <u2\)"
               if written == "without crc32"
               else r"its ids read as <u4 values \(every second <u2 value is 0: written as uint32\), but the "
                    r"manifest says <u2")
    _raises(data, [str(shard)], rf"{SHARD}: sample '[^']+': .*{pattern}")
    loader = read_stored(data, [str(shard)], on_error="skip")
    assert list(loader) == [] and loader.skipped() == {"bad_ids": 200}


def test_the_check_is_a_crc32_of_the_texts_length_and_ends_then_the_ids(demo_data, tmp_path):
    """The record prepare writes (what a tool writing shards must write; docs/data.md says so), and a text
    changed at an end with its ids kept fails it."""
    fields = members_of(shard_paths(demo_data, "train")[0])[_victim(demo_data)]
    member, text = fields["ids"], fields["txt"]
    ends = len(text).to_bytes(8, "little") + text[:64] + text[-64:]
    assert member[-4:] == zlib.crc32(member[:-4], zlib.crc32(ends)).to_bytes(4, "little")
    assert ids_member(member[:-4], text) == member
    victim = _victim(demo_data)
    shard = damaged_shard(demo_data, tmp_path, lambda key, field, data, fields:
                     b"#" + data[1:] if key == victim and field == "txt" else data)
    _raises(demo_data, [shard], rf"{SHARD}: sample '{victim}': its ids are not those prepare stored for "
            r"its text")
