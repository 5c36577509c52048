"""trainer.data.prepare.formats on real files written by the real libraries: every format reads as the same
records, spans cut anywhere partition a file exactly, and bad input is one clear error (or one counted skip)
naming the file and the line or row."""

from __future__ import annotations

import gzip
import io
import json
import os
import random
import struct
import sys
import tracemalloc
import zlib
from pathlib import Path

import datasets
import huggingface_hub.constants
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from trainer.data.prepare.corpus import ErrorPolicy, PrepareError
from trainer.data.prepare.formats import Span, expand_inputs, file_kind, plan_spans, read_span, record_stem

# ---------------------------------------------------------------------------------------------
# One corpus, written in every format
# ---------------------------------------------------------------------------------------------

UNICODE = ["naïve café", "Grüße aus Köln — 日本語のテキスト", "emoji 🎉🚀",
           "a \u2028 line separator and a \u0085 NEL", 'quotes " and \\ backslash',
           "tab\tand\nnewline inside", "\r carriage return"]


def make_records(n: int = 300) -> list[dict]:
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9)))
             for _ in range(200)]
    records = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 60)))
        if i % 7 == 3:
            text += " " + UNICODE[i % len(UNICODE)]
        records.append({"id": i, "text": text,
                        "meta": {"body": f"body {i} {UNICODE[i % len(UNICODE)]}", "n": i}})
    return records


RECORDS = make_records()
LINES = b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in RECORDS)
EXPECTED = {field: [(i + 1, r["text"] if field == "text" else r["meta"]["body"])
                    for i, r in enumerate(RECORDS)]
            for field in ("text", "meta.body")}


SKIPPABLE = struct.pack("<II", 0x184D2A50, 4) + b"seek"  # a skippable zstd frame: no data


def zst(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=3).compress(data)


