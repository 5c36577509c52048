"""Tar shards made by hand for the tests of the tar reader (trainer.data.tars), its callers and the bad-input
table: regular files written by `tarfile`, headers whose size field says what a damaged or crafted shard says,
sparse members of hundreds of MB that take no disk. Shared by tests/data/test_tars.py, test_tars_fuzz.py,
test_eval_reader.py and tests/test_bad_inputs.py (test modules share code through modules like this one only)."""

from __future__ import annotations

import contextlib
import io
import signal
import tarfile


def tar_of(members: list[tuple[str, bytes | str]], fmt=tarfile.PAX_FORMAT, pax_global: dict | None = None) -> bytes:
    """A tar of (name, data) regular files; data given as a str is the kind of a special member: "dir", "symlink",
    "hardlink", "fifo"."""
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
    return with_size(tar_of([("c" * 120 + ".txt", b"")])[:512], size)  # a long name: the first block is an 'x' header


PLAIN_MEMBERS = [("a.txt", b"first"), ("a.ids", b"\x01\x00\x02\x00"), ("b.txt", b"second")]
PLAIN = tar_of(PLAIN_MEMBERS)  # a.txt, a.ids, b.txt: a header and a data block each
NEGATIVE = {
    "pax header": PLAIN[: 6 * 512] + pax_header_then(PLAIN, -6 * 512 - 512) + PLAIN[6 * 512 :],  # back to a.txt
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
