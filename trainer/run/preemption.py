"""Preemption: SIGTERM or SIGUSR1 on any rank -> every rank finishes its step, checkpoints it, exits 0.

Slurm sends SIGTERM when it preempts a job (and, with `--signal=B:USR1@120`, USR1 before the time limit);
Kubernetes sends SIGTERM before it kills a pod. The handler only records the signal. After each step the
ranks agree through one all-reduce (MAX of "a signal arrived here"), so a signal seen by one rank alone
stops them all at the same step, and the checkpoint they write together is that step's.

    handler = PreemptionHandler()            # main thread, before training
    ...after each optimizer step...
    if handler.requested(device): save, report handler.signal_name, return

A step whose rows cannot be read (a stalled shard source) would never end: so the handler also interrupts
every shard read of this process and its DataLoader workers (trainer.data.workers.interrupt_reads). The read
raises ReadInterrupted within a fraction of a second, and the loop checkpoints the last finished step instead.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from trainer.data.feed import ReadInterrupted, allow_reads, interrupt_reads
from trainer.distributed.groups import dist_max
from trainer.errors import PREEMPTION_SIGNALS, set_parent_death_signal

SIGNALS = PREEMPTION_SIGNALS


class PreemptedAtStart(Exception):
    """A preemption signal arrived while the run was starting (loading a checkpoint, dealing a reshaped
    resume, restoring the readers' positions): it ends there, before training, writing nothing (the run dir as
    found)."""


class PreemptionHandler:
    """Records SIGTERM / SIGUSR1; restores the previous handlers on `close()`."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, object] = {}
        allow_reads()
        if threading.current_thread() is threading.main_thread():  # Python installs handlers only there
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, _frame) -> None:
        self.signal_name = self.signal_name or signal.Signals(signum).name
        interrupt_reads()  # a reader blocked on a stalled source gives up now (ReadInterrupted)

    def requested(self, device) -> bool:
        """Collective: True on every rank if any rank got a signal since training started."""
        return dist_max(float(self.signal_name is not None), device) > 0

    def during(self, phase: str, run, device):
        """Collective: `run()`, one phase of the start, then every rank stops (PreemptedAtStart) if a
        preemption signal reached any rank meanwhile. A signal cuts the phase short where it reads (the
        checkpoint's files hashed, every old rank's state read, the reshaped stream dealt: ReadInterrupted on
        that rank); the other ranks finish it and stop with it. Returns what `run` returned."""
        try:
            result = run()
        except ReadInterrupted:
            self.stop_if_requested(phase, device)
            raise
        self.stop_if_requested(phase, device)
        return result

    def stop_if_requested(self, phase: str, device) -> None:
        """Collective: every rank raises PreemptedAtStart if a preemption signal reached any rank so far."""
        if self.requested(device):
            raise PreemptedAtStart(f"preempted ({self.signal_name or 'a signal on another rank'}) while "
                                   f"{phase}, before training: nothing was trained or written; continue with "
                                   "the same command")

    def close(self) -> None:
        """The previous signal handlers back, and shard reads allowed again: what a signal interrupted was
        this run's; the process may read on (the next job of a sweep, a command after a run in the same
        process)."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
        allow_reads()


def end_with_launcher() -> None:
    """Under torchrun (its agent is this process's parent): when the agent dies, however it dies (kill -9
    included), the kernel sends this rank SIGTERM, which the run takes as a preemption (every rank checkpoints
    the step it reached and exits) instead of training on as an orphan. Linux only; elsewhere a no-op. If the
    agent is already gone, SIGTERM now."""
    if "TORCHELASTIC_RESTART_COUNT" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    set_parent_death_signal(signal.SIGTERM)
    if os.getppid() != parent or parent == 1:  # the agent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)
