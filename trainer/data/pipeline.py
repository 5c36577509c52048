"""Documents -> rows -> micro-batches, with one switch for the layout.

Every layout draws its documents from the same place: the online packer's rows. A logical batch is
a number of packer rows; the layout only decides how the documents of those rows are laid out:

    packed    the rows as they are, each padded at its tail to seq_len
    unpacked  one document per row, padded to the longest document of the micro-batch (or to seq_len)
    bucketed  documents sorted by length, grouped, each group padded to its own longest

So `packing=packed` and `packing=unpacked` with the same seed see the same documents in every
optimizer step, with the same targets; only the padding and the speed differ.

Example, seq_len = 8, packer rows [[A(5), B(3)], [C(6), D(2)]], micro_batch_tokens = 16:
    packed    -> one (2, 8) micro-batch: [A B], [C D]                  16 positions, all real
    unpacked  -> (2, 5): [A], [B . .]   then (2, 6): [C], [D . . . .]   (stream order; a group closes
                 when rows x longest would pass 16)                       22 positions, 16 real
    bucketed  -> (2, 6): [C], [A .]     then (2, 3): [B], [D .]           18 positions, 16 real
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, Protocol

from trainer.data.batch import Batch, Document, collate_rows, flatten
from trainer.data.config import PackingConfig
from trainer.data.packing import OnlinePacker, PackingStats, split_long
from trainer.data.reshape import reshape_state
from trainer.data.state import PackerState, RowStreamState, StreamState


class RowSource(Protocol):
    """What the trainer draws its steps' rows from: one source (`RowStream`) or a data mixture
    (trainer.data.mixture.Mixture); `RowPrefetcher` draws from either in the background, behind the same
    interface. Epochs (data.epoch_lockstep): `exhausted` when this rank's rows of the epoch are all handed
    out; `next_epoch` once every rank is (trainer.data.epochs.Lockstep decides). State: typed
    (trainer.data.state), as plain dicts for checkpoints, and dealt from every old rank's on another shape
    (`reshaped_state`, trainer.data.reshape)."""

    def take(self, num_rows: int) -> list[list[Document]]:
        """The next `num_rows` rows (fewer only at the end of a lockstep epoch or of a finite stream)."""

    def unread(self, rows: list[list[Document]]) -> None:
        """Put the rows of the last `take` back in front (a step abandoned before it ran)."""

    @property
    def exhausted(self) -> bool:
        """The (lockstep) epoch ended on this rank and every row of it was handed out."""

    def next_epoch(self) -> None:
        """Continue into the next epoch (after `exhausted`, when every rank is)."""

    @property
    def stats(self) -> PackingStats:
        """Packing counts of the rows handed out."""

    def start(self) -> None:
        """Start the readers now (after `load_state`: their positions are restored on return)."""

    def skipped(self) -> dict[str, int]:
        """Samples skipped under on_error=skip by this rank's readers, by reason."""

    def resume_read(self) -> tuple[int, int]:
        """(samples, bytes) this rank's readers read from shards to restore their positions after a resume."""

    def state(self) -> StreamState:
        """A snapshot of the state, typed."""

    def load_state(self, state: StreamState) -> None:
        """Continue from `state` (written on this shape)."""

    def state_dict(self) -> dict:
        """`state()` as a checkpoint stores it."""

    def load_state_dict(self, state: dict) -> None:
        """`load_state` from a checkpoint's dict (older formats included)."""

    def reshaped_state(self, states: Sequence[dict], num_workers: int, lockstep: bool,
                       written_lockstep: bool = True) -> StreamState:
        """This rank's state made from every old rank's (in rank order), written on another shape; `lockstep`,
        `written_lockstep`: data.epoch_lockstep of this run and of the checkpoint's."""

    def close(self) -> None:
        """Stop reading (DataLoader workers end)."""


