"""data.prefetch: the next step's rows drawn in a background thread give the same rows, states and checkpoints
as drawing them on demand, and the thread ends on every exit path (a finished run, an error, a preemption
signal).

The resume tests of test_train.py, test_accounting.py (2 ranks, epoch ends in lockstep) and test_cluster.py
(SIGTERM, kill -9, elastic restarts) run with prefetching on, its default: they prove the checkpoints it
writes resume exactly.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from tests.helpers import make_trainer, metrics
from trainer.data.batch import Document
from trainer.data.config import PackingConfig
from trainer.data.pipeline import PREFETCH_THREAD, RowPrefetcher, RowStream
from trainer.data.state import LoaderState

SEQ_LEN, ROWS = 32, 3


class Docs:
    """A resumable, finite document source (like DocumentLoader): documents 0..n-1 of seeded random lengths,
    `state` = how many were handed out. `fail_at`: raise when that document is reached; `delay_s`: sleep
    before each document; `closed` counts generators closed (the DataLoader workers' shutdown)."""

    def __init__(self, n: int = 200, fail_at: int | None = None, delay_s: float = 0.0) -> None:
        rng = np.random.default_rng(0)
        self.lengths = rng.integers(1, 2 * SEQ_LEN, n)
        self.pos, self.fail_at, self.delay_s, self.closed = 0, fail_at, delay_s, 0

    def __iter__(self):
        try:
            while self.pos < len(self.lengths):
                if self.pos == self.fail_at:
                    raise OSError(f"shard unreadable at document {self.pos}")
                time.sleep(self.delay_s)
                doc = Document(f"d{self.pos}", np.arange(self.lengths[self.pos]) % 100)
                self.pos += 1
                yield doc
        finally:
            self.closed += 1

    def state(self) -> LoaderState:
        return LoaderState(chunks_consumed=self.pos)  # one document a chunk

    def load_state(self, state: LoaderState) -> None:
        self.pos = state.chunks_consumed


def stream(docs: Docs) -> RowStream:
    return RowStream(docs, SEQ_LEN, PackingConfig(buffer_size=8))


def keys(rows) -> list[list[str]]:
    return [[d.key for d in row] for row in rows]


def comparable(state: dict) -> dict:
    """A RowStream state with its token arrays as lists, for ==."""
    def plain(x):
        if isinstance(x, np.ndarray):
            return x.tolist()
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        if isinstance(x, dict):
            return {k: plain(v) for k, v in x.items()}
        return x

    return plain(state)


def prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(PREFETCH_THREAD)]


def lockstep_takes(rows, epochs: int) -> list:
    """One rank's takes over `epochs` epochs as trainer.data.epochs.StepRows.take makes them, prefetching
    after each take when `rows` is a RowPrefetcher. Returns [(rows' keys, state at the take, exhausted at the
    take)]."""
    out, epoch = [], 0
    while epoch < epochs:
        exhausted = rows.exhausted
        if exhausted:
            rows.next_epoch()
            epoch += 1
        state = comparable(rows.state_dict())
        taken = rows.take(ROWS)
        if isinstance(rows, RowPrefetcher):
            rows.prefetch(ROWS)
        out.append((keys(taken), state, exhausted))
    return out


def test_prefetched_rows_and_states_are_those_of_the_plain_stream():
    """Over two epochs (each ending in an exhausted stream and next_epoch), the prefetcher hands out the same
    rows and reports the same state and `exhausted` at every take, a draw pending or not."""
    plain = lockstep_takes(stream(Docs()), epochs=2)
    prefetcher = RowPrefetcher(stream(Docs()))
    try:
        ahead = lockstep_takes(prefetcher, epochs=2)
    finally:
        prefetcher.close()
    assert len(plain) > 20 and sum(e for _, _, e in plain) == 2
    assert [k for k, _, _ in ahead] == [k for k, _, _ in plain]
    assert [e for _, _, e in ahead] == [e for _, _, e in plain]
    assert [s for _, s, _ in ahead] == [s for _, s, _ in plain]


def test_a_state_saved_while_rows_are_drawn_ahead_resumes_with_those_rows():
    """state_dict() with a draw pending is the state before it: a stream restored from it takes the drawn rows
    again, then continues as the uninterrupted stream does."""
    whole = stream(Docs())
    expected = [keys(whole.take(ROWS)) for _ in range(12)]
    prefetcher = RowPrefetcher(stream(Docs()))
    try:
        for step in range(5):
            assert keys(prefetcher.take(ROWS)) == expected[step]
            prefetcher.prefetch(ROWS)
        state = prefetcher.state_dict()  # step 6's rows are drawn (or being drawn): not in the saved state
    finally:
        prefetcher.close()
    resumed = stream(Docs())
    resumed.load_state_dict(state)
    assert [keys(resumed.take(ROWS)) for _ in range(5, 12)] == expected[5:]


