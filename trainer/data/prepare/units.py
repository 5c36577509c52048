"""Preparing one unit of a plan: its documents -> train/val split -> token counts -> staged shards + a result.

A unit is read start to end by one process, in windows of a few MB (memory never holds more than one window,
whatever the corpus or unit size). Each document goes to train or val by a hash of its key (`unit_hash`: a
key's side never depends on the other documents), in input order (shuffling is the trainer stream's job: shard
permutation and shuffle buffer), is counted with the tokenizer and appended to the unit's shards (with its
token ids, unless prepared with --text-only):

    <stage>/u000003/train-0000.tar, train-0001.tar, ..., val-0000.tar    (final names are given at the merge)
    <stage>/u000003.json                                                  the result, written last

A shard never crosses a block: `docs_per_shard` consecutive records of one file (a train shard holds the train
documents of its block, a val shard the val ones), and units are cut only between blocks
(trainer.data.prepare.plan). So the shards are a function of the records alone: the same for 1 or 16 workers,
1 or 8 parts, and for the same corpus as .jsonl, .jsonl.zst or .parquet (which the plan cuts differently). The
demo's blocks are its units.

The result holds what the manifest needs (per-shard docs/tokens/bytes, the exact length distribution as
{length: count}, skips, renames, chat turns) and is all a restarted prepare needs to know the unit is done.
Everything is a function of the unit and the options, so a unit redone after a crash gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import resource
import shutil
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np

from trainer.data.chat import (
    TemplateLimitError,
    assistant_spans,
    assistant_token_mask,
    mask_ranges,
    render_conversation,
)
from trainer.data.config import TRAIN_SPLIT, VAL_SPLIT
from trainer.data.prepare import formats
from trainer.data.prepare.conversations import message_problem, module_conversations
from trainer.data.prepare.corpus import (
    ErrorPolicy,
    json_kind,
    module_name,
    read_module,
    read_text_file,
    sanitize_key,
    split_module,
    stdlib_root,
    unique_keys,
)
from trainer.data.prepare.plan import Piece, Unit
from trainer.data.shards import (
    ASSISTANT_FIELD,
    IDS_FIELD,
    PrepareError,
    ShardWriter,
    atomic_write_bytes,
    ids_member,
)
from trainer.data.tokenizer import encode_documents

WINDOW_BYTES = 4 << 20  # text per window (split, count, write)
WINDOW_DOCS = 8192
SPLITS = (TRAIN_SPLIT, VAL_SPLIT)
Progress = Callable[[int, int], None]  # (input bytes advanced, documents finished)


MB = 1 << 20
GB = 1 << 30


@dataclass(frozen=True)
class Job:
    """The options every unit of a plan is prepared with (picklable: it travels to worker processes)."""

    stage: str
    """The plan's staging directory."""
    tokenizer: str
    """Directory of the tokenizer to count with (staged)."""
    seed: int
    val_fraction: float
    docs_per_shard: int
    max_shard_bytes: int | None
    text_key: str
    on_error: str
    chat_template: str | None
    """Chat sources: the template conversations are rendered with."""
    max_docs: int | None = None
    max_doc_bytes: int | None = None
    """One document's largest size in bytes of UTF-8 text; larger: `policy.bad("too_large", ...)`."""
    ids_dtype: str | None = None
    """Store each document's token ids beside its text in this dtype ("<u2", "<u4"); None: text only."""
    ids_check: bool = False
    """End each ids member with the crc32 of its text and ids (trainer.data.shards.ids_member); False in a
    plan staged before it was written, whose other units have none."""
    framing: int = 1
    """Tokens each document gets beyond its text's (SpecialIds.added: the EOS, and the BOS of a tokenizer that
    starts documents with one): what its count includes. The ids stored are the text's alone; the stream
    frames."""


