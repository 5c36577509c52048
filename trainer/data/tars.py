"""A tar shard's samples in one pass over its bytes: what webdataset's tar iterators give, without their cost.

webdataset cuts a shard into samples with the standard library's `tarfile` (`tar_file_expander`, then
`group_by_keys`): ~60 µs of Python per member, more than reading stored token ids takes (issue 35). `tar_samples`
reads the stream in 64 KB chunks and walks the 512-byte headers itself: the same samples, in the same order, with
the same rules, at a few µs per member:

    members     regular files (types "0", "\\0", "7"); other members (directories, links, devices) are skipped, as
                webdataset skips them; names from the ustar prefix, GNU long names ("L") and POSIX pax headers
                ("x", and "g" for the member after it, as `tarfile` applies them), decoded as `tarfile` does
                (UTF-8, surrogateescape)
    skipped     names like "__meta__" (webdataset's meta files), names without a "." in their last part
    samples     consecutive members with the same key (the name up to the first "." of its last part) make one
                sample {"__key__": key, "__url__": url, field: bytes, ...}; fields are lowercased; a field twice in
                one sample is an error, as in webdataset
    the end     a zero block, or the end of the stream at a member boundary (a shard cut there is caught by the
                manifest's count); a stream that ends inside a member is an error ("unexpected end of data")

Anything else is a `TarFormatError` naming the member: a bad header checksum, a sparse member. A compressed shard
(gzip, bzip2, xz, zstd magic) is handed to webdataset's iterators whole (`tarfile` decompresses it).

Example: members a.txt, a.ids, b.txt -> {"__key__": "a", "txt": ..., "ids": ...}, {"__key__": "b", "txt": ...}.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

BLOCK = 512
CHUNK = 1 << 16
REGULAR = frozenset({b"0", b"\0", b"7"})
"""tarfile's REGULAR_TYPES but its sparse type, which `tar_samples` refuses."""
SUPPORTED = frozenset({b"0", b"\0", b"7", b"1", b"2", b"3", b"4", b"5", b"6", b"L", b"K", b"S", b"x", b"g", b"X"})
"""Types whose data tarfile knows the layout of; the data of the others is skipped by their size, as tarfile does."""
GNU_TYPES = frozenset({b"L", b"K", b"S"})
COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")
"""Magic numbers of gzip, bzip2, xz and zstd."""
META = re.compile(r"__[^/]*__($|/)")
KEY_FIELD = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
"""webdataset's `base_plus_ext`: key = the name up to the first "." of its last part, field = the rest."""


class TarFormatError(Exception):
    """A shard that is not a readable tar: the message names the member (or says where) and what is wrong."""


class _Chunks:
    """A byte stream read in reads of up to CHUNK bytes (or what has arrived: `read1`), handed out in exact sizes."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.read = getattr(stream, "read1", stream.read)  # what has arrived: a pipe's samples before a stall
        self.buf = b""
        self.pos = 0

    def take(self, n: int) -> bytes:
        """The next `n` bytes; fewer only at the end of the stream."""
        end = self.pos + n
        if end > len(self.buf):
            parts, have = [self.buf[self.pos :]], len(self.buf) - self.pos
            while have < n:
                chunk = self.read(max(CHUNK, n - have))
                if not chunk:
                    break
                parts.append(chunk)
                have += len(chunk)
            self.buf, self.pos, end = b"".join(parts), 0, n
        out = self.buf[self.pos : end]
        self.pos = min(end, len(self.buf))
        return out


def tar_samples(stream, url: str) -> Iterator[dict]:
    """The samples of the tar on `stream` (a binary stream with `read`), in order; see the module docstring."""
    chunks = _Chunks(stream)
    first = chunks.take(BLOCK)
    if first.startswith(COMPRESSED):
        yield from _webdataset_samples(_Replayed(first, chunks), url)
        return
    sample: dict | None = None
    for name, data in _members(chunks, first):
        if "/" not in name and name.startswith("__") and name.endswith("__") or META.match(name):
            continue
        match = KEY_FIELD.match(name)
        if match is None:
            continue
        key, field = match.group(1), match.group(2).lower()
        if sample is None or key != sample["__key__"]:
            if sample is not None:
                yield sample
            sample = {"__key__": key, "__url__": url}
        if field in sample:
            raise TarFormatError(f"{name}: duplicate file name in tar file {field} {sample.keys()}")
        sample[field] = data
    if sample is not None:
        yield sample


def _members(chunks: _Chunks, header: bytes) -> Iterator[tuple[str, bytes]]:
    """(name, data) of each regular member, starting at `header` (the first block)."""
    global_pax: dict[str, str] = {}
    pending: dict[str, str] | None = None  # pax records for the next member
    long_name: str | None = None
    index = 0
    while True:
        if len(header) < BLOCK:
            if index == 0 and not header:
                raise TarFormatError("empty file: not a tar")
            if not header.strip(b"\0"):
                return  # ended at a member boundary: a short shard is the manifest count's to catch
            raise TarFormatError(f"unexpected end of data in the header of member {index + 1}")
        if header.count(0) == BLOCK:
            return  # the end-of-archive zero block
        name, size, kind = _parse(header, index)
        if kind in (b"x", b"g", b"X", b"L", b"K"):  # about the next member
            data = _data(chunks, size, -size % BLOCK + size, name)[:size]
            if kind == b"g":
                global_pax.update(_pax_records(data, name))
                pending = dict(global_pax)
            elif kind in (b"x", b"X"):
                pending = {**global_pax, **_pax_records(data, name)}
            elif kind == b"L":
                long_name = _nts(data)
            index += 1
            header = chunks.take(BLOCK)
            continue
        sparse = kind == b"S"
        if pending is not None:
            sparse = sparse or any(k.startswith("GNU.sparse.") for k in pending)
            name, size = pending.get("path", name), _pax_size(pending, size, name)
            pending = None
        if long_name is not None:
            name, long_name = long_name, None
        padded = -size % BLOCK + size
        if sparse:
            raise TarFormatError(f"{name}: a sparse member; write the shard without sparse files")
        data = b""
        if kind in REGULAR:
            data = _data(chunks, size, padded, name)
            yield name, data[:size]
        elif kind not in SUPPORTED:
            data = _data(chunks, size, padded, name)  # an unknown type's data is skipped, as tarfile does
        else:
            padded = 0  # links, directories, devices: no data, whatever their size field says (as tarfile)
        if len(data) < padded:  # the data is whole, its padding is not (tarfile too raises only after the member)
            raise TarFormatError(f"{name}: unexpected end of data after its {size} bytes (the padding to 512 is "
                                 f"cut short): a truncated shard")
        index += 1
        header = chunks.take(BLOCK)


def _data(chunks: _Chunks, size: int, padded: int, name: str) -> bytes:
    """The member's data block(s), padding included; cut short only in its padding (else an error)."""
    block = chunks.take(padded)
    if len(block) < size:
        raise TarFormatError(f"{name}: unexpected end of data ({len(block)} of its {size} bytes): a truncated shard")
    return block


