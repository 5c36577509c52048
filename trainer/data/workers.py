"""How DataLoader workers behave around signals and their parent's death.

Two rules, both about clusters:
  * A preemption signal (SIGTERM, SIGUSR1; also SIGINT) is for the trainer, not its workers. Slurm and
    `kill -TERM -<pgid>` signal every process of a job; a worker that died of it would break the batch the
    trainer still has to finish before it checkpoints. Workers ignore these signals.
  * A worker never outlives its trainer. PR_SET_PDEATHSIG makes the kernel send SIGKILL to the worker when
    the process that started it dies, whatever the cause (kill -9 included), so no orphan keeps reading
    shards. (torch's own watchdog only notices every few seconds, and only between samples.)
The trainer's preemption handler also interrupts shard reads that block, here and in the workers
(`interrupt_reads`, at the end of this module); the shard commands' own lifetime is trainer.data.sources'.
"""

from __future__ import annotations

import atexit
import mmap
import os
import signal
import time
import weakref

from trainer.errors import PREEMPTION_SIGNALS, set_parent_death_signal

IGNORED_SIGNALS = (*PREEMPTION_SIGNALS, signal.SIGINT)
"""What a DataLoader worker ignores: the trainer alone decides how a run ends
(trainer.errors.PREEMPTION_SIGNALS)."""


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies. If the parent is already gone, exit now."""
    set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def init_worker(parent_pid: int, _worker_id: int) -> None:
    """DataLoader worker_init_fn (bind the trainer's pid with functools.partial)."""
    for sig in IGNORED_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    die_with_parent(parent_pid)


_live: weakref.WeakSet = weakref.WeakSet()


def track(batches) -> None:
    """Remember a multi-process DataLoader iterator so that `shutdown_workers` runs on it at exit at the
    latest: workers ignore SIGTERM, so multiprocessing's own exit hook (terminate, then join without a
    timeout) must never be the one to end them."""
    if not _live:
        atexit.register(_shutdown_all)  # registered after multiprocessing's hook, so it runs before it
    _live.add(batches)


def shutdown_workers(batches) -> None:
    """Stop the workers of a DataLoader iterator now: torch's own graceful shutdown, then SIGKILL for any
    worker still alive (it ignores the SIGTERM that torch would fall back to)."""
    shutdown = getattr(batches, "_shutdown_workers", None)  # torch's multi-process iterator only
    if shutdown is None:
        return
    shutdown()
    for worker in getattr(batches, "_workers", []):
        if worker.is_alive():
            worker.kill()
            worker.join()
    _live.discard(batches)


def _shutdown_all() -> None:
    for batches in list(_live):
        shutdown_workers(batches)


# -- preemption while a shard read is blocked -------------------------------------------------------
#
# A reader blocked on a stalled source (a pipe: command or a server that sends nothing) would keep the trainer
# from reaching the end of its step, where it checks for a preemption signal. So the signal handler also sets
# one shared byte, and every wait of a shard read (trainer.data.sources) and of a retry's backoff looks at it
# a few times a second: it then raises ReadInterrupted, in the trainer and in its DataLoader workers alike
# (forked children share the page), and the trainer checkpoints the last finished step (trainer.run.loop).

_interrupt = mmap.mmap(-1, 1)  # MAP_SHARED | MAP_ANONYMOUS: a fork child sees the parent's writes
INTERRUPT_CHECK_S = 0.2
"""How often a blocked read looks at the flag (a preempted run ends within about this long of the signal)."""


class ReadInterrupted(Exception):
    """A preemption signal stopped a shard read: not the shard's fault (never retried, never counted as a
    skip).

    One message argument: torch re-raises a DataLoader worker's error as its type, called with one message."""


def interrupt_reads() -> None:
    """Make every shard read of this process and of its DataLoader workers raise ReadInterrupted (one byte
    written: safe in a signal handler)."""
    _interrupt[0] = 1


def allow_reads() -> None:
    """Undo `interrupt_reads` (a new training loop starts)."""
    _interrupt[0] = 0


def check_interrupt() -> None:
    """Raise ReadInterrupted if `interrupt_reads` was called."""
    if _interrupt[0]:
        raise ReadInterrupted("a preemption signal stopped the shard read")


def sleep_unless_interrupted(seconds: float) -> None:
    """time.sleep(seconds), raising ReadInterrupted within INTERRUPT_CHECK_S of `interrupt_reads`."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        check_interrupt()
        time.sleep(min(left, INTERRUPT_CHECK_S))
    check_interrupt()
