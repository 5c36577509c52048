"""Reading the formats corpora ship in, in bounded memory, as spans that worker processes read independently.

Formats (by suffix, `file_kind`): JSON lines plain (.jsonl/.json/.ndjson), gzip (.gz, multi-member) or zstd
(.zst/.zstd, multi-frame); parquet (a column, or a struct field such as `meta.body`); a Hugging Face dataset
(a `save_to_disk` directory, or a dataset name in the local cache: never downloaded).

`plan_spans` cuts each input into `Span`s of about `target_bytes`, the same for any number of workers:
plain JSONL at line starts (a span owns the lines that START in its byte range; `first` is the exact line
number), parquet at row-group boundaries, a dataset at row ranges; a .gz or .zst file is one span (not
seekable). `read_span` yields (record number, where, value): line numbers for JSONL, 1-based row numbers
for parquet and datasets, so a record's number does not depend on how its file was cut.

Bad input goes to an `ErrorPolicy`, never as a library traceback: a bad record ("a.jsonl:7: invalid JSON:
Expecting value (column 1)", "b.parquet: row 12: no 'text' field ...") is reported and left out; a bad file
("c.jsonl.gz: corrupt gzip data after line 41 (Compressed file ended before the end-of-stream marker was
reached)") ends its span, the records before it kept, and is counted once.
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

from trainer.data.prepare.corpus import (
    ErrorPolicy,
    PrepareError,
    glob_root,
    json_kind,
    match_files,
    not_regular_file,
    sanitize_key,
)

KINDS = ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf")

_FORMAT_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl"}
_COMPRESSION_SUFFIXES = {"": "", ".gz": ".gz", ".zst": ".zst", ".zstd": ".zst"}
SUFFIXES: dict[str, str] = {
    fmt + comp: kind + ckind
    for fmt, kind in _FORMAT_SUFFIXES.items()
    for comp, ckind in _COMPRESSION_SUFFIXES.items()
} | {".parquet": "parquet"}
"""File suffix (lower case) -> kind: .jsonl/.json/.ndjson, each optionally .gz/.zst/.zstd, and .parquet."""

_READ = 256 << 10  # bytes per read of a plain file
_FEED = 64 << 10  # compressed bytes per zstd decompress call (its output is at most this times the ratio)
_SCAN = 8 << 20  # bytes per read while planning (only newlines are counted)
_PROGRESS = 1 << 20  # report progress every this many bytes
_BATCH = 1024  # rows per arrow batch
_MISSING = object()


@dataclass(frozen=True)
class Span:
    """A slice of one input that one worker reads from start to end,
    independent of how many workers there are."""

    path: str
    """The file (for kind "hf": the dataset directory or cached dataset name, optionally with "#split")."""
    kind: str
    """One of KINDS: "jsonl" (plain), "jsonl.gz", "jsonl.zst", "parquet", "hf"."""
    start: int = 0
    """jsonl: byte offset of its first line; parquet: first row group; hf: first row."""
    stop: int = -1
    """Exclusive end (byte offset / row group / row); -1 = to the end of the input."""
    first: int = 1
    """Number of its first record: the 1-based line number (blank lines count), or 1-based row number."""
    bytes: int = 0
    """Bytes on disk it covers (progress, balancing); an estimate for hf."""

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> Span:
        return cls(**d)


# ---------------------------------------------------------------------------------------------
# Inputs
# ---------------------------------------------------------------------------------------------


def _suffix(path: str) -> str:
    """The longest known format suffix of `path` ("" if none). Example: "a/B.JSON.GZ" -> ".json.gz"."""
    name = os.path.basename(path).lower()
    return max((s for s in SUFFIXES if name.endswith(s) and len(name) > len(s)), key=len, default="")


def file_kind(path: str) -> str | None:
    """The kind of a file by its suffix, case-insensitive. Examples: "a.ndjson.gz" -> "jsonl.gz",
    "b.JSONL.ZSTD" -> "jsonl.zst", "c.parquet" -> "parquet", "d.csv" -> None."""
    return SUFFIXES.get(_suffix(path))


def expand_inputs(kind: str, pattern: str) -> tuple[str, list[str], dict[str, int]]:
    """(glob root, sorted files, other paths to each file) of a "jsonl" or "parquet" source: a path or a glob
    (recursive ** allowed; each real file once, see corpus.match_files).

    Every matching file must be of that kind ("jsonl" takes .gz and .zst too). Example:
    expand_inputs("jsonl", "data/**/*.json*") -> ("data", ["data/a.jsonl", "data/b/c.json.gz"], {...: 0}).
    """
    if kind not in ("jsonl", "parquet"):
        raise PrepareError(f"expand_inputs: kind must be 'jsonl' or 'parquet', got {kind!r}")
    paths, aliases = match_files(pattern)
    if not paths:
        hint = " (a directory: give a glob such as 'DIR/**/*.jsonl')" if os.path.isdir(pattern) else ""
        raise PrepareError(f"no files match {pattern!r}{hint}")
    for path in paths:
        problem = not_regular_file(path)  # a FIFO matched by the glob would hang the plan
        if problem is not None:
            raise PrepareError(f"{path}: {problem}")
        found = file_kind(path)
        if found is None or found.split(".")[0] != kind:
            wanted = "a .jsonl/.json/.ndjson(.gz/.zst) file" if kind == "jsonl" else "a .parquet file"
            raise PrepareError(f"{kind}:{pattern} matched {path}: not {wanted}")
    return glob_root(pattern), paths, aliases


def record_stem(path: str, root: str) -> str:
    """The key prefix of a file's records: its path relative to `root` without format suffixes, sanitized.

    Examples: "d/2024/part-01.json.gz", root "d" -> "2024__part-01"; "corpus.parquet" and "corpus.jsonl.zst"
    -> "corpus" (the same corpus in two formats gets the same document keys).
    """
    rel = os.path.relpath(path, root)
    suffix = _suffix(rel)
    return sanitize_key(rel[: len(rel) - len(suffix)])


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------


def plan_spans(path: str, kind: str, target_bytes: int, *, policy: ErrorPolicy | None = None,
               block: int = 1) -> list[Span]:
    """The spans of one input, each about `target_bytes` on disk, whatever the number of workers. Every span
    starts at a record number 1 + k * `block`: a block of records is never cut (prepare ends its shards at
    block ends, so that the shards do not depend on how the input was cut, nor on its format).

    An unreadable or corrupt input raises a PrepareError naming it; with `policy`, it goes to
    `policy.bad("unreadable" | "corrupt_file", path, ...)` instead and the input has no spans.
    Example: a 250-byte JSONL file of 10-byte lines, target 100 -> spans [0, 100) [100, 200) [200, 250),
    first lines 1, 11, 21.
    """
    if target_bytes < 1:
        raise PrepareError(f"span size must be at least 1 byte, got {target_bytes}")
    try:
        if kind == "jsonl":
            return _plan_jsonl(path, target_bytes, block)
        if kind in ("jsonl.gz", "jsonl.zst"):
            size = _file_size(path)
            return [Span(path, kind, 0, -1, 1, size)] if size else []
        if kind == "parquet":
            return _plan_parquet(path, target_bytes, block)
        if kind == "hf":
            return _plan_hf(path, target_bytes, block)
    except _BadFile as e:
        if policy is None:
            raise PrepareError(f"{path}: {e.what}") from None
        policy.bad(e.reason, path, e.what)
        return []
    raise PrepareError(f"{path}: unknown input kind {kind!r}; expected one of {KINDS}")


class _BadFile(Exception):
    """A whole-file problem: reason (an ErrorPolicy reason) and what (the message after the path)."""

    def __init__(self, reason: str, what: str) -> None:
        super().__init__(what)
        self.reason, self.what = reason, what


def _cannot_read(e: OSError) -> _BadFile:
    return _BadFile("unreadable", f"cannot read: {e.strerror or e}")


def _file_size(path: str) -> int:
    try:
        with open(path, "rb") as f:
            return os.fstat(f.fileno()).st_size
    except OSError as e:
        raise _cannot_read(e) from None


def _plan_jsonl(path: str, target: int, block: int = 1) -> list[Span]:
    """Cut at the first line start at or after each `start + target` that begins a block of `block` lines (its
    line number is 1 + a multiple of `block`), counting newlines on the way."""
    cuts = [(0, 1)]  # (byte offset, line number) of each span's first line
    off = newlines = 0  # bytes and newlines before the current read
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_SCAN):
                n = chunk.count(b"\n")
                m = (newlines // block + 1) * block  # the next newline number that ends a block
                pos, at = -1, newlines  # the position and number of the last newline located in this chunk
                while m <= newlines + n:
                    for _ in range(m - at):
                        pos = chunk.find(b"\n", pos + 1)
                    at = m
                    if off + pos + 1 - cuts[-1][0] >= target:
                        cuts.append((off + pos + 1, m + 1))
                    m += block
                newlines += n
                off += len(chunk)
    except OSError as e:
        raise _cannot_read(e) from None
    if cuts[-1][0] >= off:  # the last cut fell on the end of the file (or the file is empty)
        cuts.pop()
    stops = [c[0] for c in cuts[1:]] + [off] if cuts else []
    return [Span(path, "jsonl", start, stop, first, stop - start)
            for (start, first), stop in zip(cuts, stops, strict=True)]


def _plan_parquet(path: str, target: int, block: int = 1) -> list[Span]:
    """Consecutive row groups until their compressed size reaches `target` and the next group starts a block
    of `block` rows (its row index is a multiple of `block`); from the footer only."""
    meta = _open_parquet(path).metadata
    spans: list[Span] = []
    start, first, size, row = 0, 1, 0, 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        size += _group_bytes(group)
        row += group.num_rows
        if (size >= target and row % block == 0) or i == meta.num_row_groups - 1:
            spans.append(Span(path, "parquet", start, i + 1, first, size))
            start, first, size = i + 1, row + 1, 0
    return spans


def _plan_hf(path: str, target: int, block: int = 1) -> list[Span]:
    """Row ranges of about `target` bytes (estimated from the dataset's arrow files and its number of rows),
    each a whole number of blocks of `block` rows."""
    ds = _load_hf(path)
    rows = len(ds)
    if not rows:
        return []
    sizes = [_size_or_zero(f.get("filename", "")) for f in ds.cache_files]
    per_row = (sum(sizes) or ds.data.nbytes) / rows
    step = max(1, int(target / per_row)) if per_row else rows
    step = -(-step // block) * block
    return [Span(path, "hf", s, min(s + step, rows), s + 1, round((min(s + step, rows) - s) * per_row))
            for s in range(0, rows, step)]


def _size_or_zero(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def read_span(span: Span, policy: ErrorPolicy, field: str, progress: Callable[[int], None] | None = None,
              missing: str = "missing_text") -> Iterator[tuple[int, str, object]]:
    """(record number, where, value of `field`) of each record of `span`, in order.

    `field` is a key ("text") or a path into nested objects / struct columns ("meta.body": the literal key
    first, then split at the dots). where: "PATH:LINE" (JSONL) or "PATH: row N". The value is as found;
    a record without the field, a line that is not UTF-8, not JSON or not an object is reported to `policy`
    and not yielded; blank lines are skipped silently. A whole-file problem (unreadable, corrupt or truncated
    .gz/.zst, not a parquet file, no such column) is reported once and ends the span. `progress(n)` gets the
    on-disk bytes advanced, about every MB; over a span they sum to about `span.bytes`. `missing` is the
    reason a record without the field is counted under (chat: "missing_messages").
    """
    report = _Progress(progress)
    try:
        if span.kind in ("jsonl", "jsonl.gz", "jsonl.zst"):
            blocks = {"jsonl": _plain_blocks, "jsonl.gz": _gzip_blocks, "jsonl.zst": _zstd_blocks}[span.kind]
            yield from _jsonl_records(span, blocks(span, report), policy, field, missing)
        elif span.kind == "parquet":
            yield from _parquet_records(span, policy, field, report, missing)
        elif span.kind == "hf":
            yield from _hf_records(span, policy, field, report, missing)
        else:
            raise PrepareError(f"{span.path}: unknown input kind {span.kind!r}; expected one of {KINDS}")
    except _BadFile as e:
        policy.bad(e.reason, span.path, e.what)
    finally:
        report.flush()


class _Progress:
    """Accumulates advanced bytes and calls the callback once at least _PROGRESS of them are pending."""

    def __init__(self, callback: Callable[[int], None] | None) -> None:
        self.callback, self.pending = callback, 0

    def __call__(self, n: int) -> None:
        self.pending += n
        if self.pending >= _PROGRESS:
            self.flush()

    def flush(self) -> None:
        if self.callback is not None and self.pending:
            self.callback(self.pending)
        self.pending = 0


class _Corrupt(Exception):
    """Raised by a block reader: the compressed stream is broken here (`fmt` data, `detail` why)."""

    def __init__(self, fmt: str, detail: str) -> None:
        super().__init__(detail)
        self.fmt, self.detail = fmt, detail


def _open(path: str):
    try:
        return open(path, "rb")
    except OSError as e:
        raise _cannot_read(e) from None


def _plain_blocks(span: Span, report: _Progress) -> Iterator[bytes]:
    """The bytes of [start, stop) of a plain file, then up to the end of a line cut by `stop`, if any."""
    with _open(span.path) as f:
        f.seek(span.start)
        left = span.stop - span.start if span.stop >= 0 else float("inf")
        block = b"\n"
        try:
            while left > 0 and (block := f.read(int(min(_READ, left)))):
                left -= len(block)
                report(len(block))
                yield block
            while block and not block.endswith(b"\n") and (block := f.read(_READ)):  # finish a cut line
                j = block.find(b"\n")
                block = block if j < 0 else block[: j + 1]
                report(len(block))
                yield block
        except OSError as e:
            raise _cannot_read(e) from None


def _gzip_blocks(span: Span, report: _Progress) -> Iterator[bytes]:
    """Decompressed blocks of a .gz file (all members); progress in compressed bytes."""
    with _open(span.path) as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
        done = 0
        while True:
            try:
                block = gz.read1(_READ)
            except (EOFError, gzip.BadGzipFile, zlib.error) as e:
                raise _Corrupt("gzip", str(e)) from None
            except OSError as e:
                raise _cannot_read(e) from None
            pos = raw.tell()
            report(pos - done)
            done = pos
            if not block:
                return
            yield block


def _zstd_blocks(span: Span, report: _Progress) -> Iterator[bytes]:
    """Decompressed blocks of a .zst file, frame after frame; a file that ends inside a frame is corrupt."""
    zstandard = _import("zstandard", "reading .zst files needs `zstandard`: pip install 'zstandard>=0.22'")
    dctx = zstandard.ZstdDecompressor()
    frame, in_frame = dctx.decompressobj(), False
    with _open(span.path) as raw:
        while True:
            try:
                data = raw.read(_FEED)
            except OSError as e:
                raise _cannot_read(e) from None
            report(len(data))
            if not data:
                break
            while data:
                try:
                    block = frame.decompress(data)
                except zstandard.ZstdError as e:
                    raise _Corrupt("zstd", str(e)) from None
                if block:
                    yield block
                if frame.eof:  # the rest of `data` starts the next frame
                    data, frame, in_frame = frame.unused_data, dctx.decompressobj(), False
                else:
                    data, in_frame = b"", True
    if in_frame:
        raise _Corrupt("zstd", "the file ends inside a frame: truncated?")


def _line_chunks(blocks: Iterable[bytes]) -> Iterator[bytes]:
    """Runs of whole lines (joined by, but not ending with, "\\n") from blocks cut anywhere; the last may be
    a line without its newline. Example: [b"a\\nb", b"c\\nd"] -> b"a", b"bc", b"d"."""
    pending: list[bytes] = []
    for block in blocks:
        j = block.rfind(b"\n")
        if j < 0:
            pending.append(block)
            continue
        head = block[:j]
        if pending:
            pending.append(head)
            head = b"".join(pending)
        yield head
        pending = [block[j + 1 :]]
    tail = b"".join(pending)
    if tail:
        yield tail


class _NotUtf8:
    """A line that is not valid UTF-8 (json.loads of it raises TypeError)."""

    def __init__(self, e: UnicodeDecodeError) -> None:
        self.start = e.start


def _decode(line: bytes) -> str | _NotUtf8:
    try:
        return line.decode()
    except UnicodeDecodeError as e:
        return _NotUtf8(e)


def _jsonl_records(span: Span, blocks: Iterator[bytes], policy: ErrorPolicy, field: str,
                   missing: str = "missing_text") -> Iterator[tuple[int, str, object]]:
    path, parts = span.path, field.split(".")
    # 3x faster than json.loads on short lines; errors go to _parse_line
    decode = json.JSONDecoder().raw_decode
    n = span.first - 1  # the number of the last line read
    bom = span.start == 0  # a UTF-8 byte-order mark may open the file
    try:
        for chunk in _line_chunks(blocks):
            if bom and chunk.startswith(b"\xef\xbb\xbf"):
                chunk = chunk[3:]
            bom = False
            try:
                lines: list = chunk.decode().split("\n")
            except UnicodeDecodeError:
                lines = [_decode(line) for line in chunk.split(b"\n")]
            for line in lines:
                n += 1
                try:
                    record, end = decode(line)
                    if end != len(line) and line[end:].strip(" \t\r"):
                        raise ValueError("extra data")
                except (ValueError, TypeError, RecursionError):  # also a blank line, or one not UTF-8
                    record = _parse_line(line, f"{path}:{n}", policy)
                    if record is _MISSING:
                        continue
                if type(record) is not dict:
                    policy.bad("invalid_json", f"{path}:{n}",
                               f"expected a JSON object, got {json_kind(record)}")
                    continue
                value = record.get(field, _MISSING)
                if value is _MISSING and len(parts) > 1:
                    value = _walk(record, parts)
                if value is _MISSING:
                    policy.bad(missing, f"{path}:{n}", f"no {field!r} field (fields: {sorted(record)[:8]})")
                    continue
                yield n, f"{path}:{n}", value
    except _Corrupt as e:
        after = f"after line {n}" if n else "before its first line"
        raise _BadFile("corrupt_file", f"corrupt {e.fmt} data {after} ({e.detail})") from None


def _parse_line(line: str | _NotUtf8, where: str, policy: ErrorPolicy) -> Any:
    """json.loads of a line the fast path refused: its value,
    or _MISSING for a blank or bad line (reported)."""
    try:
        return json.loads(line)  # type: ignore[arg-type]
    except (ValueError, RecursionError) as e:
        if line.strip():  # type: ignore[union-attr]
            what = (f"invalid JSON: {e.msg} (column {e.colno})" if isinstance(e, json.JSONDecodeError)
                    else "invalid JSON: nested too deeply")
            policy.bad("invalid_json", where, what)
    except TypeError:
        policy.bad("not_utf8", where,
                   f"not valid UTF-8 (byte {line.start} of the line)")  # type: ignore[union-attr]
    return _MISSING


def _walk(value: Any, parts: Iterable[str]) -> Any:
    """value[p0][p1]... through nested dicts, or _MISSING where a key is absent or a value not an object."""
    for part in parts:
        if type(value) is not dict or part not in value:
            return _MISSING
        value = value[part]
    return value


# ---------------------------------------------------------------------------------------------
# Arrow: parquet files and Hugging Face datasets
# ---------------------------------------------------------------------------------------------


def _import(module: str, message: str):
    try:
        return __import__(module)
    except ImportError:
        raise PrepareError(message) from None


def _pyarrow():
    _import("pyarrow", "reading parquet needs `pyarrow`: pip install 'pyarrow>=14'")
    import pyarrow
    import pyarrow.parquet

    return pyarrow


def _open_parquet(path: str):
    pa = _pyarrow()
    _file_size(path)  # an unreadable file is "unreadable", not "corrupt"
    try:
        return pa.parquet.ParquetFile(path)
    except (pa.ArrowException, OSError) as e:
        raise _BadFile("corrupt_file", f"not a parquet file, or truncated ({e})") from None


def _group_bytes(group) -> int:
    """Compressed bytes of a row group: the sum of its column chunks."""
    return sum(group.column(j).total_compressed_size for j in range(group.num_columns))


def _column_path(schema, field: str, what: str) -> tuple[str, list[str]]:
    """(top-level column, path below it) of `field` in an arrow schema, checked through struct types."""
    import pyarrow as pa

    if field in schema.names:
        return field, []
    parts = field.split(".")
    if parts[0] in schema.names:
        kind = schema.field(parts[0]).type
        for part in parts[1:]:
            if not pa.types.is_struct(kind) or kind.get_field_index(part) < 0:
                break
            kind = kind.field(part).type
        else:
            return parts[0], parts[1:]
    columns = _leaf_names(schema)
    shown = columns[:12] + (["..."] if len(columns) > 12 else [])
    raise _BadFile("corrupt_file", f"no {field!r} {what} (columns: {shown})")


def _leaf_names(schema) -> list[str]:
    """Column names with struct fields spelled out: ["id", "meta.body", "meta.n", "text"]."""
    import pyarrow as pa

    def names(prefix: str, kind) -> list[str]:
        if not pa.types.is_struct(kind):
            return [prefix]
        return [n for i in range(kind.num_fields)
                for n in names(f"{prefix}.{kind.field(i).name}", kind.field(i).type)]

    return [n for f in schema for n in names(f.name, f.type)]


def _arrow_values(values: list, rest: list[str], number: int, where: str, field: str, policy: ErrorPolicy,
                  missing: str = "missing_text") -> Iterator[tuple[int, str, object]]:
    """(row number, where, value) for the values of one batch; `rest` walks into struct values."""
    for value in values:
        if rest:
            value = _walk(value, rest)
            if value is _MISSING:
                policy.bad(missing, f"{where}{number}", f"no {field!r} field (a struct above it is null)")
                number += 1
                continue
        yield number, f"{where}{number}", value
        number += 1


def _parquet_records(span: Span, policy: ErrorPolicy, field: str, report: _Progress,
                     missing: str = "missing_text") -> Iterator[tuple[int, str, object]]:
    pa = _pyarrow()
    pf = _open_parquet(span.path)
    column, rest = _column_path(pf.schema_arrow, field, "column")
    meta = pf.metadata
    stop = meta.num_row_groups if span.stop < 0 else min(span.stop, meta.num_row_groups)
    number, where = span.first, f"{span.path}: row "
    try:
        for group in range(span.start, stop):
            for batch in pf.iter_batches(batch_size=_BATCH, row_groups=[group], columns=[column]):
                values = batch.column(0).to_pylist()
                yield from _arrow_values(values, rest, number, where, field, policy, missing)
                number += len(values)
            report(_group_bytes(meta.row_group(group)))
    except (pa.ArrowException, OSError) as e:
        raise _BadFile("corrupt_file", f"corrupt parquet data at row {number} ({e})") from None


def _datasets():
    return _import("datasets", "hf: sources need the `datasets` library: pip install 'packtrain[hf]'")


def _load_hf(path: str):
    """The dataset of "DIR" or "NAME", optionally "#split": a save_to_disk directory (a Dataset, or the split
    of a DatasetDict: "train", else its only one), else a dataset in the local cache (offline)."""
    datasets = _datasets()
    source, _, split = path.partition("#") if not os.path.exists(path) else (path, "", "")
    if os.path.isdir(source):
        try:
            ds = datasets.load_from_disk(source)
        except (OSError, ValueError) as e:  # FileNotFoundError: not a saved dataset; others: broken files
            raise _BadFile("corrupt_file", f"not a dataset saved with save_to_disk ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            splits = list(ds)
            pick = split or ("train" if "train" in ds else splits[0] if len(splits) == 1 else None)
            if pick not in ds:
                raise _BadFile("corrupt_file", f"{'no split ' + repr(split) if split else 'no train split'} "
                               f"(splits: {splits}); name one as hf:{source}#SPLIT")
            ds = ds[pick]
        elif split:
            raise _BadFile("corrupt_file", f"a single dataset, without splits: drop '#{split}'")
        return ds
    return _load_cached(datasets, source, split or "train")


def _load_cached(datasets, name: str, split: str):
    """datasets.load_dataset(name, split) from the local cache only: the Hub is never asked."""
    import huggingface_hub.constants as hub

    # The flags are read when a download would start; set for this call only, so the caller's setting stays.
    flags = [(m, f) for m, f in ((datasets.config, "HF_HUB_OFFLINE"),
                                 (datasets.config, "HF_DATASETS_OFFLINE"),
                                 (hub, "HF_HUB_OFFLINE")) if hasattr(m, f)]
    saved = [getattr(m, f) for m, f in flags]
    for m, f in flags:
        setattr(m, f, True)
    try:
        return datasets.load_dataset(name, split=split)
    except (OSError, ValueError) as e:  # ConnectionError (offline), FileNotFoundError, an unknown split
        raise _BadFile("unreadable", "neither a dataset directory saved with save_to_disk nor a dataset in "
                       f"the local Hugging Face cache ({type(e).__name__}: {str(e)[:200]})") from None
    finally:
        for (m, f), value in zip(flags, saved, strict=True):
            setattr(m, f, value)


def _hf_records(span: Span, policy: ErrorPolicy, field: str, report: _Progress, missing: str = "missing_text"
                ) -> Iterator[tuple[int, str, object]]:
    pa = _pyarrow()
    ds = _load_hf(span.path)
    column, rest = _column_path(ds.data.schema, field, "column")
    rows = len(ds)
    stop = rows if span.stop < 0 else min(span.stop, rows)
    table = ds.select_columns([column]).with_format("arrow")
    per_row = span.bytes / max(1, stop - span.start)
    number, where = span.first, f"{span.path}: row "
    try:
        for i in range(span.start, stop, _BATCH):
            values = table[i : min(i + _BATCH, stop)].column(0).to_pylist()
            yield from _arrow_values(values, rest, number, where, field, policy, missing)
            number += len(values)
            report(round(len(values) * per_row))
    except (pa.ArrowException, OSError) as e:
        raise _BadFile("corrupt_file", f"corrupt dataset files at row {number} ({e})") from None
