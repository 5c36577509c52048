"""A preemption signal during the long phases of a resume that read no shard (hashing the checkpoint's files,
reading every old rank's state, dealing a reshaped stream) stops them, as it stops a shard read
(trainer.data.workers.ReadInterrupted); the trainer then ends the start on every rank (PreemptedAtStart,
trainer.run.preemption.PreemptionHandler.during). Before, each phase ran to its end first: minutes for a
checkpoint of a large run (thousands of rank files, gigabytes to hash) after a SIGTERM that gives a job
seconds.

The signal is a real SIGTERM to this process, through the run's own handler (trainer.run.preemption)."""

from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
import torch

from tests.helpers import stream_rows
from trainer.checkpoint import store
from trainer.data.reshape import reshape_state
from trainer.data.workers import ReadInterrupted
from trainer.distributed.groups import DistInfo
from trainer.run.preemption import PreemptionHandler

ONE = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


@contextlib.contextmanager
def sigterm_received():
    """The run's preemption handler installed, and SIGTERM delivered to this process (handled before the
    body)."""
    handler = PreemptionHandler()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline = time.monotonic() + 5
        while handler.signal_name is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert handler.signal_name == "SIGTERM"
        yield handler
    finally:
        handler.close()
        from trainer.data.workers import allow_reads

        allow_reads()


@pytest.fixture(scope="module")
def wide_checkpoint(checkpoint, tmp_path_factory):
    """The session's checkpoint as if written by 64 ranks (its rank file copied), checksums recorded."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("wide") / checkpoint.name
    shutil.copytree(checkpoint, path)
    for rank in range(1, 64):
        shutil.copy(path / store.rank_file(0), path / store.rank_file(rank))
    meta = json.loads((path / store.META_FILE).read_text())
    (path / store.META_FILE).write_text(json.dumps({**meta, "world_size": 64}))
    store.record_checksums(path)
    return path


def test_sigterm_stops_reading_every_old_ranks_state(wide_checkpoint):
    assert len(store.load_rank_states(wide_checkpoint, range(64))) == 64  # without a signal: all of them
    with sigterm_received(), pytest.raises(ReadInterrupted):
        store.load_rank_states(wide_checkpoint, range(64))


def test_sigterm_stops_hashing_the_checkpoint(wide_checkpoint):
    assert store.verify_checkpoint(wide_checkpoint, ONE) is True
    with sigterm_received(), pytest.raises(ReadInterrupted):
        store.verify_checkpoint(wide_checkpoint, ONE)


def test_sigterm_stops_the_deal_of_a_reshaped_stream(demo_data):
    states = []
    for rank in range(2):
        rows = stream_rows(demo_data, rank, 2, 0, seq_len=128)
        rows.take(3)
        states.append(rows.state_dict())
        rows.close()
    stream = stream_rows(demo_data, 0, 1, 0, seq_len=128).docs.stream
    assert reshape_state(states, stream, 0, lockstep=True) is not None  # without a signal: dealt
    with sigterm_received(), pytest.raises(ReadInterrupted):
        reshape_state(states, stream, 0, lockstep=True)
