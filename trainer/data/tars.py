"""A tar shard's samples in one pass over its bytes: what webdataset's tar iterators give, without their cost.

webdataset cuts a shard into samples with the standard library's `tarfile` (`tar_file_expander`, then
`group_by_keys`): ~60 µs of Python per member, more than reading stored token ids takes (issue 35).
`tar_samples` reads the stream in 64 KB chunks and walks the 512-byte headers itself: the same samples, in the
same order, with the same rules, at a few µs per member:

    members     regular files (types "0", "\\0", "7"); other members (directories, links, devices) are
                skipped, as webdataset skips them; names from the ustar prefix, GNU long names ("L") and POSIX
                pax headers ("x", and "g" for the member after it, as `tarfile` applies them), decoded as
                `tarfile` does (UTF-8, surrogateescape)
    skipped     names like "__meta__" (webdataset's meta files), names without a "." in their last part
    samples     consecutive members with the same key (the name up to the first "." of its last part) make one
                sample {"__key__": key, "__url__": url, field: bytes, ...}; fields are lowercased; a field
                twice in one sample is an error, as in webdataset
    headers     read as `tarfile` reads them: the checksum (unsigned, or signed as old tars), and the numeric
                fields (mode, uid, gid, size, mtime, device numbers) octal text or GNU base-256, else a bad
                header
    sizes       a size (ustar octal, GNU base-256 or pax "size") that is negative, or that runs past the end
                of a file whose length is known (a local file), is an error naming the member, before any of
                its data is read: the read position only ever moves forward. A member's data is gathered in
                reads of at most MAX_READ bytes, never one allocation of the size its header claims; a pax
                header or GNU long name over META_MAX is an error
    the bound   `max_member_bytes`: a regular member larger is not read (its data is skipped in small reads);
                its field holds a `TooLargeMember` (not raised) that names it, so that a reader can refuse or
                count that one sample and go on with the shard
    the end     a zero block, or the end of the stream at a member boundary (a shard cut there is caught by
                the manifest's count); a stream that ends inside a member, or after a pax header or long name
                before its member, or a file shorter than one header, is an error
                ("unexpected end of data", ...)

Stricter than `tarfile` on purpose (tests/data/test_tars_fuzz.py compares the two on generated tars): a
negative size, a sparse member, a damaged header after the first (tarfile takes it for the end of the archive)
and a pax record that does not parse (tarfile 3.11 drops it) are errors.

Anything else is a `TarFormatError` naming the member (or where). A compressed shard (gzip, bzip2, xz, zstd
magic) is read as webdataset's iterators read it, by `tarfile` in stream mode (it decompresses): the same
samples and the bound, but tarfile's own checks and errors.

Example: members a.txt, a.ids, b.txt -> {"__key__": "a", "txt": ..., "ids": ...},
{"__key__": "b", "txt": ...}.
"""

from __future__ import annotations

import os
import re
import stat
import tarfile
from collections.abc import Iterator

BLOCK = 512
CHUNK = 1 << 16
MAX_READ = 1 << 24
"""The largest single read: a header's claimed size is never allocated at once (issue 46: a 7e9-byte claim in
a 2 KB file was a MemoryError)."""
META_MAX = 1 << 20
"""The largest pax header or GNU long name accepted: real ones hold a few records (tarfile has no bound)."""
META_KINDS = frozenset({b"x", b"g", b"X", b"L", b"K"})
"""Members whose data is about the next member (pax headers, GNU long names)."""
REGULAR = frozenset({b"0", b"\0", b"7"})
"""tarfile's REGULAR_TYPES but its sparse type, which `tar_samples` refuses."""
SUPPORTED = frozenset({b"0", b"\0", b"7", b"1", b"2", b"3", b"4", b"5", b"6", b"L", b"K", b"S", b"x", b"g",
                       b"X"})
"""Types whose data tarfile knows the layout of; the data of the others is skipped by their size, as tarfile
does."""
GNU_TYPES = frozenset({b"L", b"K", b"S"})
COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zXZ\x00", b"\x28\xb5\x2f\xfd")
"""Magic numbers of gzip, bzip2, xz and zstd."""
META = re.compile(r"__[^/]*__($|/)")
NUMBER_FIELDS = ((100, 108, "mode"), (108, 116, "uid"), (116, 124, "gid"), (136, 148, "mtime"),
                 (329, 337, "devmajor"), (337, 345, "devminor"))
