"""trainer.data.tars against webdataset's own tar iterators: the same samples from the same bytes, errors
where they raise. The reference (`tar_file_expander` + `group_by_keys` over `tarfile`) shares no code with the
reader."""

from __future__ import annotations

import gzip
import io
import itertools
import subprocess
import sys
import tarfile
import tracemalloc

import pytest
from webdataset import tariterators

from tests.shards import BIG, NEGATIVE, PLAIN, PLAIN_MEMBERS, sparse_shard, tar_of, with_size
from trainer.data.sources import ShardReadError, read_shard
from trainer.data.tars import CHUNK, TarFormatError, TooLargeMember, tar_samples

URL = "/d/shard.tar"


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
    "plain": PLAIN_MEMBERS,
    "empty members": [("a.txt", b""), ("b.txt", b"x"), ("c.txt", b"")],
    "fields lowercased, multi-dot fields": [("a.TXT", b"1"), ("a.seg.json", b"{}"), ("b.Jpg.Gz", b"2")],
    "subdirectories and dots in them": [("dir.v2/a.txt", b"1"), ("dir.v2/a.ids", b"2"), ("x/y/b.txt", b"3")],
    "specials skipped": [("d", "dir"), ("a.txt", b"1"), ("l.txt", "symlink"), ("h.txt", "hardlink"),
                         ("f.txt", "fifo"), ("b.txt", b"2")],
    "meta files and names without a field": [("__meta__", b"m"), ("__info__/x.txt", b"i"), ("README", b"r"),
                                             ("a.txt", b"1"), ("dir/noext", b"n"), ("b.txt", b"2")],
    "long and unicode names": [(f"{LONG}.txt", b"1"), (f"{LONG}.ids", b"2"), ("Grüße/日本.txt", b"3")],
    "members across chunks": [("a.txt", b"a" * (CHUNK + 1000)), ("a.ids", b"\x00" * 513),
                              ("b.txt", b"b" * 3 * CHUNK)],
    "a key split by another key": [("a.txt", b"1"), ("b.txt", b"2"), ("a.ids", b"3")],
}


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT],
                         ids=["pax", "gnu", "ustar"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_same_samples_as_webdataset(case, fmt):
    members = CASES[case]
    if fmt == tarfile.USTAR_FORMAT and case == "long and unicode names":
        # ustar: prefix + name
        members = [(name.replace("x" * 150, "x" * 90), data) for name, data in members]
    data = tar_of(members, fmt)
    expected = _reference(data)
    assert expected, "the reference read no sample: the case tests nothing"
    assert _ours(data) == expected
    assert _ours(data, step=7) == expected  # short reads, as from a pipe


def test_pax_global_header_and_compressed_shards():
    data = tar_of([("a.txt", b"1"), ("b.txt", b"2")], pax_global={"comment": "made by hand"})
    assert _ours(data) == _reference(data) and len(_ours(data)) == 2
    packed = gzip.compress(tar_of(CASES["plain"]), mtime=0)  # handed to webdataset's iterators whole
    assert _ours(packed) == _reference(packed) == _reference(tar_of(CASES["plain"]))


def test_a_tar_without_end_blocks_ends_at_the_member_boundary():
    data = tar_of(CASES["plain"])
    cut = data[: 4 * 512]  # a.txt, a.ids, b.txt: a header and a data block each; cut after a.ids
    assert _ours(cut) == _reference(cut) == [{"__key__": "a", "__url__": URL, "txt": b"first",
                                                "ids": b"\x01\x00\x02\x00"}]


@pytest.mark.parametrize("damage", ["truncated data", "truncated padding", "truncated header", "bad checksum",
                                    "duplicate field", "not a tar", "empty"])
def test_damaged_shards_raise_where_webdataset_raises(damage):
    data = tar_of(CASES["plain"])
    if damage == "truncated data":
        data = data[: 512 + 3]
    elif damage == "truncated padding":
        data = data[: 512 + 100]  # a.txt's 5 bytes are whole, its block is not
    elif damage == "truncated header":
        data = data[:300]
    elif damage == "bad checksum":
        data = data[:148] + b"0000000\0" + data[156:]
    elif damage == "duplicate field":
        data = tar_of([("a.txt", b"1"), ("a.txt", b"2")])
    elif damage == "not a tar":
        data = b"hello, this is not a tar file at all\n" * 40
    else:
        data = b""
    # the reference's own error types vary (ReadError, ValueError)
    with pytest.raises(Exception):  # noqa: B017
        _reference(data)
    with pytest.raises(TarFormatError):
        _ours(data)


def test_sparse_members_are_refused_by_name():
    header = bytearray(tar_of([("s.txt", b"abc")], tarfile.GNU_FORMAT)[:512])
    header[156:157] = b"S"
    header[148:156] = b" " * 8
    header[148:156] = f"{sum(header):06o}\0 ".encode()
    with pytest.raises(TarFormatError, match="s.txt: a sparse member"):
        _ours(bytes(header) + b"\0" * 1024)


# -- sizes: negative, past the file, over the bound (issue 42; issue 46's 7e9-byte header) -------------------


def _read(path) -> list[dict]:
    """read_shard's samples, at most 50 (a reader that loops would yield the first members forever)."""
    return list(itertools.islice(read_shard(str(path)), 50))


@pytest.mark.parametrize("case", sorted(NEGATIVE))
def test_a_negative_size_is_refused_by_name_and_never_reads_backwards(case, tmp_path):
    """A negative base-256 size moved the read position backwards: the first members again and again, exit 0
    (a pax header), or a negative member read as an empty document."""
    path = tmp_path / "neg.tar"
    path.write_bytes(NEGATIVE[case])
    with pytest.raises(ShardReadError,
                       match=r"TarFormatError: .*: a negative size \(-\d+\) in its header") as info:
        _read(path)
    assert not info.value.transient  # the bytes are as they are: not retried
    with pytest.raises(TarFormatError, match="a negative size"):
        _ours(NEGATIVE[case], step=7)  # a stream of unknown length: the same


def test_a_negative_pax_size_record_is_refused():
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("a.txt")
        info.pax_headers = {"size": "-5"}
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(TarFormatError, match=r"a.txt: a negative pax size \(-5\)"):
        _ours(out.getvalue())


def test_a_size_past_the_file_is_refused_before_reading(tmp_path):
    """Issue 46: a header claiming 7e9 bytes in a small file was 'cannot read shard: MemoryError' (the reader
    allocated what the header said). A local file's length is known: refused at once, naming the member."""
    path = tmp_path / "huge.tar"
    path.write_bytes(with_size(PLAIN[:512], 7 * 10**9) + PLAIN[512:])
    with pytest.raises(ShardReadError, match=r"a\.txt: its header says 7,000,000,000 bytes but the file has "
                                             r"9,728 left: a truncated or damaged shard"):
        _read(path)
    tracemalloc.start()
    try:  # a stream of unknown length (a pipe): read in bounded reads to its end, then the same kind of error
        with pytest.raises(TarFormatError,
                           match=r"a\.txt: unexpected end of data \(9728 of its 7000000000 bytes"):
            _ours(path.read_bytes(), step=4096)
        assert tracemalloc.get_traced_memory()[1] < 4 << 20
    finally:
        tracemalloc.stop()


def test_a_claim_past_the_file_is_no_memory_error_under_an_address_space_cap(tmp_path):
    """The 7e9 claim read under a 2 GiB address-space cap (as the issue's run had):
    one TarFormatError line."""
    path = tmp_path / "huge.tar"
    path.write_bytes(with_size(PLAIN[:512], 7 * 10**9) + PLAIN[512:])
    script = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
              "from trainer.data.sources import read_shard\n"
              "try:\n    list(read_shard(sys.argv[1]))\n"
              "except Exception as e:\n    print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.startswith("ShardReadError TarFormatError: a.txt: its header says 7,000,000,000"), out


def test_a_member_over_the_bound_is_skipped_unread_and_named(tmp_path):
    """max_member_bytes: a member's data past the bound is never held (memory stays far below its 300 MB), and
    its field names it (a TooLargeMember) so the stream can refuse or count that one sample; the shard reads
    on."""
    path = sparse_shard(tmp_path / "big.tar")
    tracemalloc.start()
    try:
        samples = list(read_shard(str(path), max_member_bytes=2**20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"peak {peak:,} bytes"
    big, small = samples
    assert small == {"__key__": "small", "__url__": str(path), "txt": b"after the big one"}
    marker = big["txt"]
    assert isinstance(marker, TooLargeMember) and isinstance(marker, TarFormatError)
    assert (marker.url, marker.name, marker.key, marker.field, marker.size, marker.limit) == (
        str(path), "big.txt", "big", "txt", BIG, 2**20)
    assert str(marker) == "member 'big.txt' is 314,572,800 bytes, over the bound of 1,048,576 bytes " \
                          "(refused from its header, not read)"


def test_members_within_the_bound_are_read_as_before():
    data = tar_of(CASES["members across chunks"])
    assert (_ours(data) == list(tar_samples(io.BytesIO(data), URL, max_member_bytes=3 * CHUNK))
            == _reference(data))
    over = list(tar_samples(io.BytesIO(data), URL, max_member_bytes=3 * CHUNK - 1))
    assert isinstance(over[1]["txt"], TooLargeMember) and over[0] == _reference(data)[0]


def test_a_compressed_shard_is_bounded_too():
    """A gzip shard is read by tarfile (it decompresses): a member over the bound is passed over in small
    reads, as the bound asks (a 48 MB member of zeros, 220 KB compressed; peak memory follows the
    decompressor's bursts, ~7 MB at level 1 whatever the member's size, ~30 MB at level 9)."""
    big = 48 * 2**20
    out = io.BytesIO()
    with gzip.GzipFile(fileobj=out, mode="wb", mtime=0, compresslevel=1) as packed, \
            tarfile.open(fileobj=packed, mode="w") as tar:
        info = tarfile.TarInfo("big.txt")
        info.size = big
        tar.addfile(info, io.BytesIO(bytes(big)))
        for name, data in CASES["plain"]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    tracemalloc.start()
    try:
        samples = list(tar_samples(io.BytesIO(out.getvalue()), URL, max_member_bytes=2**20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"peak {peak:,} bytes"
    assert isinstance(samples[0]["txt"], TooLargeMember) and samples[0]["txt"].size == big
    assert samples[1:] == _reference(tar_of(CASES["plain"]))
