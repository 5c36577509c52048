"""Tar shards made by hand for the tests of the tar reader (trainer.data.tars), its callers and the bad-input
table: regular files written by `tarfile`, headers whose size field says what a damaged or crafted shard says,
sparse members of hundreds of MB that take no disk; and a prepared dataset's shards read from their stored
ids, or rewritten member by member as a damaged or forged one. Shared by tests/data/test_tars.py,
test_tars_fuzz.py, test_eval_reader.py and tests/test_bad_inputs.py (test modules share code through modules
like this one only)."""

from __future__ import annotations

import contextlib
import io
import signal
import tarfile
from pathlib import Path

import numpy as np

from trainer.data.config import PackingConfig
from trainer.data.loader import DocumentLoader
from trainer.data.pipeline import RowStream
from trainer.data.shards import StoredIds, load_manifest, shard_paths, stored_ids
from trainer.data.stream import DocumentStream
from trainer.data.tokenizer import load_tokenizer, special_ids, tokenizer_hash


def tar_of(members: list[tuple[str, bytes | str]], fmt=tarfile.PAX_FORMAT,
           pax_global: dict | None = None) -> bytes:
    """A tar of (name, data) regular files; data given as a str is the kind of a special member: "dir",
    "symlink", "hardlink", "fifo"."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt, pax_headers=pax_global or {}) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if isinstance(data, str):
                info.type = {"dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE, "hardlink": tarfile.LNKTYPE,
                             "fifo": tarfile.FIFOTYPE}[data]
                info.linkname = "a.txt" if "link" in data else ""
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def with_size(header: bytes, size: int) -> bytes:
    """A header block with its size field set to `size` (octal when it fits, else GNU base-256, negative ones
    too) and its checksum made right again."""
    block = bytearray(header)
    if 0 <= size < 8**11:
        block[124:136] = f"{size:011o}\0".encode()
    else:
        block[124:136] = (b"\xff" if size < 0 else b"\x80") + (size % 256**11).to_bytes(11, "big")
    block[148:156] = b" " * 8
    block[148:156] = f"{sum(block):06o}\0 ".encode()
    return bytes(block)


def pax_header_then(member: bytes, size: int) -> bytes:
    """A pax 'x' header block for the member that follows, with size field `size`, and no data."""
    # a long name: the first block is an 'x' header
    return with_size(tar_of([("c" * 120 + ".txt", b"")])[:512], size)


PLAIN_MEMBERS = [("a.txt", b"first"), ("a.ids", b"\x01\x00\x02\x00"), ("b.txt", b"second")]
PLAIN = tar_of(PLAIN_MEMBERS)  # a.txt, a.ids, b.txt: a header and a data block each
NEGATIVE = {
    # back to a.txt
    "pax header": PLAIN[: 6 * 512] + pax_header_then(PLAIN, -6 * 512 - 512) + PLAIN[6 * 512 :],
    "member": with_size(PLAIN[:512], -512) + PLAIN[512:],
    "member, -1": with_size(PLAIN[:512], -1) + PLAIN[512:],
    "GNU long name": with_size(tar_of([("l" * 120 + ".txt", b"x")], tarfile.GNU_FORMAT)[:512], -1024) + PLAIN,
}


BIG = 300 * 2**20


def sparse_shard(path, size: int = BIG):
    """big.txt of `size` zero bytes (a hole: nothing on disk), then small.txt, as a tar file."""
    head = with_size(tar_of([("big.txt", b"")])[:512], size)
    tail = tar_of([("small.txt", b"after the big one")])
    with open(path, "wb") as f:
        f.write(head)
        f.seek(512 + size + -size % 512)
        f.write(tail)
    return path


@contextlib.contextmanager
def at_most(seconds: float):
    """Raise TimeoutError in the body after `seconds` (a reader that loops forever)."""
    def expired(_signum, _frame):
        raise TimeoutError(f"still reading after {seconds} s: a loop")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# -- a prepared dataset's shards, read from their stored ids or rewritten member by member --

SEQ_LEN = 256
"""Row length of `rows_of`."""


def members_of(shard: str) -> dict[str, dict[str, bytes]]:
    """{key: {field: bytes}} read with tarfile alone."""
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(shard) as tar:
        for member in tar:
            key, field = member.name.split(".", 1)
            out.setdefault(key, {})[field] = tar.extractfile(member).read()
    return out


def rewrite_shard(src: str, dst: Path, change) -> None:
    """Copy a shard, passing each member's (name, data) through `change` (None drops the member)."""
    with tarfile.open(src) as tar_in, tarfile.open(dst, "w", format=tarfile.PAX_FORMAT) as tar_out:
        for member in tar_in:
            changed = change(member.name, tar_in.extractfile(member).read())
            if changed is not None:
                info = tarfile.TarInfo(changed[0])
                info.size = len(changed[1])
                tar_out.addfile(info, io.BytesIO(changed[1]))


