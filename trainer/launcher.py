"""`python -m trainer.launcher [torchrun's options] -m trainer.train OVERRIDES`: torchrun, ending as its ranks
end.

Plain torchrun reports a failed rank with its own ChildFailedError: two log lines ("Sending process N closing
signal SIGTERM", "failed (exitcode: 2) local_rank: 0 ..."), a 25-line traceback of its launcher holding a
table of every rank's failure, and exit status 1 whatever the ranks' were. A packtrain rank that stops on a
user's mistake has already said why in one line, `error: ...`, and exited 2 (trainer.errors), so this launcher
runs torchrun itself (torch.distributed.run, the same options) and ends as the first rank that failed ended
(torchrun's own "root cause"; the peers it then stopped with SIGTERM are not):

    exit status 2 (a mistake, its line printed) or 130 (Ctrl-C)    that status, nothing added
    another status (a bug: the rank printed its traceback)          that status, and one line naming the rank
    killed by a signal (the kernel's OOM killer: SIGKILL)           128 + the signal, and one line naming it

torchrun's report of the failure is dropped (its two log lines and its traceback); everything else it logs
(the LOGLEVEL environment variable, as for torchrun) is kept. A launcher stopped by a signal (Slurm's SIGTERM)
ends as torchrun does: the ranks are sent the signal and the launcher exits 128 + the signal.

launch/torchrun.sh and launch/slurm.sbatch run it in place of torchrun.
"""

from __future__ import annotations

import logging
import signal
import sys

from trainer.errors import EXIT_INTERRUPTED, EXIT_PEER_LOST, EXIT_USER_ERROR, print_user_error

QUIET_WHEN_FAILED = ("failed (exitcode: %s) local_rank: %s (pid: %s) of binary: %s",
                     "Sending process %s closing signal %s")
"""The log lines of torchrun's failure report (torch.distributed.elastic.multiprocessing.api), which the
rank's own line and the exit status replace."""
REPORTING_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _DropFailureReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg not in QUIET_WHEN_FAILED


def exit_status(exitcode: int) -> int:
    """A rank's exit status as a shell reports it: a negative exitcode (killed by signal N) is 128 + N."""
    return 128 - exitcode if exitcode < 0 else exitcode


def failure_line(rank: int, exitcode: int, pid: int) -> str | None:
    """The line for a rank's end that the rank did not explain itself (None: it did, or Ctrl-C)."""
    if exitcode in (EXIT_USER_ERROR, EXIT_INTERRUPTED, EXIT_PEER_LOST):
        return None
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        hint = (" (the kernel's out-of-memory killer sends SIGKILL: see dmesg)" if -exitcode == signal.SIGKILL
                else "")
        return f"rank {rank} (pid {pid}) was killed by {name}{hint}; the other ranks were stopped"
    return (f"rank {rank} (pid {pid}) failed with exit status {exitcode} (its traceback is above); the other "
            "ranks were stopped")


NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")
"""torchrun's own words for --nproc_per_node (torch.distributed.run.determine_local_world_size)."""


def nproc_problem(value: str) -> str | None:
    """The line for an --nproc_per_node torchrun cannot take (a ValueError traceback from deep inside it), or
    None.

    Example: 'two' ->
    "--nproc_per_node must be a number of processes >= 1 or one of auto, cpu, gpu, xpu; got 'two'"."""
    if value in NPROC_WORDS or (value.isdigit() and int(value) >= 1):
        return None
    return (f"--nproc_per_node must be a number of processes >= 1 or one of {', '.join(NPROC_WORDS)}; "
            f"got {value!r}")


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    logging.getLogger(REPORTING_LOGGER).addFilter(_DropFailureReport())
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if (problem := nproc_problem(str(args.nproc_per_node))) is not None:
        print_user_error(problem)
        return EXIT_USER_ERROR
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if (line := failure_line(rank, failure.exitcode, failure.pid)) is not None:
            print_user_error(line)
        return exit_status(failure.exitcode)
    except SignalException as e:  # torchrun sent the ranks the signal it received and waited for them
        return 128 + e.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main())
