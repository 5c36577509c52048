"""The data stream's typed states (trainer.data.state) and the one interface every row source implements
(trainer.data.pipeline.RowSource).

The states of real checkpoints of every format (tests/fixtures: v0, v1 single source, v1 mixture) read into
typed objects and written back give the same dicts, plus what the current version adds; the sources that the
trainer draws from (RowStream, Mixture, RowPrefetcher) each have every member of RowSource, with its
signature.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import numpy as np
import pytest

from trainer.checkpoint import store
from trainer.data.mixture import Mixture
from trainer.data.pipeline import RowPrefetcher, RowSource, RowStream
from trainer.data.state import (
    STATE_VERSION,
    MixtureState,
    RowStreamState,
    StreamStateError,
    is_mixture,
    stream_state,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CHECKPOINTS = [("v0", "ddp"), ("v1", "ddp"), ("v1", "mixture")]


def same(a, b) -> bool:
    """Deep equality of checkpoint data: dicts, lists and tuples element by element, numpy arrays by value."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and np.array_equal(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def data_state(version: str, kind: str) -> dict:
    return store.load_rank_states(FIXTURES / version / kind / store.step_name(2), [0])[0]["data"]


def with_current_keys(old: dict) -> dict:
    """An old data state dict as the current version writes it: + "version" (every stream state), + the
    mixer's "dealt" (False for each source); a v0 reader state gains the keys SlotState has since (their
    defaults)."""
    if is_mixture(old):
        mixture = {**old["docs"]["mixture"], "dealt": [False] * len(old["docs"]["mixture"]["names"])}
        return {"version": STATE_VERSION, **old, "docs": {**old["docs"], "mixture": mixture},
                "sources": [with_current_keys(s) for s in old["sources"]]}
    return {"version": STATE_VERSION, **old}


@pytest.mark.parametrize(("version", "kind"), CHECKPOINTS)
def test_a_checkpoints_data_state_reads_into_typed_objects_and_writes_back_the_same(version, kind):
    old = data_state(version, kind)
    typed = stream_state(old)
    assert isinstance(typed, MixtureState if kind == "mixture" else RowStreamState)
    written = typed.to_dict()
    assert written["version"] == STATE_VERSION
    if version == "v1":  # today's format, less what this version adds: nothing else changes
        assert same(written, with_current_keys(old))
    else:  # v0: the reader states gain the keys SlotState has since; everything else as it was
        assert same({k: v for k, v in written.items() if k != "docs"}, {"version": STATE_VERSION, **{
            k: v for k, v in old.items() if k != "docs"}})
        assert written["docs"]["lockstep_epoch"] == old["docs"].get("lockstep_epoch", 0)
    again = stream_state(written).to_dict()
    assert same(again, written)  # a fixed point: the current version reads its own writing unchanged


def test_a_mixture_state_is_not_one_sources_and_one_sources_is_not_a_mixtures():
    mixture, single = data_state("v1", "mixture"), data_state("v1", "ddp")
    with pytest.raises(StreamStateError, match=r"mixes the sources \['a', 'b'\]; this run reads one source"):
        RowStreamState.from_dict(mixture)
    assert isinstance(stream_state(single), RowStreamState) and not is_mixture(single)


def test_the_epoch_a_state_is_in():
    """A rank whose documents of the epoch ended (`ended`) has counted the epoch already: it is done with
    it."""
    typed = stream_state(data_state("v1", "ddp"))
    assert typed.epoch == typed.docs.lockstep_epoch
    typed.ended, typed.docs.lockstep_epoch = True, 3
    assert typed.epoch == 2


@pytest.mark.parametrize("source", [RowStream, Mixture, RowPrefetcher])
def test_every_row_source_has_the_whole_interface(source):
    members = [name for name, _ in inspect.getmembers(RowSource) if not name.startswith("_")]
    assert len(members) == 14, members
    for name in members:
        want = inspect.getattr_static(RowSource, name)
        got = inspect.getattr_static(source, name, None)
        assert got is not None, f"{source.__name__} lacks {name}"
        if isinstance(want, property):
            assert isinstance(got, property), f"{source.__name__}.{name} should be a property"
        else:
            assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), name