"""The numeric header fields that tarfile reads (and refuses a header over) besides the size and the
checksum."""
PLAIN_NUMBERS = re.compile(rb"(?:[0-7]{7}\0){3}(?s:.{12})[0-7]{11}\0(?s:.{181})(?:[0-7]{7}\0|\0{8}){2}")
"""Header bytes 100-345 with mode, uid, gid, mtime and the device numbers as tar writers write them: a fast
path past NUMBER_FIELDS."""
KEY_FIELD = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")
"""webdataset's `base_plus_ext`: key = the name up to the first "." of its last part, field = the rest."""


class TarFormatError(Exception):
    """A shard that is not a readable tar: the message names the member (or says where) and what is wrong."""


class TooLargeMember(TarFormatError):
    """A regular member over `max_member_bytes`, refused from its header: its data was skipped, never held.

    `tar_samples` puts it in the sample as that field's value instead of the bytes (it does not raise it), so
    that the reader decides: raise it (or its own error from its facts), or count the sample as too large and
    go on.
    """

    def __init__(self, url: str, name: str, key: str, field: str, size: int, limit: int) -> None:
        super().__init__(f"member {name!r} is {size:,} bytes, over the bound of {limit:,} bytes "
                         "(refused from its header, not read)")
        self.url, self.name, self.key, self.field, self.size, self.limit = url, name, key, field, size, limit


class _Chunks:
    """A byte stream read in reads of up to CHUNK bytes (or what has arrived: `read1`), handed out in exact
    sizes, only ever forward."""

    def __init__(self, stream) -> None:
        self.stream = stream
        self.read = getattr(stream, "read1", stream.read)  # what has arrived: a pipe's samples before a stall
        self.buf = b""
        self.pos = 0
        self.base = 0
        """Where `buf` starts in the stream: base + pos bytes have been handed out or skipped."""
        self.size = _bytes_left(stream)
        """The stream's length from where it stood, if known (a regular file), else None."""

    def take(self, n: int) -> bytes:
        """The next `n` bytes; fewer only at the end of the stream."""
        end = self.pos + n
        if end > len(self.buf):
            parts, have = [self.buf[self.pos :]], len(self.buf) - self.pos
            while have < n:
                chunk = self.read(min(max(CHUNK, n - have), MAX_READ))
                if not chunk:
                    break
                parts.append(chunk)
                have += len(chunk)
            self.base += self.pos
            self.buf, self.pos, end = b"".join(parts), 0, n
        out = self.buf[self.pos : end]
        self.pos = min(end, len(self.buf))
        return out

    def skip(self, n: int) -> int:
        """Pass the next `n` bytes without keeping them (reads of at most CHUNK); how many there were (fewer
        only at the end of the stream)."""
        if self.pos + n <= len(self.buf):  # the usual case: a member's padding, already read
            self.pos += n
            return n
        left = n - (len(self.buf) - self.pos)
        self.base += len(self.buf)
        self.buf, self.pos = b"", 0
        while left:
            chunk = self.read(min(left, CHUNK))
            if not chunk:
                break
            left -= len(chunk)
            self.base += len(chunk)
        return n - left

    def past_end(self, n: int) -> int | None:
        """The bytes left in the file if the next `n` run past its end (its length known), else None."""
        if self.size is not None and self.base + self.pos + n > self.size:
            return self.size - self.base - self.pos
        return None


def _bytes_left(stream) -> int | None:
    """The bytes from `stream`'s position to its end if it is a regular file; None for a pipe, a socket,
    memory."""
    try:
        info = os.fstat(stream.fileno())
        return info.st_size - stream.tell() if stat.S_ISREG(info.st_mode) else None
    except (AttributeError, OSError, ValueError):
        # no fileno (BytesIO: io.UnsupportedOperation), a closed file
        return None


