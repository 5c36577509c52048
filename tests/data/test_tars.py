"""trainer.data.tars against webdataset's own tar iterators: the same samples from the same bytes, errors where
they raise. The reference (`tar_file_expander` + `group_by_keys` over `tarfile`) shares no code with the reader."""

from __future__ import annotations

import gzip
import io
import tarfile

import pytest
from webdataset import tariterators

from trainer.data.tars import CHUNK, TarFormatError, tar_samples

URL = "/d/shard.tar"


def _tar(members: list[tuple[str, bytes | str]], fmt=tarfile.PAX_FORMAT, pax_global: dict | None = None) -> bytes:
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


class _Trickle(io.RawIOBase):
    """A stream that hands out at most `step` bytes per read, as a pipe may."""

    def __init__(self, data: bytes, step: int) -> None:
        self.data, self.pos, self.step = data, 0, step

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        n = self.step if size is None or size < 0 else min(size, self.step)
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out


def _reference(data: bytes) -> list[dict]:
    files = tariterators.tar_file_expander([{"url": URL, "stream": io.BytesIO(data)}])
    return list(tariterators.group_by_keys(files))


def _ours(data: bytes, step: int | None = None) -> list[dict]:
    return list(tar_samples(io.BytesIO(data) if step is None else _Trickle(data, step), URL))


LONG = "d/" + "x" * 150  # past ustar's 100-character name field
CASES = {
    "plain": [("a.txt", b"first"), ("a.ids", b"\x01\x00\x02\x00"), ("b.txt", b"second")],
    "empty members": [("a.txt", b""), ("b.txt", b"x"), ("c.txt", b"")],
    "fields lowercased, multi-dot fields": [("a.TXT", b"1"), ("a.seg.json", b"{}"), ("b.Jpg.Gz", b"2")],
    "subdirectories and dots in them": [("dir.v2/a.txt", b"1"), ("dir.v2/a.ids", b"2"), ("x/y/b.txt", b"3")],
    "specials skipped": [("d", "dir"), ("a.txt", b"1"), ("l.txt", "symlink"), ("h.txt", "hardlink"),
                         ("f.txt", "fifo"), ("b.txt", b"2")],
    "meta files and names without a field": [("__meta__", b"m"), ("__info__/x.txt", b"i"), ("README", b"r"),
                                             ("a.txt", b"1"), ("dir/noext", b"n"), ("b.txt", b"2")],
    "long and unicode names": [(f"{LONG}.txt", b"1"), (f"{LONG}.ids", b"2"), ("Grüße/日本.txt", b"3")],
    "members across chunks": [("a.txt", b"a" * (CHUNK + 1000)), ("a.ids", b"\x00" * 513), ("b.txt", b"b" * 3 * CHUNK)],
    "a key split by another key": [("a.txt", b"1"), ("b.txt", b"2"), ("a.ids", b"3")],
}


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT],
                         ids=["pax", "gnu", "ustar"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_samples_as_webdataset(case, fmt):
    members = CASES[case]
    if fmt == tarfile.USTAR_FORMAT and case == "long and unicode names":
        members = [(name.replace("x" * 150, "x" * 90), data) for name, data in members]  # ustar: prefix + name
    data = _tar(members, fmt)
    expected = _reference(data)
    assert expected, "the reference read no sample: the case tests nothing"
    assert _ours(data) == expected
    assert _ours(data, step=7) == expected  # short reads, as from a pipe


def test_pax_global_header_and_compressed_shards():
    data = _tar([("a.txt", b"1"), ("b.txt", b"2")], pax_global={"comment": "made by hand"})
    assert _ours(data) == _reference(data) and len(_ours(data)) == 2
    packed = gzip.compress(_tar(CASES["plain"]), mtime=0)  # handed to webdataset's iterators whole
    assert _ours(packed) == _reference(packed) == _reference(_tar(CASES["plain"]))


def test_a_tar_without_end_blocks_ends_at_the_member_boundary():
    data = _tar(CASES["plain"])
    cut = data[: 4 * 512]  # a.txt, a.ids, b.txt: a header and a data block each; cut after a.ids
    assert _ours(cut) == _reference(cut) == [{"__key__": "a", "__url__": URL, "txt": b"first",
                                                "ids": b"\x01\x00\x02\x00"}]


@pytest.mark.parametrize("damage", ["truncated data", "truncated padding", "truncated header", "bad checksum", "duplicate field",
                                    "not a tar", "empty"])
def test_damaged_shards_raise_where_webdataset_raises(damage):
    data = _tar(CASES["plain"])
    if damage == "truncated data":
        data = data[: 512 + 3]
    elif damage == "truncated padding":
        data = data[: 512 + 100]  # a.txt's 5 bytes are whole, its block is not
    elif damage == "truncated header":
        data = data[:300]
    elif damage == "bad checksum":
        data = data[:148] + b"0000000\0" + data[156:]
    elif damage == "duplicate field":
        data = _tar([("a.txt", b"1"), ("a.txt", b"2")])
    elif damage == "not a tar":
        data = b"hello, this is not a tar file at all\n" * 40
    else:
        data = b""
    with pytest.raises(Exception):  # noqa: B017 - the reference's own error types vary (ReadError, ValueError)
        _reference(data)
    with pytest.raises(TarFormatError):
        _ours(data)


def test_sparse_members_are_refused_by_name():
    header = bytearray(_tar([("s.txt", b"abc")], tarfile.GNU_FORMAT)[:512])
    header[156:157] = b"S"
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    with pytest.raises(TarFormatError, match="s.txt: a sparse member"):
        _ours(bytes(header) + b"\0" * 1024)
