"""A checkpoint reads nothing outside its own directory and hides no damage.

Confinement: every file a checkpoint names (its entries, and the names its manifest lists) must lie inside the
checkpoint directory: no absolute name, no `..`, no symlink whose target leaves it (`check_confined`,
`inside`). DCP's `.metadata` names its own storage files; the FSDP2 reader applies the same rule to those
(trainer.distributed.fsdp.SafeReader).

Checksums: at save, the sha256 of every file of the checkpoint is recorded in its manifest, written last
(`digests`; the store names and writes the manifest); at load, the files are hashed again and compared before
anything is read (`damaged`). sha256 runs at ~1.4 GB/s on one core here; the ranks share the files to hash.

    names = files_of(ckpt, exclude={"checksums.json"})  # ['dcp/.metadata', 'dcp/__0_0.distcp',
                                                          'meta.json', ...]
    recorded = digests(ckpt, names)                      # {'meta.json': '9f2c...', ...}
    damaged(ckpt, recorded, "its checksums.json")        # None, or "ckpt/dcp/__0_0.distcp: checksum
                                                           mismatch: ..."
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path, PurePosixPath

from trainer.data.workers import check_interrupt
from trainer.errors import UserError

HASH = "sha256"
_CHUNK = 1 << 20

DAMAGED = "the checkpoint is damaged; resume from an earlier one"
"""How every message about a damaged checkpoint ends."""


class OutsideCheckpointError(UserError, ValueError):
    """A checkpoint that names a file outside its own directory (forged, or damaged):
    refused before any read."""


class DamagedCheckpointError(UserError, ValueError):
    """A checkpoint file whose bytes are not those recorded at save (or that is gone)."""


def inside(root: Path, name: str, what: str) -> Path:
    """`root / name`, refused (OutsideCheckpointError) unless it lies inside `root`: `name` must be relative,
    hold no `..`, and no symlink on the way may lead out. `what` says who names it, for the message.

    Example: inside(ckpt, "../../etc/passwd", "its checksums.json names") -> "ckpt: its checksums.json names
    '../../etc/passwd' leaves the checkpoint ('..'); ..."."""
    pure = PurePosixPath(name)
    why = ("an absolute path" if pure.is_absolute() or os.path.isabs(name)
           else "'..'" if ".." in pure.parts else None)
    path = root / name
    if why is None and not _within(path.resolve(), root.resolve()):
        why = f"a symlink to {path.resolve()}"
    if why is not None:
        raise OutsideCheckpointError(f"{root}: {what} {name!r} leaves the checkpoint ({why}); a "
                                     "checkpoint reads only files inside its own directory: refused (it was "
                                     "forged or damaged); resume from another checkpoint")
    return path


def _within(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def check_confined(root: Path) -> None:
    """Refuse `root` if any entry under it is a symlink that leads outside it (OutsideCheckpointError)."""
    root = Path(root)
    for entry in _entries(root):
        if entry.is_symlink():
            inside(root, entry.relative_to(root).as_posix(), "its entry")


def _entries(root: Path):
    """Every file, directory and symlink under `root`, symlinked directories not followed."""
    for directory, dirs, files in os.walk(root):
        for name in (*dirs, *files):
            yield Path(directory) / name


def files_of(root: Path, exclude: set[str]) -> list[str]:
    """The relative names of every file under `root` (sorted, '/'-separated), but those in `exclude`."""
    root = Path(root)
    names = (p.relative_to(root).as_posix() for p in _entries(root) if p.is_file())
    return sorted(n for n in names if n not in exclude)


def digest(path: Path) -> str:
    h = hashlib.new(HASH)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def digests(root: Path, names: list[str]) -> dict[str, str]:
    """{name: its sha256} of each file `root / name`."""
    return {name: digest(Path(root) / name) for name in names}


def damaged(root: Path, recorded: dict[str, str], what: str) -> str | None:
    """The first of `recorded`'s files ({name: sha256}, named by `what`) that is missing, unreadable or not
    what was recorded, as its one-line message; None if all are intact. A name leading outside `root`
    raises."""
    for name, expected in sorted(recorded.items()):
        check_interrupt()  # a preemption signal stops the hashing between files (ReadInterrupted)
        path = inside(Path(root), name, f"{what} names")
        if not path.is_file():
            return f"{path} is missing ({what} lists it): {DAMAGED}"
        try:
            actual = digest(path)
        except OSError as e:
            return f"{path}: cannot be read ({e.strerror or e}): {DAMAGED}"
        if actual != expected:
            return f"{path}: checksum mismatch: {DAMAGED}"
    return None
