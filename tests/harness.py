"""A small multi-process harness: run a function on N real ranks of a gloo process group.

    results = run_distributed(fn, world_size=2, args=(...))   # fn(rank, world_size, *args) -> picklable

Workers are forked from a forkserver (multiprocessing's: a fresh interpreter started once per test process,
which imports torch, dynamo and the trainer before anything runs, so no OpenMP or thread state is forked) and
return through files; an exception in any rank fails the call with that rank's traceback. A rank then starts
in well under a second instead of paying the imports (~6 CPU seconds) each time. Never mocks: real
torch.distributed.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
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


PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "trainer.run.loop", "trainer.distributed.engine",
           "trainer.distributed.fsdp", "trainer.distributed.tensor", "tests.helpers"]
"""What the forkserver imports once: every rank forked from it starts with them loaded."""
START_METHOD = "forkserver"


def _start_method() -> str:
    import multiprocessing

    multiprocessing.get_context(START_METHOD).set_forkserver_preload(PRELOAD)
    return START_METHOD


RUN_TIMEOUT_S = 300
"""A call's ranks must all end within this: a rank that raised while another waits in a collective would
otherwise leave the test hanging (each rank meets the others at a barrier before it leaves)."""


def run_distributed(fn, world_size: int = 2, args: tuple = (), timeout_s: float = RUN_TIMEOUT_S) -> list:
    with tempfile.TemporaryDirectory() as out_dir:
        context = mp.start_processes(_worker, args=(world_size, free_port(), out_dir, fn, args),
                                     nprocs=world_size, start_method=_start_method(), join=False)
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                done = {r for r in range(world_size) if Path(out_dir, f"rank{r}.pkl").exists()}
                errors = [pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes())[1] for r in sorted(done)]
                for process in context.processes:
                    process.kill()
                for process in context.processes:
                    process.join(timeout=10)
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - done)} still running "
                                     f"after {timeout_s:g} s "
                                     "(waiting in a collective for a rank that failed?); "
                                     "what the others reported:\n"
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


def _join(rank: int, world: int, store: str) -> None:
    """Leave this process's group (if any) and form a new gloo group of `world` ranks over the file `store`,
    the trainer's environment (RANK, WORLD_SIZE, LOCAL_RANK) set to it: init_distributed then sees that
    world."""
    from trainer.distributed.groups import shutdown_distributed

    shutdown_distributed()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                            timeout=timedelta(seconds=RUN_TIMEOUT_S))


def in_worlds(rank: int, size: int, root: str,
              phases: list[tuple[int, Callable, tuple]]) -> dict[int, object]:
    """The phases (world, fn, args) one after another in one run_distributed spawn of `size` ranks: phase i on
    its first `world` ranks, in a fresh gloo group of their own (the spawn's group is left first; the ranks
    outside the phase wait for the next one they are in); {i: fn(rank, world, *args)} of the phases this rank
    ran. Every spawned rank costs its start (torch, dynamo and the trainer imported) once, not once per world
    size."""
    out = {}
    for i, (world, fn, args) in enumerate(phases):
        if rank < world:
            _join(rank, world, f"{root}/group_{i}")
            out[i] = fn(rank, world, *args)
    _join(rank, size, f"{root}/group_end")  # the harness leaves through the whole spawn's group
    return out


def by_world(ranks: list[dict[int, object]], phases: list[tuple[int, Callable, tuple]]) -> dict[int, list]:
    """in_worlds' results, per phase world: the list of its ranks' results, in rank order (one per rank)."""
    out = {world: [r[i] for r in ranks if i in r] for i, (world, _, _) in enumerate(phases)}
    assert {world: len(got) for world, got in out.items()} == {world: world for world in out}
    return out
