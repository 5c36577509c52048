"""Where the shards are, resolved once at startup, and how one shard is read.

Two ways to name the data (see `DataConfig`):
    data.path=DIR            a directory written by `trainer.prepare` (manifest.json, tokenizer/, shards)
    data.urls=SHARDS         shard lists as WebDataset users write them; data.val_urls=SHARDS for eval

SHARDS is a string or a list of strings, each expanded by webdataset's own `expand_urls` (`::` joins
lists, braces expand, `$WDS_*` variables substitute), then local globs by `glob`:
    /data/c4/train-{000000..000127}.tar                 local paths (checked at startup)
    /data/c4/train-*.tar                                a local glob (sorted)
    https://host/c4/train-{000000..000127}.tar          http(s), sftp:, ftps:, scp: curl (without its own
                                                        retries)
    gs://bucket/c4/train-{000000..000127}.tar           `gsutil cat URL`
    ais://bucket/c4/train-{000000..000127}.tar          `ais get URL -`
    hf://datasets/org/c4/train-{000000..000127}.tar     curl on the Hub's resolve URL (also hf://ORG/NAME/...,
                                                        models, hf://spaces/..., and @REVISION after the name)
    htgs://bucket/c4/train-000000.tar                   curl on gs://bucket/... (as webdataset has it)
    pipe:aws s3 cp s3://bucket/train-{000000..000127}.tar -     any command writing the tar to stdout

`read_shard` opens a shard (`open_shard`: a file, or the command that webdataset's `gopen` would run for the
scheme, but each command in a process group of its own that dies with the trainer) and cuts it into samples as
webdataset's tar iterators do (trainer.data.tars: the same samples in one pass, ~10x faster); a failure comes
out as a `ShardReadError` that says whether reading again may help (`transient`), a command that sends nothing
for data.read_timeout_s seconds included. The stream (trainer.data.stream, through trainer.data.reader) owns
the retries: data.retries, 1 s, 2 s, 4 s ... apart, is the only retry policy.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import glob
import itertools
import logging
import os
import posixpath
import queue
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote, urlparse
from urllib.request import url2pathname

import webdataset as wds
from webdataset.gopen import gopen

from trainer.data.config import VAL_SPLIT
from trainer.data.shards import MANIFEST_FILE, load_manifest, shard_paths
from trainer.data.tars import tar_samples
from trainer.data.workers import INTERRUPT_CHECK_S, ReadInterrupted, check_interrupt
from trainer.errors import PR_SET_PDEATHSIG, UserError

if TYPE_CHECKING:
    from trainer.data.config import DataConfig

log = logging.getLogger(__name__)

URLS_HELP = ("brace ranges like train-{000000..000013}.tar, a glob, http(s)://, gs://, ais:// or hf:// URLs, "
             "or pipe: commands (e.g. 'pipe:aws s3 cp s3://bucket/train-000000.tar -')")


class ShardSourceError(UserError, ValueError):
    """The data config names no usable shards or tokenizer (raised at startup, before any training)."""


@dataclass(frozen=True)
class ShardSource:
    """What the run reads, resolved from `DataConfig` by `resolve_source`."""

    train_urls: list[str]
    """Training shards: absolute local paths, URLs (http(s), gs:, ais:, hf: ...) or pipe: commands."""
    val_urls: list[str]
    """Held-out shards (data.val_urls, else the manifest's val split); empty when there are none."""
    tokenizer_dir: Path
    """Directory holding tokenizer.json."""
    expected_docs: dict[str, int]
    """Documents per shard file name, from the manifest (all splits); empty without one."""
    manifest: Path | None
    """The manifest.json the counts come from, if any."""


def resolve_source(data: DataConfig) -> ShardSource:
    """Expand and check `data.path` / `data.urls` / `data.val_urls` / `data.tokenizer`.

    Example: urls='/d/train-{000000..000001}.tar', path=None, and /d holds manifest.json -> train_urls
    ['/d/train-000000.tar', '/d/train-000001.tar'], val_urls from the manifest's val split, tokenizer
    /d/tokenizer.
    """
    if data.urls is None and not data.path:
        raise ShardSourceError("no shards: set data.path=DIR (a directory written by trainer.prepare) or "
                               f"data.urls=SHARDS ({URLS_HELP})")
    train = (expand_shards(data.urls, "data.urls") if data.urls is not None
             else shard_paths(data.path, data.split))
    manifest_dir = Path(data.path) if data.path else _manifest_beside(train)
    manifest = load_manifest(manifest_dir) if manifest_dir is not None else None
    if data.val_urls is not None:
        val = expand_shards(data.val_urls, "data.val_urls")
    elif manifest is not None and manifest["splits"].get(VAL_SPLIT, {}).get("docs"):
        val = shard_paths(manifest_dir, VAL_SPLIT)
    else:
        val = []
    counts = {s["name"]: s["docs"] for split in (manifest or {}).get("splits", {}).values()
              for s in split["shards"]}
    if counts and data.urls is not None and not any(url_file_name(u) in counts for u in train):
        log.warning("none of the data.urls shard names is listed in %s: document counts are not checked",
                    manifest_dir / MANIFEST_FILE)
    if manifest is not None and data.urls is not None:
        _check_shards_of(manifest, manifest_dir, train)
    return ShardSource(
        train_urls=train,
        val_urls=val,
        tokenizer_dir=_tokenizer_dir(data.tokenizer, manifest_dir, manifest),
        expected_docs=counts,
        manifest=None if manifest_dir is None else manifest_dir / MANIFEST_FILE,
    )


def expand_shards(spec: str | list[str], key: str) -> list[str]:
    """Shard URLs from a string or list, in order; local paths made absolute and checked.

    Example: "/d/train-{000000..000002}.tar::pipe:cat /e/x.tar" -> ['/d/train-000000.tar',
    '/d/train-000001.tar', '/d/train-000002.tar', 'pipe:cat /e/x.tar'] (if the three files exist).
    """
    specs = [spec] if isinstance(spec, str) else list(spec)
    if not specs or not all(isinstance(s, str) and s.strip() for s in specs):
        raise ShardSourceError(f"{key}={spec!r}: expected a non-empty string or list of strings "
                               f"({URLS_HELP})")
    urls: list[str] = []
    for pattern in specs:
        expanded = wds.shardlists.expand_urls(pattern)
        missing = []
        for url in expanded:
            path = _local_path(url)
            if path is None:
                urls.append(url)
            elif glob.has_magic(path):
                matches = sorted(glob.glob(path))
                urls.extend(os.path.abspath(m) for m in matches)
                if not matches:
                    missing.append(url)
            elif os.path.isfile(path):
                urls.append(os.path.abspath(path))
            else:
                missing.append(url)
        if missing:
            raise ShardSourceError(_missing_message(key, pattern, expanded, missing))
    return urls


def _missing_message(key: str, pattern: str, expanded: list[str], missing: list[str]) -> str:
    if len(expanded) == 1:
        found = "matches no file" if glob.has_magic(pattern) else "does not exist"
        return f"{key}={pattern!r} {found}; check the path, or use {URLS_HELP}"
    if len(missing) == len(expanded):
        return (f"{key}={pattern!r} matches no shard: none of its {len(expanded)} paths exists (first: "
                f"{missing[0]}); check the directory and the brace range")
    return (f"{key}={pattern!r}: {len(missing)} of its {len(expanded)} shards do not exist (first: "
            f"{missing[0]}); check the brace range, the list or the directory")


def _check_shards_of(manifest: dict, manifest_dir: Path, urls: list[str]) -> None:
    """A ShardSourceError if a local data.urls shard is not the manifest's shard of its name: it lies
    elsewhere and its size differs from the one the manifest lists (data.path and data.urls name two datasets;
    each of its shards would otherwise be read through and then reported as truncated). Remote shards are
    checked as they are read."""
    sizes = {s["name"]: s.get("bytes") for split in manifest["splits"].values() for s in split["shards"]}
    home = os.path.realpath(manifest_dir)
    for url in urls:
        path = _local_path(url)
        name = url_file_name(url)
        if path is None or sizes.get(name) is None or os.path.dirname(os.path.realpath(path)) == home:
            continue
        try:
            size = os.path.getsize(path)
        except OSError:
            continue  # named when it is read
        if size != sizes[name]:
            raise ShardSourceError(
                f"{url} is not the shard {name} of {manifest_dir / MANIFEST_FILE} ({size:,} bytes; "
                f"the manifest lists {sizes[name]:,}): data.path and data.urls name different datasets; give "
                "data.path of the dataset these shards belong to, or leave data.path out")


def _local_path(url: str) -> str | None:
    """The file path of a local shard ('/d/x.tar', 'file:///d/x.tar'), None for URLs and pipe: commands."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        return url2pathname(parsed.path)
    return url if parsed.scheme == "" else None


def _manifest_beside(urls: list[str]) -> Path | None:
    """The directory of the local shards, if they all share one that holds a manifest."""
    dirs = {os.path.dirname(p) for p in map(_local_path, urls) if p is not None}
    if len(dirs) != 1 or any(_local_path(u) is None for u in urls):
        return None
    folder = Path(dirs.pop())
    return folder if (folder / MANIFEST_FILE).is_file() else None


def _tokenizer_dir(tokenizer: str | None, manifest_dir: Path | None, manifest: dict | None) -> Path:
    if tokenizer:
        path = Path(tokenizer)
    elif manifest is not None:
        path = manifest_dir / manifest["tokenizer"]["path"]
    else:
        raise ShardSourceError("data.urls without a prepared directory needs a tokenizer: set "
                               "data.tokenizer=DIR (holding tokenizer.json, e.g. the tokenizer/ that "
                               "trainer.prepare wrote) or data.path=<prepared dir>")
    if not (path / "tokenizer.json").is_file():
        raise ShardSourceError(f"{path}: no tokenizer.json there (data.tokenizer must be a tokenizer "
                               "directory as trainer.prepare writes it)")
    return path


def url_file_name(url: str) -> str:
    """The shard's file name, which keys the manifest's document counts.

    Examples: '/d/train-000003.tar', 'https://h/d/train-000003.tar?sig=x' and
    'pipe:aws s3 cp s3://b/d/train-000003.tar -' -> 'train-000003.tar'.
    """
    if url.startswith("pipe:"):
        try:
            words = shlex.split(url[5:])
        except ValueError:
            words = url[5:].split()
        tars = [w for w in words if ".tar" in w or w.endswith(".tgz")]
        return url_file_name(tars[-1]) if tars else url
    path = _local_path(url)
    return os.path.basename(path) if path is not None else posixpath.basename(urlparse(url).path)


# -- reading one shard ------------------------------------------------------------------------------


class ShardReadError(Exception):
    """A shard could not be read (the message does not name it: the stream adds the URL and where)."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient
        """Whether reading again may help (a network or command failure, not bad bytes or a 404)."""


# Exit statuses of a pipe: command or curl that mean "we stopped reading", not "the command failed".
STOPPED_BY_READER = (0, 23, 141, -signal.SIGPIPE)  # curl's 23 is its write error, 141 / -13 SIGPIPE
TRANSIENT_HTTP = (408, 425, 429)  # and every 5xx
CURL_EXITS = {
    1: "unsupported protocol",
    6: "could not resolve the host",
    7: "could not connect (connection refused?)",
    18: "the transfer was cut short (fewer bytes than the server announced)",
    22: "the server answered with an HTTP error",
    28: "timed out",
    35: "TLS handshake failed",
    52: "the server replied nothing",
    55: "failed sending",
    56: "the connection broke while receiving",
}
CLOSE_TIMEOUT_S = 30.0
READ_TIMEOUT_S = 60.0
"""Default of data.read_timeout_s: a shard command that sends no byte for this long has failed
(transiently)."""


@dataclass
class ReadCounter:
    """What `read_shard` read, added up over the shards it was given to."""

    samples: int = 0
    bytes: int = 0
    """Bytes of the tar streams (what came from the disk, curl or the command)."""


class _CountedStream:
    """A shard's byte stream that adds what is read from it to a ReadCounter, and gives way to a preemption
    signal: each read first checks for one (trainer.data.workers.check_interrupt), so a local file, which
    never blocks, is left within one read too (a CommandStream also checks while it waits)."""

    def __init__(self, stream, counter: ReadCounter) -> None:
        self.stream = stream
        self.counter = counter

    def read(self, size: int = -1) -> bytes:
        check_interrupt()
        data = self.stream.read(size)
        self.counter.bytes += len(data)
        return data

    def read1(self, size: int = -1) -> bytes:
        """Up to `size` bytes, what one read of the underlying stream gives (b"" only at its end)."""
        check_interrupt()
        data = self.stream.read1(size) if hasattr(self.stream, "read1") else self.stream.read(size)
        self.counter.bytes += len(data)
        return data

    def fileno(self) -> int:
        """The file's descriptor (a local file: the tar reader checks each member's size against the
        file's)."""
        return self.stream.fileno()

    def tell(self) -> int:
        return self.stream.tell()


def read_shard(url: str, counter: ReadCounter | None = None, timeout_s: float = READ_TIMEOUT_S,
               max_member_bytes: int | None = None) -> Iterator[dict]:
    """The samples of one shard ({"__key__": ..., "txt": bytes, ...}) in file order, cut as webdataset's tar
    iterators cut them (trainer.data.tars, in one pass). `max_member_bytes`: a member larger is not read; its
    field holds a trainer.data.tars.TooLargeMember instead of bytes (`tar_samples`).

    `open_shard` opens the URL (a local file, else its scheme's command: curl, gsutil, ais, a shell for
    pipe:). At the end the stream is read to EOF and the command's exit status checked, so a failed transfer
    is never mistaken for a short shard. A command that sends nothing for `timeout_s` seconds is a transient
    failure ("no data for N s"). Raises ShardReadError, or ReadInterrupted after a preemption signal
    (trainer.data.workers). `counter`, if given, counts the samples and bytes read. However the read ends, no
    process of the shard's command is left.
    """
    try:
        stream = open_shard(url, timeout_s)  # a scheme nobody reads, a program not installed: ShardReadError
    except (OSError, ValueError) as exn:  # a local file that is not there or not readable
        raise ShardReadError(_describe(exn), transient=False) from exn
    counter = counter if counter is not None else ReadCounter()
    counted = _CountedStream(stream, counter)
    error: Exception | None = None
    finished = False
    try:
        for sample in tar_samples(counted, url, max_member_bytes):
            counter.samples += 1
            yield sample
        while counted.read(1 << 16):  # the tar's end padding: let the command finish writing
            pass
        finished = True
    except Exception as exn:  # tarfile, webdataset, the stream (no data in time, a signal)
        error = exn
    finally:
        # abandoned: the reader stopped early
        status = _close(stream, abandoned=not finished and error is None)
    failure = getattr(stream, "failure", None)
    if failure is not None:  # a preemption signal, or no data in time: the command was killed
        raise failure from None
    if isinstance(error, ReadInterrupted):  # a preemption signal between two reads (_CountedStream)
        raise error
    if status is None or status in STOPPED_BY_READER:
        if error is None:
            return
        # The bytes arrived as they are (a local file, or a command that did not fail): reading again won't
        # help.
        raise ShardReadError(_describe(error), transient=False) from error
    raise _command_failure(stream.command, status) from error


CURL_SCHEMES = ("http", "https", "sftp", "ftps", "scp")
SCHEMES_HELP = ("local paths, file:, http(s): (and sftp:, ftps:, scp:), gs: (gsutil), ais: (ais), htgs:, "
                "hf: (the Hugging Face Hub) and pipe:COMMAND")
CURL = ("curl", "--fail", "--silent", "--location")
"""curl as shards are fetched: without its own retries (`--retry`), data.retries is the only retry policy."""
COMMAND_WRAPPER = 'trap "kill -KILL 0" TERM HUP; "$@" & wait $!'
"""The shell that runs a shard's command ("$@": gsutil, ais, or `/bin/sh -c` for pipe:) in the command's own
process group. The kernel sends it SIGTERM when the trainer (or the DataLoader worker) that started it dies
(PR_SET_PDEATHSIG); it then kills the whole group, the command's children included. `wait $!` is its exit
status: the command's (128 + N if a signal N ended it)."""


@dataclass(frozen=True)
class ShardCommand:
    """The command that writes a (non-local) shard to its stdout, as `shard_command` makes it."""

    command: tuple[str, ...]
    """The program and its arguments, e.g. ('gsutil', 'cat', 'gs://b/train-000000.tar')."""
    wrapped: bool
    """Run under COMMAND_WRAPPER (it may start children); else directly (curl: one process, killed with
    SIGKILL if the trainer dies)."""
    curl_url: str | None = None
    """The URL curl fetches, if it is curl: its exit statuses are curl's, and an HTTP error is asked its
    status."""
    headers: tuple[tuple[str, str], ...] = ()
    """Request headers for curl, handed to it on its stdin (`--config -`), so that no token shows in `ps`."""

    @property
    def args(self) -> list[str]:
        return (["/bin/sh", "-c", COMMAND_WRAPPER, "packtrain-shard", *self.command] if self.wrapped
                else [*self.command])


def open_shard(url: str, timeout_s: float = READ_TIMEOUT_S):
    """A readable binary stream of the shard: a file for a local path (webdataset's `gopen`), else a
    `CommandStream` over the command `shard_command` names for it (each in a process group of its own, dying
    with the trainer, with the read timeout). Raises ShardReadError for a scheme nobody reads or a program
    that is not installed.
    """
    if _local_path(url) is not None:
        return gopen(url)
    command = shard_command(url)
    if shutil.which(command.command[0]) is None:
        raise ShardReadError(f"{command.command[0]!r} is not installed (not found on PATH); "
                             f"{urlparse(url).scheme}: shards are read with `{shlex.join(command.command)}`",
                             transient=False)
    return CommandStream(command, timeout_s)


def shard_command(url: str) -> ShardCommand:
    """The command webdataset's `gopen` runs for the URL's scheme, under the trainer's rules: curl with
    `CURL`, gs: `gsutil cat URL`, ais: `ais get URL -`, htgs: curl on the gs:// URL, hf: curl on the Hub's
    resolve URL (`hf_resolve_url`; with the token, `hf_token`, if there is one), pipe: the command under
    `/bin/sh -c`.

    Example: 'gs://b/train-000000.tar' ->
    ShardCommand(('gsutil', 'cat', 'gs://b/train-000000.tar'), wrapped=True).
    """
    scheme = urlparse(url).scheme
    if url.startswith("pipe:"):
        return ShardCommand(("/bin/sh", "-c", url[5:]), wrapped=True)
    if scheme == "gs":
        return ShardCommand(("gsutil", "cat", url), wrapped=True)
    if scheme == "ais":
        return ShardCommand(("ais", "get", url, "-"), wrapped=True)
    if scheme in CURL_SCHEMES or scheme == "htgs":
        fetched = re.sub(r"(?i)^htgs://", "gs://", url)  # webdataset's gopen_htgs
        return ShardCommand((*CURL, fetched), wrapped=False, curl_url=fetched)
    if scheme == "hf":
        resolved, token = hf_resolve_url(url), hf_token()
        headers = (("Authorization", f"Bearer {token}"),) if token else ()
        return ShardCommand((*CURL, *(("--config", "-") if headers else ()), resolved), wrapped=False,
                            curl_url=resolved, headers=headers)
    raise ShardReadError(f"no reader for {scheme}: URLs (accepted: {SCHEMES_HELP})", transient=False)


HF_ENDPOINT = "https://huggingface.co"
"""The Hub's address when the HF_ENDPOINT environment variable does not name another (as huggingface_hub has
it)."""
HF_REPO_PREFIXES = {"datasets": "datasets/", "spaces": "spaces/", "models": ""}
HF_FILE = re.compile(r"(?P<repo>[^/@]+/[^/@]+)(?:@(?P<revision>refs/(?:convert/[\w.-]+|pr/\d+)|[^/]+))?"
                     r"/(?P<path>.+)")
"""ORG/NAME[@REVISION]/PATH, the part of an hf:// URL after its repository type (huggingface_hub's
grammar)."""


def hf_resolve_url(url: str) -> str:
    """The https URL of an hf:// file at the Hub's resolve endpoint, as huggingface_hub's `hf_hub_url` builds
    it, without a network call: hf://[datasets/|spaces/|models/]ORG/NAME[@REVISION]/PATH, REVISION main by
    default, the Hub at HF_ENDPOINT.

    Examples: 'hf://datasets/org/c4@v1/en/train-000000.tar' -> 'https://huggingface.co/datasets/org/c4/resolve/v1/
    en/train-000000.tar'; 'hf://org/model/x.tar' (a model) ->
    'https://huggingface.co/org/model/resolve/main/x.tar'.
    """
    body = url.split("://", 1)[1]
    kind, _, rest = body.partition("/")
    if kind not in HF_REPO_PREFIXES:
        kind, rest = "models", body
    match = HF_FILE.fullmatch(rest)
    if match is None:
        raise ShardReadError("not an hf:// file: expected hf://[datasets/|spaces/]ORG/NAME[@REVISION]/PATH",
                             transient=False)
    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or HF_ENDPOINT
    revision = quote(unquote(match["revision"] or "main"), safe="")
    return f"{endpoint}/{HF_REPO_PREFIXES[kind]}{match['repo']}/resolve/{revision}/{quote(match['path'])}"


def hf_token() -> str | None:
    """The Hugging Face token: HF_TOKEN, else huggingface_hub's `get_token()` (a login's) when it is
    installed."""
    token = os.environ.get("HF_TOKEN", "").strip()
    if token:
        return token
    try:
        from huggingface_hub import get_token
    except ImportError:
        return None
    try:
        return get_token()
    except Exception as exn:  # e.g. a failed OIDC token exchange (HF_OIDC_RESOURCE)
        raise ShardReadError(f"cannot get the Hugging Face token: {_describe(exn)}", transient=True) from exn


class CommandStream:
    """The stdout of a shard's command (`ShardCommand`: curl, or gsutil, ais, a pipe: command under
    COMMAND_WRAPPER), read with a deadline.

    The command runs in a process group (and session) of its own, started from a thread that lives as long as
    this process (`_spawn`), with a parent-death signal: it never outlives the process that reads it, even
    after a kill -9. `close` kills the whole group: at once when the read stopped early, else once the command
    exited (its children with it). A read that gets no byte for `timeout_s` seconds, or a preemption signal
    (trainer.data.workers.interrupt_reads), ends the read: `failure` says which.
    """

    def __init__(self, command: ShardCommand, timeout_s: float) -> None:
        self.command = command
        self.timeout_s = timeout_s
        config = "".join(f'header = "{_curl_quoted(f"{name}: {value}")}"\n'
                         for name, value in command.headers)
        self.proc = _spawn(command.args, signal.SIGTERM if command.wrapped else signal.SIGKILL,
                           config.encode() if config else None)
        self.fd = self.proc.stdout.fileno()
        self._poll = select.poll()
        self._poll.register(self.fd, select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR)
        self._buffer = b""
        self._eof = False
        self.failure: ShardReadError | ReadInterrupted | None = None
        """Why reading stopped, if the stream stopped it: no data for timeout_s, or a preemption signal."""

    def read(self, size: int = -1) -> bytes:
        """Up to `size` bytes (fewer only at EOF; all that is left for size < 0)."""
        if size is None or size < 0:
            while not self._eof:
                self._fill(1 << 20)
            data, self._buffer = self._buffer, b""
            return data
        while len(self._buffer) < size and not self._eof:
            self._fill(size - len(self._buffer))
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def read1(self, size: int = -1) -> bytes:
        """Up to `size` bytes of what has arrived, waiting only when nothing has (b"" at EOF): a reader
        parsing as the bytes come gets every whole sample before a stall, not only once its chunk is full."""
        if not self._buffer and not self._eof:
            self._fill(1 << 16)
        size = len(self._buffer) if size is None or size < 0 else size
        data, self._buffer = self._buffer[:size], self._buffer[size:]
        return data

    def _fill(self, wanted: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            # What is raised passes webdataset's tar iterators, which append to its message: `failure` keeps a
            # clean copy for read_shard to raise.
            try:
                check_interrupt()
            except ReadInterrupted as exn:
                self.failure = ReadInterrupted(str(exn))
                raise
            left = deadline - time.monotonic()
            if left <= 0:
                message = f"no data for {self.timeout_s:g} s (data.read_timeout_s)"
                self.failure = ShardReadError(message, transient=True)
                raise ShardReadError(message, transient=True)
            if self._poll.poll(min(left, INTERRUPT_CHECK_S) * 1000):
                break
        chunk = os.read(self.fd, max(wanted, 1 << 16))
        self._eof = not chunk
        self._buffer += chunk

    def close(self, kill: bool) -> int | None:
        """Close the pipe and end the command's process group; the command's exit status, or None if it had to
        be killed (`kill`: at once; else after timeout_s for it to exit)."""
        proc = self.proc
        with contextlib.suppress(OSError):
            proc.stdout.close()
        exited = not kill and self.failure is None and _exited_within(proc.pid, self.timeout_s)
        # The leader is not reaped yet (a zombie at most), so its pid, the group's id, cannot have been
        # reused.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # the command's children too (a backgrounded one, a pipeline)
        kill_marked(getattr(proc, "packtrain_mark", None))  # and any that left the group (setsid)
        try:
            status = proc.wait(timeout=CLOSE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("shard command %s did not end after SIGKILL", proc.args)
            return None
        return status if exited else None


def _exited_within(pid: int, seconds: float) -> bool:
    """Whether child `pid` exits within `seconds`, without reaping it (waitid with WNOWAIT)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                return True
        except ChildProcessError:
            return True
        if time.monotonic() > deadline or _interrupted():
            return False
        time.sleep(0.005)


def _interrupted() -> bool:
    try:
        check_interrupt()
    except ReadInterrupted:
        return True
    return False


def _close(stream, abandoned: bool) -> int | None:
    """Close a shard's stream; for a command, return its exit status (None: a file, or a command we
    killed)."""
    if isinstance(stream, CommandStream):
        return stream.close(kill=abandoned)
    stream.close()
    return None


def _curl_quoted(text: str) -> str:
    """`text` inside double quotes of a curl config file (backslash and quote escaped)."""
    return text.replace("\\", "\\\\").replace('"', '\\"')


# -- starting shard commands --------------------------------------------------------------------------
#
# PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process. Shard commands are
# read from the main thread, the row-prefetch thread or a DataLoader worker; so that none is killed because
# the thread that happened to open its shard ended, every command is forked by one daemon thread per process,
# which lives until the process ends.

_spawners: dict[int, tuple[threading.Thread, queue.SimpleQueue]] = {}
_spawners_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _spawners_lock
    _spawners_lock = threading.Lock()  # the parent's could have been held by another thread at the fork
    _spawners.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def _spawn(args: list[str], parent_death_signal: int, stdin: bytes | None = None) -> subprocess.Popen:
    """Popen(args) with stdout piped, in a new session (its own process group), with a parent-death signal,
    forked by this process's spawner thread; `stdin`, if given, is its whole stdin (else /dev/null)."""
    pid = os.getpid()
    with _spawners_lock:
        if pid not in _spawners:  # the first command of this process (a fork child starts its own thread)
            requests: queue.SimpleQueue = queue.SimpleQueue()
            thread = threading.Thread(target=_spawner, args=(requests,), name="shard-command-spawner",
                                      daemon=True)
            thread.start()
            _spawners[pid] = (thread, requests)
        _, requests = _spawners[pid]
    done = threading.Event()
    box: list = []
    requests.put((args, parent_death_signal, stdin, box, done))
    done.wait()
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


MARK_VAR = "PACKTRAIN_SHARD_COMMAND"
"""Set in each shard command's environment to a token of its own, which its descendants inherit: a process
that left the command's group (`setsid`, a daemon) is still found, and killed, when the shard is closed."""
_marks = itertools.count()


def kill_marked(mark: str | None) -> int:
    """SIGKILL every process of this user whose environment holds MARK_VAR=`mark`; how many there were. One
    pass over /proc (~1 ms per hundred processes), once per shard command."""
    if not mark or not os.path.isdir("/proc"):
        return 0
    needle, killed = f"\0{MARK_VAR}={mark}\0".encode(), 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as f:
                environ = b"\0" + f.read() + b"\0"
        except OSError:  # another user's, or gone
            continue
        if needle in environ:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
    return killed


def _spawner(requests: queue.SimpleQueue) -> None:
    while True:
        args, parent_death_signal, stdin, box, done = requests.get()
        try:
            mark = f"{os.getpid()}-{next(_marks)}-{time.monotonic_ns()}"
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL if stdin is None else subprocess.PIPE,
                                    stdout=subprocess.PIPE, bufsize=0, start_new_session=True,
                                    env={**os.environ, MARK_VAR: mark},
                                    preexec_fn=functools.partial(_in_child, os.getpid(), parent_death_signal))
            proc.packtrain_mark = mark
            if stdin is not None:
                with contextlib.suppress(OSError):  # a few bytes: the pipe takes them before the child reads
                    proc.stdin.write(stdin)
                proc.stdin.close()
            box.append(proc)
        except BaseException as exn:  # handed to the caller
            box.append(exn)
        done.set()


def _in_child(parent_pid: int, parent_death_signal: int) -> None:
    """Between fork and exec: default signal actions, the parent-death signal, and exit if the parent died
    before it was set. (A DataLoader worker ignores SIGTERM, and an ignored signal stays ignored across exec:
    the pipe: shell could not trap it.)"""
    if _libc is not None:
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGUSR1):
            _libc.signal(sig, 0)  # SIG_DFL
        _libc.prctl(PR_SET_PDEATHSIG, parent_death_signal, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _command_failure(command: ShardCommand, status: int) -> ShardReadError:
    """Name what failed; a client error (HTTP 4xx but 408/425/429) is not transient, anything else is."""
    if command.curl_url is None:
        return ShardReadError(f"the command exited with status {status} (its stderr is above)",
                              transient=True)
    if status == 22 and urlparse(command.curl_url).scheme in ("http", "https"):
        # curl -f says "HTTP error" without the status: ask once, with a 1-byte ranged GET
        code = _http_status(command.curl_url, dict(command.headers))
        if code is not None and code >= 400:
            transient = code in TRANSIENT_HTTP or code >= 500
            hint = "" if transient else " (a client error: not retried; check the URL)"
            return ShardReadError(f"HTTP {code} {_phrase(code)}{hint}", transient=transient)
    return ShardReadError(f"curl exit {status}: {CURL_EXITS.get(status, 'failed')}", transient=True)


def _http_status(url: str, headers: dict[str, str]) -> int | None:
    """The status the server answers for `url` (with `headers`) now, or None if it cannot be reached."""
    request = urllib.request.Request(url, headers={**headers, "Range": "bytes=0-0"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as exn:
        return exn.code
    except Exception:
        return None


def _phrase(code: int) -> str:
    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return ""


def _describe(exn: BaseException | None) -> str:
    """A one-line message without the stream objects webdataset appends to exception args."""
    if exn is None:
        return "unknown error"
    # "FileNotFoundError: No such file or directory: '/d/x.tar'"
    if isinstance(exn, OSError) and exn.strerror:
        return f"{type(exn).__name__}: {exn.strerror}" + (f": {exn.filename!r}" if exn.filename else "")
    first = str(exn.args[0]).split(" @ <")[0] if exn.args else ""
    return f"{type(exn).__name__}: {first}" if first else type(exn).__name__
