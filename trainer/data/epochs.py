"""Epochs: every rule of when one ends and the next begins, for each part of the training stream, in one
place. The other modules ask here; none counts or compares epochs on its own.

    part (where its number lives)                 its epoch ends when                           asked by
    a reader, one (rank, worker) slot             it has read its shards of the epoch           stream
      (SlotState.epoch)                           (`after`; it stops at `reader_stops`)
    one source's readers on a rank                the iteration over them ends: with lockstep,  loader
      (DocumentLoader.lockstep_epoch)             when every slot reached `stop_epoch`
    a rank's stream, in a checkpoint              `current`: the epoch it is in, or has ended   state, reshape
      (RowStreamState / MixtureState .epoch)      and waits in (its end counted already)
    a mixture (Mixture.epoch)                     `mixture_epoch_ends`: the first source ran    mixture
                                                  out (stop) or the last one did (restart)
    the ranks (StepRows.epoch)                    every rank's stream is exhausted: then all    run (via feed)
                                                  continue together (data.epoch_lockstep)

With data.epoch_lockstep (the default) the ranks agree: a rank whose rows of the epoch are all handed out
gives fewer (or no) rows in the steps until every rank is done, then every rank starts the next epoch in the
same step (`StepRows`). So every document is read exactly once per epoch, and no rank runs an epoch ahead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from trainer.data.workers import ReadInterrupted

FIRST = 0
"""The first epoch's number (of readers, loaders, mixtures and the ranks alike)."""


def after(epoch: int) -> int:
    """The epoch that follows `epoch` (a reader read its shards, a loader's iteration ended, a mixture's epoch
    ended)."""
    return epoch + 1


def reader_stops(epoch: int, epochs: int | None, stop_epoch: int | None) -> bool:
    """Whether a reader in `epoch` reads no more: it has read data `epochs` epochs (a finite stream, e.g. the
    eval), or reached the epoch a lockstep loader stops its readers at (`stop_epoch`)."""
    return (epochs is not None and epoch >= epochs) or (stop_epoch is not None and epoch >= stop_epoch)


def stop_epoch(lockstep: bool, lockstep_epoch: int) -> int | None:
    """The epoch a loader's readers stop at: with lockstep, the one after the loader's current epoch (one
    iteration covers one epoch); without, none (the readers run on from epoch to epoch)."""
    return after(lockstep_epoch) if lockstep else None


def current(counted: int, ended: bool) -> int:
    """The epoch a rank's stream is in, from its counter and whether that epoch ended on it: a rank whose
    documents of the epoch ended has counted the epoch already (`after`) and waits for the other ranks in it.
    Example: counted 3, ended -> 2 (done with epoch 2, waiting); counted 3, not ended -> 3."""
    return counted - 1 if ended else counted


def reader_done(reader_epoch: int, epoch: int) -> bool | None:
    """Whether a reader of a rank in `epoch` is done with it (True: it read its shards and waits; False: it is
    still reading them); None where it is in neither, so the readers were not in lockstep."""
    if reader_epoch == after(epoch):
        return True
    return False if reader_epoch == epoch else None


def mixture_epoch_ends(policy: str, read_through: Sequence[bool]) -> bool:
    """Whether a mixture's epoch ends now that a source ran out (data.mix_exhausted): `stop` at the first
    source to run out, `restart` when every source was read through once (`read_through`, this epoch)."""
    return policy == "stop" or all(read_through)


class StepInterrupted(ReadInterrupted):
    """A preemption signal stopped a read of this step's rows: raised by `StepRows.take` on every rank at the
    same point, before the step ran, so the ranks can checkpoint the last finished step together."""


class StepRows:
    """This rank's rows of each step, agreed with the other ranks: at an epoch's end (data.epoch_lockstep) and
    when a read was interrupted by a preemption signal.

    `rows`: this rank's row source (trainer.data.pipeline.RowSource). `all_sum(values)`: the element-wise sum
    of `values` over all ranks (an all-reduce; collective), given by the caller, which owns the process group.
    With lockstep, a rank whose row source is exhausted has packed what it held and contributes fewer (or no)
    rows until every rank is; then all call `next_epoch` in the same step. Two tiny all-reduces per step with
    lockstep, one without (only with several ranks).
    """

    def __init__(self, rows, world_size: int, rows_per_step: int, lockstep: bool,
                 all_sum: Callable[[list[float]], list[float]]) -> None:
        self.rows = rows
        self.world_size = world_size
        self.rows_per_step = rows_per_step
        self.lockstep = lockstep
        self.all_sum = all_sum
        self.wait_steps = [0]
        """Per epoch of the ranks (from FIRST), the steps in which some rank had fewer rows than its share
        because its readers had finished the epoch (lockstep; the same on every rank). A checkpoint keeps
        it."""

    @property
    def epoch(self) -> int:
        """The epoch the ranks are in (lockstep), counted from the wait steps' entries."""
        return FIRST + len(self.wait_steps) - 1

    def take(self, n_rows: int) -> list:
        """This rank's rows of the next step (collective with several ranks). Raises StepInterrupted on every
        rank if a preemption signal stopped a read on any."""
        if not self.lockstep:
            return self._take_agreed(n_rows)[0] if self.world_size > 1 else self._take_alone(n_rows)
        for _ in range(3):
            (waiting,) = self.all_sum([float(self.rows.exhausted)])
            if waiting == self.world_size:  # every rank is done with the epoch
                self.rows.next_epoch()
                self.wait_steps.append(0)
            rows, total = self._take_agreed(n_rows)
            if total > 0:
                self.wait_steps[-1] += total < self.rows_per_step  # fewer only at an epoch's end
                return rows
        raise RuntimeError("a whole epoch gave no documents on any rank "
                           "(empty or all-skipped training shards?)")

    def _take_alone(self, n_rows: int) -> list:
        try:
            return self.rows.take(n_rows)
        except ReadInterrupted as exn:
            raise StepInterrupted(str(exn)) from exn

    def _take_agreed(self, n_rows: int) -> tuple[list, float]:
        """take(n_rows) and the number of rows taken over all ranks (collective). A read interrupted on any
        rank (a preemption signal while its source stalled) abandons the step on every rank, before it runs:
        the ranks that got their rows put them back (RowSource.unread), so the checkpoint of the last finished
        step holds them, and all raise StepInterrupted here together. Without this, the interrupted rank would
        leave while the others wait in this step's collectives."""
        try:
            rows, interrupted = self.rows.take(n_rows), None
        except ReadInterrupted as exn:
            rows, interrupted = [], exn
        total, n_interrupted = self.all_sum([float(len(rows)), float(interrupted is not None)])
        if n_interrupted:
            if rows:
                self.rows.unread(rows)
            raise StepInterrupted(str(interrupted) if interrupted else
                                  "a preemption signal stopped a shard read on "
                                  f"{int(n_interrupted)} other rank(s)")
        return rows, total
