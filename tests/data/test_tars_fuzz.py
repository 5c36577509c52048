"""trainer.data.tars against the standard library's `tarfile` (through webdataset's tar iterators, the
reference of tests/data/test_tars.py) on generated tars: valid ones written by `tarfile` (random names, sizes,
types, pax and GNU long names), then damaged: header bytes overwritten (the checksum made right again, or
not), or the file cut.

Where the reference reads the tar, `tar_samples` gives the same samples; where it fails, `tar_samples` raises
a TarFormatError and nothing else; either way within a bounded time and without reading backwards (a reader
that loops is caught by the alarm, or by yielding more samples than the tar has members). The reader is
stricter in a few places, on purpose: a negative size and a sparse member are refused where `tarfile` reads
on.
"""

from __future__ import annotations

import io
import tarfile
import time

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from webdataset import tariterators

from tests.shards import at_most
from trainer.data.tars import TarFormatError, TooLargeMember, tar_samples

URL = "/d/fuzz.tar"
SECONDS_PER_EXAMPLE = 2.0
KINDS = {"file": tarfile.REGTYPE, "dir": tarfile.DIRTYPE, "symlink": tarfile.SYMTYPE,
         "hardlink": tarfile.LNKTYPE, "fifo": tarfile.FIFOTYPE, "chardev": tarfile.CHRTYPE,
         "contiguous": tarfile.CONTTYPE}
FORMATS = [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT]
# Offsets of a header's fields: name, mode, uid, gid, size, mtime, chksum, type, linkname, magic, ..., prefix.
FIELDS = [0, 100, 108, 116, 124, 136, 148, 156, 157, 257, 263, 345]


@st.composite
def member_names(draw) -> str:
    """Names as shards have them (key.field, subdirectories, meta files, no field), some past ustar's 100
    characters, some not ASCII."""
    parts = draw(st.lists(st.sampled_from(["a", "b", "dir", "d.v2", "Grüße", "x" * 60, "__meta__"]),
                          min_size=1, max_size=3))
    field = draw(st.sampled_from([".txt", ".ids", ".TXT", ".seg.json", "", ".txt"]))
    return "/".join(parts) + field


@st.composite
def valid_tars(draw) -> bytes:
    fmt = draw(st.sampled_from(FORMATS))
    out = io.BytesIO()
    pax_global = (draw(st.sampled_from([{}, {}, {"comment": "made by a fuzzer"}]))
                  if fmt == tarfile.PAX_FORMAT else {})
    with tarfile.open(fileobj=out, mode="w", format=fmt, pax_headers=pax_global) as tar:
        for _ in range(draw(st.integers(0, 5))):
            info = tarfile.TarInfo(draw(member_names()))
            info.type = KINDS[draw(st.sampled_from(["file"] * 5 + sorted(KINDS)))]
            if fmt == tarfile.PAX_FORMAT and draw(st.booleans()):
                info.pax_headers = {"comment": "x" * draw(st.integers(0, 600))}
            data = b""
            if info.type in (tarfile.REGTYPE, tarfile.CONTTYPE):
                data = draw(st.binary(max_size=1200))
                info.size = len(data)
            elif info.type in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = draw(member_names())
            try:
                tar.addfile(info, io.BytesIO(data))
            except ValueError:  # a name ustar cannot hold: left out
                continue
    return out.getvalue()


