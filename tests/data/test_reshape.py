"""A data stream written on W ranks x K workers, resumed on W' x K' (trainer.data.reshape), in this process.

Each old rank's real stream (shards -> shuffle buffer -> tokenizer -> packer) takes some rows and is
checkpointed (through safe_io, as a checkpoint is); every new rank deals itself a part of all old states and
reads to the epoch's end. The chunks trained before and after must be the epoch's, each exactly once (counted
against the shards read with tarfile and the tokenizers library, not the trainer's reader), and the next epoch
must be the new shape's own, as if the run had started on it.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import ROOT, epoch_chunks, first_keys_of_epoch, short_docs_corpus, stream_rows
from trainer.checkpoint.safe_io import load_state, save_state
from trainer.data.pipeline import RowStream
from trainer.data.reader import DataStreamError, SlotState
from trainer.data.reshape import ReshapeError, reshape_state

SEQ_LEN = 128


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return short_docs_corpus(tmp_path_factory.mktemp("reshape") / "short")


@pytest.fixture(scope="module")
def epoch(corpus) -> Counter:
    chunks = epoch_chunks(corpus, SEQ_LEN)
    assert set(chunks.values()) == {1}  # chunk keys are unique within an epoch
    return chunks


def rows_on(data: Path, rank: int, world_size: int, workers: int) -> RowStream:
    return stream_rows(data, rank, world_size, workers, SEQ_LEN)


def keys(rows) -> list[str]:
    return [doc.key for row in rows for doc in row]


def checkpointed(states: list[dict], tmp: Path) -> list[dict]:
    save_state(states, tmp / "states.pt")
    return load_state(tmp / "states.pt")


def train_part(data: Path, shape: tuple[int, int], takes: list[int], tmp: Path,
               states: list[dict] | None = None) -> tuple[list[str], list[dict]]:
    """Each rank of `shape` takes takes[rank] rows (from `states` dealt to it, if given); their keys and
    states."""
    world, workers = shape
    seen, out = [], []
    for rank in range(world):
        rows = rows_on(data, rank, world, workers)
        if states is not None:
            rows.load_state(reshape_state(states, rows.docs.stream, workers, lockstep=True))
        seen += keys(rows.take(takes[rank]))
        out.append(rows.state_dict())
        rows.close()
    return seen, checkpointed(out, tmp)


def finish_epoch(data: Path, shape: tuple[int, int], states: list[dict], next_rows: int = 6):
    """Each new rank dealt its part of `states`, read to the epoch's end, then the first rows of the next
    epoch; (keys of the rest of the epoch, per rank the next epoch's first keys, the dealt states)."""
    world, workers = shape
    rest, nxt, dealt = [], [], []
    for rank in range(world):
        rows = rows_on(data, rank, world, workers)
        dealt.append(reshape_state(states, rows.docs.stream, workers, lockstep=True))
        rows.load_state(dealt[-1])
        while not rows.exhausted:
            rest += keys(rows.take(5))
        rows.next_epoch()
        nxt.append(keys(rows.take(next_rows)))
        rows.close()
    return rest, nxt, dealt


def fresh_next_epoch(data: Path, shape: tuple[int, int], next_rows: int = 6) -> list[list[str]]:
    """Per rank, the first keys of epoch 1 of a run that was on `shape` from the start."""
    return [first_keys_of_epoch(rows_on(data, rank, *shape), 1, next_rows) for rank in range(shape[0])]


# (old shape, rows taken per old rank, new shape); workers 0 = the rank reads in-process, as one reader
CASES = [
    ((2, 0), [10, 20], (1, 0)),
    ((2, 0), [3, 40], (3, 0)),  # rank 1 well into its shards, rank 0 barely started
    ((1, 0), [25], (2, 0)),  # more ranks than before
    # rank 0 has finished the epoch and waits (lockstep): a resume inside the wait
    ((2, 0), [1000, 30], (3, 0)),
    ((2, 0), [0, 0], (1, 0)),  # nothing trained yet
    ((2, 2), [20, 7], (3, 0)),  # 2 DataLoader workers per rank before
    ((2, 0), [30, 12], (2, 2)),  # same ranks, other workers
]


@pytest.mark.parametrize("old, takes, new", CASES,
                         ids=[f"{o[0]}x{o[1]}-{t}-{n[0]}x{n[1]}" for o, t, n in CASES])
def test_every_chunk_of_the_epoch_once_and_the_next_epoch_the_new_shapes(corpus, epoch, tmp_path, old, takes,
                                                                         new):
    seen, states = train_part(corpus, old, takes, tmp_path)
    rest, nxt, _ = finish_epoch(corpus, new, states)
    trained = Counter(seen + rest)
    assert trained == epoch, ({k: n for k, n in trained.items() if n != 1},
                              sorted(set(epoch) - set(trained))[:5])
    assert nxt == fresh_next_epoch(corpus, new)


def test_a_reshape_of_a_reshape_in_the_same_epoch(corpus, epoch, tmp_path):
    """2 -> 3 ranks, some rows, then 3 -> 1 rank x 2 workers: the dealt shards, read in part again, deal
    again."""
    seen, states = train_part(corpus, (2, 0), [10, 40], tmp_path)
    more, states = train_part(corpus, (3, 0), [30, 2, 50], tmp_path, states)
    rest, nxt, _ = finish_epoch(corpus, (1, 2), states)
    assert Counter(seen + more + rest) == epoch
    assert nxt == fresh_next_epoch(corpus, (1, 2))


def test_one_reader_continues_several_shards_read_in_part(corpus, epoch, tmp_path):
    """3 ranks -> 1: the one new reader holds three shards read in part, and buffered samples that are still
    references into each of them; those past the first are read for it before reading starts."""
    seen, states = train_part(corpus, (3, 0), [12, 9, 15], tmp_path)
    rest, _, dealt = finish_epoch(corpus, (1, 0), states)
    slot = SlotState.from_dict(dealt[0].docs.slot_states[0].to_dict())  # as a checkpoint holds it
    assert len(slot.starts) == 3, slot.starts
    refs = {item[0] for item in slot.position.buffer if item[3] is None}
    assert len(refs) >= 2 and refs <= set(slot.starts), (refs, slot.starts)
    assert Counter(seen + rest) == epoch


def test_a_dealt_state_resumes_bit_exactly_on_its_own_shape(corpus, tmp_path):
    """After a reshape, a checkpoint on the new shape resumes as any other: the same rows as without it."""
    _, states = train_part(corpus, (2, 2), [15, 25], tmp_path)
    first, then = [17, 5, 30], [23, 35, 10]
    for rank in range(3):
        whole = rows_on(corpus, rank, 3, 0)
        whole.load_state(reshape_state(states, whole.docs.stream, 0, lockstep=True))
        whole.take(first[rank])
        expected = keys(whole.take(then[rank]))
        whole.close()
        part = rows_on(corpus, rank, 3, 0)
        part.load_state(reshape_state(states, part.docs.stream, 0, lockstep=True))
        part.take(first[rank])
        (saved,) = checkpointed([part.state_dict()], tmp_path)
        part.close()
        resumed = rows_on(corpus, rank, 3, 0)
        resumed.load_state_dict(saved)
        assert keys(resumed.take(then[rank])) == expected != []
        resumed.close()


def test_totals_are_kept(corpus, tmp_path):
    """Documents emitted, packing counts: every old rank's and reader's, once, in the new ranks' sums."""
    _, states = train_part(corpus, (2, 2), [20, 7], tmp_path)
    dealt = [reshape_state(states, rows_on(corpus, r, 3, 0).docs.stream, 0, True).to_dict() for r in range(3)]
    old_docs = sum(s["docs"] for state in states for s in state["docs"]["slot_states"].values())
    new_docs = sum(s["docs"] for state in dealt for s in state["docs"]["slot_states"].values())
    assert new_docs == old_docs > 0
    for name in states[0]["stats"]:
        assert sum(s["stats"][name] for s in dealt) == sum(s["stats"][name] for s in states)


def test_every_new_rank_deals_the_same_in_another_process(corpus, tmp_path):
    """The deal is a function of the states and the seed alone: another process (another hash seed) gets the
    same."""
    _, states = train_part(corpus, (2, 2), [20, 7], tmp_path)
    here = [summary(reshape_state(states, rows_on(corpus, r, 3, 0).docs.stream, 0, True).to_dict())
            for r in range(3)]
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from tests.data.test_reshape import *; "
            f"states = load_state({str(tmp_path / 'states.pt')!r}); "
            f"print(json.dumps([summary(reshape_state(states, rows_on(Path({str(corpus)!r}), "
            "r, 3, 0).docs.stream, 0, True).to_dict()) for r in range(3)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == json.loads(json.dumps(here))


def summary(state: dict) -> dict:
    """What a dealt state decides: each reader's shards, starts, position and buffer keys; the loose
    documents."""
    slots = {}
    for slot, s in state["docs"]["slot_states"].items():
        p = s["position"]
        slots[str(slot)] = [s["shards"], sorted(s["starts"].items()), p["shard_index"], p["taken"],
                            [(i, m, k) for i, m, k, _ in p["buffer"]]]
    return {"slots": slots, "pending": [d[0] for d in state["docs"]["pending"]],
            "packer": [d[0] for d in state["packer"]["docs"]],
            "ready": [[d[0] for d in row] for row in state["ready"]]}


def test_refusals_say_why(corpus, tmp_path):
    _, states = train_part(corpus, (2, 0), [5, 5], tmp_path)
    stream = rows_on(corpus, 0, 1, 0).docs.stream
    with pytest.raises(ReshapeError, match=r"only with data.epoch_lockstep=true"):
        reshape_state(states, stream, 0, lockstep=False)
    # this run keeps lockstep, the checkpoint's did not: the refusal says so (not "set
    # data.epoch_lockstep=true")
    with pytest.raises(ReshapeError, match=r"the checkpoint was written with data.epoch_lockstep=false "
                                           r".*resumes only on the number of ranks and DataLoader workers it "
                                           r"was written on"):
        reshape_state(states, stream, 0, lockstep=True, written_lockstep=False)
    legacy = copy.deepcopy(states)  # as a checkpoint written before reader positions were saved
    for state in legacy:
        for s in state["docs"]["slot_states"].values():
            s["position"], s["drawn"] = None, 3
    with pytest.raises(ReshapeError, match=r"written before reader positions were saved"):
        reshape_state(legacy, stream, 0, lockstep=True)
    # 6 readers for 5 shards: refused now, not at the next epoch
    too_many = rows_on(corpus, 0, 3, 2).docs.stream
    with pytest.raises(DataStreamError, match=r"5 shards cannot feed 6 readers"):
        reshape_state(states, too_many, 2, lockstep=True)
    drifted = [states[0], {**states[1], "docs": {**states[1]["docs"], "lockstep_epoch": 2}}]
    with pytest.raises(ReshapeError, match=r"ranks are in different epochs \(\[0, 2\]\): not a lockstep run"):
        reshape_state(drifted, stream, 0, lockstep=True)
