"""Raw documents: the demo corpus (the standard library) and text files; keys, and the policy for bad input.

Keys are WebDataset keys: webdataset splits a tar member name into key and field at the FIRST dot, so a key
must hold no dot; `sanitize_key` maps module and path separators to `__` and the def separator to `--`, and
`unique_keys` makes names unique (trainer.data.prepare.plan says how every document's key is made). Record
files (JSONL, parquet, ...) are read by trainer.data.prepare.formats.

Example: the class `JSONDecoder` in `json/decoder.py` becomes the document `json__decoder--JSONDecoder`,
and the module's header (docstring and imports) becomes `json__decoder`; the `demo-modules` corpus
(`whole_modules`) keeps each module whole, as the document `json__decoder`.

Bad input never surfaces as a library traceback: each reader hands the problem to an `ErrorPolicy`, which
either raises a `PrepareError` naming the file (and line) or warns and counts the item as skipped.
"""

from __future__ import annotations

import ast
import fnmatch
import glob
import io
import json
import os
import re
import stat
import sys
import sysconfig
import tokenize
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tqdm import tqdm

from trainer.data.config import ON_ERROR
from trainer.data.shards import PrepareError

# Directories of the standard library that are not the library itself. Test suites are left out by
# default: they hold deliberately broken files and would dominate the corpus (20 MB of 34 MB).
_NOT_STDLIB = {"site-packages", "dist-packages", "__pycache__"}
_TEST_DIRS = {"test", "tests", "idle_test"}


class ErrorPolicy:
    """What to do with a bad item: raise at once, or warn, count it by reason and go on.

    Example: policy = ErrorPolicy("skip"); policy.bad("empty", "a.txt", "document is empty")
    prints "warning: skipping a.txt: document is empty" and leaves policy.skipped == {"empty": 1}.
    """

    def __init__(self, on_error: str = "raise", warn: Callable[[str], None] | None = None) -> None:
        if on_error not in ON_ERROR:
            raise PrepareError(f"--on-error must be one of {ON_ERROR}, got {on_error!r}")
        self.on_error = on_error
        self.skipped: Counter[str] = Counter()
        # tqdm.write keeps a running progress bar intact.
        self._warn = warn or (lambda msg: tqdm.write(msg, file=sys.stderr))

    def bad(self, reason: str, where: str, what: str) -> None:
        """Raise, or skip the item, as the policy says."""
        if self.on_error == "raise":
            raise PrepareError(f"{where}: {what}")
        self.skip(reason, where, what)

    def skip(self, reason: str, where: str, what: str) -> None:
        """Warn and count, whatever the policy (the demo skips its odd files this way)."""
        self.skipped[reason] += 1
        self._warn(f"warning: skipping {where}: {what}")


# ---------------------------------------------------------------------------------------------
# Keys
# ---------------------------------------------------------------------------------------------


def sanitize_key(name: str) -> str:
    """A WebDataset-safe key: only [A-Za-z0-9_-], no dots (webdataset splits key from field at a dot).

    Examples:
        "json.decoder:JSONDecoder" -> "json__decoder--JSONDecoder"
        "notes/day 1.txt"          -> "notes__day_1__txt"
    """
    key = name.replace(".", "__").replace("/", "__").replace("\\", "__").replace(":", "--")
    key = re.sub(r"[^A-Za-z0-9_-]", "_", key)
    return key or "_"


def unique_keys(docs: Iterable[tuple[str, str]],
                renamed: Counter[str] | None = None) -> Iterator[tuple[str, str]]:
    """Make keys unique in stream order: the second `k` becomes `k-2`, the third `k-3`, and so on.

    A module can define the same top-level name twice, and two paths can sanitize to one key. The
    first occurrence keeps its key, so keys do not change when a later duplicate is added or removed.
    `renamed["duplicate_key"]` counts the renames.
    """
    seen: set[str] = set()
    for key, text in docs:
        new_key, n = key, 1
        while new_key in seen:
            n += 1
            new_key = f"{key}-{n}"
        if new_key != key and renamed is not None:
            renamed["duplicate_key"] += 1
        seen.add(new_key)
        yield new_key, text


# ---------------------------------------------------------------------------------------------
# The demo corpus: the standard library, one document per top-level def / class, plus the header
# ---------------------------------------------------------------------------------------------