def _parse(header: bytes, index: int) -> tuple[str, int, bytes]:
    """(name, size, type) of a header block, checked against its checksum, as tarfile reads them."""
    chksum = _nti(header[148:156], index, "checksum")
    rest = header[:148] + header[156:]
    unsigned = 256 + sum(rest)  # the checksum field counts as 8 spaces
    if chksum != unsigned and chksum != unsigned - 256 * sum(1 for b in rest if b > 127):  # or signed chars (old tars)
        where = "the first member" if index == 0 else f"member {index + 1}"
        raise TarFormatError(f"bad header checksum at {where}: not a tar, or a damaged shard")
    kind = header[156:157]
    name = _nts(header[0:100])
    if kind == b"\0" and name.endswith("/"):
        kind = b"5"  # the old V7 form of a directory
    if kind == b"5":
        name = name.rstrip("/")
    prefix = _nts(header[345:500])
    if prefix and kind not in GNU_TYPES:
        name = prefix + "/" + name
    return name, _nti(header[124:136], index, "size"), kind


def _pax_size(records: dict[str, str], size: int, name: str) -> int:
    try:
        return int(records.get("size", size))
    except ValueError:
        raise TarFormatError(f"{name}: bad pax size {records['size']!r}") from None


def _nts(field: bytes) -> str:
    end = field.find(b"\0")
    return (field if end == -1 else field[:end]).decode("utf-8", "surrogateescape")


def _nti(field: bytes, index: int, what: str) -> int:
    """A numeric header field: octal text, or GNU's base-256 (first byte 0x80 or 0xff)."""
    if field[:1] in (b"\x80", b"\xff"):
        n = int.from_bytes(field[1:], "big")
        return n - (256 ** (len(field) - 1)) if field[0] == 0xFF else n
    end = field.find(b"\0")
    text = (field if end == -1 else field[:end]).strip()
    try:
        return int(text or b"0", 8)
    except ValueError:
        where = "the first member" if index == 0 else f"member {index + 1}"
        raise TarFormatError(f"bad {what} field {field!r} at {where}: not a tar, or a damaged shard") from None


def _pax_records(data: bytes, name: str) -> dict[str, str]:
    """A pax header's "LENGTH KEY=VALUE\\n" records."""
    records, pos = {}, 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise TarFormatError(f"{name}: bad pax header record at byte {pos}") from None
        record = data[space + 1 : pos + length - 1]
        key, sep, value = record.partition(b"=")
        if length < 1 or not sep:
            raise TarFormatError(f"{name}: bad pax header record at byte {pos}")
        records[key.decode("utf-8", "surrogateescape")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


class _Replayed:
    """`chunks`' stream with the bytes already taken from it (`head`) in front again."""

    def __init__(self, head: bytes, chunks: _Chunks) -> None:
        self.head = head + chunks.buf[chunks.pos :]
        self.stream = chunks.stream

    def read(self, size: int = -1) -> bytes:
        if self.head:
            if size is None or size < 0:
                out, self.head = self.head + self.stream.read(), b""
                return out
            out, self.head = self.head[:size], self.head[size:]
            return out
        return self.stream.read(size)


def _webdataset_samples(stream, url: str) -> Iterator[dict]:
    from webdataset import tariterators

    yield from tariterators.group_by_keys(tariterators.tar_file_expander([{"url": url, "stream": stream}]))
