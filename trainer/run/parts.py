"""The parts the loop calls after each optimizer step, in order, each owning its cadence
(OLMo-core's callbacks):

    part         due                                        does
    NonFinite    the loss or gradient norm is NaN/inf       stops the run (train.on_nonfinite=stop)
                                                            or counts a skip
    Counting     every step                                 the run's counters; the document keys;
                                                            the resume line
    HeldOut      Evaluator.due (train.eval_every, the end)  the held-out eval (trainer.run.evals),
                                                            cut short by a signal
    Tasks        TaskScorer.due, no signal pending          the downstream tasks (train.eval_tasks)
    StepFlops    the line is logged (Logging.due)           the step's FLOPs, mfu / hfu, the ranks' imbalance
    Logging      MetricsLogger.due, or forced by the line   the metrics line (metrics.jsonl, W&B)
    Saving       Checkpointer.due                           the checkpoint

A part reads the step (`StepEnd`) and returns what it adds to the step's metrics line (`StepEnd.line`): a part
later in the list sees what the earlier ones added (an eval forces the line to be logged). The loop itself
(trainer.run.loop) only runs the step and the parts: no cadence, no metric, no file of its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from trainer.data.feed import Batch, LossGroups, imbalance
from trainer.distributed.engine import Engine
from trainer.distributed.groups import DistInfo, dist_sum
from trainer.errors import NonFiniteError
from trainer.run.checkpointer import Checkpointer
from trainer.run.evals import EvalInterrupted, EvalResult, Evaluator, TaskScorer
from trainer.run.flops import FlopModel, flop_metrics
from trainer.run.metrics import DocKeysLog, MetricsLogger, step_metrics
from trainer.run.preemption import PreemptionHandler
from trainer.run.step import ComputeClock, StepStats

log = logging.getLogger(__name__)


@dataclass
class StepEnd:
    """One optimizer step, as the parts see it once it ran."""

    step: int
    """The step just taken (the first is 1)."""
    last: bool
    """Whether it is train.max_steps."""
    stats: StepStats
    rows: list
    """This rank's rows of the step."""
    batches: list[Batch]
    """This rank's micro-batches."""
    lr: float
    step_time: float
    data_time: float
    line: dict = field(default_factory=dict)
    """What the parts so far add to the step's metrics line."""


class Part(Protocol):
    def due(self, end: StepEnd) -> bool:
        """Whether this part runs after step `end`."""

    def run(self, end: StepEnd) -> dict:
        """This part's work after step `end`; returns what it adds to the metrics line."""


@dataclass
class Resumed:
    """Where this run resumed: the checkpoint, its step, and what restoring the data readers read."""

    path: Path | None = None
    at: int | None = None
    """The step resumed from (None: a fresh start)."""
    read: dict = field(default_factory=lambda: {"resume_samples_read": None, "resume_bytes_read": None})

    def first_after(self, step: int) -> bool:
        return self.at is not None and step == self.at + 1


class NonFinite:
    """A step whose loss or gradient norm is NaN/inf (its update was not applied): stops the run with a line
    that names the suspect (train.on_nonfinite=stop), or counts it as skipped (skip)."""

    def __init__(self, policy: str, resumed: Resumed, checkpointer: Checkpointer, counters: dict) -> None:
        self.policy, self.resumed, self.checkpointer, self.counters = policy, resumed, checkpointer, counters

    def due(self, end: StepEnd) -> bool:
        return not end.stats.finite

    def run(self, end: StepEnd) -> dict:
        message = self.message(end.step, f"non-finite loss ({end.stats.loss}) or gradient norm "
                                         f"({end.stats.grad_norm})")
        if self.policy == "stop":
            raise NonFiniteError(message)
        if self.resumed.first_after(end.step):
            log.warning("%s (train.on_nonfinite=skip: the step was dropped)", message)
        self.counters["skipped_steps"] += 1
        return {}

    def message(self, step: int, what: str) -> str:
        """The line for a non-finite step `step`. On the first step after a resume, the checkpoint is the
        suspect (damaged weights or optimizer state train to NaN at once), not the learning rate."""
        resumed, last = self.resumed, self.checkpointer.last
        if resumed.first_after(step):
            return (f"step {step}: {what} on the first step after resuming from {resumed.path}: that "
                    "checkpoint is the suspect (damaged weights or optimizer state?); resume from an earlier "
                    "one (or start from it with train.init_from to reset the optimizer)")
        if last is None and resumed.at is not None:  # nothing saved since the resume
            return (f"step {step}: {what}, {step - resumed.at} steps after resuming from {resumed.path}, and "
                    "no checkpoint written since: that checkpoint is a suspect (damaged optimizer state "
                    "trains to NaN within a few steps); the update was not applied; resume from an earlier "
                    "checkpoint, or lower optim.lr if it trained well")
        return (f"step {step}: {what}; the update was not applied and no checkpoint of it was written (last "
                f"good checkpoint: {last or 'none: this run saved none yet'}); lower optim.lr, or set "
                "train.on_nonfinite=skip to drop such steps")