class RowStream:
    """Pulls documents, splits the long ones, packs them online, and hands out rows on demand."""

    def __init__(self, docs: Iterable[Document], seq_len: int, cfg: PackingConfig) -> None:
        self.docs = docs
        self.seq_len = seq_len
        self.cfg = cfg
        self.packer = OnlinePacker(seq_len, cfg.buffer_size)
        self._stats = PackingStats()
        self._ready: deque[list[Document]] = deque()
        self._doc_iter: Iterator[Document] | None = None
        self._ended = False
        """The documents ended (lockstep: the epoch's) and the packer was flushed; rows of it may be left."""

    def take(self, num_rows: int) -> list[list[Document]]:
        """The next `num_rows` rows (fewer only when a finite stream has ended)."""
        if self._doc_iter is None:
            self._doc_iter = iter(self.docs)
        while len(self._ready) < num_rows and not self._ended:
            doc = next(self._doc_iter, None)
            if doc is None:
                self._ended = True
                self._ready.extend(self.packer.flush())
                break
            for piece in split_long(doc, self.seq_len, self.cfg.long_docs, self._stats):
                self._ready.extend(self.packer.push(piece))
        return [self._ready.popleft() for _ in range(min(num_rows, len(self._ready)))]

    @property
    def stats(self) -> PackingStats:
        """What happened to the documents on their way into rows (split, truncated, dropped)."""
        return self._stats

    def unread(self, rows: list[list[Document]]) -> None:
        """Put rows handed out by the last `take` back in front: the next `take` (and a checkpoint's state)
        has them again, as if they had never been taken (a step abandoned before it ran,
        trainer.run.inputs)."""
        self._ready.extendleft(reversed(rows))

    @property
    def exhausted(self) -> bool:
        """The documents ended and every row of them was handed out. Not before: the flush at a lockstep
        epoch's end can leave more rows than a take asks for, and a rank holding such rows has not finished
        the epoch (were it counted as done, the other ranks would start the next epoch while it still trains
        this one)."""
        return self._ended and not self._ready

    def next_epoch(self) -> None:
        """Continue after the end of a finite (lockstep: one epoch) document stream: iterate it again."""
        self._doc_iter = None
        self._ended = False

    def abandon_epoch(self) -> int:
        """Leave the rest of the current (lockstep) epoch untrained: its rows not handed out, the packer's
        pieces and the documents not yet read (a data mixture's epoch ended, trainer.data.mixture). The next
        `take` starts the next epoch. Returns the documents dropped (rows' and packer's, and the reader's
        current chunk's)."""
        self.close()
        dropped = sum(map(len, self._ready)) + len(self.packer)
        self._ready.clear()
        self.packer = OnlinePacker(self.seq_len, self.cfg.buffer_size)
        self._ended = False
        return dropped + len(self.docs.skip_rest_of_epoch())

    def close(self) -> None:
        """Stop reading: closes the document iterator (and with it any DataLoader workers)."""
        if self._doc_iter is not None and hasattr(self._doc_iter, "close"):
            self._doc_iter.close()
        self._doc_iter = None

    # -- what the trainer reports (RowSource) ------------------------------------------------------------

    def start(self) -> None:
        """Start the DataLoader workers now (after `load_state`: their positions are restored on return)."""
        self.docs.start()

    def skipped(self) -> dict[str, int]:
        """Samples skipped under on_error=skip by this rank's readers, by reason."""
        return self.docs.skipped()

    def resume_read(self) -> tuple[int, int]:
        """(samples, bytes) this rank's readers read from shards to restore their positions after a resume."""
        return self.docs.resume_read()

    # -- checkpoints --------------------------------------------------------------------------------------

    def state(self) -> RowStreamState:
        return RowStreamState(docs=self.docs.state() if hasattr(self.docs, "state") else None,
                              packer=PackerState.from_dict(self.packer.state_dict()),
                              ready=[[d.to_state() for d in row] for row in self._ready],
                              stats=self.stats.state_dict(), ended=self._ended)

    def load_state(self, state: RowStreamState) -> None:
        if state.docs is not None:
            self.docs.load_state(state.docs)
        self.packer.load_state_dict(state.packer.to_dict())
        self._ready = deque([[Document.from_state(d) for d in row] for row in state.ready])
        self.stats.load_state_dict(state.stats)
        self._doc_iter = None
        self._ended = state.ended  # a rank waiting at an epoch end keeps waiting

    def state_dict(self) -> dict:
        return self.state().to_dict()

    def load_state_dict(self, state: dict) -> None:
        self.load_state(RowStreamState.from_dict(state))

    def reshaped_state(self, states: Sequence[dict | RowStreamState], num_workers: int, lockstep: bool,
                       written_lockstep: bool = True) -> RowStreamState:
        """This rank's state from every old rank's, written on another number of ranks or DataLoader workers
        (trainer.data.reshape)."""
        return reshape_state(states, self.docs.stream, num_workers, lockstep, written_lockstep)


