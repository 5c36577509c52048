"""Shard sources that stall, fail or outlive their reader: nothing hangs, nothing is left running.

Real parts only: the standard library's HTTP server in a thread of this process (tests.helpers.ShardServer,
here also answering 503 for chosen files), a listening socket that never answers, real pipe: commands, and
real `python -m trainer.train` runs on the tiny model that are sent SIGTERM or killed with SIGKILL. Processes
are found with psutil: the shard commands are the trainer's descendants running `sleep <marker>`, `cat` or
`curl`.
"""

from __future__ import annotations

import collections
import io
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import psutil
import pytest

from tests.harness import free_port
from tests.helpers import ROOT, SMALL, ShardHandler, serve_shards
from trainer.data.config import DataConfig
from trainer.data.loader import DocumentLoader
from trainer.data.reader import DataStreamError
from trainer.data.sources import resolve_source
from trainer.data.stream import DocumentStream
from trainer.data.tokenizer import load_tokenizer, special_ids

TRAIN = "train-{000000..000004}.tar"  # the demo_data fixture's five train shards


class StatusHandler(ShardHandler):
    """ShardHandler that answers `server.statuses[name]` (e.g. 503) for the files listed there."""

    def do_GET(self) -> None:
        name = self.path.lstrip("/")
        if name not in self.server.statuses:
            return super().do_GET()
        self.server.requests[name].append(self.headers.get("User-Agent", ""))
        self.send_error(self.server.statuses[name])


@pytest.fixture(scope="module")
def server(demo_data):
    with serve_shards(demo_data, StatusHandler) as srv:
        yield srv


@pytest.fixture
def http(server):
    server.cuts, server.statuses, server.requests = {}, {}, collections.defaultdict(list)
    return server


@pytest.fixture
def silent():
    """The base URL of a server that accepts connections (the kernel's backlog does) and never answers."""
    with socket.create_server(("127.0.0.1", 0), backlog=64) as sock:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def marker() -> str:
    """A `sleep` duration no other process on the machine uses: the shard commands' processes are found by
    it."""
    return str(random.randint(7_000_000, 7_999_999))


def read(demo_data: Path, urls, **kw) -> tuple[list[str], DocumentLoader]:
    """The keys of one epoch read from `urls` in this process (DocumentStream, DocumentLoader without
    workers)."""
    data = DataConfig(urls=urls, tokenizer=str(demo_data / "tokenizer"), on_error=kw.pop("on_error", "raise"))
    source = resolve_source(data)
    eos = special_ids(load_tokenizer(source.tokenizer_dir)).eos
    stream = DocumentStream(source.train_urls, source.tokenizer_dir, eos, seed=3, shuffle_buffer=16,
                            chunk_docs=16, epochs=1, on_error=data.on_error, **kw)
    loader = DocumentLoader(stream, num_workers=0)
    return [d.key for d in loader], loader


def processes_running(mark: str) -> list[psutil.Process]:
    """Live processes (zombies do not count) whose command line holds `mark`."""
    found = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and mark in " ".join(proc.info["cmdline"] or []):
            found.append(proc)
    return found


# -- a stalled source is a transient failure --------------------------------------------------------------


def test_a_stalled_pipe_command_is_retried_then_named_and_killed(demo_data):
    """A command that writes part of a shard and then nothing: after read_timeout_s without a byte the read
    fails (transiently), is retried from the shard's start, and then stops with the URL and
    "no data for 1 s"."""
    mark = marker()
    url = f"pipe:head -c 30000 {demo_data}/train-000000.tar; exec sleep {mark}"
    t0 = time.perf_counter()
    with pytest.raises(DataStreamError, match=rf"^{re.escape(url)}: cannot read shard "
                                              r"\(after sample '[^']+'; 2 attempts\): no data for 1 s"):
        read(demo_data, url, retries=1, retry_backoff_s=0.05, read_timeout_s=1)
    assert 2 <= time.perf_counter() - t0 < 10
    assert processes_running(f"sleep {mark}") == []


def test_a_server_that_never_answers_is_skipped_under_on_error_skip(demo_data, http, silent):
    keys, loader = read(demo_data, [f"{http.base}/{TRAIN}", f"{silent}/train-000009.tar"], on_error="skip",
                        retries=1, retry_backoff_s=0.05, read_timeout_s=1)
    manifest = json.loads((demo_data / "manifest.json").read_text())
    assert len(keys) == len(set(keys)) == manifest["splits"]["train"]["docs"]  # every document served arrived
    assert loader.skipped() == {"unreadable_shard": 1}
    assert processes_running(silent) == []  # no curl left waiting on it


