"""The run directory holds one run: a start that would mix two runs in it is refused, or sets the old one
aside.

    a fresh run (train.resume=false) in a used run dir    refused with one line naming the choices; with
                                                         train.overwrite=true the old run's files are moved
                                                         into `<run dir>/replaced-<UTC time>/`
    a resume from another run's checkpoint (a path        the same: refused, or with train.overwrite=true the
      outside the run dir's checkpoints/) in a used one   old run moved aside; into an empty run dir it starts
    a resume from the run dir's own checkpoints/          continues it (with train.overwrite=true: refused)
    a resume from step k while checkpoints after k exist  that abandoned branch (its checkpoints, its
                                                         metrics.jsonl lines after k, its summary.json) is
                                                         moved into
                                                         `<run dir>/abandoned-after-step_k-<UTC time>/`

A run dir is used when it holds one of RUN_FILES (what a run writes); Hydra's `.hydra/` and job log, which
Hydra writes into every run dir (a fresh timestamped one, a sweep's job dir) before the job starts, never
count. A directory that holds anything else and no run (someone's own files: `hydra.run.dir=.` from a source
tree, a typo naming a home directory) is refused before a byte is written, unless train.overwrite=true allows
it (the run's files go beside the user's, which are never moved). What is set aside stays inside the run dir:
a rename on the run's own file system (no copy of checkpoints), where neither `train.resume=true` (the run
dir's checkpoints/) nor a report of a sweep dir (run dirs one level down) looks, and nothing is deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from trainer.checkpoint import store
from trainer.config import RunConfig
from trainer.data.feed import MANIFEST_FILE
from trainer.distributed.groups import DistInfo, broadcast_object
from trainer.errors import ConfigError
from trainer.registry import CONFIG_FILE, DOC_KEYS_DIR, METRICS_FILE, SUMMARY_FILE

RUN_FILES = (METRICS_FILE, CONFIG_FILE, SUMMARY_FILE, store.ROOT_DIR, DOC_KEYS_DIR, "wandb", "wandb_run_id")
"""What a run writes into its run dir (trainer.run.loop, .metrics, the checkpoint store, W&B)."""


def truncate_jsonl_after(path: Path, step: int) -> None:
    """Keep the lines of `path` with "step" <= step: a resumed run rewrites the steps after its checkpoint, so
    the file holds each step once (a line cut short by a crash is dropped too)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    path.write_text("".join(line + "\n" for line in kept))


def resuming(resume: bool | str) -> bool:
    """Whether train.resume continues a run (true or a checkpoint path) rather than starting one."""
    return not (resume is False or resume in ("false", "False"))


def used_by(run_dir: Path) -> list[str]:
    """The RUN_FILES in `run_dir`: an earlier run's (empty: a fresh directory)."""
    return [name for name in RUN_FILES if (run_dir / name).exists()]


def own_checkpoint(run_dir: Path, checkpoint: str | Path) -> bool:
    """Whether `checkpoint` lies in `run_dir`'s checkpoints/, both resolved first (symlinks, `..`, a relative
    path from the working directory, as the checkpointer reads train.resume): a resume from it continues that
    run."""
    return Path(checkpoint).resolve().parent == store.checkpoint_root(run_dir).resolve()


LOCK_FILE = ".lock"
"""In the run dir: locked (flock) by rank 0 of the run that holds it, for the run's life; it names the
holder."""

OURS = (LOCK_FILE, ".hydra")
"""Besides RUN_FILES, what packtrain writes into a run dir (the lock, Hydra's record) and the job log `*.log`,
the directories a run sets aside (`replaced-*`, `abandoned-after-*`): none of them is a user's file."""
SET_ASIDE_PREFIXES = ("replaced-", "abandoned-after-")


def foreign_files(run_dir: Path) -> list[str]:
    """The entries of `run_dir` that no packtrain run wrote (empty for a new or a run's directory), sorted.
    A directory holding a run (one of RUN_FILES, or the lock) is the run's: whatever else is in it is too."""
    if not run_dir.is_dir() or used_by(run_dir) or (run_dir / LOCK_FILE).exists():
        return []
    return sorted(p.name + "/" * p.is_dir() for p in run_dir.iterdir()
                  if not (p.name in OURS or p.name.endswith(".log") or p.name.startswith(SET_ASIDE_PREFIXES)))