def zst_streamed(data: bytes, block: int = 0) -> bytes:
    """A frame written by stream_writer: no content size in its header; a block ends every `block` bytes."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as writer:
        for i in range(0, len(data), block or len(data) or 1):
            writer.write(data[i : i + (block or len(data))])
            writer.flush(zstandard.FLUSH_BLOCK)
    return out.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """name -> (path, kind) of RECORDS in each format."""
    root = tmp_path_factory.mktemp("corpus")
    # cuts in the middle of lines: members/frames need not end at one
    third, half = len(LINES) // 3, len(LINES) // 2
    files = {
        "c.jsonl": LINES,
        "c.jsonl.gz": gzip.compress(LINES[:half]) + gzip.compress(LINES[half:]),  # two members
        "c.json.gz": gzip.compress(LINES),
        "c.jsonl.zst": zst(LINES),
        "multi.jsonl.zst": zst(LINES[:third]) + zst(b"") + zst_streamed(LINES[third:half]) + zst(LINES[half:])
        + SKIPPABLE,  # as the seekable zstd format appends its seek table
    }
    found = {}
    for name, data in files.items():
        (root / name).write_bytes(data)
        found[name] = (str(root / name), file_kind(name))
    table = pa.Table.from_pylist(RECORDS)
    pq.write_table(table, root / "c.parquet", row_group_size=64)  # 5 row groups
    found["c.parquet"] = (str(root / "c.parquet"), "parquet")
    datasets.Dataset.from_list(RECORDS).save_to_disk(str(root / "hf"), num_shards=2)
    found["hf"] = (str(root / "hf"), "hf")
    return found


def read_all(spans: list[Span], field: str = "text",
             policy: ErrorPolicy | None = None) -> list[tuple[int, object]]:
    policy = policy or ErrorPolicy("raise")
    return [(n, value) for span in spans for n, _, value in read_span(span, policy, field)]


def skipping() -> tuple[ErrorPolicy, list[str]]:
    warnings: list[str] = []
    return ErrorPolicy("skip", warn=warnings.append), warnings


@pytest.mark.parametrize("target", [2000, 10**9])
@pytest.mark.parametrize("field", ["text", "meta.body"])
@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "c.json.gz", "c.jsonl.zst", "multi.jsonl.zst",
                                  "c.parquet", "hf"])
def test_every_format_reads_the_same_records_span_by_span(corpus, name, field, target):
    path, kind = corpus[name]
    spans = plan_spans(path, kind, target)
    assert spans and all(s.path == path and s.kind == kind for s in spans)
    if target == 2000 and kind in ("jsonl", "parquet", "hf"):
        assert len(spans) >= 5  # several spans, read one after the other
    got = []
    for span in spans:
        records = list(read_span(span, ErrorPolicy("raise"), field))
        assert records[0][0] == span.first
        sep = ":" if kind.startswith("jsonl") else ": row "
        assert all(where == f"{path}{sep}{n}" for n, where, _ in records)
        got += [(n, value) for n, _, value in records]
        assert Span.from_json(json.loads(json.dumps(span.to_json()))) == span
    assert got == EXPECTED[field]


def test_plans_cover_the_input_on_disk(corpus):
    size = os.path.getsize(corpus["c.jsonl"][0])
    spans = plan_spans(corpus["c.jsonl"][0], "jsonl", 2000)
    assert (spans[0].start, spans[-1].stop, sum(s.bytes for s in spans)) == (0, size, size)
    for name in ("c.jsonl.gz", "multi.jsonl.zst"):
        path, kind = corpus[name]
        # not seekable
        assert plan_spans(path, kind, 100) == [Span(path, kind, 0, -1, 1, os.path.getsize(path))]
    path = corpus["c.parquet"][0]
    meta = pq.ParquetFile(path).metadata
    spans = plan_spans(path, "parquet", 1)
    assert [(s.start, s.stop, s.first) for s in spans] == [(i, i + 1, 64 * i + 1) for i in range(5)]
    assert sum(s.bytes for s in spans) == sum(meta.row_group(i).column(j).total_compressed_size
                                              for i in range(5) for j in range(meta.num_columns))
    sizes = [s.bytes for s in spans]
    target = max(sizes) + 1  # a target just over any one group takes two (the last may be alone)
    groups = plan_spans(path, "parquet", target)
    assert [(s.start, s.stop, s.first, s.bytes) for s in groups] == [
        (i, min(i + 2, 5), 64 * i + 1, sum(sizes[i : i + 2])) for i in range(0, 5, 2)]
    assert all(s.bytes >= target for s in groups[:-1])
    hf = plan_spans(corpus["hf"][0], "hf", 2000)
    assert [s.start for s in hf] == [s.first - 1 for s in hf] and hf[-1].stop == len(RECORDS)
    assert all(a.stop == b.start for a, b in zip(hf, hf[1:], strict=False))
    arrow = sum(p.stat().st_size for p in Path(corpus["hf"][0]).glob("*.arrow"))
    assert abs(sum(s.bytes for s in hf) - arrow) <= len(hf)  # an estimate, rounded per span


# ---------------------------------------------------------------------------------------------
# Byte ranges of plain JSONL: every cut, every line ending
# ---------------------------------------------------------------------------------------------

VARIANTS = {
    "trailing newline": b'{"text": "one"}\n{"text": "two two"}\n{"text": "3"}\n'
                        b'{"text": "caf\xc3\xa9 four"}\n',
    "no trailing newline": b'{"text": "one"}\n{"text": "two two"}\n{"text": "3"}',
    "crlf": b'{"text": "one"}\r\n{"text": "two two"}\r\n\r\n{"text": "3"}\r\n',
    "blank lines": b'\n{"text": "a"}\n\n   \n{"text": "b"}\r\n\t\n\n \t{"text": "indented"} \t\r\n'
                   b'{"text": "c"}\n\n',
    "one line": b'{"text": "only"}',
    "byte-order mark": b'\xef\xbb\xbf{"text": "bom"}\n{"text": "\xef\xbb\xbf kept inside"}\n',
}


def lines_by_enumerate(data: bytes) -> tuple[dict[int, int], list[tuple[int, str]]]:
    """({byte offset of each line start: its line number}, [(line number, text) of each non-blank line])."""
    starts, records, offset = {}, [], 0
    for number, line in enumerate(io.BytesIO(data), start=1):
        starts[offset] = number
        offset += len(line)
        if line.strip():
            records.append((number, json.loads(line)["text"]))
    return starts, records


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_jsonl_spans_cut_anywhere_partition_the_lines(tmp_path, variant):
    data = VARIANTS[variant]
    path = tmp_path / "v.jsonl"
    path.write_bytes(data)
    starts, expected = lines_by_enumerate(data)
    for target in range(1, len(data) + 2):
        spans = plan_spans(str(path), "jsonl", target)
        assert spans[0].start == 0 and spans[-1].stop == len(data), target
        assert all(a.stop == b.start for a, b in zip(spans, spans[1:], strict=False)), target
        assert all(s.bytes == s.stop - s.start >= target for s in spans[:-1]), target
        assert all(starts.get(s.start) == s.first for s in spans), target  # at a line start, its exact number
        # Each cut is the first line start at or after start + target, and the last span has none.
        assert [s.stop for s in spans[:-1]] == [min(o for o in starts if o >= s.start + target)
                                                for s in spans[:-1]]
        assert not [o for o in starts if o >= spans[-1].start + target]
        assert read_all(spans) == expected, target


def test_cuts_at_a_newline_mid_line_and_on_the_last_byte(tmp_path):
    data = VARIANTS["trailing newline"]
    path = str(tmp_path / "v.jsonl")
    Path(path).write_bytes(data)
    first_line = data.index(b"\n") + 1  # 16 bytes
    # lands on a line start
    assert [s.start for s in plan_spans(path, "jsonl", first_line)][:2] == [0, first_line]
    # on the newline
    assert [s.start for s in plan_spans(path, "jsonl", first_line - 1)][:2] == [0, first_line]
    second_end = data.index(b"\n", first_line) + 1
    assert [s.start for s in plan_spans(path, "jsonl", first_line + 1)][:2] == [0, second_end]  # mid-line
    assert len(plan_spans(path, "jsonl", len(data) - 1)) == 1  # the last byte is the final newline: no cut
    last_start = data.rindex(b"\n", 0, len(data) - 1) + 1
    assert [s.start for s in plan_spans(path, "jsonl", last_start)] == [0, last_start]
    # A span owns the lines that START in it: a stop inside line 2 still reads all of line 2.
    assert read_all([Span(path, "jsonl", 0, first_line + 3)]) == [(1, "one"), (2, "two two")]
    assert read_all([Span(path, "jsonl", first_line, second_end, first=2)]) == [(2, "two two")]


def test_empty_and_blank_files(tmp_path):
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "blank.jsonl").write_bytes(b"\n \n\r\n")
    (tmp_path / "empty.jsonl.zst").write_bytes(b"")
    assert plan_spans(str(tmp_path / "empty.jsonl"), "jsonl", 10) == []
    assert plan_spans(str(tmp_path / "empty.jsonl.zst"), "jsonl.zst", 10) == []
    spans = plan_spans(str(tmp_path / "blank.jsonl"), "jsonl", 2)
    assert [(s.start, s.first) for s in spans] == [(0, 1), (3, 3)]
    assert read_all(spans) == []
    (tmp_path / "frame.jsonl.zst").write_bytes(zst(b""))  # one empty frame: no records, no error
    assert read_all(plan_spans(str(tmp_path / "frame.jsonl.zst"), "jsonl.zst", 10)) == []


# ---------------------------------------------------------------------------------------------
# Field paths
# ---------------------------------------------------------------------------------------------


def test_nested_field_paths_and_literal_dotted_keys_in_jsonl(tmp_path):
    path = tmp_path / "n.jsonl"
    records = [{"meta.body": "literal", "meta": {"body": "nested"}}, {"meta": {"body": "nested only"}},
               {"meta": {"body": {"deep": [1]}}}, {"meta": "flat"}, {"meta": {"other": 1}}, {"meta": None},
               {"a": {"b": {"c": "abc"}}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    policy, warnings = skipping()
    assert read_all(plan_spans(str(path), "jsonl", 10**6), "meta.body", policy) == [
        (1, "literal"), (2, "nested only"), (3, {"deep": [1]})]  # the value as found: the caller judges it
    assert policy.skipped == {"missing_text": 4}
    assert warnings[0] == f"warning: skipping {path}:4: no 'meta.body' field (fields: ['meta'])"
    assert warnings[-1] == f"warning: skipping {path}:7: no 'meta.body' field (fields: ['a'])"
    assert read_all(plan_spans(str(path), "jsonl", 10**6), "a.b.c", skipping()[0]) == [(7, "abc")]
    assert read_all(plan_spans(str(path), "jsonl", 10**6), "meta", skipping()[0])[:2] == [
        (1, {"body": "nested"}), (2, {"body": "nested only"})]


def test_nested_field_paths_and_literal_dotted_columns_in_parquet(tmp_path):
    path = str(tmp_path / "n.parquet")
    pq.write_table(pa.table({"meta.body": ["lit 1", "lit 2"], "meta": [{"body": "nested"}, None]}), path)
    spans = plan_spans(path, "parquet", 1)
    assert read_all(spans, "meta.body") == [(1, "lit 1"), (2, "lit 2")]  # the literal column first
    assert read_all(spans, "meta") == [(1, {"body": "nested"}), (2, None)]
    path2 = str(tmp_path / "m.parquet")
    pq.write_table(pa.table({"id": [1, 2], "meta": [{"body": "nested", "n": 1}, None]}), path2)
    policy, warnings = skipping()
    assert read_all(plan_spans(path2, "parquet", 1), "meta.body", policy) == [(1, "nested")]
    assert warnings == [f"warning: skipping {path2}: row 2: no 'meta.body' field (a struct above it is null)"]
    with pytest.raises(PrepareError) as e:
        read_all(plan_spans(path2, "parquet", 1), "meta.title")
    assert str(e.value) == f"{path2}: no 'meta.title' column (columns: ['id', 'meta.body', 'meta.n'])"


# ---------------------------------------------------------------------------------------------
# Bad records
# ---------------------------------------------------------------------------------------------

BAD_LINES = {  # line 2 of a file whose line 1 is good -> the error after "PATH:2: "
    "not_utf8": (b'{"text": "caf\xe9"}', "not valid UTF-8 (byte 13 of the line)"),
    "not_json": (b'{"text": ', "invalid JSON: Expecting value (column 10)"),
    "extra_data": (b'{"text": "a"} x', "invalid JSON: Extra data (column 15)"),
    "array": (b"[1, 2]", "expected a JSON object, got an array ([1, 2])"),
    "string": (b'"just a string"', 'expected a JSON object, got a string ("just a string")'),
    "no_field": (b'{"id": 5, "body": "x"}', "no 'text' field (fields: ['body', 'id'])"),
}
COMPRESS = {"jsonl": lambda b: b, "jsonl.gz": gzip.compress, "jsonl.zst": zst}
SUFFIX = {"jsonl": ".jsonl", "jsonl.gz": ".jsonl.gz", "jsonl.zst": ".jsonl.zst"}


@pytest.mark.parametrize("kind", sorted(COMPRESS))
@pytest.mark.parametrize("case", sorted(BAD_LINES))
def test_a_bad_line_raises_naming_file_and_line(tmp_path, case, kind):
    line, what = BAD_LINES[case]
    path = tmp_path / f"bad{SUFFIX[kind]}"
    path.write_bytes(COMPRESS[kind](b'{"text": "good"}\n' + line + b'\n{"text": "never read"}\n'))
    records = read_span(plan_spans(str(path), kind, 10**6)[0], ErrorPolicy("raise"), "text")
    assert next(records)[2] == "good"
    with pytest.raises(PrepareError) as e:
        next(records)
    assert str(e.value) == f"{path}:2: {what}"


@pytest.mark.parametrize("kind", sorted(COMPRESS))
def test_bad_lines_are_skipped_and_counted_by_reason(tmp_path, kind):
    lines = [b'{"text": "good 1"}', *(BAD_LINES[c][0] for c in sorted(BAD_LINES)), b"", b'{"text": "good 9"}']
    path = tmp_path / f"bad{SUFFIX[kind]}"
    path.write_bytes(COMPRESS[kind](b"\n".join(lines) + b"\n"))
    policy, warnings = skipping()
    assert read_all(plan_spans(str(path), kind, 10**6), "text", policy) == [(1, "good 1"), (9, "good 9")]
    assert policy.skipped == {"invalid_json": 4, "not_utf8": 1, "missing_text": 1}
    assert warnings == [f"warning: skipping {path}:{n}: {BAD_LINES[c][1]}"
                        for n, c in enumerate(sorted(BAD_LINES), 2)]


# ---------------------------------------------------------------------------------------------
# Bad files: corrupt or truncated compression, not parquet, no column, unreadable
# ---------------------------------------------------------------------------------------------

HEAD = LINES[: LINES.index(b"\n", len(LINES) // 3) + 1]  # whole lines: the first third or so
TAIL = LINES[len(HEAD) :]
K = HEAD.count(b"\n")


def bad_magic(member: bytes) -> bytes:
    return b"X" + member[1:]


def bad_crc(member: bytes) -> bytes:
    return member[:-8] + bytes(b ^ 0xFF for b in member[-8:-4]) + member[-4:]


def zlib_lines(prefix: bytes) -> int:
    """Whole lines a gzip prefix decompresses to (as far as zlib gets)."""
    return zlib.decompressobj(31).decompress(prefix).count(b"\n")


def zstd_lines(prefix: bytes) -> int:
    return zstandard.ZstdDecompressor().decompressobj().decompress(prefix).count(b"\n")


TRUNCATED_GZ = gzip.compress(LINES)[: len(gzip.compress(LINES)) // 2]
TRUNCATED_ZST = zst_streamed(LINES, block=3000)[: len(zst_streamed(LINES, block=3000)) // 2]  # one frame, cut
CORRUPT = {  # name -> (file suffix, data, whole lines kept, the error after "PATH: ")
    "gzip member 2 not gzip": (".jsonl.gz", gzip.compress(HEAD) + bad_magic(gzip.compress(TAIL)), K,
                               f"corrupt gzip data after line {K} (Not a gzipped file (b'X\\x8b'))"),
    "gzip member 1 bad crc": (".jsonl.gz", bad_crc(gzip.compress(HEAD)) + gzip.compress(TAIL), K,
                              f"corrupt gzip data after line {K} (CRC check failed 0x"),
    "gzip truncated": (".jsonl.gz", TRUNCATED_GZ, zlib_lines(TRUNCATED_GZ),
                       f"corrupt gzip data after line {zlib_lines(TRUNCATED_GZ)} (Compressed file ended "
                       "before the end-of-stream marker was reached)"),
    "gzip not gzip": (".json.gz", b'{"text": "plain"}\n', 0,
                      "corrupt gzip data before its first line (Not a gzipped file (b'{\"'))"),
    "zstd truncated": (".jsonl.zst", TRUNCATED_ZST, zstd_lines(TRUNCATED_ZST),
                       f"corrupt zstd data after line {zstd_lines(TRUNCATED_ZST)} (the file ends inside a "
                       "frame: truncated?)"),
    "zstd truncated in frame 2": (".jsonl.zst", zst(HEAD) + zst(TAIL)[:10], K,
                                  f"corrupt zstd data after line {K} (the file ends inside a frame: "
                                  "truncated?)"),
    "zstd garbage": (".jsonl.zst", b"this is not zstd\n" * 3, 0,
                     "corrupt zstd data before its first line (zstd decompressor error: Unknown frame "
                     "descriptor)"),
    "zstd trailing garbage": (".jsonl.zst", zst(HEAD) + b"garbage", K,
                              f"corrupt zstd data after line {K} (zstd decompressor error: Unknown frame "
                              "descriptor)"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_a_corrupt_compressed_file_names_the_file_and_the_last_good_line(tmp_path, case):
    suffix, data, kept, what = CORRUPT[case]
    path = tmp_path / f"c{suffix}"
    path.write_bytes(data)
    assert 0 < kept < len(RECORDS) or "before its first line" in what
    [span] = plan_spans(str(path), file_kind(str(path)), 1000)
    with pytest.raises(PrepareError) as e:
        read_all([span])
    assert str(e.value).startswith(f"{path}: {what}")
    policy, warnings = skipping()
    assert read_all([span], "text", policy) == EXPECTED["text"][:kept]  # the records before it are kept
    assert policy.skipped == {"corrupt_file": 1} and len(warnings) == 1
    assert warnings[0].startswith(f"warning: skipping {path}: {what}")


def test_parquet_whole_file_problems(corpus, tmp_path):
    good = Path(corpus["c.parquet"][0])
    (tmp_path / "csv.parquet").write_bytes(b"id,text\n1,hello\n")
    (tmp_path / "cut.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    not_parquet = "not a parquet file, or truncated (Parquet magic bytes not found in footer"
    for path in (tmp_path / "csv.parquet", tmp_path / "cut.parquet"):
        for attempt in (lambda p: plan_spans(str(p), "parquet", 1000),
                        lambda p: read_all([Span(str(p), "parquet")])):
            with pytest.raises(PrepareError) as e:
                attempt(path)
            assert str(e.value).startswith(f"{path}: {not_parquet}")
        policy, warnings = skipping()
        assert plan_spans(str(path), "parquet", 1000, policy=policy) == []
        assert read_all([Span(str(path), "parquet")], "text", policy) == []
        assert policy.skipped == {"corrupt_file": 2}  # once by the plan, once by the read
        assert warnings[0].startswith(f"warning: skipping {path}: {not_parquet}")
    # A parquet without the column: which columns it has, once per span, nothing read.
    spans = plan_spans(str(good), "parquet", 1)
    with pytest.raises(PrepareError) as e:
        read_all(spans, "body")
    assert str(e.value) == f"{good}: no 'body' column (columns: ['id', 'text', 'meta.body', 'meta.n'])"
    policy, _ = skipping()
    assert read_all(spans[:1], "body", policy) == [] and policy.skipped == {"corrupt_file": 1}


def test_corrupt_parquet_pages_keep_the_row_groups_before(corpus, tmp_path):
    good = Path(corpus["c.parquet"][0])
    meta = pq.ParquetFile(good).metadata
    text = meta.row_group(3).column(1)  # the `text` column chunk of the 4th row group
    assert text.path_in_schema == "text"
    data = bytearray(good.read_bytes())
    at = text.data_page_offset
    data[at : at + 40] = bytes(40)  # the page header: unreadable
    path = tmp_path / "pages.parquet"
    path.write_bytes(bytes(data))
    policy, warnings = skipping()
    assert read_all(plan_spans(str(path), "parquet", 10**9), "text", policy) == EXPECTED["text"][: 3 * 64]
    assert policy.skipped == {"corrupt_file": 1}
    assert warnings[0].startswith(f"warning: skipping {path}: corrupt parquet data at row {3 * 64 + 1} (")


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "jsonl.zst", "parquet"])
def test_an_unreadable_file_is_named(tmp_path, kind):
    path = str(tmp_path / "missing")
    with pytest.raises(PrepareError) as e:
        read_all([Span(path, kind)])
    assert str(e.value) == f"{path}: cannot read: No such file or directory"
    with pytest.raises(PrepareError) as e:
        plan_spans(path, kind, 100)
    assert str(e.value) == f"{path}: cannot read: No such file or directory"
    policy, _ = skipping()
    assert read_all([Span(path, kind)], "text", policy) == [] and policy.skipped == {"unreadable": 1}
    if kind == "jsonl":
        with pytest.raises(PrepareError, match=f"^{tmp_path}: cannot read: Is a directory$"):
            plan_spans(str(tmp_path), kind, 100)


# ---------------------------------------------------------------------------------------------
# Hugging Face datasets: splits, the local cache, never the Hub
# ---------------------------------------------------------------------------------------------


def test_hf_dataset_dict_splits(tmp_path):
    train = datasets.Dataset.from_list([{"text": f"train {i}"} for i in range(5)])
    test = datasets.Dataset.from_list([{"text": f"test {i}"} for i in range(3)])
    datasets.DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "dd"))
    datasets.DatasetDict({"a": train, "b": test}).save_to_disk(str(tmp_path / "ab"))
    datasets.DatasetDict({"only": test}).save_to_disk(str(tmp_path / "one"))
    dd, ab = tmp_path / "dd", tmp_path / "ab"
    assert read_all(plan_spans(str(dd), "hf", 10**6)) == [(i + 1, f"train {i}") for i in range(5)]
    spans = plan_spans(f"{dd}#test", "hf", 1)
    assert len(spans) == 3 and read_all(spans) == [(i + 1, f"test {i}") for i in range(3)]
    assert read_all(plan_spans(str(tmp_path / "one"), "hf", 10**6)) == [(i + 1, f"test {i}")
                                                                         for i in range(3)]
    with pytest.raises(PrepareError) as e:
        plan_spans(str(ab), "hf", 100)
    assert str(e.value) == f"{ab}: no train split (splits: ['a', 'b']); name one as hf:{ab}#SPLIT"
    with pytest.raises(PrepareError) as e:
        plan_spans(f"{dd}#nope", "hf", 100)
    assert str(e.value) == (f"{dd}#nope: no split 'nope' (splits: ['train', 'test']); "
                            f"name one as hf:{dd}#SPLIT")
    with pytest.raises(PrepareError) as e:
        plan_spans(str(tmp_path), "hf", 100)
    assert str(e.value).startswith(f"{tmp_path}: not a dataset saved with save_to_disk (")
    with pytest.raises(PrepareError) as e:
        read_all(plan_spans(str(dd), "hf", 100), "body")
    assert str(e.value) == f"{dd}: no 'body' column (columns: ['text'])"


def test_hf_dataset_names_come_from_the_local_cache_only(tmp_path, monkeypatch):
    # A dataset cached as `load_dataset("me/tiny_corpus")` leaves it:
    # <cache>/me___tiny_corpus/default/0.0.0/<hash>/
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(50)))
    from datasets.packaged_modules.json.json import Json

    builder = Json(cache_dir=str(tmp_path / "build"), dataset_name="tiny_corpus", hash="abc",
                   data_files={"train": str(tmp_path / "d.jsonl")})
    builder.download_and_prepare()
    cached = tmp_path / "cache" / "me___tiny_corpus" / "default" / "0.0.0"
    cached.mkdir(parents=True)
    os.rename(builder.cache_dir, cached / "abc")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    spans = plan_spans("me/tiny_corpus", "hf", 200)
    assert len(spans) > 1 and read_all(spans) == [(i + 1, f"doc {i}") for i in range(50)]
    with pytest.raises(PrepareError) as e:
        plan_spans("me/not_cached", "hf", 200)
    assert str(e.value).startswith("me/not_cached: neither a dataset directory saved with save_to_disk nor a "
                                   "dataset in the local Hugging Face cache (ConnectionError: ")
    assert "OfflineModeIsEnabled" in str(e.value)  # the Hub was not asked
    # restored
    assert datasets.config.HF_HUB_OFFLINE is False and huggingface_hub.constants.HF_HUB_OFFLINE is False


def test_a_missing_library_is_named_with_its_install(corpus, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # `import datasets` now fails as if not installed
    with pytest.raises(PrepareError) as e:
        plan_spans(corpus["hf"][0], "hf", 100)
    assert str(e.value) == "hf: sources need the `datasets` library: pip install 'packtrain[hf]'"
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(PrepareError) as e:
        read_all([Span(corpus["c.parquet"][0], "parquet")])
    assert str(e.value) == "reading parquet needs `pyarrow`: pip install 'pyarrow>=14'"


# ---------------------------------------------------------------------------------------------
# Progress and memory
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["c.jsonl", "c.jsonl.gz", "multi.jsonl.zst", "c.parquet", "hf"])
def test_progress_sums_to_the_span_bytes(corpus, name):
    path, kind = corpus[name]
    for span in plan_spans(path, kind, 3000):
        calls: list[int] = []
        list(read_span(span, ErrorPolicy("raise"), "text", calls.append))
        assert calls and all(n > 0 for n in calls)
        if kind == "hf":
            assert abs(sum(calls) - span.bytes) <= 1 + span.bytes // 100
        else:
            assert sum(calls) == span.bytes


def big_lines(n_bytes: int) -> bytes:
    """JSON lines of random hex text (compresses about 2x, like real text), about n_bytes in all."""
    rng = random.Random(1)
    lines, size, i = [], 0, 0
    while size < n_bytes:
        line = json.dumps({"id": i, "text": rng.randbytes(rng.randint(100, 3000)).hex()}).encode() + b"\n"
        lines.append(line)
        size, i = size + len(line), i + 1
    return b"".join(lines)


@pytest.mark.parametrize("suffix", [".jsonl.zst", ".jsonl"])
def test_reading_a_big_span_takes_bounded_memory(tmp_path, suffix):
    data = big_lines(30 << 20)
    path = tmp_path / f"big{suffix}"
    path.write_bytes(zstandard.ZstdCompressor(level=1).compress(data) if suffix == ".jsonl.zst" else data)
    del data
    [span] = plan_spans(str(path), file_kind(str(path)), 1 << 30)
    calls: list[int] = []
    tracemalloc.start()
    try:
        count = sum(1 for _ in read_span(span, ErrorPolicy("raise"), "text", calls.append))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert count > 10_000
    assert peak < 5 << 20, f"peak {peak / 2**20:.1f} MB while reading {span.bytes / 2**20:.0f} MB"
    assert sum(calls) == span.bytes and all(n >= 1 << 20 for n in calls[:-1])  # about every MB
    assert span.bytes // (2 << 20) <= len(calls) <= span.bytes // (1 << 20) + 1


# ---------------------------------------------------------------------------------------------
# Inputs and keys
# ---------------------------------------------------------------------------------------------


def test_file_kinds_by_suffix():
    kinds = {"a.jsonl": "jsonl", "a.JSON": "jsonl", "a.ndjson": "jsonl", "a.jsonl.gz": "jsonl.gz",
             "a.json.gz": "jsonl.gz", "a.NDJSON.GZ": "jsonl.gz", "a.jsonl.zst": "jsonl.zst",
             "a.json.zst": "jsonl.zst", "a.jsonl.zstd": "jsonl.zst", "a.parquet": "parquet",
             "dir.v2/a.Parquet": "parquet", "a.csv": None, "a.gz": None, "a.txt": None, ".jsonl": None,
             "a.jsonl.bz2": None, "a.parquet.gz": None}
    assert {p: file_kind(p) for p in kinds} == kinds


def test_expand_inputs(tmp_path):
    for rel in ("d/a.jsonl", "d/2024/b.json.gz", "d/2024/c.jsonl.zst", "d/x.csv", "p/one.parquet",
                "p/sub/two.parquet"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(b"")
    d = tmp_path / "d"
    def listed(kind, pattern):
        root, paths, aliases = expand_inputs(kind, pattern)
        assert aliases == dict.fromkeys(paths, 0)
        return root, paths

    assert listed("jsonl", f"{d}/**/*.json*") == (str(d), [f"{d}/2024/b.json.gz", f"{d}/2024/c.jsonl.zst",
                                                          f"{d}/a.jsonl"])
    assert listed("jsonl", f"{d}/a.jsonl") == (str(d), [f"{d}/a.jsonl"])
    assert listed("parquet", f"{tmp_path}/p/**/*") == (f"{tmp_path}/p", [f"{tmp_path}/p/one.parquet",
                                                                        f"{tmp_path}/p/sub/two.parquet"])
    with pytest.raises(PrepareError) as e:
        expand_inputs("jsonl", f"{d}/*")
    assert str(e.value) == f"jsonl:{d}/* matched {d}/x.csv: not a .jsonl/.json/.ndjson(.gz/.zst) file"
    with pytest.raises(PrepareError) as e:
        expand_inputs("parquet", f"{d}/**/*.json*")
    assert str(e.value) == f"parquet:{d}/**/*.json* matched {d}/2024/b.json.gz: not a .parquet file"
    with pytest.raises(PrepareError) as e:
        expand_inputs("jsonl", f"{d}/*.ndjson")
    assert str(e.value) == f"no files match '{d}/*.ndjson'"
    with pytest.raises(PrepareError) as e:
        expand_inputs("jsonl", str(d))
    assert str(e.value) == f"no files match '{d}' (a directory: give a glob such as 'DIR/**/*.jsonl')"


def test_record_stems_drop_format_suffixes():
    assert record_stem("d/2024/part-01.json.gz", "d") == "2024__part-01"
    assert record_stem("corpus.parquet", ".") == record_stem("corpus.jsonl.zst", ".") == "corpus"
    assert record_stem("d/v1.2/a.b.NDJSON.ZSTD", "d") == "v1__2__a__b"
    assert record_stem("d/notes.txt", "d") == "notes__txt"


@pytest.mark.parametrize("block", [1, 7, 50])
def test_spans_start_at_a_block_of_records_and_still_partition_the_file(tmp_path, block):
    """prepare ends shards at blocks of `block` records: a span never cuts one, wherever the byte target
    falls."""
    path = tmp_path / "b.jsonl"
    path.write_bytes(b"".join(json.dumps({"text": "x" * (i % 37)}).encode() + b"\n" for i in range(400)))
    starts = {}
    offset = 0
    for number, line in enumerate(path.read_bytes().splitlines(keepends=True), start=1):
        starts[offset] = number
        offset += len(line)
    for target in (1, 100, 999, 5000):
        spans = plan_spans(str(path), "jsonl", target, block=block)
        assert spans[0].start == 0 and spans[-1].stop == offset
        assert all(a.stop == b.start for a, b in zip(spans, spans[1:], strict=False))
        assert all(starts[s.start] == s.first and (s.first - 1) % block == 0 for s in spans), (block, target)
        assert all(s.bytes >= target for s in spans[:-1])
        if target == 1:
            assert [s.first for s in spans] == list(range(1, 401, block))  # every block its own span
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"text": str(i)} for i in range(400)]), tmp_path / "b.parquet",
                   row_group_size=40)
    groups = plan_spans(str(tmp_path / "b.parquet"), "parquet", 1, block=block)
    assert all((s.first - 1) % block == 0 for s in groups) and groups[-1].stop == 10