def stored_stream(data: Path, stored: StoredIds | None, loss_on: str = "all", **kw) -> DocumentStream:
    """The training stream of dataset `data` (its train shards unless `shards=` says), one epoch, from
    `stored` ids (None: from the text)."""
    eos = special_ids(load_tokenizer(data / "tokenizer")).eos
    kw.setdefault("shuffle_buffer", 50)
    kw.setdefault("epochs", 1)
    return DocumentStream(kw.pop("shards", shard_paths(data, "train")), data / "tokenizer", eos, seed=3,
                          loss_on=loss_on, stored_ids=stored, **kw)


def rows_of(stream: DocumentStream, num_workers: int = 0) -> list[list]:
    """Every packed row of `stream` (rows of SEQ_LEN), through a DocumentLoader of `num_workers`."""
    rows = RowStream(DocumentLoader(stream, num_workers=num_workers), SEQ_LEN, PackingConfig(buffer_size=32))
    out = []
    while batch := rows.take(8):
        out.extend(batch)
    return out


def assert_same_rows(a: list[list], b: list[list]) -> None:
    assert len(a) == len(b) > 0
    for row_a, row_b in zip(a, b, strict=True):
        assert [d.key for d in row_a] == [d.key for d in row_b]
        for x, y in zip(row_a, row_b, strict=True):
            assert x.tokens.dtype == y.tokens.dtype and np.array_equal(x.tokens, y.tokens)
            assert (x.loss_mask is None) == (y.loss_mask is None)
            if x.loss_mask is not None:
                assert np.array_equal(x.loss_mask, y.loss_mask)


def stored_of(data: Path, assistant: bool = False) -> StoredIds:
    stored = stored_ids(load_manifest(data), tokenizer_hash(data / "tokenizer"), assistant)
    assert stored is not None
    return stored


def ids_of(member: bytes) -> np.ndarray:
    """The uint16 ids of an `.ids` member, its 4-byte check left off."""
    return np.frombuffer(member[:-4], dtype="<u2")


def damaged_shard(demo_data: Path, tmp_path: Path, change, which: int = 0) -> str:
    """Training shard `which`, copied under its name (train-000000.tar: the manifest's) into tmp_path through
    `change`: (key, field, data, fields of the sample) -> new data."""
    src = shard_paths(demo_data, "train")[which]
    members = members_of(src)
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / Path(src).name
    rewrite_shard(src, out,
                  lambda name, data: (name, change(*name.split(".", 1), data, members[name.split(".")[0]])))
    return str(out)


def read_stored(demo_data: Path, shards: list[str], stored=True, **kw) -> DocumentLoader:
    """`shards` of the dataset `demo_data` read as a run reads them (from stored ids unless `stored` is
    False)."""
    return DocumentLoader(stored_stream(demo_data, stored_of(demo_data) if stored else None,
                                        shards=shards, **kw))
