"""`DocumentLoader`: a `DocumentStream` run in DataLoader workers,
handed out one document at a time, resumable.

Workers send chunks of documents, each tagged with its slot's state after it (trainer.data.reader.SlotState,
with only the shuffle-buffer changes since the slot's previous chunk); the loader keeps each slot's latest
state, how many chunks it consumed (which worker comes next) and the documents left in the current chunk:
all a resumed run needs. With lockstep (data.epoch_lockstep) one iteration covers one epoch.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator

import torch
from torch.utils.data import DataLoader

from trainer.data import epochs
from trainer.data.batch import Document
from trainer.data.reader import SlotState
from trainer.data.state import LoaderState
from trainer.data.stream import DocumentStream
from trainer.data.workers import init_worker, shutdown_workers, track

log = logging.getLogger(__name__)


class DocumentLoader:
    """Runs a `DocumentStream` in DataLoader workers and yields single documents, resumably.

    Chunks arrive round-robin from the workers, each tagged with its slot's state after it. The
    loader remembers the latest state per slot (keeping each slot's shuffle buffer up to date from the
    changes the chunks carry), how many chunks it consumed (which worker comes next) and the documents
    left in the current chunk, which is all a resumed run needs.
    """

    def __init__(self, stream: DocumentStream, num_workers: int = 0, prefetch_factor: int = 4,
                 lockstep: bool = False) -> None:
        self.stream = stream
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.lockstep = lockstep
        """One epoch per iteration: iterating ends when all this rank's slots have finished the epoch."""
        self.slot_states: dict[int, SlotState] = {}
        self.chunks_consumed = 0
        self.epoch_chunks = 0
        """Chunks consumed in the current lockstep epoch (which worker comes next)."""
        self.lockstep_epoch = 0
        """The epoch the current lockstep iteration covers. Kept, not derived from the slots: when every slot
        has delivered its last chunk but documents of it are still pending, the epoch has not ended yet."""
        self.restore_read: dict[int, tuple[int, int, float]] = {}
        """Per slot, after a resume: samples and bytes read from shards to restore its position,
        and seconds."""
        self._pending: list[Document] = []
        self._restoring = False
        self._started: Iterator | None = None

    def start(self) -> None:
        """Start the workers now rather than at the first document asked for. After `load_state_dict` this
        returns once every slot has restored its position, so that `restore_read` is complete."""
        if self._started is None:
            self._started = self._start()

    def __iter__(self) -> Iterator[Document]:
        batches = self._started if self._started is not None else self._start()
        self._started = None
        try:
            while self._pending:
                yield self._pending.pop(0)
            for slot, state, docs in batches:
                self._keep(slot, state)
                self.chunks_consumed += 1
                self.epoch_chunks += 1
                self._pending = list(docs)
                while self._pending:
                    yield self._pending.pop(0)
            self.epoch_chunks = 0  # every slot finished the epoch (lockstep) or the finite stream ended
            self.lockstep_epoch = epochs.after(self.lockstep_epoch)
        finally:  # on exhaustion, on an error, and when the consumer closes this generator
            shutdown_workers(batches)

    def _start(self) -> Iterator[tuple[int, SlotState, list[Document]]]:
        """The DataLoader's iterator over the chunks, past the restore reports of a resumed run."""
        self.stream.resume_states = dict(self.slot_states)
        consumed = self.epoch_chunks if self.lockstep else self.chunks_consumed
        self.stream.worker_rotation = consumed % max(1, self.num_workers)
        self.stream.stop_epoch = epochs.stop_epoch(self.lockstep, self.lockstep_epoch)
        self.stream.report_restore, self._restoring = self._restoring, False
        loader = DataLoader(
            self.stream,
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
            persistent_workers=False,
            collate_fn=_identity,
            worker_init_fn=functools.partial(init_worker, os.getpid()),
            # Its own generator: the DataLoader draws its base seed from it when iterated, never from the
            # global RNG, whose state a resumed run has just restored for dropout.
            generator=torch.Generator().manual_seed(0),
        )
        batches = iter(loader)
        track(batches)
        if self.stream.report_restore:  # every slot's first message, before any chunk: what restoring it read
            try:
                for _ in range(max(1, self.num_workers)):
                    slot, state, _ = next(batches)
                    self._keep(slot, state)
                    self.restore_read[slot] = state.restore_read
            except BaseException:
                shutdown_workers(batches)
                raise
        return batches

    def _keep(self, slot: int, state: SlotState) -> None:
        """Remember a slot's state from its chunk,
        applying the chunk's buffer changes to the slot's buffer."""
        if state.position is not None and state.position.changes is not None:
            previous = self.slot_states.get(slot)
            buffer = (previous.position.buffer if previous is not None and previous.position is not None
                      else [])
            state.position = state.position.with_changes_applied(buffer)
        self.slot_states[slot] = state

    def skip_rest_of_epoch(self) -> list[Document]:
        """Leave the current lockstep epoch unread (a mixture's epoch ended, trainer.data.mixture): the next
        iteration starts the next epoch. Call it with no iteration running (close the iterator first). Returns
        the documents of the current chunk that were not handed out
        (the rest of the epoch is not read at all)."""
        if self._started is not None:  # started (after a resume) but never iterated
            shutdown_workers(self._started)
            self._started = None
        workers = max(1, self.num_workers)
        slots = range(self.stream.rank * workers, (self.stream.rank + 1) * workers)
        epoch = epochs.after(self.lockstep_epoch)
        kept = {slot: self.slot_states.get(slot, SlotState()) for slot in slots}
        self.slot_states = {slot: SlotState(epoch=epoch, skipped=dict(s.skipped), docs=s.docs)
                            for slot, s in kept.items()}
        left, self._pending = self._pending, []
        self.epoch_chunks = 0
        self.lockstep_epoch = epoch
        self._restoring = False
        return left

    def resume_read(self) -> tuple[int, int]:
        """(samples, bytes) this rank's slots read from shards to restore their positions after a resume."""
        return sum(r[0] for r in self.restore_read.values()), sum(r[1] for r in self.restore_read.values())

    def skipped(self) -> dict[str, int]:
        """Samples skipped under on_error=skip, summed over this rank's slots."""
        total: dict[str, int] = {}
        for state in self.slot_states.values():
            for reason, n in state.skipped.items():
                total[reason] = total.get(reason, 0) + n
        return total

    def state(self) -> LoaderState:
        """A snapshot (the slots' buffers change in place as chunks arrive;
        a checkpoint's form of them is kept)."""
        return LoaderState(slot_states={slot: SlotState.from_dict(s.to_dict())
                                        for slot, s in self.slot_states.items()},
                           chunks_consumed=self.chunks_consumed,
                           epoch_chunks=self.epoch_chunks, lockstep_epoch=self.lockstep_epoch,
                           num_workers=self.num_workers, pending=[d.to_state() for d in self._pending])

    def load_state(self, state: LoaderState) -> None:
        # the trainer deals such a state first (trainer.data.reshape)
        if state.num_workers != self.num_workers:
            raise ValueError(
                f"stream state was saved with {state.num_workers} DataLoader workers; "
                f"this run has {self.num_workers} (deal it with trainer.data.reshape.reshape_state)"
            )
        # copies, as a checkpoint holds them: reading changes a slot's buffer in place, `state` stays as given
        self.slot_states = {slot: SlotState.from_dict(s.to_dict()) for slot, s in state.slot_states.items()}
        self.chunks_consumed = state.chunks_consumed
        self.epoch_chunks = state.epoch_chunks
        self.lockstep_epoch = state.lockstep_epoch
        self._pending = [Document.from_state(d) for d in state.pending]
        self._restoring = True
        replaying = sorted(slot for slot, s in self.slot_states.items() if s.position is None and s.drawn)
        if replaying:
            log.warning("the stream state was saved before reader positions were: slot(s) %s replay their "
                        "epoch up to the samples drawn, reading every shard before that point", replaying)

    def state_dict(self) -> dict:
        return self.state().to_dict()

    def load_state_dict(self, state: dict) -> None:
        self.load_state(LoaderState.from_dict(state))


def _identity(x):
    return x