@st.composite
def damaged_tars(draw) -> bytes:
    """A valid tar with header bytes overwritten (in a field, at a block start: so mostly headers), or cut."""
    data = bytearray(draw(valid_tars()))
    if not data:
        return bytes(data)
    if draw(st.booleans()):
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    block = draw(st.integers(0, len(data) // 512 - 1)) * 512
    start = block + draw(st.sampled_from(FIELDS))
    patch = draw(st.one_of(
        st.binary(min_size=1, max_size=12),
        st.sampled_from([b"\xff" * 12, b"\x80" + b"\xff" * 11, b"\xff" + b"\x00" * 10 + b"\x01", b"-1\0",
                         b"7777777777\0", b"x", b"L", b"K", b"g", b"S", b"5", b"\0", b"30 size=-5\n"]),
    ))
    data[start : start + len(patch)] = patch[: max(0, len(data) - start)]
    if draw(st.booleans()):  # the checksum made right again: the damage passes the first check
        header = data[block : block + 512]
        header[148:156] = b" " * 8
        data[block + 148 : block + 156] = f"{sum(header):06o}\0 ".encode()
    return bytes(data)


def _reference(data: bytes) -> list[dict] | Exception:
    try:
        files = tariterators.tar_file_expander([{"url": URL, "stream": io.BytesIO(data)}])
        return list(tariterators.group_by_keys(files))
    except Exception as exn:  # tarfile's and webdataset's errors vary (ReadError, ValueError, EOFError ...)
        return exn


def _stricter(data: bytes, error: TarFormatError) -> bool:
    """Whether `error` is one that tar_samples raises on purpose where tarfile reads on: a negative size, a
    sparse member, a damaged header after the first (tarfile's `next()` takes a bad checksum or a cut header
    past offset 0 for the end of the archive), a pax record that does not parse (tarfile 3.11 drops it and the
    records after it without a word)."""
    if "bad pax header record" in str(error):
        return True
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
            if any(m.size < 0 or m.issparse() for m in tar.getmembers()):
                return True
            stop = tar.offset  # where tarfile read its last header: the end marker, or what it took for one
    except Exception:
        return False
    return bool(data[stop : stop + 512].strip(b"\0"))


def _check(data: bytes) -> None:
    note(f"{len(data)} bytes, blocks: " + " | ".join(data[i : i + 512].rstrip(b"\0")[:160].hex(" ")
                                                     for i in range(0, len(data), 512)))
    expected = _reference(data)
    started = time.monotonic()
    with at_most(SECONDS_PER_EXAMPLE):
        try:
            ours: list[dict] | TarFormatError = []
            for sample in tar_samples(io.BytesIO(data), URL):
                ours.append(sample)
                assert len(ours) <= len(data) // 512, "more samples than the tar has blocks: the reader loops"
        except TarFormatError as exn:
            ours = exn
    assert time.monotonic() - started < SECONDS_PER_EXAMPLE
    if isinstance(expected, Exception):
        assert isinstance(ours, TarFormatError), f"the reference raised {expected!r}; tar_samples gave {ours}"
    elif isinstance(ours, TarFormatError):
        assert _stricter(data, ours), f"tar_samples raised {ours!r} where the reference read {expected}"
    else:
        assert ours == expected


FUZZ = settings(max_examples=200, deadline=2000, derandomize=True, print_blob=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(valid_tars())
def test_valid_tars_give_the_same_samples_as_tarfile(data):
    _check(data)


@FUZZ
@given(damaged_tars())
def test_damaged_tars_give_the_same_samples_or_a_tar_format_error(data):
    _check(data)


@settings(max_examples=100, deadline=2000, derandomize=True, print_blob=False,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(valid_tars(), st.integers(0, 1300))
def test_the_member_bound_replaces_exactly_the_members_over_it(data, bound):
    """With max_member_bytes, every field over the bound is a TooLargeMember of its size, every other one the
    reference's bytes: skipping a member's data keeps the reader on the next header."""
    expected = _reference(data)
    if isinstance(expected, Exception):
        return
    with at_most(SECONDS_PER_EXAMPLE):
        ours = list(tar_samples(io.BytesIO(data), URL, max_member_bytes=bound))
    assert [s.keys() for s in ours] == [s.keys() for s in expected]
    for mine, theirs in zip(ours, expected, strict=True):
        for field, value in theirs.items():
            if isinstance(value, bytes) and len(value) > bound:
                assert isinstance(mine[field], TooLargeMember) and mine[field].size == len(value)
            else:
                assert mine[field] == value
