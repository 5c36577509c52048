"""Held-out evaluation: the same documents, in the same order, every time, in every layout and world size.

The eval set is the prepared `val` split read in a fixed order (shards as listed in the manifest permuted
with seed 0, no sample shuffle), cut to `train.eval_docs` documents, long documents split into chunks of
seq_len. Rank r of W evaluates documents r, r + W, r + 2W, ...; packing (or not) only lays them out. A mixture
(data.sources) evaluates each source's held-out shards read the same way, source after source, its documents
tagged with the source's index (`Document.source`), `train.eval_docs` documents of each.

    val_loss = sum of token losses over every eval target (all ranks) / number of those targets
    val_ppl  = exp(val_loss)

so, as with the training objective, the number does not depend on the layout, the micro-batch size or
the world size (tested). Evaluation reads its own stream (the training stream and its position are
untouched), runs the model in eval mode without gradients (no dropout, no RNG drawn), and is rebuilt
identically after a resume.

Downstream tasks (train.eval_tasks, `TaskScorer`) are scored the way `python -m trainer.evaluate` scores a
checkpoint (trainer.tasks.suite: the same tasks, rows and numbers), in train.eval_tasks_layout, items split
over the ranks, on the unwrapped model: the metrics line's `tasks` holds each task's metrics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from trainer.config import RunConfig
from trainer.data.feed import (
    NO_GROUPS,
    Batch,
    DataSource,
    Document,
    FramedTokenizer,
    LossGroups,
    ShardSourceError,
    eval_batches,
    load_eval_docs,
)
from trainer.distributed.engine import Engine
from trainer.distributed.groups import DistInfo, dist_sum
from trainer.model import model_inputs
from trainer.run.metrics import by_group
from trainer.run.step import empty_batch, with_group_targets
from trainer.tasks.suite import load_suite, score_tasks
from trainer.tasks.tasks import Task

log = logging.getLogger(__name__)


class EvalInterrupted(Exception):
    """A preemption signal arrived during the eval: abandoned on every rank at the same micro-batch."""


@dataclass
class EvalResult:
    val_loss: float
    val_ppl: float
    val_tokens: int
    """Eval targets, all ranks."""
    val_docs: int
    """Eval documents (chunks of split documents count once each), all ranks."""
    val_token_loss_by_length: dict[str, float | None] = field(default_factory=dict)
    """Per document-length bucket (logging.length_buckets): summed token loss / targets; {} when not
    measured."""
    val_targets_by_length: dict[str, int] = field(default_factory=dict)
    val_token_loss_by_position: dict[str, float | None] = field(default_factory=dict)
    """Per bucket of the target's position in its document (logging.position_buckets); {} when not
    measured."""
    val_targets_by_position: dict[str, int] = field(default_factory=dict)
    val_token_loss_by_source: dict[str, float | None] | None = None
    """With a mixture: per source, summed token loss / targets (None for a source left out of the eval)."""
    val_targets_by_source: dict[str, int] | None = None

    def metrics(self) -> dict:
        """The metrics line's eval keys: every field, but no *_by_source key without a mixture."""
        return {key: value for key, value in vars(self).items() if value is not None}


class Evaluator:
    """This rank's share of the eval set, laid out once; `run(engine)` gives the global `EvalResult`."""

    def __init__(self, docs: list[Document], info: DistInfo, seq_len: int, layout: str,
                 micro_batch_tokens: int, pad_id: int, every: int = 0,
                 groups: LossGroups = NO_GROUPS) -> None:
        self.info = info
        self.groups = groups
        """The loss groups (source x length bucket) whose token losses the result carries."""
        self.every = every
        """train.eval_every: evaluate every `every` steps (0: only when `due` is told it is the last step)."""
        self.pad_id = pad_id
        # Split over the loss group (data x context): the ranks of a tensor group run the same forwards
        # together.
        self.batches: list[Batch] = eval_batches(docs, info.dims.loss_rank, info.dims.loss_size, seq_len,
                                                 layout, micro_batch_tokens, pad_id)
        self.batches, self.group_targets = with_group_targets(self.batches, groups)  # G targets on every rank
        self.docs, self.tokens = (sum(b.num_docs for b in self.batches),
                                  sum(b.num_valid_targets for b in self.batches))

    def due(self, step: int, last: bool) -> bool:
        """Whether the eval runs after optimizer step `step`: every `every` steps, and after the last one."""
        return last or (self.every > 0 and step % self.every == 0)

    def run(self, engine: Engine, stop: Callable[[], bool] | None = None) -> EvalResult:
        """Collective: every rank runs as many forwards as the busiest one (ZeRO-3 gathers weights in each).
        `stop`: asked before each micro-batch (collective, the same answer on every rank: a preemption signal
        on any rank); True abandons the eval there (EvalInterrupted), so a signal is acted on within one
        forward."""
        info = self.info
        counts = [0.0] * info.world_size
        counts[info.rank] = len(self.batches)
        most = int(max(dist_sum(counts, info.device)))
        batches = self.batches + [empty_batch(self.pad_id)] * (most - len(self.batches))
        module = engine.module
        was_training = module.training
        module.eval()
        num_groups = self.groups.size
        try:
            loss_sum, group_sums = 0.0, torch.zeros(num_groups)
            for mb in batches:
                if stop is not None and stop():
                    raise EvalInterrupted("a preemption signal arrived during the eval")
                mb_loss, _, mb_groups = engine.eval_forward(model_inputs(mb.to_device(info.device)))
                loss_sum = loss_sum + mb_loss.float()  # a tensor: no host sync per micro-batch
                if mb_groups is not None:
                    group_sums = group_sums.to(mb_groups.device) + mb_groups
        finally:
            module.train(was_training)
        total_loss, tokens, docs, *groups = dist_sum(
            [float(loss_sum), self.tokens, self.docs, *group_sums.tolist(), *self.group_targets],
            info.device, info.loss_group)
        by = by_group(self.groups, groups[:num_groups], groups[num_groups:], prefix="val_")
        if tokens == 0:
            raise ShardSourceError(f"the eval set's {int(docs)} documents hold no targets (each is a single "
                                   "token, or data.loss_on=assistant finds no assistant turn); set "
                                   "train.eval_every=0")
        val_loss = total_loss / tokens
        return EvalResult(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 700.0)), val_tokens=int(tokens),
                          val_docs=int(docs), **by)


