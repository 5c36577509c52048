"""The plan of a prepare: a source cut into units that worker processes (and machines) prepare independently.

A unit is a list of pieces read in order: spans of record files (trainer.data.prepare.formats: byte ranges of
a JSONL, a whole .gz/.zst, row groups of a parquet, rows of a Hugging Face dataset), or whole files (text: one
file = one document; the demo: one standard-library module). Units are cut from the input alone, ~`unit_bytes`
each, so the shards a unit gives do not depend on how many workers or machines share the work: `--workers 1`
and `--workers 8`, one machine and `--parts 4` on four, give byte-identical shards.

Keys. Every document's key is derived from its position, so keys are unique by construction and nothing has
to remember the keys already seen (at 10^9 documents that set would not fit in memory):

    jsonl / parquet / hf   <file stem>--<record number>   "2024/part-01.json.gz", line 7 -> "2024__part-01--7"
    text                   the file's path               "notes/day 1.txt" -> "notes__day_1__txt"
    demo                   module and definition         json/decoder.py, JSONDecoder ->
                                                         "json__decoder--JSONDecoder"

The stem is the file's path relative to the glob's fixed directory without its format suffixes, so the same
corpus as .jsonl, .jsonl.zst or .parquet gets the same keys (and the same train/val split). Record numbers are
line numbers for JSONL (blank lines count) and row numbers for parquet and datasets: unique within a file.
File stems (and text keys, and module names) are made unique over the files, which the plan lists anyway:
a second `a.jsonl.gz` beside `a.jsonl` gets the stem `a-2` (counted in the manifest's renamed_duplicate_keys).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from trainer.data.prepare import formats
from trainer.data.prepare.corpus import (
    ErrorPolicy,
    PrepareError,
    glob_root,
    module_name,
    sanitize_key,
    stdlib_files,
    text_paths,
    unique_keys,
)

MIB = 1 << 20
MIN_UNIT_BYTES = 1 * MIB
MAX_UNIT_BYTES = 64 * MIB
UNITS_PER_CORPUS = 64  # automatic unit size: the corpus / 64, within [1 MiB, 64 MiB]
RECORD_KINDS = ("jsonl", "parquet", "hf")  # source prefixes whose documents are records of files
SOURCES = ("'demo', 'demo-chat', 'demo-modules', 'text:GLOB', 'jsonl:GLOB', 'parquet:GLOB', "
           "'hf:DIR_OR_NAME' or 'chat:GLOB'")


@dataclass(frozen=True)
class Piece:
    """One input of a unit: a span of a record file, a text file (one document) or a standard-library
    module."""

    kind: str
    """A formats kind ("jsonl", "jsonl.gz", "jsonl.zst", "parquet", "hf"), "text" or "module"."""
    path: str
    name: str
    """Record kinds: the key stem; text: the document's key; module: the module's key (its sanitized name)."""
    bytes: int
    renamed: bool = False
    """`name` was made unique (another file had it first)."""
    aliases: int = 0
    """Other paths of the source that reach this same file (symlinks): it is read once, under `path`; each is
    counted as skipped (`same_file`)."""
    span: formats.Span | None = None
    number: int = 0
    """Text: the file's 1-based position in the listing (its record number: files make blocks too)."""

    def to_json(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "span"}
        if self.span is not None:
            d["span"] = self.span.to_json()
        return d

    @classmethod
    def from_json(cls, d: dict) -> Piece:
        span = formats.Span.from_json(d["span"]) if d.get("span") is not None else None
        return cls(**{**{k: v for k, v in d.items() if k != "span"}, "span": span})


@dataclass(frozen=True)
class Unit:
    index: int
    pieces: tuple[Piece, ...]

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.pieces)

    def to_json(self) -> dict:
        return {"index": self.index, "pieces": [p.to_json() for p in self.pieces]}

    @classmethod
    def from_json(cls, d: dict) -> Unit:
        return cls(index=d["index"], pieces=tuple(Piece.from_json(p) for p in d["pieces"]))