class Counting:
    """The run's counters (what summary.json and a resumed run continue from), the document keys
    (logging.record_doc_keys), and on the first step after a resume what restoring the readers read."""

    def __init__(self, counters: dict, doc_keys: DocKeysLog | None, resumed: Resumed) -> None:
        self.counters, self.doc_keys, self.resumed = counters, doc_keys, resumed

    def due(self, end: StepEnd) -> bool:
        return True

    def run(self, end: StepEnd) -> dict:
        stats, counters = end.stats, self.counters
        counters["valid_tokens"] += stats.valid_tokens
        counters["allocated_tokens"] += stats.allocated_tokens
        counters["docs"] += stats.docs
        counters["elapsed_s"] += end.step_time
        if stats.source_tokens is not None:
            counters["tokens_by_source"] = [a + b for a, b in zip(counters["tokens_by_source"],
                                                                  stats.source_tokens, strict=True)]
        if self.doc_keys is not None:
            self.doc_keys.log(end.step, [doc.key for row in end.rows for doc in row])
        return self.resumed.read if self.resumed.first_after(end.step) else {}


class HeldOut:
    """The held-out eval on its steps; abandoned ({}) when a preemption signal reaches any rank meanwhile: the
    step is checkpointed right after, without waiting for the rest of the eval."""

    def __init__(self, evaluator: Evaluator, engine: Engine, preemption: PreemptionHandler,
                 info: DistInfo) -> None:
        self.evaluator, self.engine, self.preemption, self.info = evaluator, engine, preemption, info
        self.last: EvalResult | None = None
        """The newest eval's result (summary.json's)."""

    def due(self, end: StepEnd) -> bool:
        return self.evaluator.due(end.step, end.last)

    def run(self, end: StepEnd) -> dict:
        t0 = time.perf_counter()
        try:
            self.last = self.evaluator.run(self.engine, lambda: self.preemption.requested(self.info.device))
        except EvalInterrupted:
            log.warning("step %d: the eval was abandoned after %.1f s (a preemption signal)", end.step,
                        time.perf_counter() - t0)
            return {}
        return {**self.last.metrics(), "eval_time_s": time.perf_counter() - t0}


class Tasks:
    """The downstream tasks on their steps (not once a preemption signal is pending: the step is checkpointed
    first): the line's `tasks` (each task's metrics) and `tasks_time_s`."""

    def __init__(self, scorer: TaskScorer, engine: Engine, preemption: PreemptionHandler,
                 info: DistInfo) -> None:
        self.scorer, self.engine, self.preemption, self.info = scorer, engine, preemption, info

    def due(self, end: StepEnd) -> bool:
        return self.scorer.due(end.step, end.last) and not self.preemption.requested(self.info.device)

    def run(self, end: StepEnd) -> dict:
        t0 = time.perf_counter()
        return {"tasks": self.scorer.run(self.engine), "tasks_time_s": time.perf_counter() - t0}