def tar_samples(stream, url: str, max_member_bytes: int | None = None) -> Iterator[dict]:
    """The samples of the tar on `stream` (a binary stream with `read`), in order; see the module docstring.

    `max_member_bytes`: a regular member larger than this is skipped unread, and its field holds a
    `TooLargeMember` instead of bytes. Example: bound 100, members a.txt (10 bytes), a.ids (400 bytes) ->
    {"__key__": "a", "txt": b"...", "ids": TooLargeMember(size=400)}.
    """
    chunks = _Chunks(stream)
    first = chunks.take(BLOCK)
    if first.startswith(COMPRESSED):
        members = _compressed_members(_Replayed(first, chunks), max_member_bytes)
    else:
        members = _members(chunks, first, max_member_bytes)
    sample: dict | None = None
    for name, size, data in members:
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
        sample[field] = (data if data is not None
                         else TooLargeMember(url, name, key, field, size, max_member_bytes))
    if sample is not None:
        yield sample


def _members(chunks: _Chunks, header: bytes,
             max_member_bytes: int | None) -> Iterator[tuple[str, int, bytes | None]]:
    """(name, size, data) of each regular member, starting at `header` (the first block); data None for a
    member over `max_member_bytes` (skipped unread)."""
    global_pax: dict[str, str] = {}
    pending: dict[str, str] | None = None  # pax records for the next member
    long_name: str | None = None
    index = 0
    while True:
        if len(header) < BLOCK or header.count(0) == BLOCK:
            _check_end(header, index, dangling=pending is not None or long_name is not None)
            return
        name, size, kind = _parse(header, index)
        if kind in META_KINDS:  # about the next member
            if size > META_MAX:
                raise TarFormatError(f"{name}: a {kind.decode()!r} header of {size:,} bytes, over the "
                                     f"{META_MAX:,} any real one needs: a damaged or crafted shard")
            data = _data(chunks, size, name)
            _skip_padding(chunks, size, name)
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
        if sparse:
            raise TarFormatError(f"{name}: a sparse member; write the shard without sparse files")
        if kind in REGULAR:
            if max_member_bytes is not None and size > max_member_bytes:
                _skip_data(chunks, size, name)
                yield name, size, None
            else:
                yield name, size, _data(chunks, size, name)
            padding = -size % BLOCK  # tarfile too raises a cut padding only after the member
            if chunks.skip(padding) < padding:
                raise _cut_padding(name, size)
        elif kind not in SUPPORTED:  # an unknown type's data is skipped, as tarfile does
            _skip_data(chunks, size, name)
            _skip_padding(chunks, size, name)
        # links, directories, devices: no data, whatever their size field says (as tarfile)
        index += 1
        header = chunks.take(BLOCK)


def _check_end(header: bytes, index: int, dangling: bool) -> None:
    """At a short or zero block where member `index` would start: the tar's end (a zero block, or the end of
    the stream at a member boundary: a short shard is the manifest count's to catch), else a
    TarFormatError."""
    if index == 0 and len(header) < BLOCK:
        raise TarFormatError(f"the file is {len(header)} bytes, not even one tar header: not a tar" if header
                             else "empty file: not a tar")
    if header.strip(b"\0"):
        raise TarFormatError(f"unexpected end of data in the header of member {index + 1}")
    if dangling:  # tarfile: "end of file header"
        raise TarFormatError(f"the tar ends after the pax header or long name of member {index + 1}, "
                             "before the member: a truncated shard")


def _check_size(chunks: _Chunks, size: int, name: str) -> None:
    """A TarFormatError if the member's `size` bytes of data run past the end of a file of known length."""
    left = chunks.past_end(size)
    if left is not None:
        raise TarFormatError(f"{name}: its header says {size:,} bytes but the file has "
                             f"{max(left, 0):,} left: a truncated or damaged shard")


def _data(chunks: _Chunks, size: int, name: str) -> bytes:
    """The member's `size` bytes of data (without the padding); an error if they are cut short."""
    if chunks.size is not None:
        _check_size(chunks, size, name)
    try:
        data = chunks.take(size)
    except MemoryError:
        raise TarFormatError(f"{name}: its {size:,} bytes do not fit in memory "
                             "(bound the member size)") from None
    if len(data) < size:
        raise TarFormatError(f"{name}: unexpected end of data ({len(data)} of its {size} bytes): "
                             "a truncated shard")
    return data


