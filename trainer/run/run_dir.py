"""The run directory holds one run: a start that would mix two runs in it is refused, or sets the old one aside.

    a fresh run (train.resume=false) in a used run dir    refused with one line naming the choices; with
                                                         train.overwrite=true the old run's files are moved
                                                         into `<run dir>/replaced-<UTC time>/`
    a resume from another run's checkpoint (a path        the same: refused, or with train.overwrite=true the
      outside the run dir's checkpoints/) in a used one   old run moved aside; into an empty run dir it starts
    a resume from the run dir's own checkpoints/          continues it (with train.overwrite=true: refused)
    a resume from step k while checkpoints after k exist  that abandoned branch (its checkpoints, its
                                                         metrics.jsonl lines after k, its summary.json) is
                                                         moved into `<run dir>/abandoned-after-step_k-<UTC time>/`

A run dir is used when it holds one of RUN_FILES (what a run writes); Hydra's `.hydra/` and job log, which
Hydra writes into every run dir (a fresh timestamped one, a sweep's job dir) before the job starts, never
count. What is set aside stays inside the run dir: a rename on the run's own file system (no copy of
checkpoints), where neither `train.resume=true` (the run dir's checkpoints/) nor a report of a sweep dir (run
dirs one level down) looks, and nothing is deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from trainer.checkpoint import store
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
    """Whether `checkpoint` lies in `run_dir`'s checkpoints/, both resolved first (symlinks, `..`, a relative path
    from the working directory, as the checkpointer reads train.resume): a resume from it continues that run."""
    return Path(checkpoint).resolve().parent == store.checkpoint_root(run_dir).resolve()


OVERWRITE = "train.overwrite=true (the run dir's files are moved into <run dir>/replaced-<UTC time>/, not deleted)"


def guard_fresh_start(run_dir: Path, resume: bool | str, overwrite: bool, info: DistInfo) -> None:
    """Collective, before anything is written. A start that would put a second run into a used run dir (a fresh
    one, or a resume from another run's checkpoint) raises a ConfigError naming the choices, or with `overwrite`
    moves the old run's files aside and says where; a resume from the run dir's own checkpoints continues it.
    Rank 0 looks and decides; every rank raises the same error, so none is left waiting in a later collective."""
    if resume in (True, "true", "True"):  # the run dir's latest (with overwrite: refused by TrainConfig)
        return
    refusal = None
    if info.is_main and (found := used_by(run_dir)):
        refusal = _refusal(run_dir, resume, overwrite, found)
        if refusal is None and overwrite:
            dest = _new_dir(run_dir, "replaced")
            for name in found:
                os.replace(run_dir / name, dest / name)
            print(f"overwrite: the earlier run's {', '.join(found)} moved into {dest} (nothing deleted)", flush=True)
    refusal = broadcast_object(refusal)
    if refusal:
        raise ConfigError(refusal)


def _refusal(run_dir: Path, resume: bool | str, overwrite: bool, found: list[str]) -> str | None:
    """Why this start may not use `run_dir`, which holds `found` of an earlier run; None: it may (with
    `overwrite`, once those are moved aside)."""
    held = f"{run_dir} already holds a run ({', '.join(found)})"
    if resuming(resume) and own_checkpoint(run_dir, str(resume)):  # a continuation
        return (f"train.overwrite=true would move {Path(str(resume)).resolve()} aside with the rest of the run it "
                f"continues: drop train.overwrite to continue {run_dir}'s run from it, or resume it in another "
                "hydra.run.dir") if overwrite else None
    if overwrite:
        return None
    if resuming(resume):
        return (f"{held} and train.resume={Path(str(resume)).resolve()} is another run's checkpoint: resume it in "
                f"another hydra.run.dir, or with {OVERWRITE}")
    return (f"{held}: continue it with train.resume=true, start in another hydra.run.dir (hydra.sweep.dir under -m), "
            f"or replace it with {OVERWRITE}")


def set_aside_after(run_dir: Path, step: int) -> Path | None:
    """Rank 0, resuming from step `step`: if the run dir has checkpoints after it, move the branch this resume
    abandons (those checkpoints, the lines after `step` of metrics.jsonl and doc_keys/, summary.json, a copy of
    config.json) into `<run dir>/abandoned-after-step_NNNNNN-<UTC time>/` and say so; returns that directory.
    Afterwards `train.resume=true` finds this run's checkpoints only, and metrics.jsonl holds each step once.

    None when no checkpoint is newer (an ordinary resume from the latest): the lines after its step are of an
    attempt that died before its next checkpoint, rewritten by the resumed steps (MetricsLogger), as before."""
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
    for keys in sorted((run_dir / DOC_KEYS_DIR).glob("rank_*.jsonl")):  # every rank's (each truncates its own next)
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
    """The lines of JSONL `src` after `step` (and any unreadable one) appended to `dest` and dropped from `src`;
    returns their steps."""
    if not src.exists():
        return []
    moved, steps = [], []
    for line in src.read_text().splitlines():
        try:
            s = json.loads(line)["step"]
            after = s > step
        except (ValueError, KeyError, TypeError):
            s, after = None, True  # unreadable: dropped from `src` anyway (truncate_jsonl_after), so kept here
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
