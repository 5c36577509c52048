"""Resuming the stream costs one shard, not the epoch so far: exact, bounded, over disk and HTTP.

The corpus: 120 shards of 20 documents (a few bad ones, skipped and counted under on_error=skip, and one shard
the manifest counts wrong). A resumed slot reports what it read to restore its position (`restore_read`):
at most the samples it had taken from its current shard, wherever the epoch stood. The replay that a
checkpoint from before positions were saved falls back to reads everything before the position.
"""

from __future__ import annotations

import collections
import functools
import itertools
import json
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import ShardHandler, ShardServer, metrics, run_train
from trainer.checkpoint.safe_io import load_state, save_state
from trainer.data.loader import DocumentLoader
from trainer.data.reader import DataStreamError, SlotReader, SlotState
from trainer.data.stream import DocumentStream
from trainer.data.tokenizer import load_tokenizer, special_ids

SHARDS, DOCS_PER_SHARD, BUFFER, CHUNK = 120, 20, 64, 16
BAD = {(7, 3): "missing_text", (30, 11): "empty", (55, 0): "not_utf8"}  # (shard, member) -> skip reason
MISCOUNTED = "train-000090.tar"  # the manifest lists one document more than it holds


def _sample(shard: int, member: int, rng: np.random.Generator) -> dict:
    key = f"d{shard:03d}_{member:02d}"
    bad = BAD.get((shard, member))
    if bad == "missing_text":
        return {"__key__": key, "json": b"{}"}
    if bad == "empty":
        return {"__key__": key, "txt": b"  \n"}
    if bad == "not_utf8":
        return {"__key__": key, "txt": b"caf\xe9 \xff"}
    words = rng.choice(["alpha", "beta", "resume", "shard", "buffer", "\u00e9t\u00e9", "\u03bb"],
                       size=rng.integers(5, 40))
    return {"__key__": key, "txt": " ".join(words).encode()}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, demo_data) -> dict:
    root = tmp_path_factory.mktemp("resume_cost")
    rng = np.random.default_rng(0)
    shards = []
    for s in range(SHARDS):
        path = root / f"train-{s:06d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for m in range(DOCS_PER_SHARD):
                sink.write(_sample(s, m, rng))
        shards.append(str(path))
    expected = {Path(p).name: DOCS_PER_SHARD for p in shards} | {MISCOUNTED: DOCS_PER_SHARD + 1}
    tok_dir = demo_data / "tokenizer"
    return {"root": root, "shards": shards, "expected": expected, "tokenizer": tok_dir,
            "eos": special_ids(load_tokenizer(tok_dir)).eos,
            "largest_shard": max(Path(p).stat().st_size for p in shards)}


def _stream(corpus, shards=None, **kw) -> DocumentStream:
    kw = {"seed": 5, "shuffle_buffer": BUFFER, "chunk_docs": CHUNK, "on_error": "skip",
          "expected_docs": corpus["expected"], **kw}
    return DocumentStream(shards or corpus["shards"], corpus["tokenizer"], corpus["eos"], **kw)


def _through_a_checkpoint(state: dict, tmp_path: Path) -> dict:
    """The state as a resumed run gets it: saved and loaded as packtrain saves rank states (weights_only)."""
    path = tmp_path / "state.pt"
    tmp_path.mkdir(parents=True, exist_ok=True)
    save_state(state, path)
    return load_state(path)


def _legacy(state: dict) -> dict:
    """The state as checkpoints before positions were saved hold it: only `drawn` says where a slot stands."""
    return {**state, "slot_states": {slot: {k: v for k, v in s.items() if k != "position"}
                                     for slot, s in state["slot_states"].items()}}


def _resume(make, stop_after: int, tmp_path: Path,
            legacy: bool = False) -> tuple[list[str], list[str], DocumentLoader]:
    """(keys before the stop, keys after the resume, the resumed loader)."""
    first = make()
    head = [d.key for d in itertools.islice(iter(first), stop_after)]
    state = _through_a_checkpoint(first.state_dict(), tmp_path)
    resumed = make()
    resumed.load_state_dict(_legacy(state) if legacy else state)
    resumed.start()
    return head, [d.key for d in resumed], resumed