# -- HTTP errors: data.retries is the only retry policy --------------------------------------------------


@pytest.mark.parametrize("retries", [0, 2])
def test_http_503_is_tried_exactly_retries_plus_one_times(demo_data, http, retries):
    """curl does not retry by itself: a 503 with data.retries=0 fails at once, with 2 it is tried 3 times, 1 s
    and 2 s apart (the default backoff)."""
    http.statuses["train-000001.tar"] = 503
    url = f"{http.base}/train-000001.tar"
    t0 = time.perf_counter()
    with pytest.raises(DataStreamError,
                       match=rf"^{re.escape(url)}: cannot read shard .*HTTP 503 Service Unavailable"):
        read(demo_data, url, retries=retries)
    elapsed = time.perf_counter() - t0
    assert http.curl_gets("train-000001.tar") == retries + 1
    assert elapsed < 3 if retries == 0 else 3 <= elapsed < 6  # backoff 1 s + 2 s


# -- real training runs: SIGTERM while stalled, kill -9, abandoned shards ---------------------------------


def start(run_dir: Path, demo_data: Path, *overrides: str,
          launcher: list[str] | None = None) -> subprocess.Popen:
    """`python -m trainer.train` (or `launcher` + trainer.train) in the background (its own session), output
    to files beside run_dir."""
    cmd = [*(launcher or [sys.executable, "-m"]), "trainer.train", f"data.path={demo_data}",
           f"hydra.run.dir={run_dir}", *SMALL, "train.eval_every=0", "train.checkpoint_every=0", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    out = open(run_dir.parent / f"{run_dir.name}.out", "a")  # noqa: SIM115 (closed with the process)
    err = open(run_dir.parent / f"{run_dir.name}.err", "a")  # noqa: SIM115
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)


def output(run_dir: Path) -> str:
    return ((run_dir.parent / f"{run_dir.name}.out").read_text()
            + (run_dir.parent / f"{run_dir.name}.err").read_text())


def steps_logged(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def shard_commands(proc: subprocess.Popen, run_dir: Path, *marks: str,
                   timeout: float = 90) -> list[psutil.Process]:
    """The trainer's descendants running the shard commands, once a command holding each of `marks` runs."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"trainer exited early ({proc.returncode}): {output(run_dir)[-3000:]}"
        below = psutil.Process(proc.pid).children(recursive=True)
        commands = [p for p in below if _name(p) in ("sh", "sleep", "cat", "curl", "head")]
        lines = [" ".join(_cmdline(p)) for p in commands]
        if all(any(mark in line for line in lines) for mark in marks):
            return commands
        time.sleep(0.1)
    raise AssertionError(f"no shard command holding {marks} in {timeout} s: {output(run_dir)[-3000:]}")


def _name(proc: psutil.Process) -> str:
    try:
        return proc.name()
    except psutil.Error:
        return ""


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def groups_of(commands: list[psutil.Process]) -> set[int]:
    """The process groups `commands` run in, other than this test's own."""
    groups = set()
    for p in commands:
        try:
            groups.add(os.getpgid(p.pid))
        except ProcessLookupError:
            pass
    return groups - {os.getpgid(0)}


def survivors(commands: list[psutil.Process], groups: set[int], timeout: float = 10) -> list[str]:
    """Which of `commands`, or of the processes in `groups`, are still alive (zombies are not) after at most
    `timeout` seconds."""
    deadline = time.time() + timeout
    while True:
        left = [p for p in commands if _alive(p)]
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) in groups and _alive(p) and p not in left:
                    left.append(p)
            except ProcessLookupError:
                pass
        if not left or time.time() > deadline:
            return [f"{p.pid} {' '.join(_cmdline(p))}" for p in left]
        time.sleep(0.1)


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def small_shard(tmp_path_factory) -> Path:
    """A shard of 80 short documents (~60 tokens each): a reader's first chunk (64 documents) makes ~3
    steps."""
    path = tmp_path_factory.mktemp("small") / "small-000000.tar"
    with tarfile.open(path, "w") as tar:
        for i in range(80):
            text = "".join(f"def f{i}_{j}(x):\n    return x + {j}\n" for j in range(6)).encode()
            info = tarfile.TarInfo(f"doc{i:03d}.txt")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 1])