OVERWRITE = ("train.overwrite=true (the run dir's files are moved into <run dir>/replaced-<UTC time>/, "
             "not deleted)")


_held: dict[Path, tuple[int, bool, bool]] = {}
"""Run dirs whose lock this process holds: resolved path -> (the locked file's descriptor, whether this
process created the file, and the run dir)."""


class RunDirInUse(ConfigError):
    """Another run, alive, holds the run dir."""


def claim_run_dir(run_dir: Path, resume: bool | str, overwrite: bool, info: DistInfo,
                  inputs: Sequence[tuple[str, Path, bool]] = ()) -> None:
    """Collective, before anything is written: this run takes the run dir or is refused, and a refused run
    leaves nothing in it. Rank 0 takes the run dir's exclusive lock (flock on LOCK_FILE), then checks the
    start (`guard_fresh_start`: a second run into a used dir is refused, or with train.overwrite moves the old
    one aside); only then does it write its name into the lock file. Every rank raises the same error.

    The lock is held for the run's life (until `unlock_run_dir` or the process exits); all ranks of one run
    share rank 0's. Another live run holding it refuses this one with RunDirInUse, naming the holder's pid and
    host. The kernel drops a lock when its process dies, however it dies (kill -9 included), so a lock left by
    a dead run is free: the next run takes it over. Taking it again in the same process is a no-op. The lock
    is as good as the file system's flock: local file systems and NFSv4 honour it across hosts. A run dir that
    is one of the run's `inputs` (`input_dirs`), or inside a dataset, tokenizer or checkpoint it reads, is
    refused."""
    refusal = _take_lock(run_dir.resolve(), inputs, overwrite) if info.is_main else None
    refusal = broadcast_object(refusal)
    if refusal:
        raise RunDirInUse(refusal)
    try:
        guard_fresh_start(run_dir, resume, overwrite, info)
    except ConfigError:
        unlock_run_dir(run_dir, refused=True)
        raise
    if info.is_main:
        fd = _held[run_dir.resolve()][0]
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}, since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}\n".encode(), 0)


def input_dirs(cfg: RunConfig) -> list[tuple[str, Path, bool]]:
    """The local directories a run reads, as (the setting, the directory, whether a run dir inside it is
    refused too): datasets, tokenizers and checkpoints (never written into, nor under), and the directories of
    local shards (data.urls / val_urls: never the run dir itself; a run dir under them is fine, e.g.
    `data.urls=*.tar` from the directory the runs go under).

    Example: data.path=data/demo, data.urls=/d/train-{000..009}.tar -> [("data.path", data/demo, True),
    ("data.urls", /d, False)]."""
    found: list[tuple[str, Path, bool]] = []
    data = cfg.data
    named = [("data.path", data.path), ("data.tokenizer", data.tokenizer),
             ("train.init_from", cfg.train.init_from)]
    if not resuming(cfg.train.resume) and cfg.train.resume not in (False, "false", "False", None):
        named.append(("train.resume", cfg.train.resume))
    urls = [("data.urls", data.urls), ("data.val_urls", data.val_urls)]
    for source in data.sources or []:
        if isinstance(source, Mapping):
            name = source.get("name", "?")
            named.append((f"data.sources[{name}].path", source.get("path")))
            urls += [(f"data.sources[{name}].urls", source.get("urls")),
                     (f"data.sources[{name}].val_urls", source.get("val_urls"))]
    found += [(what, Path(str(value)).resolve(), True) for what, value in named if value]
    for what, value in urls:
        for url in [value] if isinstance(value, str) else value or []:
            for one in str(url).split("::"):
                directory = _local_dir(one)
                if directory is not None:
                    found.append((what, directory, False))
    return found


def _local_dir(url: str) -> Path | None:
    """The directory a local shard pattern reads from: its components before the first wildcard or brace, less
    the file name; None for URLs and pipe: commands. Example: "/d/x/train-{0..9}.tar" -> /d/x."""
    url = url.removeprefix("file://")
    if url.startswith("pipe:") or "://" in url or ":" in url.split("/")[0]:
        return None
    fixed = []
    for part in Path(url).parts:
        if any(c in part for c in "*?[{"):
            break
        fixed.append(part)
    else:
        fixed = fixed[:-1]  # a file: its directory
    return Path(*fixed).resolve() if fixed else Path.cwd()


