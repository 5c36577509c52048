"""The prepared dataset on disk: WebDataset tar shards plus one `manifest.json`.

Layout of a prepared directory:

    <out>/manifest.json          written last; the only file readers need to find everything else
    <out>/tokenizer/             Hugging Face layout (see trainer.data.tokenizer)
    <out>/train-000000.tar ...   one sample per document
    <out>/val-000000.tar ...

Sample schema: each document is a `<key>.txt` tar member holding its UTF-8 text, which webdataset reads back
as {"__key__": key, "txt": bytes, ...}; by default followed by `<key>.ids`, the text's token ids as the
manifest's tokenizer encodes it (no EOS; little-endian uint16, or uint32 for a vocabulary over 65,536: the
manifest's "ids" entry says which, and the tokenizer's sha256 they were encoded with; under the entry's
"check": "crc32" the member ends with 4 more bytes, a little-endian crc32 of the text's length and ends and of
the ids, which ties the ids to their text: `ids_check`), and for chat data `<key>.assistant`, the
assistant turns' tokens as [start, end) ranges of token indices (little-endian uint32 pairs). The stream reads
the ids instead of tokenizing the text when the run's tokenizer is the one they were encoded with
(`StoredIds`). Keys hold no dot (webdataset cuts the member name into key and field at the first dot) and are
unique across the dataset.

Every file is written atomically (temp file in the same directory, then `os.replace`), so a reader
never sees half a shard; `trainer.prepare` stages a new dataset beside the old one and swaps it in at the end,
manifest last (trainer.data.prepare.assemble).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tarfile
import tempfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from trainer.errors import UserError


class PrepareError(UserError):
    """Bad input or bad prepared data. The message names the file (and line) and what is wrong."""


TEXT_FIELD = "txt"
IDS_FIELD = "ids"
ASSISTANT_FIELD = "assistant"
MANIFEST_FILE = "manifest.json"
FORMAT_VERSION = "packtrain-shards/1"
SCHEMA = {
    "__key__": "str: unique document id, no dots (webdataset splits a member name at its first dot)",
    TEXT_FIELD: "bytes: the document text, UTF-8, without EOS (the stream appends one EOS per document)",
}
IDS_SCHEMA = {
    IDS_FIELD: "bytes: the text's token ids (no EOS), little-endian, of the dtype and tokenizer in 'ids'; "
               "with its check 'crc32', then 4 bytes: trainer.data.shards.ids_check, the little-endian "
               "crc32 of the text's length (8 bytes, little-endian), its first and last 64 bytes, then "
               "the ids' bytes",
}
ASSISTANT_SCHEMA = {
    ASSISTANT_FIELD: "bytes: the assistant turns' tokens, [start, end) token index ranges, "
                     "little-endian uint32 pairs",
}


def ids_dtype(vocab_size: int) -> str:
    """The numpy dtype stored ids take: "<u2" up to 65,536 token ids, else "<u4"."""
    return "<u2" if vocab_size <= 1 << 16 else "<u4"


IDS_CHECK = "crc32"
"""The manifest's "ids" "check": each ids member ends with a crc32 of its text and ids (`ids_member`)."""
CHECK_BYTES = 4
TEXT_ENDS = 64
"""Bytes of each end of the text the check covers, with the text's length:
a text of any size costs the same."""


def ids_check(ids: bytes, text: bytes) -> int:
    """The crc32 that ties `ids` to `text`: of the text's length (8 bytes, little-endian), its first and last
    TEXT_ENDS bytes, then the ids. Another sample's ids fail it unless that sample's text has the same length
    and ends; a changed id fails it. Cheap: ~1 KB hashed for a document of a few hundred tokens, whatever its
    text's size."""
    ends = len(text).to_bytes(8, "little") + text[:TEXT_ENDS] + text[-TEXT_ENDS:]
    return zlib.crc32(ids, zlib.crc32(ends))


def ids_member(ids: bytes, text: bytes) -> bytes:
    """The `ids` member prepare writes: the ids' bytes, then their `ids_check` with `text` (4 bytes,
    little-endian). Example:
    ids_member(b"\x01\x00", b"a") -> b"\x01\x00" + ids_check(b"\x01\x00", b"a").to_bytes(4, "little")."""
    return ids + ids_check(ids, text).to_bytes(CHECK_BYTES, "little")


def wide_ids(ids: bytes, dtype: str) -> bool:
    """Whether <u2 ids look like <u4 ones read as <u2: at least two values, every second one 0 (the high
    halves of ids under 65,536). Examples: [7, 0, 9, 0] -> True; [7, 0, 9, 4] -> False. O(1) unless the last
    value is 0."""
    if len(ids) < 8 or ids[-1] or ids[-2] or dtype != "<u2" or len(ids) % 4:
        return False
    return not np.frombuffer(ids, dtype="<u2")[1::2].any()


