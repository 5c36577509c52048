"""Errors that are the user's mistake, and the one way every command shows them: one line, `error: <message>`,
on stderr, and exit status 2.

A `UserError` says what is wrong with what the user gave (a config value, a data directory, a shard, a
tokenizer, a checkpoint path, an attention backend this machine cannot run) and what to do about it, so its
message alone is enough and a traceback would only bury it. Any other exception is a bug and keeps its
traceback.

Every command (`python -m trainer.train`, `prepare`, `report`, `inspect_mask`, `export`, `generate`) runs
through `run_command` (or its decorator form, `command`); none prints the line or returns 2 itself
(tests/test_errors.py checks that). A command may count more exception types as user mistakes
(`OSError` where it writes files the user named; Hydra's own errors in train). argparse's own usage errors
(a missing or mistyped flag) are left to argparse: usage, `prog: error: ...`, exit 2.
"""

from __future__ import annotations

import functools
import math
import multiprocessing
import os
import signal
import sys
import threading
from collections.abc import Callable

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
"""The signals that ask a run to checkpoint the step it reached and stop (Slurm's and torchrun's): the run's
handler takes them (trainer.run.preemption); its DataLoader workers ignore them, and SIGINT
(trainer.data.workers)."""
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def set_parent_death_signal(sig: int) -> None:
    """Linux: the kernel sends this process `sig` when the thread that forked it ends (prctl
    PR_SET_PDEATHSIG); elsewhere nothing. The one place a parent-death signal is set outside a fork's child
    (trainer.data.sources sets it between fork and exec with the same constant)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")

EXIT_USER_ERROR = 2
"""The exit status of a user's mistake (argparse uses 2 for its usage errors too); a bug exits 1."""

EXIT_INTERRUPTED = 130
"""The exit status of a command stopped by Ctrl-C (SIGINT), as a shell reports a process killed by it."""

EXIT_PEER_LOST = 3
"""A rank whose collective failed because a peer rank ended first (gloo's "Connection closed by peer"): one
line, not the collective's traceback; the launcher names the rank that ended (trainer.launcher)."""
PEER_LOST_MARKS = ("Connection closed by peer", "Connection reset by peer")
"""What gloo's error says when the other end of a collective went away."""

ErrorTypes = tuple[type[BaseException], ...]


class UserError(Exception):
    """A mistake in the user's config, data or environment; the message names it and what to do."""


class ConfigError(UserError, ValueError):
    """An unknown key, or a value of the wrong type or out of range, in the composed config."""


class NonFiniteError(UserError, RuntimeError):
    """A non-finite loss or gradient norm that the run was told to stop on (train.on_nonfinite=stop), or that
    an engine could not drop (DeepSpeed steps in one call)."""