class TaskScorer:
    """train.eval_tasks scored in the loop: `run(engine)` gives {task name: its metrics} (collective)."""

    def __init__(self, tasks: list[Task], tok: FramedTokenizer, info: DistInfo, layout: str,
                 batch_tokens: int, pad_id: int, every: int) -> None:
        self.tasks, self.tok, self.info = tasks, tok, info
        self.layout, self.batch_tokens, self.pad_id = layout, batch_tokens, pad_id
        self.every = every
        """Score every `every` steps (0: only after the last step)."""

    def due(self, step: int, last: bool) -> bool:
        return last or (self.every > 0 and step % self.every == 0)

    def digests(self) -> dict[str, str]:
        """{task name: the sha256 of its items}: recorded in each checkpoint's meta (TASKS_KEY)."""
        return {task.name: task.digest() for task in self.tasks}

    def changed_since(self, recorded: dict) -> list[str]:
        """One line per task whose items differ from those `recorded` (a checkpoint's digests) or that it
        lacks."""
        out = []
        for name, digest in self.digests().items():
            if name in recorded and recorded[name] != digest:
                out.append(f"train.eval_tasks: {name}'s items changed since the checkpoint "
                           f"(sha256 {recorded[name][:12]} "
                           f"-> {digest[:12]}): its scores after the resume are of other items than before")
        return out

    def run(self, engine: Engine) -> dict[str, dict]:
        """Each task's metrics (trainer.tasks.metrics), scored on `engine.module` (the model as built: a
        replicated engine's, which every rank holds whole, or split over a tensor group, whose ranks score the
        same rows together: the rows are dealt over the loss group)."""
        results = score_tasks(engine.module, self.tasks, self.tok, self.pad_id, self.layout,
                              self.batch_tokens, self.info.device, self.info)
        return {name: result["metrics"] for name, result in results.items()}


def build_evaluator(cfg: RunConfig, data: DataSource, info: DistInfo, groups: LossGroups,
                    read: Callable = lambda phase, run: run()) -> Evaluator | None:
    """train.eval_every's Evaluator (None without): its documents read once, through `read(phase, run)` (the
    start's preemptible phase, trainer.run.preemption.PreemptionHandler.during)."""
    if not cfg.train.eval_every:
        return None
    docs = read("reading the held-out documents", lambda: load_eval_docs(
        cfg.data, data.tokenizer_dir, data.eos_id, cfg.train.seq_len, cfg.train.eval_docs, cfg.data.on_error))
    return Evaluator(docs, info, cfg.train.seq_len, cfg.train.eval_layout, cfg.train.micro_batch_tokens,
                     data.pad_id, every=cfg.train.eval_every, groups=groups)


def build_task_scorer(cfg: RunConfig, data: DataSource, info: DistInfo) -> TaskScorer | None:
    """train.eval_tasks, loaded once (built-ins from the run's held-out data) and checked against the model's
    context before the first step (None without tasks)."""
    if not cfg.train.eval_tasks:
        return None
    tasks, tok = load_suite(cfg.train.eval_tasks, "train.eval_tasks", lambda: cfg.data, data.tokenizer_dir,
                            cfg.model.max_seq_len)
    every = cfg.train.eval_every if cfg.train.eval_tasks_every is None else cfg.train.eval_tasks_every
    return TaskScorer(tasks, tok, info, cfg.train.eval_tasks_layout, cfg.train.micro_batch_tokens,
                      data.pad_id, every)
