"""Where the shards are, resolved once at startup, and how one shard is read.

Two ways to name the data (see `DataConfig`):
    data.path=DIR            a directory written by `trainer.prepare` (manifest.json, tokenizer/, shards)
    data.urls=SHARDS         shard lists as WebDataset users write them; data.val_urls=SHARDS for eval

SHARDS is a string or a list of strings, each expanded by webdataset's own `expand_urls` (`::` joins
lists, braces expand, `$WDS_*` variables substitute), then local globs by `glob`:
    /data/c4/train-{000000..000127}.tar                 local paths (checked at startup)
    /data/c4/train-*.tar                                a local glob (sorted)
    https://host/c4/train-{000000..000127}.tar          http(s): webdataset's curl handler
    pipe:aws s3 cp s3://bucket/train-{000000..000127}.tar -     any command writing the tar to stdout

`read_shard` opens a shard with webdataset's `gopen` and cuts it into samples with its tar iterators;
a failure comes out as a `ShardReadError` that says whether reading again may help (`transient`).
The stream (trainer.data.stream) owns the retries.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import posixpath
import shlex
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse
from urllib.request import url2pathname

import webdataset as wds
from webdataset import tariterators
from webdataset.gopen import gopen

from trainer.data.config import VAL_SPLIT
from trainer.data.shards import MANIFEST_FILE, load_manifest, shard_paths
from trainer.errors import UserError

if TYPE_CHECKING:
    from trainer.data.config import DataConfig

log = logging.getLogger(__name__)

URLS_HELP = ("brace ranges like train-{000000..000013}.tar, a glob, http(s):// URLs or pipe: commands "
             "(e.g. 'pipe:aws s3 cp s3://bucket/train-000000.tar -')")


class ShardSourceError(UserError, ValueError):
    """The data config names no usable shards or tokenizer (raised at startup, before any training)."""


@dataclass(frozen=True)
class ShardSource:
    """What the run reads, resolved from `DataConfig` by `resolve_source`."""

    train_urls: list[str]
    """Training shards: absolute local paths, http(s) URLs or pipe: commands."""
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
    ['/d/train-000000.tar', '/d/train-000001.tar'], val_urls from the manifest's val split, tokenizer /d/tokenizer.
    """
    if data.urls is None and not data.path:
        raise ShardSourceError("no shards: set data.path=DIR (a directory written by trainer.prepare) or "
                               f"data.urls=SHARDS ({URLS_HELP})")
    train = expand_shards(data.urls, "data.urls") if data.urls is not None else shard_paths(data.path, data.split)
    manifest_dir = Path(data.path) if data.path else _manifest_beside(train)
    manifest = load_manifest(manifest_dir) if manifest_dir is not None else None
    if data.val_urls is not None:
        val = expand_shards(data.val_urls, "data.val_urls")
    elif manifest is not None and manifest["splits"].get(VAL_SPLIT, {}).get("docs"):
        val = shard_paths(manifest_dir, VAL_SPLIT)
    else:
        val = []
    counts = {s["name"]: s["docs"] for split in (manifest or {}).get("splits", {}).values() for s in split["shards"]}
    if counts and data.urls is not None and not any(url_file_name(u) in counts for u in train):
        log.warning("none of the data.urls shard names is listed in %s: document counts are not checked",
                    manifest_dir / MANIFEST_FILE)
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
        raise ShardSourceError(f"{key}={spec!r}: expected a non-empty string or list of strings ({URLS_HELP})")
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
    return (f"{key}={pattern!r}: {len(missing)} of its {len(expanded)} shards do not exist (first: {missing[0]}); "
            "check the brace range, the list or the directory")


def _local_path(url: str) -> str | None:
    """The file path of a local shard ('/d/x.tar', 'file:///d/x.tar'), None for http(s), pipe: and others."""
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
        raise ShardSourceError("data.urls without a prepared directory needs a tokenizer: set data.tokenizer=DIR "
                               "(holding tokenizer.json, e.g. the tokenizer/ that trainer.prepare wrote) or "
                               "data.path=<prepared dir>")
    if not (path / "tokenizer.json").is_file():
        raise ShardSourceError(f"{path}: no tokenizer.json there (data.tokenizer must be a tokenizer directory "
                               f"as trainer.prepare writes it)")
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


