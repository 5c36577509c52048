"""gs:, ais: and hf: shards are read by the trainer's own commands, under the same rules as http(s) and pipe:.

Real processes only: stand-in `gsutil` and `ais` executables (shell scripts in a tmp dir at the front of PATH
that log their arguments and write a shard of the demo data set, stall, or leave a child behind), the repo's
local HTTP shard server as the Hub (HF_ENDPOINT), and a Python process reading a shard that is killed with
SIGKILL. The commands' processes are found with psutil by a unique `sleep <marker>`.
"""

from __future__ import annotations

import collections
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import ROOT, ShardHandler, serve_shards
from trainer.data.loader import DocumentLoader
from trainer.data.reader import DataStreamError
from trainer.data.sources import read_shard
from trainer.data.stream import DocumentStream
from trainer.data.tokenizer import load_tokenizer, special_ids

SHARD = "train-000000.tar"  # one of the demo_data fixture's train shards (200 documents)
GS_URL = f"gs://bucket/c4/{SHARD}"
AIS_URL = f"ais://bucket/c4/{SHARD}"
HF_URL = f"hf://datasets/org/name/{SHARD}"
STANDIN_ARGS = {  # the stand-in checks it is called as webdataset's gopen calls the real program
    "gsutil": '[ "$#" = 2 ] && [ "$1" = cat ]',
    "ais": '[ "$#" = 3 ] && [ "$1" = get ] && [ "$3" = - ]',
}


class Hung(BaseException):
    """Not an Exception: the reader's own error handling does not take it for a failed read and retry."""


@pytest.fixture(autouse=True)
def deadline():
    """A read that hangs (a command without a timeout) fails the test after 30 s instead of blocking the
    suite."""

    def expired(signum, frame):
        raise Hung("the test ran for 30 s: a shard read hangs")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def bin_dir(tmp_path, monkeypatch) -> Path:
    """An empty directory at the front of PATH, for the stand-in programs."""
    path = tmp_path / "bin"
    path.mkdir()
    monkeypatch.setenv("PATH", f"{path}{os.pathsep}{os.environ['PATH']}")
    return path


def standin(bin_dir: Path, demo_data: Path, program: str, then: str = 'cat "$f"') -> Path:
    """Install `program` (gsutil or ais): it appends its arguments to the returned log (and its process group
    to log.pgid), checks them, and runs `then` with $f the demo shard named by the URL's last part."""
    log = bin_dir / f"{program}.log"
    script = bin_dir / program
    script.write_text(f'#!/bin/sh\necho "$*" >> {log}\ncut -d" " -f5 /proc/$$/stat >> {log}.pgid\n'
                      f'{STANDIN_ARGS[program]} || '
                      f'{{ echo "{program}: unexpected arguments: $*" >&2; exit 2; }}\n'
                      f'f={demo_data}/"${{2##*/}}"\n{then}\n')
    script.chmod(0o755)
    return log


def calls(log: Path) -> list[str]:
    return log.read_text().splitlines() if log.exists() else []


def read(demo_data: Path, url: str, **kw) -> tuple[list[str], DocumentLoader]:
    """The keys of one epoch of the shard `url`, read in this process by the stream (data.retries,
    data.read_timeout_s ... in `kw`) and a DocumentLoader without workers."""
    tokenizer = demo_data / "tokenizer"
    stream = DocumentStream([url], tokenizer, special_ids(load_tokenizer(tokenizer)).eos, shuffle_buffer=1,
                            epochs=1, **{"retry_backoff_s": 0.05, **kw})
    loader = DocumentLoader(stream, num_workers=0)
    return [d.key for d in loader], loader


def marker() -> str:
    """A `sleep` duration no other process on the machine uses: the commands' processes are found by it."""
    return str(random.randint(8_000_000, 8_999_999))


def processes_running(mark: str) -> list[str]:
    """The command lines of the live processes (zombies do not count) that hold `mark`."""
    procs = psutil.process_iter(["cmdline", "status"])
    lines = [" ".join(p.info["cmdline"] or []) for p in procs if p.info["status"] != psutil.STATUS_ZOMBIE]
    return [line for line in lines if mark in line]