def test_sigterm_while_a_reader_is_stalled_checkpoints_the_last_step_and_exits_zero(demo_data, small_shard,
                                                                                     tmp_path, num_workers):
    """The only shard writes its 80 documents, then nothing (and never ends): the run trains on what came,
    then blocks in the read, in the trainer itself (0 workers) or in its DataLoader worker (1). SIGTERM ends
    it within seconds: the checkpoint of the last finished step, exit 0, the command gone."""
    mark = marker()
    run_dir = tmp_path / "run"
    proc = start(run_dir, demo_data, f"data.num_workers={num_workers}", "train.max_steps=1000",
                 "data.shuffle_buffer=4", "packing.buffer_size=4", "data.read_timeout_s=600",
                 f"data.urls='pipe:cat {small_shard}; exec sleep {mark}'")
    try:
        commands = shard_commands(proc, run_dir, f"sleep {mark}")
        groups = groups_of(commands)
        deadline, logged, since = time.time() + 90, -1, time.time()
        # steps stopped: blocked
        while time.time() < deadline and not (logged > 0 and time.time() - since > 2):
            if steps_logged(run_dir) != logged:
                logged, since = steps_logged(run_dir), time.time()
            time.sleep(0.1)
        assert logged > 0, f"no step was trained: {output(run_dir)[-3000:]}"
        t0 = time.time()
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            raise AssertionError("SIGTERM did not end a run blocked on a stalled shard in 30 s") from None
        assert time.time() - t0 < 10
    finally:
        stop(proc)
    assert code == 0, output(run_dir)[-3000:]
    step = json.loads((run_dir / "summary.json").read_text())["final_step"]
    assert step == logged and json.loads((run_dir / "summary.json").read_text())["preempted"] == "SIGTERM"
    assert f"preempted (SIGTERM) after step {step}" in output(run_dir)
    assert (run_dir / "checkpoints" / f"step_{step:06d}").is_dir()
    assert survivors(commands, groups) == []


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
def test_kill_9_of_the_trainer_leaves_no_shard_command_running(demo_data, tmp_path, silent, num_workers):
    """kill -9 of the trainer while its readers wait on a pipe: command with children (`sleep | cat`) and,
    with two workers, on curl: no process of theirs, nor of their process groups, survives."""
    mark = marker()
    urls = [f"pipe:sleep {mark} | cat"] + ([f"{silent}/train-{mark}.tar"] if num_workers else [])
    run_dir = tmp_path / "run"
    proc = start(run_dir, demo_data, f"data.num_workers={num_workers}", "train.max_steps=1000",
                 "data.read_timeout_s=600", f"data.urls=[{','.join(repr(u) for u in urls)}]")
    try:
        commands = shard_commands(proc, run_dir, f"sleep {mark}",
                                  *([f"train-{mark}.tar"] if num_workers else []))
        groups = groups_of(commands)
        proc.kill()
        proc.wait()
    finally:
        stop(proc)
    assert survivors(commands, groups) == []


def test_a_shard_read_to_its_end_leaves_no_child_of_its_command(demo_data):
    """Each shard's command leaves a child running (`sleep &`, its output elsewhere) and exits: once the shard
    is read, the command's process group is killed, the child with it."""
    mark = marker()
    keys, _ = read(demo_data, [f"pipe:sleep {mark} >/dev/null 2>&1 & cat {demo_data}/train-{i:06d}.tar"
                               for i in range(2)])
    assert len(keys) == 400
    assert processes_running(f"sleep {mark}") == []


@pytest.mark.slow
def test_a_run_that_abandons_its_shards_leaves_no_process_of_their_commands(demo_data, tmp_path):
    """The same commands in a real run of 2 steps: it stops in the middle of its shard (abandons it). Once it
    exited, no child of any shard command is alive."""
    mark = marker()
    urls = [f"pipe:sleep {mark} >/dev/null 2>&1 & cat {demo_data}/train-{i:06d}.tar" for i in range(5)]
    run_dir = tmp_path / "run"
    proc = start(run_dir, demo_data, "data.num_workers=1", "train.max_steps=2",
                 f"data.urls=[{','.join(repr(u) for u in urls)}]")
    try:
        assert proc.wait(timeout=300) == 0, output(run_dir)[-3000:]
    finally:
        stop(proc)
    assert processes_running(f"sleep {mark}") == []