@dataclass
class Plan:
    """What a prepare will do: the source's units and every option that shapes the output. Its `id` names the
    staging directory, so a restarted prepare (or another part) finds the work of the same plan."""

    source: str
    units: list[Unit]
    options: dict = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return is_chat(self.source)

    @functools.cached_property
    def id(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()[:16]

    @property
    def bytes(self) -> int:
        return sum(u.bytes for u in self.units)

    def to_json(self) -> dict:
        return {"source": self.source, "options": self.options, "units": [u.to_json() for u in self.units]}

    @classmethod
    def from_json(cls, d: dict) -> Plan:
        return cls(source=d["source"], options=d["options"], units=[Unit.from_json(u) for u in d["units"]])

    def part(self, index: int, parts: int) -> list[Unit]:
        """The units of part `index` of `parts`: every parts-th unit (units are about the same size)."""
        return [u for u in self.units if u.index % parts == index]


def is_chat(source: str) -> bool:
    return source == "demo-chat" or source.startswith("chat:")


def input_files(source: str) -> list[Piece]:
    """The files of `source`, named, with their sizes (a listing and a stat each: cheap)."""
    kind, _, arg = source.partition(":")
    if kind in ("demo", "demo-chat") and not arg:
        return list(_module_files())
    if kind == "text" and arg:
        return list(_text_files(arg))
    if kind in ("jsonl", "parquet", "chat") and arg:
        return list(_record_files("jsonl" if kind == "chat" else kind, arg))
    if kind == "hf" and arg:
        return [Piece("hf", arg, sanitize_key(Path(arg.rstrip("/")).name or arg), 0)]
    raise PrepareError(f"unknown source {source!r}; expected {SOURCES}")


def inputs_key(files: Sequence[Piece], options: dict, unit_bytes: int | None, single_unit: bool) -> str:
    """What the plan is a function of, short of reading the files: their names and sizes, and the options. A
    restarted prepare (or another part) with the same key reuses the staged plan instead of planning again,
    which for a plain JSONL means reading it through to count lines."""
    data = [[p.to_json() for p in files], options, unit_bytes, single_unit]
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def make_plan(source: str, options: dict, unit_bytes: int | None = None, single_unit: bool = False,
              files: list[Piece] | None = None) -> Plan:
    """Cut `source` (its `input_files`, unless given) into units of ~`unit_bytes` (None: automatic, see
    UNITS_PER_CORPUS). `single_unit`: one unit holding every piece in order (--max-docs: "the first N
    documents" needs one sequential reader)."""
    files = input_files(source) if files is None else files
    key = inputs_key(files, options, unit_bytes, single_unit)
    total = sum(p.bytes for p in files)
    if unit_bytes is None:
        unit_bytes = min(MAX_UNIT_BYTES, max(MIN_UNIT_BYTES, total // UNITS_PER_CORPUS))
    # --on-error skip: a file that cannot be planned (not a parquet, unreadable) is skipped and counted here.
    policy = ErrorPolicy(options.get("on_error", "raise"))
    if sum(f.aliases for f in files):
        policy.skipped["same_file"] += sum(f.aliases for f in files)
    block = options.get("docs_per_shard", 1)
    pieces = [piece for f in files for piece in _spans(f, unit_bytes, policy, block)]
    if not pieces:
        raise PrepareError(f"no documents in {source!r}: its files are empty or were skipped "
                           f"({dict(policy.skipped) or 'none skipped'})")
    groups = [pieces] if single_unit else list(_group(pieces, unit_bytes, block))
    units = [Unit(i, tuple(g)) for i, g in enumerate(groups)]
    return Plan(source=source, units=units, options={**options, "unit_bytes": unit_bytes, "inputs": key,
                                                     "plan_skipped": dict(sorted(policy.skipped.items()))})


def _spans(piece: Piece, unit_bytes: int, policy: ErrorPolicy, block: int) -> Iterator[Piece]:
    """A record file cut into its spans (each starting a block); a text file or module as it is."""
    if piece.kind in ("text", "module"):
        yield piece
        return
    for span in formats.plan_spans(piece.path, piece.kind, unit_bytes, block=block,
                                   policy=policy if policy.on_error == "skip" else None):
        yield dataclasses.replace(piece, bytes=span.bytes, span=span)


def _group(pieces: Sequence[Piece], unit_bytes: int, block: int) -> Iterator[list[Piece]]:
    """Consecutive pieces into units of at least `unit_bytes` (the last may be smaller), cut only where a
    block starts: before a span or a file of records, before a text file whose number is 1 + a multiple of
    `block`, or between modules (the demo's blocks are its units)."""
    group: list[Piece] = []
    size = 0
    for piece in pieces:
        starts_block = piece.kind != "text" or (piece.number - 1) % block == 0
        if group and size >= unit_bytes and starts_block:
            yield group
            group, size = [], 0
        group.append(piece)
        size += piece.bytes
    if group:
        yield group


def _unique(named: list[tuple[str, str]], kind: str,
            aliases: dict[str, int] | None = None) -> Iterator[Piece]:
    """Pieces for (name, path) pairs, names made unique in order (`unique_keys`: the second `k` is `k-2`)."""
    aliases = aliases or {}
    for (name, path), (original, _) in zip(unique_keys(named), named, strict=True):
        yield Piece(kind, path, name, _size(path), renamed=name != original, aliases=aliases.get(path, 0))


def _module_files() -> Iterator[Piece]:
    root, files = stdlib_files()
    yield from _unique([(sanitize_key(module_name(p.relative_to(root))), str(p)) for p in files], "module")


def _text_files(pattern: str) -> Iterator[Piece]:
    root = glob_root(pattern)
    paths, aliases = text_paths(pattern)
    named = [(sanitize_key(os.path.relpath(p, root)), p) for p in paths]
    for number, piece in enumerate(_unique(named, "text", aliases), start=1):
        yield dataclasses.replace(piece, number=number)


def _record_files(kind: str, pattern: str) -> Iterator[Piece]:
    root, paths, aliases = formats.expand_inputs(kind, pattern)
    for piece in _unique([(formats.record_stem(p, root), p) for p in paths], kind, aliases):
        yield dataclasses.replace(piece, kind=formats.file_kind(piece.path) or kind)


def _size(path: str | os.PathLike) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0  # unreadable: reported when the unit reads it
