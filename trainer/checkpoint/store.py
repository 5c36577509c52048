"""Checkpoints: written atomically (temp dir + rename), the last K kept, resumable by every rank.

Layout of `<run dir>/checkpoints/step_000050/`:
    engine.pt            model, optimizer and LR schedule (DDP: replicated, written by rank 0)
    model.safetensors    the weights alone (DDP), for loaders that trust only safetensors
    deepspeed/           or, under DeepSpeed, its own checkpoint: one ZeRO shard per rank (engine.save)
    rank_00000.pt ...    each rank's data-stream state and RNG states
Every .pt is plain data and tensors, read with weights_only=True (trainer.checkpoint.safe_io).
    meta.json            step, token counters, world size, engine
    conventions.json     how inputs and objective were built (see `conventions`)
    tokenizer/           the tokenizer files the weights were trained with
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from trainer.checkpoint.safe_io import load_state, save_state
from trainer.distributed.engine import Engine
from trainer.distributed.groups import DistInfo, barrier
from trainer.errors import UserError


class CheckpointError(UserError, ValueError):
    """A checkpoint that this run cannot resume from (not one, another world size or engine)."""


STEP_DIR = re.compile(r"^step_(\d{6,})$")
TMP_PREFIX = ".tmp-"
"""A checkpoint being written: `.tmp-step_000050/`, renamed to `step_000050/` once every rank has written its
part. A kill at any moment leaves either the complete renamed directory or a `.tmp-` one, which is never loaded."""


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))
    return steps[-1][1] if steps else None


def incomplete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Directories of saves that were interrupted (the process died before the rename)."""
    root = checkpoint_root(run_dir)
    return sorted(p for p in root.glob(f"{TMP_PREFIX}step_*") if p.is_dir()) if root.is_dir() else []


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    info: DistInfo,
    engine: Engine,
    rank_state: dict,
    meta: dict,
    conventions: dict,
    tokenizer_dir: str | Path,
    keep_last: int,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory."""
    root = checkpoint_root(run_dir)
    final = root / f"step_{step:06d}"
    tmp = root / f"{TMP_PREFIX}step_{step:06d}"
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    save_state({"rng": rng_state(), **rank_state}, tmp / f"rank_{info.rank:05d}.pt")
    engine.save(tmp)  # collective
    if info.is_main:
        (tmp / "meta.json").write_text(json.dumps({**meta, "step": step, "world_size": info.world_size}, indent=2))
        (tmp / "conventions.json").write_text(json.dumps(conventions, indent=2))
        shutil.copytree(tokenizer_dir, tmp / "tokenizer")
    barrier()
    if info.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _prune(root, keep_last)
    barrier()
    return final


def _prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, and the leftovers of interrupted saves. A checkpoint
    is renamed out of the `step_` namespace before it is deleted, so a kill mid-delete never leaves a partial
    `step_` directory behind."""
    steps = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))
    for _, path in steps[: max(0, len(steps) - max(1, keep_last))]:
        doomed = path.with_name(f"{TMP_PREFIX}deleting-{path.name}")
        os.replace(path, doomed)
        shutil.rmtree(doomed)
    for leftover in root.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def load_checkpoint(path: str | Path, info: DistInfo, engine: Engine) -> tuple[dict, dict]:
    """Restore the engine and this rank's RNG; returns (meta, this rank's state with 'data' etc.)."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a packtrain checkpoint (no meta.json): give train.resume a "
                              "checkpoints/step_NNNNNN directory, or true for the run dir's latest")
    meta = json.loads(meta_file.read_text())
    if meta["world_size"] != info.world_size:
        raise CheckpointError(
            f"{path} was written by {meta['world_size']} ranks and this run has {info.world_size}: "
            "each rank resumes its own data stream, so the world size must match"
        )
    if meta.get("engine", engine.name) != engine.name:
        raise CheckpointError(f"{path} was written by engine {meta['engine']!r} and this run uses {engine.name!r}; "
                         "resume with the same distributed= config")
    engine.load(path)
    rank_state = load_state(path / f"rank_{info.rank:05d}.pt")
    set_rng_state(rank_state.pop("rng"))
    return meta, rank_state