def _small_shards(directory: Path, count: int, docs: int) -> list[Path]:
    """`count` shards of `docs` one-line functions (~20 tokens) each."""
    paths = []
    for s in range(count):
        path = directory / f"small-{s:06d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(docs):
                text = f"def g{s}_{i}(x):\n    return x * {s}\n".encode()
                info = tarfile.TarInfo(f"doc{s}_{i:03d}.txt")
                info.size = len(text)
                tar.addfile(info, io.BytesIO(text))
        paths.append(path)
    return paths


def _rank_processes(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    """torchrun's rank processes by RANK (their environment)."""
    found = {}
    for p in psutil.Process(launcher.pid).children(recursive=True):
        try:
            rank = p.environ().get("RANK")
            if rank is not None and "trainer.train" in " ".join(p.cmdline()):
                found[int(rank)] = p
        except psutil.Error:
            pass
    return found


@pytest.mark.slow
def test_sigterm_to_the_one_rank_stalled_in_a_read_checkpoints_every_rank_and_resumes_exactly(
        demo_data, tmp_path):
    """Two ranks (torchrun, gloo). Rank 1's shard source stalls at its end while the flag file exists (the
    pipe: command sees RANK): rank 1 trains on the first 64 documents (the stream tokenizes 64 at a time),
    then blocks inside its read, rank 0 waits for it in the step's collective. SIGTERM to
    rank 1 alone: both ranks checkpoint the last finished step together and exit 0 (before, rank 1 raised and
    the job died). Resumed without the stall, the run's losses are those of a run never interrupted: rank 0's
    rows of the abandoned step were put back, none lost or doubled."""
    shards = _small_shards(tmp_path, 2, docs=80)  # ~3 steps per epoch
    flag, mark = tmp_path / "stall", marker()
    urls = [f'pipe:cat {s}; if [ -e {flag} ] && [ "$RANK" = 1 ]; then exec sleep {mark}; fi' for s in shards]
    common = ["data.num_workers=0", "train.max_steps=10", "data.shuffle_buffer=4", "packing.buffer_size=4",
              "data.read_timeout_s=600", f"data.urls=[{','.join(repr(u) for u in urls)}]"]
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                str(free_port()), "-m"]
    reference = tmp_path / "reference"
    done = start(reference, demo_data, *common, launcher=launcher)
    try:
        assert done.wait(timeout=300) == 0, output(reference)[-3000:]
    finally:
        stop(done)

    flag.touch()
    run_dir = tmp_path / "run"
    proc = start(run_dir, demo_data, *common, launcher=launcher)
    try:
        shard_commands(proc, run_dir, f"sleep {mark}", timeout=180)  # rank 1 reached the stall
        deadline, logged, since = time.time() + 90, -1, time.time()
        # steps stopped: blocked
        while time.time() < deadline and not (logged > 0 and time.time() - since > 2):
            if steps_logged(run_dir) != logged:
                logged, since = steps_logged(run_dir), time.time()
            time.sleep(0.1)
        assert 0 < logged < 10, f"the stall did not stop the run mid-way: {output(run_dir)[-3000:]}"
        _rank_processes(proc)[1].send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError("SIGTERM to the stalled rank did not end the job in 60 s") from None
    finally:
        stop(proc)
    assert code == 0, output(run_dir)[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_step"] == logged and summary["preempted"] == "a signal on another rank"
    assert f"preempted (a signal on another rank) after step {logged}" in output(run_dir)
    assert (run_dir / "checkpoints" / f"step_{logged:06d}").is_dir()

    flag.unlink()
    resumed = start(run_dir, demo_data, *common, "train.resume=true", launcher=launcher)
    try:
        assert resumed.wait(timeout=300) == 0, output(run_dir)[-3000:]
    finally:
        stop(resumed)
    losses = {m["step"]: m["loss"]
              for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    expected = {m["step"]: m["loss"]
                for m in map(json.loads, (reference / "metrics.jsonl").read_text().splitlines())}
    assert sorted(losses) == list(range(1, 11))
    assert losses == pytest.approx(expected, abs=1e-6), "the resumed run trained on other rows"