def _input_refusal(run_dir: Path, inputs: Sequence[tuple[str, Path, bool]]) -> str | None:
    for what, directory, inside_too in inputs:
        if run_dir == directory or (inside_too and directory in run_dir.parents):
            where = "is a directory" if run_dir == directory else f"is inside {directory}, a directory"
            return (f"hydra.run.dir {run_dir} {where} the run reads ({what}): a run writes into a directory "
                    "of its own; choose another hydra.run.dir")
    return None


def _take_lock(run_dir: Path, inputs: Sequence[tuple[str, Path, bool]] = (),
               overwrite: bool = False) -> str | None:
    """Lock `run_dir` for this process (rank 0); why not, if another process holds it, the run reads from it,
    or it holds someone's own files (`foreign_files`, allowed by `overwrite`)."""
    if run_dir in _held:
        return None
    if (refusal := _input_refusal(run_dir, inputs)) is not None:
        return refusal
    if (run_dir / MANIFEST_FILE).is_file():
        return (f"{run_dir} is a prepared dataset ({MANIFEST_FILE}): a run writes into a directory of its "
                "own; choose another hydra.run.dir")
    if (run_dir / store.META_FILE).is_file():
        return (f"{run_dir} is a checkpoint: a run writes into a directory of its own; "
                "choose another hydra.run.dir")
    if not overwrite and (foreign := foreign_files(run_dir)):
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        return (f"hydra.run.dir {run_dir} holds files that no run wrote ({shown}): a run writes into a new "
                "directory or one of its own; choose another hydra.run.dir, or write into it anyway with "
                "train.overwrite=true (your files are left as they are)")
    made_dir = not run_dir.exists()
    path = run_dir / LOCK_FILE
    created = not path.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # read-only, not a directory, no space: every rank refuses with this line
        return (f"cannot write into the run dir {run_dir} ({e}): hydra.run.dir must name a directory this "
                "run can write")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "a run that is starting"
        os.close(fd)
        return (f"{run_dir} is in use by another run ({holder}): wait for it to end, stop it, or start in "
                "another hydra.run.dir (hydra.sweep.dir under -m)")
    except OSError as e:  # the file system cannot lock: say so rather than run unprotected
        os.close(fd)
        return (f"cannot lock {path} ({e}): the run dir's file system does not support flock; "
                "use another directory")
    _held[run_dir] = (fd, created, made_dir)
    return None


def unlock_run_dir(run_dir: Path, refused: bool = False) -> None:
    """Release this process's lock of `run_dir`: the run ended (the lock file stays, naming the last holder),
    or it was `refused` (a lock file this process created is removed, and the run dir if it made it and it is
    empty: a refused run leaves nothing)."""
    fd, created, made_dir = _held.pop(Path(run_dir).resolve(), (None, False, False))
    if fd is None:
        return
    if refused and created:
        with contextlib.suppress(OSError):
            os.unlink(Path(run_dir) / LOCK_FILE)
        if made_dir:
            with contextlib.suppress(OSError):
                Path(run_dir).rmdir()  # only if empty
    os.close(fd)  # closing the descriptor drops the flock


def guard_fresh_start(run_dir: Path, resume: bool | str, overwrite: bool, info: DistInfo) -> None:
    """Collective, before anything is written. A start that would put a second run into a used run dir (a
    fresh one, or a resume from another run's checkpoint) raises a ConfigError naming the choices, or with
    `overwrite` moves the old run's files aside and says where; a resume from the run dir's own checkpoints
    continues it. Rank 0 looks and decides; every rank raises the same error, so none is left waiting in a
    later collective."""
    if resume in (True, "true", "True"):  # the run dir's latest (with overwrite: refused by TrainConfig)
        return
    refusal = None
    if info.is_main and (found := used_by(run_dir)):
        refusal = _refusal(run_dir, resume, overwrite, found)
        if refusal is None and overwrite:
            dest = _new_dir(run_dir, "replaced")
            for name in found:
                os.replace(run_dir / name, dest / name)
            print(f"overwrite: the earlier run's {', '.join(found)} moved into {dest} (nothing deleted)",
                  flush=True)
    refusal = broadcast_object(refusal)
    if refusal:
        raise ConfigError(refusal)