PREFETCH_THREAD = "row-prefetch"
"""Name of RowPrefetcher's thread (tests look for leftovers by it)."""


class RowPrefetcher:
    """A `RowStream` whose next `take` is drawn in a background thread while the current step computes.

    The trainer calls `prefetch(n, prepare)` once it holds a step's rows; the thread draws the rows of the
    next `take(n)` and lays them out (`prepare`, e.g. into checked micro-batches), and `take(n)` returns them:

        rows = stream.take(n)            # step 1: drawn now (the first draw starts the DataLoader workers)
        stream.prefetch(n, lay_out)      # step 2's rows are drawn and laid out in the background...
        train_step(...)                  # ...while step 1 computes
        rows = stream.take(n)            # step 2: already there (waits only if drawing is the slower)
        batches = stream.prepared(rows)  # lay_out(rows), made in the background

    Same rows, same order, same states as the plain stream: only one thread uses the stream at a time (while a
    draw is pending every other method waits for it first), and the thread makes exactly the `take(n)` the
    trainer would make next. An error of the draw or of `prepare` is raised by the `take` that wanted the
    rows.

    Checkpoints: rows drawn ahead have not been trained on, so `state_dict()` is the stream's state *before*
    them, a snapshot the thread takes just before it draws; a run resumed from it draws them again.
    `exhausted` is likewise the state before a pending draw, and no draw starts on an exhausted stream:
    whether the next take follows `next_epoch()` is decided by all ranks (data.epoch_lockstep,
    trainer.run.loop).

    One thread, kept until `close()`, which the trainer calls on every exit path: it waits for a pending draw,
    closes the stream (and its DataLoader workers), then ends the thread. The thread lives that long because
    workers forked from it are killed when it ends (PR_SET_PDEATHSIG follows the forking thread).
    """

    def __init__(self, rows: RowSource) -> None:
        self.rows = rows
        self._executor: ThreadPoolExecutor | None = None
        self._pending: tuple[int, Future] | None = None
        """(rows asked for, the draw's future -> (rows, prepare(rows)))."""
        self._before: StreamState | None = None
        """The stream's state before the pending draw (set by the thread first)."""
        self._prepared: tuple[list, Any] | None = None
        """(rows handed out by the last take, what prepare made of them)."""

    def prefetch(self, num_rows: int, prepare: Callable[[list[list[Document]]], Any] | None = None) -> None:
        """Start drawing the rows of the next `take(num_rows)` and `prepare`-ing them (nothing if a draw is
        pending or the stream is exhausted)."""
        if self._pending is not None or self.rows.exhausted:
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=PREFETCH_THREAD)
        self._before = None
        self._pending = (num_rows, self._executor.submit(self._draw, num_rows, prepare))

    def _draw(self, num_rows: int, prepare) -> tuple[list[list[Document]], Any]:
        self._before = self.rows.state()
        rows = self.rows.take(num_rows)
        return rows, prepare(rows) if prepare is not None else None

    def take(self, num_rows: int) -> list[list[Document]]:
        """The next `num_rows` rows: the pending draw's (its error, if it failed, is raised here), else drawn
        now."""
        self._prepared = None
        if self._pending is None:
            return self.rows.take(num_rows)
        asked, future = self._pending
        if asked != num_rows:
            raise RuntimeError(f"{asked} rows were drawn ahead, but {num_rows} are taken")
        try:
            rows, prepared = future.result()
        finally:
            # not when the wait itself was interrupted: close() must still wait for the draw
            if future.done():
                self._pending = None
        self._prepared = (rows, prepared)
        return rows

    def prepared(self, rows: list[list[Document]]) -> Any | None:
        """What `prepare` made of `rows` in the background, if the last take handed them out from a draw; else
        None."""
        if self._prepared is None or self._prepared[0] is not rows:
            return None
        return self._prepared[1]

    @property
    def exhausted(self) -> bool:
        return False if self._pending is not None else self.rows.exhausted

    @property
    def stats(self) -> PackingStats:
        """Packing counts of the rows handed out (a pending draw's are not counted)."""
        if self._pending is None:
            return self.rows.stats
        stats = PackingStats()
        stats.load_state_dict(self.state().stats)
        return stats

    def unread(self, rows: list[list[Document]]) -> None:
        """RowStream.unread: before any next draw started (a draw holds the rows after these)."""
        self._no_pending("unread")
        self._prepared = None
        self.rows.unread(rows)

    def next_epoch(self) -> None:
        self._no_pending("next_epoch")
        self.rows.next_epoch()

    def state(self) -> StreamState:
        """The state before any rows drawn ahead (see the class docstring); waits for a pending draw."""
        if self._pending is None:
            return self.rows.state()
        wait([self._pending[1]])  # the draw's own error is for the take that wants its rows
        if self._before is None:  # the snapshot itself failed
            self._pending[1].result()
        return self._before

    def load_state(self, state: StreamState) -> None:
        self._no_pending("load_state")
        self.rows.load_state(state)

    def state_dict(self) -> dict:
        return self.state().to_dict()

    def load_state_dict(self, state: dict) -> None:
        self._no_pending("load_state_dict")
        self.rows.load_state_dict(state)

    def reshaped_state(self, states: Sequence[dict], num_workers: int, lockstep: bool,
                       written_lockstep: bool = True) -> StreamState:
        return self.rows.reshaped_state(states, num_workers, lockstep, written_lockstep)

    def start(self) -> None:
        self._no_pending("start")
        self.rows.start()

    def skipped(self) -> dict[str, int]:
        """RowSource.skipped (of the readers' latest chunks, drawn ahead or not)."""
        return self.rows.skipped()

    def resume_read(self) -> tuple[int, int]:
        return self.rows.resume_read()

    def close(self) -> None:
        """Wait for a pending draw (its rows and any error of it are dropped), close the stream, end the
        thread. `stats` then count the rows handed out, as without prefetching."""
        self._prepared = None
        try:
            if self._pending is not None:
                wait([self._pending[1]])
                self._pending = None
                if self._before is not None:  # the packing counts of rows handed out, not of the dropped draw
                    self.rows.stats.load_state_dict(self._before.stats)
        finally:
            # the wait was interrupted (a second Ctrl-C): the draw still runs
            busy = self._pending is not None
            try:
                if not busy:
                    self.rows.close()
            finally:
                if self._executor is not None:
                    self._executor.shutdown(wait=not busy)
                    self._executor = None

    def _no_pending(self, what: str) -> None:
        if self._pending is not None:
            raise RuntimeError(f"RowPrefetcher.{what} while rows are drawn ahead")