def require_range(key: str, value, low: float | None = None, high: float | None = None, *,
                  low_open: bool = False, high_open: bool = False) -> None:
    """A ConfigError naming `key`, its value and the valid range unless `value` is a finite number in it.

    Example: require_range("model.n_head", 0, 1) -> "model.n_head must be >= 1, got 0";
    require_range("model.dropout", -0.5, 0, 1, high_open=True) -> "model.dropout must be in [0, 1), got -0.5".
    """
    if low is not None and high is not None:
        valid = f"in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    elif low is not None:
        valid = f"{'>' if low_open else '>='} {low}"
    elif high is not None:
        valid = f"{'<' if high_open else '<='} {high}"
    else:
        valid = "a finite number"
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = number and math.isfinite(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        raise ConfigError(f"{key} must be {valid}, got {value!r}")


def run_command(
    command: Callable[[], int | None],
    *,
    extra_user_errors: ErrorTypes = (),
    message: Callable[[BaseException], str] | None = None,
    tracebacks: bool = False,
    same_on_every_rank: ErrorTypes = (),
) -> int:
    """Run `command` and return its exit status (None counts as 0); a user's mistake is printed, not raised.

    A UserError (or one of `extra_user_errors`) prints one line, `error: <message(e)>`, on stderr and returns
    EXIT_USER_ERROR; `message` defaults to `original_message` (train passes one that also shortens Hydra's).
    `same_on_every_rank`: errors every rank of a launch raises alike (a config, an override: train passes
    ConfigError and Hydra's): printed by rank 0 alone (RANK, as torchrun and the deepspeed launcher set it),
    the other ranks exit EXIT_USER_ERROR without a word, so a launch prints the mistake once, not once per
    rank. `tracebacks=True` (train's HYDRA_FULL_ERROR=1) re-raises user errors like bugs. Ctrl-C
    (KeyboardInterrupt) prints one line too, `error: interrupted (SIGINT)...` with the interrupt's own text
    (train's says which step and checkpoint), and returns EXIT_INTERRUPTED. Whatever ends the command, its
    multiprocessing children are stopped first (stop_worker_processes), so the process can exit.
    """
    try:
        return command() or 0
    except (UserError, *extra_user_errors) as e:
        if tracebacks:
            stop_worker_processes()
            raise
        if not (isinstance(e, same_on_every_rank) and int(os.environ.get("RANK", "0") or 0) > 0):
            print_user_error((message or original_message)(e))
        return EXIT_USER_ERROR
    except KeyboardInterrupt as e:
        if tracebacks:
            stop_worker_processes()
            raise
        print_user_error("interrupted (SIGINT)" + (f": {e}" if str(e) else ""))
        return EXIT_INTERRUPTED
    except BaseException as e:  # a bug (its traceback follows) or an exit: the process must still end
        if (mark := peer_lost(e)) is not None:
            print_user_error(f"rank {os.environ.get('RANK', '?')} stopped: a peer rank left the collective "
                             f"this rank was in ({mark}): another rank ended first, and its own line or "
                             "the launcher's says why")
            return EXIT_PEER_LOST
        stop_worker_processes()
        raise


def peer_lost(error: BaseException) -> str | None:
    """The mark of a collective that failed because a peer rank went away (PEER_LOST_MARKS), under a launch of
    several ranks (WORLD_SIZE > 1); None for anything else."""
    if not isinstance(error, RuntimeError) or int(os.environ.get("WORLD_SIZE", "1") or 1) <= 1:
        return None
    return next((mark for mark in PEER_LOST_MARKS if mark in str(error)), None)


def command(*, extra_user_errors: ErrorTypes = ()
            ) -> Callable[[Callable[..., int | None]], Callable[..., int]]:
    """`run_command` as a decorator on a command's `main(argv)`; the decorated main returns the exit status.

    Example:
        @command(extra_user_errors=(OSError,))
        def main(argv: list[str] | None = None) -> int: ...
    """

    def decorate(main: Callable[..., int | None]) -> Callable[..., int]:
        @functools.wraps(main)
        def wrapper(*args, **kwargs) -> int:
            return run_command(lambda: main(*args, **kwargs), extra_user_errors=extra_user_errors)

        return wrapper

    return decorate


def print_user_error(message: str) -> None:
    """`error: <message on one line>` on stderr, after stopping this process's workers. One write of one line:
    the lines of several ranks sharing one pipe do not interleave."""
    stop_worker_processes()
    sys.stderr.write(f"error: {one_line(message)}\n")
    sys.stderr.flush()


def stop_worker_processes() -> None:
    """Kill this process's multiprocessing children (e.g. DataLoader workers) when a command ends in an error.

    A second line of defence: the training loop already shuts its workers down on every exit path
    (Trainer.fit, and trainer/data/workers.py at exit). The workers ignore SIGTERM, so if one were left,
    multiprocessing's exit handler, which terminates and then joins them without a timeout, would wait
    forever.
    """
    children = multiprocessing.active_children()
    if not children:
        return
    # torch's DataLoader installs a SIGCHLD handler that raises "DataLoader worker (pid N) is killed by
    # signal" in the main thread for any of its registered workers that dies of a signal: our own kill below
    # would turn this one-line error into that traceback (exit 1). The handler is put aside until the children
    # are reaped.
    main_thread = threading.current_thread() is threading.main_thread()
    handler = signal.signal(signal.SIGCHLD, signal.SIG_DFL) if main_thread else None
    try:
        for child in children:
            child.kill()
        for child in children:
            child.join(timeout=5)
    finally:
        if main_thread:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL if handler is None else handler)


def original_message(error: BaseException) -> str:
    """The message of `error`, without the wrapping torch adds when it re-raises a DataLoader worker's error.

    torch re-raises `DataStreamError("a.tar: bad")` from a worker as `DataStreamError("Caught DataStreamError
    in DataLoader worker process 0.\\nOriginal Traceback (most recent call last):\\n  File ...\\n
    trainer.data.reader.DataStreamError: a.tar: bad\\n")`; this returns "a.tar: bad". Other messages are
    returned as they are.
    """
    text = str(error)
    if not (text.startswith("Caught ") and "\nOriginal Traceback (most recent call last):" in text):
        return text
    lines = text.rstrip("\n").splitlines()
    # The last traceback block is the exception that was raised (earlier ones are its causes). Its frame
    # lines are indented; the first line that is not is "<module>.<Type>: <message>".
    start = max(i for i, line in enumerate(lines) if line.endswith("Traceback (most recent call last):"))
    body = [i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")]
    if not body:
        return text
    first = lines[body[0]]
    message = first.split(": ", 1)[1] if ": " in first else first
    return "\n".join([message, *lines[body[0] + 1 :]])


def one_line(message: str) -> str:
    """A message on one line: its non-blank lines, stripped, joined by "; " (by " " after a colon).

    Example: "Could not find 'attention/x'\\n\\nAvailable options:\\n\\tauto\\n\\tdense" ->
    "Could not find 'attention/x'; Available options: auto; dense".
    """
    parts = [line.strip() for line in message.splitlines() if line.strip()]
    out = parts[0] if parts else ""
    for part in parts[1:]:
        out += (" " if out.endswith(":") else "; ") + part
    return out