def test_prepare_runs_with_the_draw_and_belongs_to_its_rows():
    prefetcher = RowPrefetcher(stream(Docs()))
    try:
        first = prefetcher.take(ROWS)
        assert prefetcher.prepared(first) is None  # drawn on demand: nothing prepared
        prefetcher.prefetch(ROWS, lambda rows: ("laid out", threading.current_thread().name, keys(rows)))
        second = prefetcher.take(ROWS)
        what, thread, prepared_keys = prefetcher.prepared(second)
        assert what == "laid out" and thread.startswith(PREFETCH_THREAD) and prepared_keys == keys(second)
        assert prefetcher.prepared(first) is None
    finally:
        prefetcher.close()


def test_an_error_of_the_draw_is_raised_by_the_take_and_close_still_ends_everything():
    docs = Docs(fail_at=40)
    prefetcher = RowPrefetcher(stream(docs))
    with pytest.raises(OSError, match="unreadable at document 40"):
        for _ in range(30):
            prefetcher.take(ROWS)
            prefetcher.prefetch(ROWS)
    prefetcher.close()
    assert not prefetch_threads()


def test_close_waits_for_a_slow_draw_then_closes_the_stream_and_ends_the_thread():
    docs = Docs(delay_s=0.05)
    prefetcher = RowPrefetcher(stream(docs))
    prefetcher.take(ROWS)
    handed_out = prefetcher.stats.state_dict()
    prefetcher.prefetch(ROWS)
    assert prefetch_threads()
    t0 = time.perf_counter()
    prefetcher.close()  # while the draw is still reading documents
    assert time.perf_counter() - t0 < 30
    assert docs.closed == 1  # the document iterator was closed (DataLoader workers shut down), after the draw
    assert not prefetch_threads()
    assert prefetcher.stats.state_dict() == handed_out  # the dropped draw's documents are not counted


def test_no_draw_starts_on_an_exhausted_stream():
    docs = Docs(n=10)
    prefetcher = RowPrefetcher(stream(docs))
    try:
        while not prefetcher.exhausted:
            prefetcher.take(ROWS)
        prefetcher.prefetch(ROWS)  # the ranks decide whether next_epoch comes first: nothing drawn ahead
        assert prefetcher._pending is None
        docs.pos = 0  # the source's next epoch (exhausted: every row of this one was handed out)
        prefetcher.next_epoch()
        assert keys(prefetcher.take(ROWS))
    finally:
        prefetcher.close()


# ---------------------------------------------------------------------------------------------------
# The trainer, in this process: the thread ends however fit() ends
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_thread_ends_when_training_ends_fails_or_is_preempted_and_the_preempted_run_resumes_exactly(
        demo_data, tmp_path, monkeypatch):
    """Step 2 of 5 is preempted (SIGTERM) while step 3's rows are drawn ahead: the checkpoint of step 2
    resumes into the same steps 3-5 as the uninterrupted run. After each fit(), finished, failed or preempted,
    no prefetch thread is left."""
    from trainer.run import loop

    summary = make_trainer(demo_data, tmp_path / "whole", "train.max_steps=5").fit()
    assert summary["final_step"] == 5 and not prefetch_threads()

    real_step, calls = loop.train_step, []

    def step_2_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            assert prefetch_threads()  # step 3's rows are being drawn while step 2 runs
            raise RuntimeError("the step failed")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(loop, "train_step", step_2_fails)
    with pytest.raises(RuntimeError, match="the step failed"):
        make_trainer(demo_data, tmp_path / "failed", "train.max_steps=5").fit()
    assert not prefetch_threads()

    calls.clear()

    def step_2_preempted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler records it; fit saves and returns
        return real_step(*args, **kwargs)

    run_dir = tmp_path / "preempted"
    monkeypatch.setattr(loop, "train_step", step_2_preempted)
    summary = make_trainer(demo_data, run_dir, "train.max_steps=5").fit()
    assert summary["preempted"] == "SIGTERM" and summary["final_step"] == 2
    assert not prefetch_threads()

    monkeypatch.setattr(loop, "train_step", real_step)
    make_trainer(demo_data, run_dir, "train.max_steps=5", "train.resume=true").fit()
    assert not prefetch_threads()
    whole, resumed = metrics(tmp_path / "whole"), metrics(run_dir)
    assert [m["step"] for m in resumed] == [1, 2, 3, 4, 5]
    for a, b in zip(whole, resumed, strict=True):
        assert a["docs"] == b["docs"] and a["valid_tokens"] == b["valid_tokens"]
        assert abs(a["loss"] - b["loss"]) <= 1e-6, (a["step"], a["loss"], b["loss"])