@pytest.fixture(scope="module")
def local_keys(demo_data) -> list[str]:
    keys, _ = read(demo_data, str(demo_data / SHARD))
    assert len(keys) == 200
    return keys


# -- gs: and ais: --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("url", "program", "command"), [(GS_URL, "gsutil", f"cat {GS_URL}"),
                                                         (AIS_URL, "ais", f"get {AIS_URL} -")])
def test_gs_and_ais_shards_give_the_documents_of_the_local_shard(demo_data, bin_dir, local_keys, url, program,
                                                                 command):
    """`gsutil cat URL` and `ais get URL -`, as webdataset runs them, in a process group of their own; the tar
    they write, as read from disk."""
    log = standin(bin_dir, demo_data, program)
    keys, _ = read(demo_data, url)
    assert keys == local_keys
    assert calls(log) == [command]
    assert int(Path(f"{log}.pgid").read_text()) != os.getpgid(0)


def test_a_stalled_gs_command_hits_read_timeout_s_and_is_retried_then_named(demo_data, bin_dir):
    """gsutil writes part of the shard and then nothing: data.read_timeout_s ends each attempt, data.retries
    retries it, then the error names the URL; the stalled command is gone."""
    mark = marker()
    log = standin(bin_dir, demo_data, "gsutil", f'head -c 30000 "$f"; exec sleep {mark}')
    t0 = time.perf_counter()
    with pytest.raises(DataStreamError, match=rf"^{re.escape(GS_URL)}: cannot read shard "
                                              r"\(after sample '[^']+'; 2 attempts\): no data for 1 s "
                                              r"\(data.read_timeout_s\)"):
        read(demo_data, GS_URL, retries=1, read_timeout_s=1)
    assert 2 <= time.perf_counter() - t0 < 10
    assert calls(log) == [f"cat {GS_URL}"] * 2
    assert processes_running(f"sleep {mark}") == []


@pytest.mark.parametrize("detach", ["", "setsid "])
@pytest.mark.parametrize("how", ["read to its end", "abandoned"])
def test_no_process_of_the_command_group_outlives_the_read(demo_data, bin_dir, how, detach):
    """ais leaves a child running (`sleep &`, its output elsewhere) and writes the shard: once the shard is
    read, or left after its first sample, the command's process group is killed, the child with it; a child
    detached into a session of its own (`setsid sleep &`, out of the group's reach) too."""
    mark = marker()
    standin(bin_dir, demo_data, "ais", f'{detach}sleep {mark} >/dev/null 2>&1 & cat "$f"')
    samples = read_shard(AIS_URL)
    if how == "abandoned":
        assert next(samples)["__key__"]
        samples.close()
    else:
        assert len(list(samples)) == 200
    assert processes_running(f"sleep {mark}") == []


READER = """
import sys
from trainer.data.sources import read_shard
samples = read_shard(sys.argv[1])
next(samples)
print("reading", flush=True)
sys.stdin.read()
"""