def _refusal(run_dir: Path, resume: bool | str, overwrite: bool, found: list[str]) -> str | None:
    """Why this start may not use `run_dir`, which holds `found` of an earlier run; None: it may (with
    `overwrite`, once those are moved aside)."""
    held = f"{run_dir} already holds a run ({', '.join(found)})"
    if resuming(resume) and own_checkpoint(run_dir, str(resume)):  # a continuation
        return (f"train.overwrite=true would move {Path(str(resume)).resolve()} aside with the rest of the "
                f"run it continues: drop train.overwrite to continue {run_dir}'s run from it, or resume it "
                "in another hydra.run.dir") if overwrite else None
    if overwrite:
        return None
    if resuming(resume):
        return (f"{held} and train.resume={Path(str(resume)).resolve()} is another run's checkpoint: resume "
                f"it in another hydra.run.dir, or with {OVERWRITE}")
    return (f"{held}: continue it with train.resume=true, start in another hydra.run.dir "
            f"(hydra.sweep.dir under -m), or replace it with {OVERWRITE}")


def set_aside_after(run_dir: Path, step: int) -> Path | None:
    """Rank 0, resuming from step `step`: if the run dir has checkpoints after it, move the branch this resume
    abandons (those checkpoints, the lines after `step` of metrics.jsonl and doc_keys/, summary.json, a copy
    of config.json) into `<run dir>/abandoned-after-step_NNNNNN-<UTC time>/` and say so; returns that
    directory. Afterwards `train.resume=true` finds this run's checkpoints only, and metrics.jsonl holds each
    step once.

    None when no checkpoint is newer (an ordinary resume from the latest): the lines after its step are of an
    attempt that died before its next checkpoint, rewritten by the resumed steps (MetricsLogger), as
    before."""
    newer = store.checkpoints_after(run_dir, step)
    if not newer:
        return None
    dest = _new_dir(run_dir, f"abandoned-after-{store.step_name(step)}")
    (dest / store.ROOT_DIR).mkdir()
    for path in newer:
        os.replace(path, dest / store.ROOT_DIR / path.name)
    moved = [f"{len(newer)} checkpoint{'s' * (len(newer) > 1)}"]
    if steps := _move_lines_after(run_dir / METRICS_FILE, dest / METRICS_FILE, step):
        moved.append(f"metrics.jsonl's lines of steps {min(steps)}..{max(steps)}")
    # every rank's (each truncates its own next)
    for keys in sorted((run_dir / DOC_KEYS_DIR).glob("rank_*.jsonl")):
        (dest / DOC_KEYS_DIR).mkdir(exist_ok=True)
        _move_lines_after(keys, dest / DOC_KEYS_DIR / keys.name, step)
    if (run_dir / SUMMARY_FILE).exists():
        os.replace(run_dir / SUMMARY_FILE, dest / SUMMARY_FILE)
        moved.append(SUMMARY_FILE)
    if (run_dir / CONFIG_FILE).exists():
        shutil.copy2(run_dir / CONFIG_FILE, dest / CONFIG_FILE)  # the resumed run writes its own next
    print(f"resume: step {step} is older than this run dir's {', '.join(p.name for p in newer)}: that branch "
          f"({', '.join(moved)}) moved into {dest} (nothing deleted)", flush=True)
    return dest


def _move_lines_after(src: Path, dest: Path, step: int) -> list[int]:
    """The lines of JSONL `src` after `step` (and any unreadable one) appended to `dest` and dropped from
    `src`; returns their steps."""
    if not src.exists():
        return []
    moved, steps = [], []
    for line in src.read_text().splitlines():
        try:
            s = json.loads(line)["step"]
            after = s > step
        except (ValueError, KeyError, TypeError):
            # unreadable: dropped from `src` anyway (truncate_jsonl_after), so kept here
            s, after = None, True
        if after:
            moved.append(line)
            steps += [s] if s is not None else []
    if moved:
        with dest.open("a") as f:
            f.write("".join(line + "\n" for line in moved))
        truncate_jsonl_after(src, step)
    return steps


def _new_dir(run_dir: Path, prefix: str) -> Path:
    """A new `<run dir>/<prefix>-<UTC time>` (a `-N` suffix if that second is taken)."""
    base = run_dir / f"{prefix}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    path, n = base, 1
    while True:
        try:
            path.mkdir(parents=True)
            return path
        except FileExistsError:
            path, n = base.with_name(f"{base.name}-{n}"), n + 1