def split_module(source: str, module: str, tree: ast.Module | None = None) -> list[tuple[str, str]]:
    """Cut a module into documents: its header, then each top-level function and class, by source lines.

    The header is every line before the first top-level def/class (docstring, imports, constants).
    A def or class starts at its first decorator. Top-level code between or after the defs (other
    than the header) belongs to no document. Raises SyntaxError if `source` does not parse (`tree`, if
    given, is `ast.parse(source)` done already).

    Example, module "m":
        1  '''Doc.'''                 ->  ("m",          "'''Doc.'''\\nimport os\\n")
        2  import os
        3  @cache                     ->  ("m--f",       "@cache\\ndef f():\\n    return 1\\n")
        4  def f():
        5      return 1
        6  class C:                   ->  ("m--C",       "class C:\\n    x = 1\\n")
        7      x = 1
    """
    tree = ast.parse(source) if tree is None else tree
    # Split on "\n" only: ast counts lines that way, while str.splitlines also breaks at form feeds.
    lines = io.StringIO(source).readlines()
    defs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    starts = [min([n.lineno] + [d.lineno for d in n.decorator_list]) for n in defs]

    docs = []
    header = "".join(lines[: starts[0] - 1] if defs else lines)
    if header.strip():
        docs.append((sanitize_key(module), header))
    for node, start in zip(defs, starts, strict=True):
        docs.append((sanitize_key(f"{module}:{node.name}"), "".join(lines[start - 1 : node.end_lineno])))
    return docs


def module_name(rel_path: Path) -> str:
    """Dotted module name of a file relative to its library root.

    Examples: json/decoder.py -> "json.decoder", json/__init__.py -> "json", os.py -> "os".
    """
    parts = list(rel_path.with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(include_tests: bool = False) -> tuple[Path, list[Path]]:
    """The standard library's root and its `.py` files on this machine, sorted; site-packages excluded."""
    root = stdlib_root()
    skip = _NOT_STDLIB | (set() if include_tests else _TEST_DIRS)
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in skip]
        files.extend(Path(dirpath, f) for f in filenames if f.endswith(".py"))
    return root, sorted(files, key=lambda p: p.relative_to(root).as_posix())


def whole_modules(include_tests: bool = False) -> list[tuple[str, Path]]:
    """The `demo-modules` corpus: (key, path) of each standard-library module that makes a document as a whole
    file, in `stdlib_files` order. A module qualifies when it is UTF-8 and not blank (the stdlib holds many
    empty `__init__.py` files); keys are the module's sanitized dotted name, as the demo names a module's
    header.

    Example: json/decoder.py -> ("json__decoder", <stdlib>/json/decoder.py);
    json/__init__.py -> ("json", ...). The same text as the demo, cut differently: whole modules (thousands of
    tokens) instead of its functions and classes (a hundred or so), so the two make a mixture with clearly
    different length profiles.
    """
    root, files = stdlib_files(include_tests)
    out = []
    for path in files:
        try:
            usable = bool(path.read_bytes().decode("utf-8").strip())
        except (OSError, UnicodeDecodeError):
            usable = False
        if usable:
            out.append((sanitize_key(module_name(path.relative_to(root))), path))
    return out


def decode_python(data: bytes) -> str:
    """Source bytes to text, honouring a PEP 263 coding cookie; newlines normalized to "\\n"."""
    encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    text = data.decode(encoding)
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def read_module(path: str | Path, policy: ErrorPolicy) -> tuple[str, ast.Module] | None:
    """A standard-library file's source and syntax tree, or None after counting it as skipped (`policy.skip`,
    whatever the policy says: the demo has no user to blame) when it cannot be read, decoded or parsed."""
    try:
        source = decode_python(Path(path).read_bytes())
        return source, ast.parse(source)
    except OSError as e:
        policy.skip("unreadable", str(path), f"cannot read: {e.strerror or e}")
    except (UnicodeDecodeError, SyntaxError, LookupError, ValueError) as e:  # ValueError: a NUL byte
        reason = "syntax_error" if isinstance(e, SyntaxError) else "not_decodable"
        policy.skip(reason, str(path), f"{type(e).__name__}: {e}")
    return None


# ---------------------------------------------------------------------------------------------
# User sources: text files and JSON lines
# ---------------------------------------------------------------------------------------------


def glob_root(pattern: str) -> str:
    """The directory part of a glob before its first wildcard: keys are paths relative to it.

    Examples: "data/docs/**/*.md" -> "data/docs", "notes/*.txt" -> "notes", "*.txt" -> ".".
    """
    parts = Path(pattern).parts
    fixed = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return str(Path(*fixed)) if fixed else "."