# -- one reader, rebuilt at any draw ----------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(data=st.data(), buffer=st.sampled_from([1, 5, BUFFER]))
def test_a_reader_rebuilt_at_any_draw_continues_exactly(corpus, data, buffer):
    """Draw k samples, take the position (as the loader keeps it: changes applied to a copy of the buffer,
    then the checkpoint's plain form), build a new reader there: it draws what the uninterrupted reader drew
    after k, having read at most the samples taken from the current shard."""
    stream = _stream(corpus, shuffle_buffer=buffer)
    shards = corpus["shards"][:8]

    def keys(reader: SlotReader, n: int | None = None) -> list[str]:
        drawn = iter(reader.draw, None)
        return [item[2] for item in itertools.islice(drawn, n)]

    whole = keys(SlotReader(stream, shards, 11, SlotState(), None))
    assert sorted(whole) == sorted(f"d{s:03d}_{m:02d}" for s in range(8) for m in range(DOCS_PER_SHARD))
    stop = data.draw(st.integers(0, len(whole)))
    reader = SlotReader(stream, shards, 11, SlotState(), None)
    head = keys(reader, stop)
    mirror: list = []
    for _ in range(data.draw(st.integers(1, 3))):  # changes since the last call, so later calls add nothing
        position = reader.position().with_changes_applied(mirror)
    position = type(position).from_dict(position.to_dict())
    resumed = SlotReader(stream, shards, 11, SlotState(), position)
    assert head + keys(resumed) == whole
    samples, nbytes, _ = resumed.restore_read
    assert samples == position.taken <= DOCS_PER_SHARD
    assert nbytes <= corpus["largest_shard"]


def test_shuffle_buffer_matches_its_worked_example(corpus):
    """The docstring's example: size 2, a b c d -> b a, then the shuffled rest."""
    from trainer.data.reader import ShuffleBuffer

    class Scripted:  # randrange answers 1 then 0; shuffle leaves [d c] -> [c d]
        answers = [1, 0]

        def randrange(self, n):
            return self.answers.pop(0)

        def shuffle(self, items):
            items.reverse()

    buf = ShuffleBuffer(2, Scripted())
    assert [buf.push(x) for x in "abcd"] == [None, None, "b", "a"]
    assert buf.changes() == (2, {0: "d", 1: "c"})
    buf.start_draining()
    assert [buf.pop(), buf.pop(), buf.pop()] == ["c", "d", None]


# -- the cost of a resume, at 10, 50 and 90% of an epoch --------------------------------------------


@pytest.fixture(scope="module")
def uninterrupted(corpus) -> list[str]:
    return [d.key for d in DocumentLoader(_stream(corpus, epochs=1), num_workers=2)]


@pytest.fixture(scope="module")
def resumes(corpus, uninterrupted, tmp_path_factory) -> dict:
    """{(fraction, legacy): (head, tail, per-slot restore_read)} for resumes at 10, 50 and 90% of the
    epoch."""
    out = {}
    for fraction in (0.1, 0.5, 0.9):
        for legacy in (False, True):
            head, tail, loader = _resume(lambda: DocumentLoader(_stream(corpus, epochs=1), num_workers=2),
                                         int(fraction * len(uninterrupted)), tmp_path_factory.mktemp("r"),
                                         legacy)
            out[fraction, legacy] = (head, tail, dict(loader.restore_read), loader.skipped())
    return out


