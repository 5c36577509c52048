"""The run's side of checkpoints: when it saves, which checkpoint it resumes from, and what goes in.

What a checkpoint directory holds, and how it is written and read, is the checkpoint store's
(trainer.checkpoint.store); this component decides only the cadence (`due`) and the run's choices
(train.resume, train.keep_last).
"""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint import store
from trainer.distributed.engine import Engine
from trainer.distributed.groups import DistInfo


class Checkpointer:
    """Saves every `every` steps and after the last one; keeps the newest `keep_last`."""

    def __init__(self, run_dir: Path, info: DistInfo, every: int, keep_last: int, max_steps: int) -> None:
        self.run_dir = run_dir
        self.info = info
        self.every = every
        self.keep_last = keep_last
        self.max_steps = max_steps
        self.last: Path | None = None
        """The newest checkpoint this run wrote."""

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` ends with a save. Example: every=50, max_steps=120 -> 50, 100, 120."""
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    def resume_path(self, resume: bool | str) -> Path | None:
        """The checkpoint train.resume names (true: the run dir's latest), or None: a fresh start."""
        if resume is False or resume in ("false", "False"):
            return None
        if self.info.is_main:
            for partial in store.incomplete_checkpoints(self.run_dir):
                print(f"resume: ignoring incomplete checkpoint {partial} (its save was interrupted; never loaded)")
        path = store.latest_checkpoint(self.run_dir) if resume in (True, "true", "True") else Path(resume)
        if path is None and self.info.is_main:
            print(f"resume: no checkpoint in {store.checkpoint_root(self.run_dir)}; starting from step 0")
        return path

    def save(self, step: int, engine: Engine, rank_state: dict, meta: dict, conventions: dict,
             tokenizer_dir: Path) -> Path:
        """Collective: every rank writes its part of step `step`'s checkpoint."""
        self.last = store.save_checkpoint(self.run_dir, step, self.info, engine, rank_state=rank_state, meta=meta,
                                          conventions=conventions, tokenizer_dir=tokenizer_dir,
                                          keep_last=self.keep_last)
        return self.last

    def load(self, path: Path, engine: Engine) -> tuple[dict, dict]:
        """Collective: the engine restored from `path`; returns (meta, this rank's state)."""
        return store.load_checkpoint(path, self.info, engine)
