"""Each component owns its cadence: the checkpointer, the evaluator and the metrics logger say which steps are
theirs."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch

from trainer.distributed.groups import DistInfo
from trainer.run import loop, parts
from trainer.run.checkpointer import Checkpointer
from trainer.run.evals import Evaluator
from trainer.run.metrics import MetricsLogger

INFO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def due_steps(due, max_steps: int) -> list[int]:
    return [s for s in range(1, max_steps + 1) if due(s)]


def test_checkpoints_every_n_steps_and_at_the_end(tmp_path):
    assert due_steps(Checkpointer(tmp_path, INFO, every=50, keep_last=2, max_steps=120).due,
                     120) == [50, 100, 120]
    assert due_steps(Checkpointer(tmp_path, INFO, every=0, keep_last=2, max_steps=7).due, 7) == [7]


def test_eval_every_n_steps_and_at_the_end():
    evaluator = Evaluator([], INFO, seq_len=8, layout="packed", micro_batch_tokens=8, pad_id=0, every=25)
    assert due_steps(lambda s: evaluator.due(s, last=s == 60), 60) == [25, 50, 60]


def test_metrics_every_n_steps_at_the_end_and_when_forced(tmp_path):
    logger = MetricsLogger(tmp_path, None, {}, [], None, enabled=False, log_every=10)
    assert due_steps(lambda s: logger.due(s, last=s == 25), 25) == [10, 20, 25]
    assert logger.due(3, last=False, forced=True)


def test_the_loop_decides_no_cadence_itself():
    """Trainer.fit runs the parts (trainer.run.parts), which reach for the components' `due`; no `% every`
    arithmetic is left in the loop or the parts."""
    loop_source, parts_source = inspect.getsource(loop), inspect.getsource(parts)
    assert "part.due(" in loop_source
    assert ("checkpointer.due(" in parts_source and "evaluator.due(" in parts_source
            and "metrics.due(" in parts_source)
    for source in (loop_source, parts_source):
        for rule in ("checkpoint_every", "eval_every ==", "% cfg", "% self.cfg", "log_every =="):
            assert rule not in source.replace("cfg.train.checkpoint_every, cfg.train.keep_last", ""), rule


def test_the_trainer_is_a_short_list_of_methods():
    """What happens after a step is the parts' (trainer.run.parts); the Trainer builds, resumes and runs
    them."""
    methods = [name for name, value in vars(loop.Trainer).items() if inspect.isfunction(value)]
    assert len(methods) < 12, methods


def test_resume_path(tmp_path: Path):
    ckpt = Checkpointer(tmp_path, INFO, every=1, keep_last=2, max_steps=3)
    assert ckpt.resume_path(False) is None and ckpt.resume_path("false") is None
    assert ckpt.resume_path(True) is None  # nothing saved yet: a fresh start
    (tmp_path / "checkpoints" / "step_000002").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step_000010").mkdir()
    assert ckpt.resume_path(True) == tmp_path / "checkpoints" / "step_000010"
    assert ckpt.resume_path(str(tmp_path / "x")) == tmp_path / "x"