@pytest.mark.parametrize("fraction", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("legacy", [False, True])
def test_resume_is_exact_and_counts_skips_once(uninterrupted, resumes, fraction, legacy):
    head, tail, _, skipped = resumes[fraction, legacy]
    assert head + tail == uninterrupted
    assert skipped == {"missing_text": 1, "empty": 1, "not_utf8": 1, "truncated_shard": 1}


def test_resume_reads_at_most_one_shard_per_slot_wherever_the_epoch_stood(resumes, corpus):
    """Both at 10% and at 90% of the epoch, each slot reads at most its current shard's samples (the bound the
    issue sets is the shuffle buffer plus those), and no more bytes than a shard holds. The replay of a state
    without positions reads everything up to the position: ~9x more at 90% than at 10%."""
    for fraction in (0.1, 0.5, 0.9):
        read = resumes[fraction, False][2]
        assert sorted(read) == [0, 1]
        for samples, nbytes, _ in read.values():
            assert samples <= DOCS_PER_SHARD <= BUFFER + DOCS_PER_SHARD
            assert nbytes <= corpus["largest_shard"]
    replayed = {f: sum(r[0] for r in resumes[f, True][2].values()) for f in (0.1, 0.5, 0.9)}
    epoch = SHARDS * DOCS_PER_SHARD
    assert replayed[0.9] >= 0.85 * epoch and replayed[0.1] <= 0.15 * epoch + 2 * BUFFER
    assert replayed[0.9] >= 5 * replayed[0.1]
    assert replayed[0.9] >= 20 * max(r[0] for r in resumes[0.9, False][2].values())


# -- 2 ranks x 2 workers, across chunks and an epoch boundary -----------------------------------------


@pytest.mark.parametrize("stop_after", [3 * CHUNK, 333, 1250])  # 1250: past this rank's first epoch
def test_two_ranks_two_workers_consume_each_key_exactly_once(corpus, tmp_path, stop_after):
    """Each rank's documents across a resume (state through torch.save / weights_only load) are exactly those
    of the uninterrupted run, in order; together the ranks read every good document once per epoch."""
    seen = collections.Counter()
    for rank in range(2):
        def make(rank=rank):
            return DocumentLoader(_stream(corpus, rank=rank, world_size=2, epochs=2), num_workers=2)

        whole = [d.key for d in make()]
        head, tail, loader = _resume(make, stop_after, tmp_path / str(rank))
        assert head + tail == whole
        assert all(samples <= DOCS_PER_SHARD for samples, _, _ in loader.restore_read.values())
        seen.update(whole)
    good = {f"d{s:03d}_{m:02d}" for s in range(SHARDS) for m in range(DOCS_PER_SHARD)} - {
        f"d{s:03d}_{m:02d}" for s, m in BAD}
    assert set(seen) == good and set(seen.values()) == {2}


# -- shards served over HTTP ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(corpus):
    srv = ShardServer(("127.0.0.1", 0), functools.partial(ShardHandler, directory=str(corpus["root"])))
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.cuts, srv.requests = {}, collections.defaultdict(list)
    srv.base = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def test_http_resume_fetches_only_the_current_shards(corpus, server, uninterrupted, tmp_path):
    """Over data.urls-style http shards: the same documents as from disk, and restoring the position at 90%
    fetches the shard each slot was in, none of the ~108 before them. (The workers read on after restoring, so
    later shards may be fetched too.)"""
    urls = [f"{server.base}/{Path(p).name}" for p in corpus["shards"]]

    def make():
        return DocumentLoader(_stream(corpus, shards=urls, epochs=1), num_workers=2)

    first = make()
    head = [d.key for d in itertools.islice(iter(first), int(0.9 * len(uninterrupted)))]
    state = _through_a_checkpoint(first.state_dict(), tmp_path)
    server.requests.clear()
    resumed = make()
    resumed.load_state_dict(state)
    resumed.start()
    fetched = {name for name, agents in server.requests.items() if any(a.startswith("curl/") for a in agents)}
    current, before = set(), set()
    for slot, s in resumed.slot_states.items():
        names = [Path(u).name for u in resumed.stream.epoch_shards(s.epoch, slot, 2)]
        current.add(names[s.position.shard_index])
        before.update(names[: s.position.shard_index])
    assert current <= fetched and len(before) > 100 and not fetched & before
    assert head + [d.key for d in resumed] == uninterrupted


# -- a shard that changed between the checkpoint and the resume ----------------------------------------


def test_a_changed_current_shard_is_refused_or_counted(corpus, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    shards = [shutil.copy(p, data) for p in corpus["shards"][:3]]

    def make(on_error):
        return DocumentLoader(_stream(corpus, shards=shards, epochs=1, shuffle_buffer=4, on_error=on_error))

    first = make("raise")
    list(itertools.islice(iter(first), 30))
    state = first.state_dict()
    position = first.slot_states[0].position
    assert 0 < position.taken < DOCS_PER_SHARD
    current = Path(first.slot_states[0].shard)
    with wds.TarWriter(str(current)) as sink:  # same size, other keys
        for m in range(DOCS_PER_SHARD):
            sink.write({"__key__": f"other{m:02d}", "txt": b"replaced"})
    resumed = make("raise")
    resumed.load_state_dict(state)
    with pytest.raises(DataStreamError, match=rf"{current.name}: cannot read shard .*the shard changed"):
        resumed.start()
    skipping = make("skip")
    skipping.load_state_dict(state)
    rest = [d.key for d in skipping]
    assert skipping.skipped() == {"unreadable_shard": 1}
    assert not any(k.startswith("other") for k in rest)


# -- the trainer reports it --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_resumed_run_reports_what_it_read(demo_data, tmp_path):
    """`python -m trainer.train` resumed at step 2: the resume line, the metrics line of step 3 (logged
    although log_every=2) and summary.json give resume_samples_read and resume_bytes_read: a part of one
    200-document shard (one reader: 1 rank, 1 DataLoader worker). A fresh run's summary holds None."""
    run_dir = tmp_path / "run"
    common = ("train.max_steps=4", "train.checkpoint_every=2", "train.eval_every=0", "logging.log_every=2")
    run_train(run_dir, demo_data, *common)
    assert json.loads((run_dir / "summary.json").read_text())["resume_samples_read"] is None
    shutil.rmtree(run_dir / "checkpoints" / "step_000004")
    proc = run_train(run_dir, demo_data, *common, "train.resume=true")
    line = next(line for line in proc.stdout.splitlines() if line.startswith("resumed from"))
    found = re.search(r"resume_samples_read=(\d+) resume_bytes_read=(\d+)$", line)
    assert found, line
    read = {"resume_samples_read": int(found[1]), "resume_bytes_read": int(found[2])}
    assert 0 < read["resume_samples_read"] <= 200 and read["resume_bytes_read"] > 0
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == [2, 3, 4]
    assert {k: lines[1][k] for k in read} == read and "resume_samples_read" not in lines[2]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {k: summary[k] for k in read} == read