@dataclass(frozen=True)
class StoredIds:
    """Token ids a prepared dataset stores beside its text (the manifest's "ids" entry),
    as a stream reads them."""

    dtype: str
    """numpy dtype of the ids member: "<u2" or "<u4"."""
    assistant: bool = False
    """Read the assistant ranges too (data.loss_on=assistant):
    a sample without them is tokenized from its text."""
    checked: bool = False
    """Each ids member ends with its crc32 (`ids_member`): verified against the sample's text as it is read.
    False for shards prepared before the check was written: their ids are read whole."""
    vocab_size: int | None = None
    """The tokenizer's vocabulary (the manifest's):
    a stored id at or over it is a damaged sample (bad_ids)."""


def stored_ids(manifest: dict, tokenizer_hash: str, assistant: bool) -> StoredIds | None:
    """How a run whose tokenizer has `tokenizer_hash` reads the shards of `manifest`: their stored ids when
    they were encoded by that tokenizer (and, if `assistant`, with the assistant ranges stored too); None:
    tokenize the text (no ids stored, another tokenizer, e.g. one extended by tokenizer.add_tokens)."""
    ids = manifest.get("ids")
    if (not isinstance(ids, dict) or ids.get("tokenizer_sha256") != tokenizer_hash
            or ids.get("field") != IDS_FIELD):
        return None
    if (ids.get("dtype") not in ("<u2", "<u4")
            or (assistant and ids.get("assistant_field") != ASSISTANT_FIELD)):
        return None
    vocab = manifest.get("tokenizer", {}).get("vocab_size")
    return StoredIds(dtype=ids["dtype"], assistant=assistant, checked=ids.get("check") == IDS_CHECK,
                     vocab_size=vocab if isinstance(vocab, int) else None)
FILE_MODE = 0o644  # mkstemp creates 0600 files; prepared data is meant to be shared


@dataclass(frozen=True)
class ShardInfo:
    """One written shard."""

    name: str
    """File name relative to the output directory, e.g. "train-000000.tar"."""
    docs: int
    """Documents (samples) in the shard."""
    bytes: int
    """Size of the tar file."""


def shard_name(prefix: str, index: int) -> str:
    """Example: shard_name("train", 3) -> "train-000003.tar"."""
    return f"{prefix}-{index:06d}.tar"


class _OpenShard:
    """A shard being written to a temp file; `commit` renames it into place, `abort` deletes it."""

    def __init__(self, out_dir: Path, name: str) -> None:
        self.path = out_dir / name
        fd, self.tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
        self.file: BinaryIO = os.fdopen(fd, "wb")
        # The members webdataset's TarWriter(encoder=False, mtime=0) writes, byte for byte (tested), with the
        # standard library alone: importing webdataset imports torch, which prepare's worker processes do not
        # need. PAX: keys may be longer than USTAR's 100 characters;
        # mtime 0: the same documents give the same bytes.
        self.tar = tarfile.open(fileobj=self.file, mode="w|", format=tarfile.PAX_FORMAT)
        self.docs = 0
        self.text_bytes = 0

    def write(self, key: str, data: bytes, fields: dict[str, bytes]) -> None:
        for field_name, value in ((TEXT_FIELD, data), *fields.items()):
            info = tarfile.TarInfo(f"{key}.{field_name}")
            info.size, info.mtime, info.mode, info.uname, info.gname = (
                len(value), 0, 0o444, "bigdata", "bigdata")
            self.tar.addfile(info, io.BytesIO(value))
        self.docs += 1
        self.text_bytes += len(data)

    def commit(self) -> ShardInfo:
        self.tar.close()
        self.file.close()
        os.chmod(self.tmp, FILE_MODE)
        os.replace(self.tmp, self.path)
        return ShardInfo(name=self.path.name, docs=self.docs, bytes=self.path.stat().st_size)

    def abort(self) -> None:
        # Close the tar stream first: left open, its finalizer would write to the closed file.
        with contextlib.suppress(Exception):
            self.tar.close()
        self.file.close()
        Path(self.tmp).unlink(missing_ok=True)


