"""Token-length files of real text found on this machine, for `bench/packing.py --lengths`.

    .venv/bin/python bench/lengths/build.py [--tokenizer data/demo/tokenizer] [--out bench/lengths]

Each corpus is a list of documents cut from text that ships with the OS (Debian packages) and its Python,
tokenized with the demo tokenizer; a document's length is `count_tokens` (its tokens + 1 EOS), exactly
what the stream feeds the packer. Files are read in sorted order, so a machine with the same packages
gives the same lengths. The shapes differ on purpose:

    info_nodes.txt         GNU info manuals (/usr/share/info) cut at node separators: chapter- and
                           section-length prose, heavy tail (long reference chapters)
    man_sections.txt       English man pages (/usr/share/man/man[1-8]) cut at `.SH` headings: manual
                           entries, many short ones (NAME, SEE ALSO) and long DESCRIPTION/OPTIONS sections
    changelog_entries.txt  Debian changelogs (/usr/share/doc/*/changelog*.gz) cut at each version stanza:
                           dictionary-like, many short entries with a long tail
    docstrings.txt         docstrings of the Python standard library's modules, classes and functions:
                           short quotes, a few long module docstrings
    licenses.txt           /usr/share/common-licenses and the .venv's license files, one per document:
                           few, long documents (a small corpus the buffer mostly holds)
    mix.txt                all of the above, interleaved in a seeded random order

Example: a man page whose source holds `.TH LS 1`, `.SH NAME`, `.SH SYNOPSIS` gives three documents:
the header, the NAME section and the SYNOPSIS section (each section's text begins with its heading).
"""

from __future__ import annotations

import argparse
import ast
import glob
import gzip
import hashlib
import os
import random
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MAN_PAGE_STRIDE = 4  # every 4th man page: ~50,000 sections instead of ~200,000 keeps the file small
sys.path.insert(0, str(ROOT))

from trainer.data.tokenizer import count_tokens, load_tokenizer  # noqa: E402


def read_text(path: str) -> str:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            return f.read().decode("utf-8", errors="replace")
    except (OSError, EOFError):
        return ""


def unique_files(paths: list[str]) -> list[str]:
    """Sorted paths, the later of two files with identical bytes left out (packages share changelogs)."""
    seen: set[str] = set()
    out = []
    for path in sorted(paths):
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        if digest not in seen:
            seen.add(digest)
            out.append(path)
    return out


def nonempty(parts: Iterator[str] | list[str]) -> list[str]:
    return [p for p in parts if p.strip()]


def info_nodes() -> list[str]:
    """Info manuals, cut at the 0x1f node separator (the tag table and indirect tables dropped)."""
    docs: list[str] = []
    for path in unique_files(glob.glob("/usr/share/info/*.gz")):
        for node in read_text(path).split("\x1f"):
            if node.lstrip().startswith(("Tag Table:", "Indirect:", "End Tag Table")):
                continue
            docs.append(node)
    return nonempty(docs)


def man_sections() -> list[str]:
    """English man page sources (every MAN_PAGE_STRIDE-th page), cut before each `.SH` heading."""
    docs: list[str] = []
    for path in unique_files(glob.glob("/usr/share/man/man[1-8]/*.gz"))[::MAN_PAGE_STRIDE]:
        text = read_text(path)
        if text.startswith(".so "):  # a link to another page
            continue
        docs.extend(re.split(r"\n(?=\.SH[ \n])", text))
    return nonempty(docs)


def changelog_entries() -> list[str]:
    """Debian changelogs, cut before each stanza header (`package (version) dist; urgency=...`)."""
    docs: list[str] = []
    for path in unique_files(glob.glob("/usr/share/doc/*/changelog.Debian.gz")):
        docs.extend(re.split(r"\n(?=\S[^\n]*\([^)\n]*\)[^\n]*;\s*urgency=)", read_text(path)))
    return nonempty(docs)


def docstrings() -> list[str]:
    """Docstrings of the standard library (tests excluded), module, class and function, in file order."""
    stdlib = sysconfig.get_paths()["stdlib"]
    docs: list[str] = []
    for path in sorted(glob.glob(os.path.join(stdlib, "**", "*.py"), recursive=True)):
        rel = os.path.relpath(path, stdlib)
        if any(part in {"test", "tests", "idle_test", "site-packages"} for part in rel.split(os.sep)):
            continue
        try:
            tree = ast.parse(read_text(path))
        except (SyntaxError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    docs.append(doc)
    return nonempty(docs)


def licenses() -> list[str]:
    """Whole license files: the OS's common licenses and those shipped in the .venv's packages."""
    paths = sorted(p for p in glob.glob("/usr/share/common-licenses/*") if os.path.isfile(p))
    paths += sorted(glob.glob(str(ROOT / ".venv/lib/python*/site-packages/*.dist-info/LICEN[CS]E*")))
    paths += sorted(glob.glob(str(ROOT / ".venv/lib/python*/site-packages/*.dist-info/licenses/*")))
    return nonempty(read_text(p) for p in paths if os.path.isfile(p))


CORPORA = {
    "info_nodes": info_nodes,
    "man_sections": man_sections,
    "changelog_entries": changelog_entries,
    "docstrings": docstrings,
    "licenses": licenses,
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=str(ROOT / "data/demo/tokenizer"), help="tokenizer dir or json")
    p.add_argument("--out", default=str(HERE), help="directory for the .txt.gz files")
    p.add_argument("--seed", type=int, default=0, help="seed of the mix's interleaving")
    p.add_argument("--only", nargs="*", choices=list(CORPORA), help="build only these (and no mix)")
    args = p.parse_args(argv)
    tok = load_tokenizer(args.tokenizer)
    # The mix also holds the demo corpus (standard-library code), whose lengths are already here.
    with open(HERE / "demo_train.txt") as f:
        mix = [int(line) for line in f if line.strip() and not line.startswith("#")]
    for name, read in CORPORA.items():
        if args.only and name not in args.only:
            continue
        lengths = count_tokens(tok, read(), desc=name)
        mix.extend(lengths)
        write(os.path.join(args.out, f"{name}.txt.gz"), name, lengths)
    if not args.only:
        random.Random(args.seed).shuffle(mix)
        write(os.path.join(args.out, "mix.txt.gz"),
              f"mix (demo_train and the above, shuffled, seed {args.seed})", mix)


def write(path: str, name: str, lengths: list[int]) -> None:
    """One length per line after a `#` summary line; gzip with a zero mtime, so equal lengths give equal
    bytes."""
    s = sorted(lengths)
    median, p99 = s[len(s) // 2], s[min(len(s) - 1, int(0.99 * len(s)))]
    summary = f"{len(s):,} docs, {sum(s):,} tokens, median {median}, p99 {p99}, max {s[-1]}"
    text = f"# {name}: bench/lengths/build.py, demo tokenizer, EOS included; {summary}\n"
    text += "".join(f"{n}\n" for n in lengths)
    with open(path, "wb") as f:
        f.write(gzip.compress(text.encode(), compresslevel=9, mtime=0))
    print(f"{path}: {summary}")


if __name__ == "__main__":
    main()
