"""A small multi-process harness: run a function on N real ranks of a gloo process group.

    results = run_distributed(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> picklable

Workers are spawned (fresh interpreters, no forked OpenMP state) and return through files; an exception
in any rank fails the call with that rank's traceback. Never mocks: real torch.distributed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # report, then let the parent fail the test
        result = ("error", traceback.format_exc())
    finally:
        if result[0] == "error":  # said before the barrier: a rank left waiting there is reported with this
            Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        # Leave together: a rank that tears gloo down while another still talks to it can abort (SIGABRT,
        # "terminate called without an active exception"). Every rank reaches this line, errors included.
        with contextlib.suppress(Exception):
            dist.barrier()
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


RUN_TIMEOUT_S = 300
"""A call's ranks must all end within this: a rank that raised while another waits in a collective would otherwise
leave the test hanging (each rank meets the others at a barrier before it leaves)."""


def run_distributed(fn, world_size: int = 2, args: tuple = (), timeout_s: float = RUN_TIMEOUT_S) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args), nprocs=world_size,
                                     start_method="spawn", join=False)
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                done = {r for r in range(world_size) if Path(out_dir, f"rank{r}.pkl").exists()}
                errors = [pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes())[1] for r in sorted(done)]
                for process in context.processes:
                    process.kill()
                for process in context.processes:
                    process.join(timeout=10)
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - done)} still running after {timeout_s:g} s "
                                     "(waiting in a collective for a rank that failed?); what the others reported:\n"
                                     + "\n".join(str(e)[-3000:] for e in errors))
        results = [pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]
    errors = [f"rank {r}:\n{value}" for r, (status, value) in enumerate(results) if status == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [value for _, value in results]


def require_module(name: str, install: str):
    """Import an optional dependency a test needs: skip without it, but fail under CI=true, where every
    dependency must be installed (a missing one would otherwise hide the test)."""
    import importlib

    import pytest

    from tests.browser import ci_is_set

    try:
        return importlib.import_module(name)
    except ImportError:
        message = f"{name} is not installed ({install})"
        if ci_is_set():
            pytest.fail(f"{message}; CI=true: tests never skip on a missing dependency")
        pytest.skip(message)