def unit_hash(key: str, seed: int) -> float:
    """A uniform number in [0, 1) from the key and seed; the same on every machine and Python."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def result_path(stage: str | Path, index: int) -> Path:
    return Path(stage) / f"u{index:06d}.json"


def unit_dir(stage: str | Path, index: int) -> Path:
    return Path(stage) / f"u{index:06d}"


def prepare_unit(unit: Unit, job: Job, tok, progress: Progress | None = None,
                 force: dict[str, str] | None = None) -> dict:
    """Prepare `unit` into `<stage>/u<index>/` and write its result `<stage>/u<index>.json`; return the
    result. `force` (key -> split) overrides the hash for those keys: the merge's at-least-one-document
    rules."""
    out = unit_dir(job.stage, unit.index)
    shutil.rmtree(out, ignore_errors=True)  # what an interrupted attempt left
    force = dict(force or {})
    policy = ErrorPolicy(job.on_error)
    renamed = Counter()
    lengths = {split: Counter() for split in SPLITS}
    extremes: dict[str, list] = {}  # train_min / val_max: [score, key] for the merge's at-least-one rules
    turns = 0
    writers = {split: ShardWriter(out, split, job.docs_per_shard, job.max_shard_bytes, name=_staged_name)
               for split in SPLITS}
    try:
        docs = unit_documents(unit, job, policy, renamed, progress)
        previous = None
        for block, window in _windows(docs):
            if block != previous:  # shards end with their block: the same shards however the input was cut
                for writer in writers.values():
                    writer.cut()
                previous = block
            sides: dict[str, list[tuple[str, str]]] = {split: [] for split in SPLITS}
            for key, text in window:
                score = unit_hash(key, job.seed)
                split = force.get(key) or (VAL_SPLIT if score < job.val_fraction else TRAIN_SPLIT)
                sides[split].append((key, text))
                _track(extremes, split, score, key)
            for split, side in sides.items():
                counts = _write_side(writers[split], side, tok, job)
                lengths[split].update(counts)
                if job.chat_template is not None:
                    turns += sum(len(assistant_spans(text)) for _, text in side)
            if progress is not None:
                progress(0, len(window))
        shards = {split: writer.close() for split, writer in writers.items()}
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    result = {
        "unit": unit.index,
        "force": force,
        "splits": {
            split: {
                "shards": [{"file": f"{out.name}/{s.name}", "docs": s.docs, "tokens": t, "bytes": s.bytes}
                           for s, t in zip(shards[split], writers[split].tokens, strict=True)],
                "docs": sum(s.docs for s in shards[split]),
                "tokens": sum(writers[split].tokens),
                "lengths": {str(k): v for k, v in sorted(lengths[split].items())},
            }
            for split in SPLITS
        },
        "skipped": dict(sorted(policy.skipped.items())),
        "renamed": renamed["doc"],
        "extremes": extremes,
        **({"chat": {"conversations": sum(lengths[s].total() for s in SPLITS), "assistant_turns": turns}}
           if job.chat_template is not None else {}),
    }
    atomic_write_bytes(result_path(job.stage, unit.index), (json.dumps(result) + "\n").encode("utf-8"))
    return result


def _write_side(writer: ShardWriter, side: list[tuple[str, str]], tok, job: Job) -> list[int]:
    """Append the documents of one split of a window to its shards: the text, and with `job.ids_dtype` the
    token ids (and, for chat data, the assistant turns' token ranges, from the offsets as the stream computes
    them); return their token counts (framing included: EOS, and BOS if the tokenizer adds one)."""
    chat_ranges = job.ids_dtype is not None and job.chat_template is not None
    encodings = encode_documents(tok, [text for _, text in side], offsets=chat_ranges)
    counts = []
    for (key, text), enc in zip(side, encodings, strict=True):
        fields = {}
        data = text.encode("utf-8")
        if job.ids_dtype is not None:
            ids = np.asarray(enc.ids, dtype=job.ids_dtype).tobytes()
            fields[IDS_FIELD] = ids_member(ids, data) if job.ids_check else ids
            if chat_ranges:
                fields[ASSISTANT_FIELD] = mask_ranges(assistant_token_mask(text, enc.offsets)).tobytes()
        writer.add(key, data, len(enc.ids) + job.framing, fields)
        counts.append(len(enc.ids) + job.framing)
    return counts


def load_result(stage: str | Path, index: int) -> dict | None:
    """A unit's result if the unit is done: the result file is there and every shard it lists has its size."""
    path = result_path(stage, index)
    try:
        result = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    for split in result["splits"].values():
        for shard in split["shards"]:
            file = Path(stage) / shard["file"]
            if not file.is_file() or file.stat().st_size != shard["bytes"]:
                return None
    return result