def _skip_data(chunks: _Chunks, size: int, name: str) -> None:
    """Pass the member's `size` bytes of data unread; an error if they are cut short."""
    _check_size(chunks, size, name)
    skipped = chunks.skip(size)
    if skipped < size:
        raise TarFormatError(f"{name}: unexpected end of data ({skipped} of its {size} bytes): "
                             "a truncated shard")


def _skip_padding(chunks: _Chunks, size: int, name: str) -> None:
    """Pass the zeros that pad the member's data to a whole block; an error if they are cut short."""
    padding = -size % BLOCK
    if chunks.skip(padding) < padding:
        raise _cut_padding(name, size)


def _cut_padding(name: str, size: int) -> TarFormatError:
    return TarFormatError(f"{name}: unexpected end of data after its {size} bytes "
                          "(the padding to 512 is cut short): a truncated shard")


def _parse(header: bytes, index: int) -> tuple[str, int, bytes]:
    """(name, size, type) of a header block, checked against its checksum, as tarfile reads them."""
    chksum = _nti(header[148:156], index, "checksum")
    if not PLAIN_NUMBERS.fullmatch(header, 100, 345):
        for start, end, what in NUMBER_FIELDS:  # as tarfile: a field that is not a number is a bad header
            _nti(header[start:end], index, what)
    unsigned = 256 + sum(header) - sum(header[148:156])  # the checksum field counts as 8 spaces
    if chksum != unsigned and chksum != unsigned - 256 * _high_bytes(header):  # or of signed chars (old tars)
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
    size = _nti(header[124:136], index, "size")
    if size < 0:
        raise TarFormatError(f"{name}: a negative size ({size}) in its header: a damaged or crafted shard")
    return name, size, kind


def _high_bytes(header: bytes) -> int:
    """How many bytes of the header, its checksum field aside, are over 127 (negative as signed chars)."""
    return sum(1 for b in header[:148] + header[156:] if b > 127)


def _pax_size(records: dict[str, str], size: int, name: str) -> int:
    """The member's size: its pax "size" record if it has one (as tarfile), else its header's."""
    try:
        size = int(records.get("size", size))
    except ValueError:
        raise TarFormatError(f"{name}: bad pax size {records['size']!r}") from None
    if size < 0:
        raise TarFormatError(f"{name}: a negative pax size ({size}): a damaged or crafted shard")
    return size


def _nts(field: bytes) -> str:
    end = field.find(b"\0")
    return (field if end == -1 else field[:end]).decode("utf-8", "surrogateescape")


def _nti(field: bytes, index: int, what: str) -> int:
    """A numeric header field: octal text, or GNU's base-256 (first byte 0x80 or 0xff)."""
    if field[:1] in (b"\x80", b"\xff"):
        n = int.from_bytes(field[1:], "big")
        return n - (256 ** (len(field) - 1)) if field[0] == 0xFF else n
    end = field.find(b"\0")
    # str's strip, as tarfile's (it also strips \x1c-\x1f); a byte over 127 is a bad field
    # (UnicodeDecodeError)
    try:
        return int((field if end == -1 else field[:end]).decode("ascii").strip() or "0", 8)
    except ValueError:
        where = "the first member" if index == 0 else f"member {index + 1}"
        raise TarFormatError(f"bad {what} field {field!r} at {where}: "
                             "not a tar, or a damaged shard") from None


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


def _compressed_members(stream, max_member_bytes: int | None) -> Iterator[tuple[str, int, bytes | None]]:
    """(name, size, data) of each regular member of a compressed tar, as webdataset's `tar_file_expander`
    reads them (`tarfile` in stream mode decompresses it); data None for a member over `max_member_bytes`:
    tarfile passes over its data in small reads when it moves to the next member."""
    with tarfile.open(fileobj=stream, mode="r|*") as tar:
        for info in tar:
            tar.members = []  # tarfile keeps every member's TarInfo otherwise (as webdataset: memory)
            if not info.isreg():
                continue
            if max_member_bytes is not None and info.size > max_member_bytes:
                yield info.name, info.size, None
            else:
                yield info.name, info.size, tar.extractfile(info).read()