def micro_batches(
    rows: Sequence[Sequence[Document]],
    cfg: PackingConfig,
    seq_len: int,
    micro_batch_tokens: int,
    pad_id: int,
) -> list[Batch]:
    """Lay out one logical batch (packer rows) as micro-batches of at most `micro_batch_tokens` positions.

    A micro-batch always holds at least one row, so a single document of seq_len fits any budget.
    """
    if not rows:
        return []
    if cfg.layout == "packed":
        per_mb = max(1, micro_batch_tokens // seq_len)
        return [
            collate_rows(rows[i : i + per_mb], seq_len, pad_id, "packed", cfg.reset_positions)
            for i in range(0, len(rows), per_mb)
        ]
    docs = flatten(rows)
    if cfg.layout == "bucketed":
        docs = sorted(docs, key=len, reverse=True)  # stable: equal lengths keep stream order
    fixed = seq_len if (cfg.layout == "unpacked" and cfg.pad_to == "seq_len") else None
    return [
        collate_rows([[d] for d in group], fixed or max(map(len, group)), pad_id, cfg.layout,
                     cfg.reset_positions)
        for group in _group_by_budget(docs, micro_batch_tokens, fixed)
    ]


def _group_by_budget(docs: list[Document], budget: int, fixed_len: int | None) -> list[list[Document]]:
    """Consecutive groups whose padded size (rows x longest, or rows x fixed_len) stays within `budget`.

    Example, budget 12, lengths [5, 3, 6, 2] -> [[5, 3], [6, 2]] (3 x 6 = 18 > 12 closes the first group).
    """
    groups: list[list[Document]] = []
    current: list[Document] = []
    longest = 0
    for doc in docs:
        longest_if_added = fixed_len or max(longest, len(doc))
        if current and (len(current) + 1) * longest_if_added > budget:
            groups.append(current)
            current, longest_if_added = [], fixed_len or len(doc)
        current.append(doc)
        longest = longest_if_added
    if current:
        groups.append(current)
    return groups