def _staged_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:04d}.tar"


def _track(extremes: dict[str, list], split: str, score: float, key: str) -> None:
    if split == TRAIN_SPLIT and ("train_min" not in extremes or [score, key] < extremes["train_min"]):
        extremes["train_min"] = [score, key]
    if split == VAL_SPLIT and ("val_max" not in extremes or [score, key] > extremes["val_max"]):
        extremes["val_max"] = [score, key]


def _windows(docs: Iterator[tuple[str, str, object]]) -> Iterator[tuple[object, list[tuple[str, str]]]]:
    """(block, documents) in order: runs of one block's documents of at most WINDOW_BYTES / WINDOW_DOCS."""
    window: list[tuple[str, str]] = []
    size, current = 0, None
    for key, text, block in docs:
        if window and (block != current or size >= WINDOW_BYTES or len(window) >= WINDOW_DOCS):
            yield current, window
            window, size = [], 0
        current = block
        window.append((key, text))
        size += len(text)
    if window:
        yield current, window


# ---------------------------------------------------------------------------------------------
# The documents of a unit
# ---------------------------------------------------------------------------------------------


def unit_documents(unit: Unit, job: Job, policy: ErrorPolicy, renamed: Counter | None = None,
                   progress: Progress | None = None) -> Iterator[tuple[str, str, object]]:
    """(key, text, block) of every document of `unit`, in order; at most `job.max_docs`. The block is what a
    shard may not cross: `docs_per_shard` consecutive records of a file (text: files of the listing), or the
    whole unit for the demo (whose units are cut between modules)."""
    renamed = Counter() if renamed is None else renamed
    left = job.max_docs
    for piece in unit.pieces:
        for key, text, block in _piece_documents(piece, job, policy, renamed, progress):
            if left is not None:
                if left == 0:
                    return
                left -= 1
            yield key, text, block
        if progress is not None and piece.kind in ("text", "module"):
            progress(piece.bytes, 0)