def not_regular_file(path: str) -> str | None:
    """Why `path` is not a regular file one can read to its end (None if it is, or if it cannot be stat'ed:
    the read reports that). Example: a FIFO -> "not a regular file (a FIFO): reading it would block"."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a device"
    return f"not a regular file ({kind}): reading it would block or never end"


def read_text_file(path: str, policy: ErrorPolicy) -> str | None:
    """A file's text, or None after reporting why it is unusable (unreadable, not a regular file, not UTF-8,
    empty). A FIFO, socket or device is never opened: reading one would block, or never end."""
    problem = not_regular_file(path)
    if problem is not None:
        policy.bad("not_a_file", path, problem)
        return None
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        policy.bad("unreadable", path, f"cannot read: {e.strerror or e}")
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        policy.bad("not_utf8", path, f"not valid UTF-8 (byte {e.start}: {data[e.start : e.start + 1]!r})")
        return None
    if not text.strip():
        policy.bad("empty", path, "document is empty (only whitespace)")
        return None
    return text


def match_files(pattern: str) -> tuple[list[str], dict[str, int]]:
    """The files matching `pattern` (a path or a glob; a `**` component matches any number of directories),
    sorted, each real file once, and for each kept path how many other matching paths reach the same file.

    `glob.glob(recursive=True)` follows directory symlinks without noticing a loop: with `sub/up -> ..`,
    `d/**/*.txt` lists `d/a.txt`, `d/sub/up/a.txt`, `d/sub/up/sub/up/a.txt`... until the path is too long, and
    two loops make that exponential. Here each real directory is walked once and each real file (device,
    inode) is kept under its first path in sorted order. As `glob`, wildcards skip names starting with a dot
    unless the pattern's component starts with one. Example: d/a.txt, d/sub/up -> .. :
    match_files("d/**/*.txt") -> (["d/a.txt"], {"d/a.txt": 0}); a second link d/b.txt -> a.txt makes it
    (["d/a.txt"], {"d/a.txt": 1}).
    """
    parts = Path(pattern).parts
    if "**" in parts:
        at = parts.index("**")
        prefix = os.path.join(*parts[:at]) if at else ""
        bases = sorted(glob.glob(prefix)) if glob.has_magic(prefix) else [prefix]
        found = [path for base in bases for path in _walk_matching(base, parts[at:])]
    else:
        found = glob.glob(pattern)
    kept: dict[tuple[int, int], str] = {}
    aliases: dict[str, int] = {}
    for path in sorted(found):
        try:
            st = os.stat(path)
        except OSError:  # a dangling link: the reader names it
            kept[(-1, len(kept))] = path
            aliases[path] = 0
            continue
        if stat.S_ISDIR(st.st_mode):
            continue
        first = kept.setdefault((st.st_dev, st.st_ino), path)
        aliases[first] = aliases.get(first, -1) + 1
    return list(aliases), aliases


def _walk_matching(base: str, rest: tuple[str, ...]) -> Iterator[str]:
    """Paths under directory `base` whose relative path matches `rest` (components; `**`: zero or more of
    them), walking each real directory once (symlinked directories are followed, loops are not)."""
    top = base or "."
    if not os.path.isdir(top):
        return
    hidden = any(part.startswith(".") for part in rest)
    seen: set[tuple[int, int]] = set()
    for dirpath, dirnames, filenames in os.walk(top, followlinks=True):
        st = os.stat(dirpath)
        if (st.st_dev, st.st_ino) in seen:
            dirnames[:] = []
            continue
        seen.add((st.st_dev, st.st_ino))
        if not hidden:
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        rel = os.path.relpath(dirpath, top)
        rel_parts = () if rel == "." else tuple(Path(rel).parts)
        for name in [*filenames, *dirnames]:
            if _matches((*rel_parts, name), rest):
                yield os.path.join(base, *rel_parts, name) if base else os.path.join(*rel_parts, name)


def _matches(names: tuple[str, ...], parts: tuple[str, ...]) -> bool:
    """Whether path components `names` match glob components `parts` (`**`: zero or more non-hidden names)."""
    if not parts:
        return not names
    head, tail = parts[0], parts[1:]
    if head == "**":
        return any(_matches(names[i:], tail) for i in range(len(names) + 1)
                   if not any(n.startswith(".") for n in names[:i]))
    if not names or (names[0].startswith(".") and not head.startswith(".")):
        return False
    return fnmatch.fnmatchcase(names[0], head) and _matches(names[1:], tail)


def text_paths(pattern: str) -> tuple[list[str], dict[str, int]]:
    """The files matching `pattern` (`match_files`: recursive `**`, each real file once); an error if none."""
    paths, aliases = match_files(pattern)
    if not paths:
        raise PrepareError(f"no files match {pattern!r}")
    return paths, aliases


def json_kind(value: object) -> str:
    """How JSON names a parsed value, with a short preview. Example: 42 -> "a number (42)", None -> "null"."""
    if value is None:
        return "null"
    kind = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "an array",
            dict: "an object"}
    preview = json.dumps(value, ensure_ascii=False)
    return (f"{kind.get(type(value), type(value).__name__)} "
            f"({preview if len(preview) <= 40 else preview[:37] + '...'})")