class Logging:
    """The step's metrics line, written on MetricsLogger's steps and on any step a part before it added to (an
    eval, the first after a resume) or that was not finite."""

    def __init__(self, metrics: MetricsLogger, counters: dict, groups: LossGroups,
                 source_weights: list[float], info: DistInfo, warmup_marked_steps: int, lockstep,
                 compile_counter) -> None:
        self.metrics, self.counters, self.groups, self.source_weights = (
            metrics, counters, groups, source_weights)
        self.info, self.warmup_marked_steps = info, warmup_marked_steps
        self.lockstep, self.compile_counter = lockstep, compile_counter
        self.last_loss: float | None = None
        """The newest logged step's loss (summary.json's final_loss)."""

    def due(self, end: StepEnd) -> bool:
        return self.metrics.due(end.step, end.last, forced=bool(end.line) or not end.stats.finite)

    def run(self, end: StepEnd) -> dict:
        self.last_loss = end.stats.loss
        recompiles = self.compile_counter.recompiles if self.compile_counter is not None else None
        line = step_metrics(end.step, end.stats, end.lr, end.step_time, end.data_time, self.counters,
                            self.groups, self.source_weights, self.info.device,
                            end.step <= self.warmup_marked_steps, self.lockstep, recompiles)
        self.metrics.log({**line, **end.line})
        return {}


class StepFlops:
    """On logged steps: the step's model and hardware FLOPs over all ranks, and mfu / hfu where the peak is
    known (trainer.run.flops); with several data ranks each one's modeled work and measured compute and wait
    (ComputeClock); under context parallelism how evenly the group shares the rows and the bytes of keys and
    values exchanged. Collective: one all-reduce of 2 + 3 x data ranks numbers."""

    def __init__(self, flops: FlopModel, clock: ComputeClock, info: DistInfo, peak_flops: float | None,
                 dealer, kv_row_bytes: int, logged: Callable[[StepEnd], bool]) -> None:
        self.flops, self.clock, self.info, self.peak_flops = flops, clock, info, peak_flops
        self.dealer, self.kv_row_bytes, self.logged = dealer, kv_row_bytes, logged

    def due(self, end: StepEnd) -> bool:
        return self.logged(end)

    def run(self, end: StepEnd) -> dict:
        info = self.info
        model_flops, hardware_flops = self.flops.step_flops(end.rows, end.batches)
        n, r = info.data_world, info.data_rank
        per_rank = [0.0] * 3 * n  # each data rank's modeled work, measured compute s and wait s, in thirds
        compute_s, wait_s = self.clock.read()
        per_rank[r], per_rank[n + r], per_rank[2 * n + r] = model_flops, compute_s, wait_s
        model_flops, hardware_flops, *per_rank = dist_sum(  # over the data group: each row once
            [model_flops, hardware_flops, *per_rank], info.device, info.data_group)
        peak = self.peak_flops * info.world_size if self.peak_flops else None
        out = flop_metrics(model_flops, hardware_flops, end.step_time, peak)
        if n > 1:
            out["dp_imbalance"] = imbalance(per_rank[:n])
            out["dp_compute_imbalance"] = imbalance(per_rank[n:2 * n])
            out["dp_wait_s"] = max(per_rank[2 * n:])
        if self.dealer is not None:
            out["dp_imbalance_drawn"] = self.dealer.drawn_imbalance
        # how evenly the group shares this rank's micro-batches (host arithmetic)
        if info.context is not None:
            out["cp_imbalance"] = self.flops.context_imbalance(end.batches, info.context_size,
                                                               info.context.split)
            out["cp_kv_bytes"] = self.kv_row_bytes * sum(mb.plan.received_rows() for mb in end.batches)
        return out


class Saving:
    """The checkpoint, on the Checkpointer's steps (`save`: the trainer's, which knows what goes in)."""

    def __init__(self, checkpointer: Checkpointer, save: Callable[[], None], saved: int) -> None:
        self.checkpointer, self.save = checkpointer, save
        self.saved = saved
        """The step of the newest checkpoint this run wrote, or resumed from (a preempted run saves only a
        step newer than that)."""

    def due(self, end: StepEnd) -> bool:
        return self.checkpointer.due(end.step)

    def run(self, end: StepEnd) -> dict:
        self.ensure(end.step)
        return {}

    def ensure(self, step: int) -> None:
        """Collective: step `step` (the trainer's step) checkpointed, unless it already is."""
        if self.saved != step:
            self.save()
            self.saved = step