def _piece_documents(piece: Piece, job: Job, policy: ErrorPolicy, renamed: Counter,
                     progress: Progress | None) -> Iterator[tuple[str, str, object]]:
    size = job.docs_per_shard
    if piece.kind == "text":
        if not _fits(piece.bytes, piece.path, job, policy):  # judged by its size, before it is read
            return
        text = read_text_file(piece.path, policy)
        if text is not None:
            renamed["doc"] += piece.renamed
            yield piece.name, text, ("text", (piece.number - 1) // size)
        return
    if piece.kind == "module":
        for key, text in _module_documents(piece, job, policy, renamed):
            yield key, text, "unit"
        return
    assert piece.span is not None
    bytes_progress = (lambda n: progress(n, 0)) if progress is not None else None
    chat = job.chat_template is not None
    field_name = "messages" if chat else job.text_key
    missing = "missing_messages" if chat else "missing_text"
    for number, where, value in formats.read_span(piece.span, policy, field_name, bytes_progress, missing):
        text = _conversation(value, where, policy, job.chat_template) if chat else \
            document_text(value, where, policy, field_name)
        if text is not None and not _fits(len(text.encode("utf-8")), where, job, policy):
            continue
        if text is not None:
            renamed["doc"] += piece.renamed
            yield f"{piece.name}--{number}", text, (piece.path, (number - 1) // size)


TOKENIZE_BYTES_PER_BYTE = 128
"""What tokenizing one document holds at its peak, per byte of its text: measured ~110 for the BPE of
`tokenizers` (1.2 GB for a 10.8 MB document of words, 435 MB for 4 MB without whitespace). A document that
needs more than the process may still allocate would end the process with the library's abort (SIGABRT, no
message)."""
CHECKED_MB = 4
"""Documents larger than this are checked against the memory the process may still allocate before
tokenizing."""


def _fits(size: int, where: str, job: Job, policy: ErrorPolicy) -> bool:
    """Whether a document of `size` bytes is within job.max_doc_bytes and, if large, within what this process
    may still allocate to tokenize it; if not, reported (an error, or a counted skip `too_large`)."""
    if job.max_doc_bytes is not None and size > job.max_doc_bytes:
        policy.bad("too_large", where, f"the document is {size:,} bytes, over --max-doc-mb "
                                       f"{job.max_doc_bytes / MB:.3g} "
                                       "(tokenizing one document takes ~200x its size in memory): split it, "
                                       "raise --max-doc-mb, or skip such documents with --on-error skip")
        return False
    if (size > CHECKED_MB * MB and (room := allocatable_bytes()) is not None
            and size * TOKENIZE_BYTES_PER_BYTE > room):
        policy.bad("too_large", where, f"the document is {size:,} bytes: tokenizing it needs ~"
                                       f"{size * TOKENIZE_BYTES_PER_BYTE / GB:.1f} GB "
                                       f"(~{TOKENIZE_BYTES_PER_BYTE}x its size), more than the "
                                       f"{room / GB:.1f} GB this process may still allocate (its "
                                       "address-space limit or the machine's available memory): split it, "
                                       "lower --max-doc-mb, or skip such documents with --on-error skip")
        return False
    return True


def allocatable_bytes() -> int | None:
    """What this process may still allocate: the address-space limit (ulimit -v) less its mapped size, and the
    machine's available memory (/proc/meminfo), the smaller; None where neither is known."""
    known = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and (mapped := _status_kb("/proc/self/status", "VmSize")) is not None:
        known.append(soft - mapped * 1024)
    if (available := _status_kb("/proc/meminfo", "MemAvailable")) is not None:
        known.append(available * 1024)
    return max(0, min(known)) if known else None


def _status_kb(path: str, field: str) -> int | None:
    """A `Field:   N kB` line of a /proc file, in kB; None if unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _module_documents(piece: Piece, job: Job, policy: ErrorPolicy,
                      renamed: Counter) -> Iterator[tuple[str, str]]:
    """The demo's documents of one module (`split_module`), or the demo chat's conversations about it."""
    parsed = read_module(piece.path, policy)
    if parsed is None:
        return
    source, tree = parsed
    if job.chat_template is not None:  # the demo chat set: questions about the module's definitions
        module = module_name(Path(piece.path).relative_to(stdlib_root()))
        docs: Iterator[tuple[str, str]] = (
            (f"{piece.name}--{sanitize_key(name)}", text)
            for name, text in module_conversations(module, tree, policy, job.chat_template))
    else:
        docs = ((_rekey(piece.name, key), text) for key, text in split_module(source, "m", tree))
    # A module can define the same name twice: the second `k` becomes `k-2`.
    for (key, text), (original, _) in zip(unique_keys(docs := list(docs)), docs, strict=True):
        renamed["doc"] += key != original or piece.renamed
        yield key, text


def _rekey(module_key: str, key: str) -> str:
    """split_module's keys of the module "m" ("m", "m--f") with the module's real key in place of "m"."""
    return module_key + key[1:]


def document_text(value: object, where: str, policy: ErrorPolicy, field_name: str) -> str | None:
    """The document's text from a record's field, or None for a bad one (reported to `policy`)."""
    if not isinstance(value, str):
        policy.bad("text_not_string", where, f"field {field_name!r} is {json_kind(value)}, not a string: "
                   "each record needs its document as a string there (pick another field with --text-key, "
                   "or skip such records with --on-error skip)")
        return None
    if not value.strip():
        policy.bad("empty", where, "document is empty (only whitespace)")
        return None
    return value


def _conversation(value: object, where: str, policy: ErrorPolicy, template: str) -> str | None:
    """A chat record's messages rendered by the template, or None for a bad one (reported to `policy`)."""
    record = {"messages": value}
    problem = message_problem(record)
    if problem is not None:
        reason, field_path, what = problem
        policy.bad(reason, where, f"field {field_path!r} {what}" if field_path else what)
        return None
    messages = [{"role": m["role"], "content": m["content"]} for m in value]  # type: ignore[union-attr]
    try:
        return render_conversation(messages, template)
    except TemplateLimitError as e:  # the template's fault: every conversation would pay for it
        raise PrepareError(f"{where}: {e}") from None
    except jinja2.TemplateError as e:  # a template that refuses this conversation (raise_exception)
        policy.bad("template_error", where, f"the chat template refuses this conversation: {e}")
        return None
