"""How DataLoader workers behave around signals and their parent's death.

Two rules, both about clusters:
  * A preemption signal (SIGTERM, SIGUSR1; also SIGINT) is for the trainer, not its workers. Slurm and
    `kill -TERM -<pgid>` signal every process of a job; a worker that died of it would break the batch the
    trainer still has to finish before it checkpoints. Workers ignore these signals.
  * A worker never outlives its trainer. PR_SET_PDEATHSIG makes the kernel send SIGKILL to the worker when
    the process that started it dies, whatever the cause (kill -9 included), so no orphan keeps reading
    shards. (torch's own watchdog only notices every few seconds, and only between samples.)
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import weakref

PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies. If the parent is already gone, exit now."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def init_worker(parent_pid: int, _worker_id: int) -> None:
    """DataLoader worker_init_fn (bind the trainer's pid with functools.partial)."""
    for sig in PREEMPTION_SIGNALS:
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