@dataclass
class ReadCounter:
    """What `read_shard` read, added up over the shards it was given to."""

    samples: int = 0
    bytes: int = 0
    """Bytes of the tar streams (what came from the disk, curl or the command)."""


class _CountedStream:
    """A shard's byte stream that adds what is read from it to a ReadCounter."""

    def __init__(self, stream, counter: ReadCounter) -> None:
        self.stream = stream
        self.counter = counter

    def read(self, size: int = -1) -> bytes:
        data = self.stream.read(size)
        self.counter.bytes += len(data)
        return data


def read_shard(url: str, counter: ReadCounter | None = None) -> Iterator[dict]:
    """The samples of one shard ({"__key__": ..., "txt": bytes, ...}) in file order, read by webdataset.

    `gopen` opens the URL (a local file, curl for http(s), a shell for pipe:) and webdataset's tar
    iterators cut the stream into samples. At the end the stream is read to EOF and the command's exit
    status checked, so a failed transfer is never mistaken for a short shard. Raises ShardReadError.
    `counter`, if given, counts the samples and bytes read.
    """
    try:
        stream = gopen(url)
    except (OSError, ValueError) as exn:  # a local file that is not there, no curl, a scheme webdataset lacks
        raise ShardReadError(_describe(exn), transient=False) from exn
    counter = counter if counter is not None else ReadCounter()
    counted = _CountedStream(stream, counter)
    error: Exception | None = None
    finished = False
    try:
        files = tariterators.tar_file_expander([{"url": url, "stream": counted}])
        for sample in tariterators.group_by_keys(files):
            counter.samples += 1
            yield sample
        while counted.read(1 << 16):  # the tar's end padding: let the command finish writing
            pass
        finished = True
    except Exception as exn:  # tarfile, webdataset or the command's status, checked by webdataset's Pipe
        error = exn
    finally:
        status = _close(stream, abandoned=not finished and error is None)  # abandoned: the reader stopped early
    if status is None or status in STOPPED_BY_READER:
        if error is None:
            return
        # The bytes arrived as they are (a local file, or a command that did not fail): reading again won't help.
        raise ShardReadError(_describe(error), transient=False) from error
    raise _command_failure(url, status) from error


def _close(stream, abandoned: bool) -> int | None:
    """Close a shard's stream; for a command (webdataset's Pipe: pipe: and curl), return its exit status."""
    proc: subprocess.Popen | None = getattr(stream, "proc", None)
    if proc is None:
        stream.close()
        return None
    with contextlib.suppress(Exception):
        stream.stream.close()  # the Pipe's own close() would raise on a bad status; we classify it instead
    if abandoned and proc.poll() is None:
        proc.kill()
    try:
        return proc.wait(timeout=CLOSE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def _command_failure(url: str, status: int) -> ShardReadError:
    """Name what failed; a client error (HTTP 4xx but 408/425/429) is not transient, anything else is."""
    if urlparse(url).scheme not in ("http", "https"):
        return ShardReadError(f"the command exited with status {status} (its stderr is above)", transient=True)
    if status == 22:  # curl -f says "HTTP error" without the status: ask once, with a 1-byte ranged GET
        code = _http_status(url)
        if code is not None and code >= 400:
            transient = code in TRANSIENT_HTTP or code >= 500
            hint = "" if transient else " (a client error: not retried; check the URL)"
            return ShardReadError(f"HTTP {code} {_phrase(code)}{hint}", transient=transient)
    return ShardReadError(f"curl exit {status}: {CURL_EXITS.get(status, 'failed')}", transient=True)


def _http_status(url: str) -> int | None:
    """The status the server answers for `url` now, or None if it cannot be reached."""
    request = urllib.request.Request(url, headers={"Range": "bytes=0-0"})
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
    if isinstance(exn, OSError) and exn.strerror:  # "FileNotFoundError: No such file or directory: '/d/x.tar'"
        return f"{type(exn).__name__}: {exn.strerror}" + (f": {exn.filename!r}" if exn.filename else "")
    first = str(exn.args[0]).split(" @ <")[0] if exn.args else ""
    return f"{type(exn).__name__}: {first}" if first else type(exn).__name__