class ShardWriter:
    """Shards written one document at a time: `<out_dir>/<prefix>-000000.tar`, `-000001.tar`, ...

    A shard closes after `docs_per_shard` documents, or before the text that would take it past
    `max_shard_bytes` of text (a single larger document still gets a shard of its own; other fields do not
    count, so a dataset with stored ids has the same shards as without). `tokens` given to `add` are summed
    per shard. Use as a context manager: an error mid-shard leaves no temp file behind.
    Example: 5 documents, docs_per_shard=2 -> shards of 2, 2 and 1 documents; none -> no shards.
    """

    def __init__(self, out_dir: str | Path, prefix: str, docs_per_shard: int,
                 max_shard_bytes: int | None = None, name: Callable[[str, int], str] | None = None) -> None:
        if docs_per_shard < 1:
            raise PrepareError(f"docs per shard must be >= 1, got {docs_per_shard}")
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.prefix, self.docs_per_shard, self.max_shard_bytes = prefix, docs_per_shard, max_shard_bytes
        self._name = name or shard_name
        self.shards: list[ShardInfo] = []
        self.tokens: list[int] = []  # per shard in `shards`
        self._open: _OpenShard | None = None
        self._open_tokens = 0
        self._keys: set[str] = set()  # of the open shard: keys are unique by construction, this catches a bug

    def add(self, key: str, data: bytes, tokens: int = 0, fields: dict[str, bytes] | None = None) -> None:
        """Append a document: its text `data` (`<key>.txt`),
        then `fields` as `<key>.<field>` members in order."""
        if self._open is not None and _is_full(self._open, len(data), self.docs_per_shard,
                                               self.max_shard_bytes):
            self._commit()
        _check_key(key, self._keys)
        if self._open is None:
            self._open = _OpenShard(self.out_dir, self._name(self.prefix, len(self.shards)))
        self._open.write(key, data, fields or {})
        self._open_tokens += tokens

    def cut(self) -> None:
        """End the open shard here (the next document starts a new one)."""
        if self._open is not None:
            self._commit()

    def close(self) -> list[ShardInfo]:
        self.cut()
        return self.shards

    def abort(self) -> None:
        if self._open is not None:
            self._open.abort()
            self._open = None

    def _commit(self) -> None:
        assert self._open is not None
        self.shards.append(self._open.commit())
        self.tokens.append(self._open_tokens)
        self._open, self._open_tokens, self._keys = None, 0, set()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_shards(
    samples: Iterable[tuple[str, str]],
    out_dir: str | Path,
    prefix: str,
    docs_per_shard: int,
    max_shard_bytes: int | None = None,
) -> list[ShardInfo]:
    """Write (key, text) samples, in order, to `<out_dir>/<prefix>-000000.tar`, ... (see ShardWriter);
    keys must be unique."""
    seen: set[str] = set()
    with ShardWriter(out_dir, prefix, docs_per_shard, max_shard_bytes) as writer:
        for key, text in tqdm(samples, desc=f"writing {prefix}", unit="doc", disable=None):
            if key in seen:
                raise PrepareError(f"duplicate sample key {key!r}")
            seen.add(key)
            writer.add(key, text.encode("utf-8"))
    return writer.shards


def _is_full(shard: _OpenShard, next_bytes: int, docs_per_shard: int, max_shard_bytes: int | None) -> bool:
    if shard.docs >= docs_per_shard:
        return True
    return max_shard_bytes is not None and shard.text_bytes + next_bytes > max_shard_bytes


def _check_key(key: str, seen: set[str]) -> None:
    if not key or "." in key:
        raise PrepareError(f"bad sample key {key!r}: keys must be non-empty and hold no dot")
    if key in seen:
        raise PrepareError(f"duplicate sample key {key!r}")
    seen.add(key)


# ---------------------------------------------------------------------------------------------
# The manifest
# ---------------------------------------------------------------------------------------------


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to a temp file next to `path`, then rename it over `path`: readers see the old
    file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_manifest(data_dir: str | Path, manifest: dict) -> Path:
    """Write `<data_dir>/manifest.json` atomically; return its path."""
    path = Path(data_dir) / MANIFEST_FILE
    atomic_write_bytes(path, (json.dumps(manifest, indent=2) + "\n").encode("utf-8"))
    return path


def load_manifest(data_dir: str | Path) -> dict:
    """Read `<data_dir>/manifest.json`, with an error naming the file if it is missing or bad."""
    path = Path(data_dir) / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as e:
        raise PrepareError(f"{path}: no manifest; prepare the data first (python -m trainer.prepare --out "
                           f"{data_dir} ...), or the last run was interrupted") from e
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PrepareError(f"{path}: cannot read the manifest ({e})") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise PrepareError(f"{path}: format {found!r}, expected {FORMAT_VERSION!r}; prepare the data again")
    return manifest


def shard_paths(data_dir: str | Path, split: str) -> list[str]:
    """Absolute paths of a split's shards, in manifest order; an error if a split or file is missing."""
    manifest = load_manifest(data_dir)
    splits = manifest["splits"]
    if split not in splits:
        raise PrepareError(f"{Path(data_dir) / MANIFEST_FILE}: no split {split!r} (has {sorted(splits)})")
    paths = [str((Path(data_dir) / shard["name"]).resolve()) for shard in splits[split]["shards"]]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise PrepareError(f"shard listed in {Path(data_dir) / MANIFEST_FILE} is missing: {missing[0]}")
    return paths


_MEMBER_KINDS = {tarfile.DIRTYPE: "a directory", tarfile.SYMTYPE: "a symlink", tarfile.LNKTYPE: "a hard link"}


def non_sample_members(shard: str | Path, limit: int = 3) -> list[str]:
    """Members of a local shard that webdataset skips without a word: non-regular files, names without an
    extension. Example: ["'b.txt' (a symlink)", "'notes' (no extension)"]. [] for remote or unreadable
    shards."""
    found: list[str] = []
    if not Path(shard).is_file():
        return found
    try:
        with tarfile.open(shard, "r|*") as tar:
            for member in tar:
                if not member.isreg():
                    found.append(f"{member.name!r} ({_MEMBER_KINDS.get(member.type, 'not a regular file')})")
                elif "." not in Path(member.name).name:
                    found.append(f"{member.name!r} (no extension)")
                if len(found) == limit:
                    break
    except (OSError, tarfile.TarError):
        pass
    return found