def test_kill_9_of_the_reader_leaves_no_process_of_the_gs_command(demo_data, bin_dir):
    """A process that reads a gs: shard whose command stalls (and left a child) is killed with SIGKILL: the
    parent-death signal ends the command's whole group."""
    mark = marker()
    standin(bin_dir, demo_data, "gsutil",
            f'sleep {mark} >/dev/null 2>&1 & head -c 30000 "$f"; exec sleep {mark}')
    proc = subprocess.Popen([sys.executable, "-c", READER, GS_URL], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        assert proc.stdout.readline() == b"reading\n"
        # the reader has its first sample once `head` wrote it, which may be before the shell's child and the
        # shell itself have exec'd their `sleep`: wait (bounded) for both to show
        deadline = time.monotonic() + 5
        while len(processes_running(f"sleep {mark}")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(processes_running(f"sleep {mark}")) == 2
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while processes_running(f"sleep {mark}") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_running(f"sleep {mark}") == []


# -- hf: -----------------------------------------------------------------------------------------------------


class HubHandler(ShardHandler):
    """The Hub's resolve endpoint over the demo data: /datasets/org/name/resolve/main/NAME serves NAME (or
    answers `server.statuses[NAME]`, e.g. 503), and records each request's Authorization header and the
    command lines of the processes that show it."""

    PREFIX = "/datasets/org/name/resolve/main/"

    def do_GET(self) -> None:
        if not self.path.startswith(self.PREFIX):
            return self.send_error(404)
        name = self.path[len(self.PREFIX):]
        self.path = f"/{name}"
        auth = self.headers.get("Authorization")
        self.server.auth.append(auth)
        self.server.exposed += processes_running(auth.split()[-1]) if auth else []
        status = self.server.statuses.get(name)
        if status is None:
            return super().do_GET()
        self.server.requests[name].append(self.headers.get("User-Agent", ""))
        self.send_error(status)


@pytest.fixture
def hub(demo_data, monkeypatch, tmp_path):
    """The Hub (a HubHandler server) at HF_ENDPOINT, and no token anywhere (HF_TOKEN unset, no token file)."""
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(name, raising=False)
    try:
        from huggingface_hub import constants
    except ImportError:
        pass
    else:
        monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    with serve_shards(demo_data, HubHandler) as srv:
        srv.cuts, srv.statuses, srv.auth, srv.exposed, srv.requests = ({}, {}, [], [],
                                                                       collections.defaultdict(list))
        monkeypatch.setenv("HF_ENDPOINT", srv.base)
        yield srv


@pytest.mark.parametrize("token", [None, "hf_test_token_1234"])
def test_an_hf_dataset_shard_is_read_from_the_resolve_url_of_hf_endpoint(demo_data, hub, local_keys,
                                                                         monkeypatch, token):
    """hf://datasets/org/name/FILE is curl on HF_ENDPOINT/datasets/org/name/resolve/main/FILE: the documents
    of the local shard; `Authorization: Bearer TOKEN` only with HF_TOKEN set, and never on a command line."""
    if token:
        monkeypatch.setenv("HF_TOKEN", token)
    keys, _ = read(demo_data, HF_URL)
    assert keys == local_keys
    assert hub.curl_gets(SHARD) == 1
    assert hub.auth == [f"Bearer {token}" if token else None]
    assert hub.exposed == []


@pytest.mark.parametrize("retries", [0, 2])
def test_an_hf_503_is_requested_exactly_retries_plus_one_times(demo_data, hub, retries):
    """curl runs without --retry: data.retries is the only retry policy; the error says what the Hub
    answered."""
    hub.statuses[SHARD] = 503
    with pytest.raises(DataStreamError, match=rf"^{re.escape(HF_URL)}: cannot read shard .*HTTP 503 Service "
                                              "Unavailable"):
        read(demo_data, HF_URL, retries=retries)
    assert hub.curl_gets(SHARD) == retries + 1


# -- one clear error -----------------------------------------------------------------------------------------


def test_a_missing_program_is_one_clear_error_naming_the_url_and_the_program(demo_data, tmp_path,
                                                                             monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))  # no gsutil (the machine may have a real one)
    with pytest.raises(DataStreamError) as caught:
        read(demo_data, GS_URL, retries=2)
    message = str(caught.value)
    assert message.startswith(f"{GS_URL}: cannot read shard (before its first sample): ")
    assert "'gsutil' is not installed" in message and "attempts" not in message and "\n" not in message


def test_an_unknown_scheme_is_one_clear_error_naming_the_url_and_the_schemes_accepted(demo_data):
    url = f"s3://bucket/c4/{SHARD}"
    with pytest.raises(DataStreamError) as caught:
        read(demo_data, url, retries=2)
    message = str(caught.value)
    assert message.startswith(f"{url}: cannot read shard (before its first sample): no reader for s3: URLs")
    for scheme in ("http(s):", "gs:", "ais:", "htgs:", "hf:", "pipe:"):
        assert scheme in message
    assert "attempts" not in message and "\n" not in message
