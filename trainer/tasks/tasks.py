"""Task files: llm-foundry's jsonl forms, one item a line, checked line by line.

    multiple choice      {"query": "2 + 2 =", "choices": [" 4", " 5"], "gold": 0}
    language modeling    {"context": "The capital of France is", "continuation": " Paris"}

The scored text is the query followed by the choice exactly as written: no delimiter is added, so a space
that separates them belongs to one of the two strings (lm-eval's convention puts it at the start of the
choice). A language-modeling item is one choice, its gold, scored by log-likelihood and by greedy match. Every
line of a file has the same form; blank lines are skipped. A bad row (invalid UTF-8 or JSON, a missing key, an
empty query or choice, a gold index outside the choices) is one `TaskFileError` naming the file and the line.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from trainer.errors import UserError

MULTIPLE_CHOICE = "multiple_choice"
LANGUAGE_MODELING = "language_modeling"
FORMS = {MULTIPLE_CHOICE: ("query", "choices", "gold"), LANGUAGE_MODELING: ("context", "continuation")}
"""Each form's keys, as llm-foundry's ICL tasks spell them."""


class TaskFileError(UserError):
    """A task file, or one of its lines, that is not a task."""


@dataclass(frozen=True)
class Item:
    """One question: the query and its choices (a language-modeling item: the context and its
    continuation)."""

    query: str
    choices: tuple[str, ...]
    gold: int
    """Index of the right choice (0 for a language-modeling item)."""
    line: int = 0
    """1-based line of the task file (0: made in memory)."""


@dataclass(frozen=True)
class Task:
    name: str
    kind: str
    """MULTIPLE_CHOICE or LANGUAGE_MODELING."""
    items: tuple[Item, ...]
    source: str = ""
    """The file it was read from, or the built-in's description."""

    def digest(self) -> str:
        """sha256 of the items as scored (queries, choices, golds; not the file's bytes): what a checkpoint
        records, so that a resume can tell a task file changed since (its scores before and after are of other
        items)."""
        h = hashlib.sha256(self.kind.encode())
        for item in self.items:
            h.update(json.dumps([item.query, list(item.choices), item.gold]).encode("utf-8", "surrogatepass"))
        return h.hexdigest()


def load_task_file(path: str | Path) -> Task:
    """The task in jsonl file `path`, named by the file's stem; a TaskFileError names the first bad line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise TaskFileError(f"{path}: no such task file "
                            "(give a .jsonl file, or a built-in task name)") from None
    except OSError as e:
        raise TaskFileError(f"{path}: cannot read the task file ({e.strerror or e})") from e
    kind, items = None, []
    for number, line_bytes in enumerate(raw.split(b"\n"), 1):
        if not line_bytes.strip():
            continue
        where = f"{path}:{number}"
        row = _json_object(line_bytes, where)
        row_kind = _form(row, where)
        if kind is not None and row_kind != kind:
            raise TaskFileError(f"{where}: a {row_kind.replace('_', '-')} row in a "
                                f"{kind.replace('_', '-')} file: every line of a task file has the same form")
        kind = row_kind
        items.append(_item(row, kind, number, where))
    if not items:
        raise TaskFileError(f"{path}: the task file holds no items (one JSON object a line: "
                            '{"query", "choices", "gold"} or {"context", "continuation"})')
    return Task(name=path.stem, kind=kind, items=tuple(items), source=str(path))


def _json_object(line_bytes: bytes, where: str) -> dict:
    try:
        text = line_bytes.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TaskFileError(f"{where}: not UTF-8 (byte {e.start}: {line_bytes[e.start:e.start + 1]!r}): "
                            "task files are UTF-8 JSON lines") from None
    try:
        row = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise TaskFileError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise TaskFileError(f"{where}: JSON nested too deeply to read "
                            "(a task row is one flat object)") from None
    except ValueError as e:  # an integer of thousands of digits (the int conversion limit); a duplicate key
        raise TaskFileError(f"{where}: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(row, dict):
        raise TaskFileError(f"{where}: a JSON {type(row).__name__}, not an object")
    return row


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """json's object hook: a key given twice is refused (json.loads would keep the last one silently)."""
    row = dict(pairs)
    if len(row) != len(pairs):
        seen = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {twice!r} appears twice in one object: which one is meant is unclear")
    return row


def _form(row: dict, where: str) -> str:
    """The form whose keys the row holds: the one it holds the most keys of, if it holds them all (and no key
    of the other form)."""
    both = [key for keys in FORMS.values() for key in keys if key in row]
    if all(any(key in row for key in keys) for keys in FORMS.values()):
        raise TaskFileError(f"{where}: holds keys of both forms ({both}): a row is either "
                            "{\"query\", \"choices\", \"gold\"} (multiple choice) or "
                            "{\"context\", \"continuation\"} (language modeling)")
    kind = max(FORMS, key=lambda k: sum(key in row for key in FORMS[k]))
    missing = [key for key in FORMS[kind] if key not in row]
    if missing:
        raise TaskFileError(f"{where}: missing key(s) {missing}: a row is "
                            "{\"query\", \"choices\", \"gold\"} (multiple choice) or "
                            "{\"context\", \"continuation\"} (language modeling)")
    return kind


def _item(row: dict, kind: str, number: int, where: str) -> Item:
    if kind == LANGUAGE_MODELING:
        query, choices, gold = row["context"], [row["continuation"]], 0
        names = ("context", "continuation")
    else:
        query, choices, gold = row["query"], row["choices"], row["gold"]
        names = ("query", "choice")
    if not isinstance(query, str) or not query:
        raise TaskFileError(f"{where}: {names[0]} must be a non-empty string, got {query!r} (nothing "
                            f"precedes it, so its first {names[1]} token would be predicted from nothing)")
    if not isinstance(choices, list) or not choices:
        raise TaskFileError(f"{where}: choices must be a non-empty list of strings, got {choices!r}")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            label = names[1] if kind == LANGUAGE_MODELING else f"choice {i}"
            raise TaskFileError(f"{where}: {label} must be a non-empty string, got {choice!r}")
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        shown = (repr(gold) if len(repr(gold)) <= 40
                 else f"{repr(gold)[:20]}... ({len(repr(gold))} characters)")
        raise TaskFileError(f"{where}: gold must be an index into the {len(choices)} choices (0 to "
                            f"{len(choices) - 1}), got {shown}")
    for label, text in ((names[0], query), *((f"choice {i}", c) for i, c in enumerate(choices))):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise TaskFileError(f"{where}: {label} holds a lone surrogate "
                                f"({text[e.start]!r} at character {e.start}), "
                                "which is no Unicode character and cannot be tokenized") from None
    twins = [i for i, c in enumerate(choices) if c == choices[gold] and i != gold]
    if twins:
        raise TaskFileError(f"{where}: choice {twins[0]} is the gold choice {gold}'s text again "
                            f"({choices[gold]!r}): "
                            "the gold can never win alone, so the item scores no better than a coin")
    return Item(query=query, choices=tuple(choices), gold=gold, line=number)
