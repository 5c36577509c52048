"""The trainer: builds the parts from a `RunConfig`, then runs the loop.

    for each optimizer step until train.max_steps (or a preemption signal):
        micro-batches = inputs.next()                 trainer.run.inputs
        stats = train_step(engine, micro-batches)     trainer.run.step
        evaluate    if evaluator.due(step)            trainer.run.evals
        log         if metrics.due(step)              trainer.run.metrics
        checkpoint  if checkpointer.due(step)         trainer.run.checkpointer (files: trainer.checkpoint.store)

Each part owns its own rule (cadence, file layout, what is logged); the loop only calls them in order.
Wrapping for several ranks happens once, in trainer.distributed.engine.parallelize.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from trainer.checkpoint import hf, store
from trainer.checkpoint.weights import (
    checkpoint_conventions,
    checkpoint_tokenizer_hash,
    init_from_checkpoint,
    tokenizer_mismatch,
)
from trainer.config import RunConfig, resolve_dtype
from trainer.data.feed import (
    LossGroups,
    ReadInterrupted,
    StepInterrupted,
    allow_reads,
    imbalance,
    interrupt_reads,
    load_eval_docs,
)
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo, broadcast_object, dist_sum
from trainer.errors import ConfigError, NonFiniteError
from trainer.model import build_model
from trainer.model.compile import CompileCounter
from trainer.registry import CONFIG_FILE, SUMMARY_FILE
from trainer.run.checkpointer import Checkpointer, check_resumable
from trainer.run.conventions import conventions
from trainer.run.evals import EvalInterrupted, EvalResult, Evaluator, TaskScorer
from trainer.run.flops import flop_metrics, flop_model
from trainer.run.inputs import StepInputs, build_data
from trainer.run.metrics import DocKeysLog, MetricsLogger, peak_flops, run_summary, step_metrics
from trainer.run.optim import build_optimizer, build_scheduler
from trainer.run.preemption import PreemptedAtStart, PreemptionHandler
from trainer.run.run_dir import claim_run_dir, input_dirs, set_aside_after, unlock_run_dir
from trainer.run.step import ComputeClock, train_step
from trainer.tasks.suite import load_suite

TASKS_KEY = "eval_tasks"
"""meta.json's {task name: sha256 of its items} of train.eval_tasks (TaskScorer.digests)."""

log = logging.getLogger(__name__)


class Trainer:
    def __init__(self, cfg: RunConfig, info: DistInfo, accepted: Callable[[], None] | None = None) -> None:
        """`accepted`: called once the run dir is this run's (locked, the start and the checkpoint checked), before
        the run writes its files: the command writes its own record there (Hydra's files, the job log)."""
        self.cfg = cfg
        self.info = info
        self.run_dir = Path(cfg.run_dir)
        claim_run_dir(self.run_dir, cfg.train.resume, cfg.train.overwrite, info,  # before anything is written
                      input_dirs(cfg))
        # From here a preemption signal is recorded, not fatal: the long phases of the start (loading a checkpoint,
        # dealing a reshaped resume, the readers replaying shards to their positions) end at the next check.
        self.preemption = PreemptionHandler()
        try:
            self._build(accepted)
        except BaseException:  # refused after all (e.g. a checkpoint that does not fit): the run dir is left as found
            self.preemption.close()
            unlock_run_dir(self.run_dir, refused=True)
            raise

    def _build(self, accepted: Callable[[], None] | None) -> None:
        cfg, info = self.cfg, self.info
        self.dtype = resolve_dtype(cfg.train.dtype, info.device)
        """train.dtype as run: 'auto' resolved to 'bf16' (CUDA with bf16) or 'fp32'."""
        _seed_everything(cfg.seed)
        self.checkpointer = Checkpointer(self.run_dir, info, cfg.train.checkpoint_every, cfg.train.keep_last,
                                         cfg.train.max_steps)
        self.resume_path = self._preemptible("verifying the checkpoint to resume from",
                                             lambda: self.checkpointer.resume_path(cfg.train.resume))
        if self.resume_path is not None:  # before the data and the model are built from this config
            check_resumable(self.resume_path, cfg.resolved)
        self.data = build_data(cfg, info)
        mixture = cfg.data.mixture()
        self.groups = LossGroups(tuple(cfg.logging.length_buckets), tuple(s.name for s in mixture),
                                 tuple(cfg.logging.position_buckets))
        """The loss groups of the step's and the eval's metrics: data.sources x logging.length_buckets x
        logging.position_buckets."""
        self.source_weights = [s.weight for s in mixture]
        # A fresh run builds on the meta device: parallelize gives each rank its part of the one-rank weights
        # (trainer.distributed.engine.materialize), the whole model never built. A resumed or init_from run loads
        # whole weights anyway; DeepSpeed takes a built model.
        meta = self.resume_path is None and not cfg.train.init_from and cfg.distributed.engine != "deepspeed"
        self._check_hf_vocabulary()
        model = build_model(cfg.model, cfg.attention, vocab_size=self.data.vocab_size,
                            loss_chunk_tokens=cfg.loss.chunk_tokens, meta=meta)
        self.init_record = self._init_from(model) if self.resume_path is None else None
        if not meta:
            model = model.to(info.device)
        self.flops = flop_model(model, cfg.attention, cfg.train.activation_checkpointing, info.device,
                                self.dtype)  # before wrapping: ZeRO-3 partitions the parameters
        self.kv_row_bytes = (2 * 2 * model.cfg.n_layer * model.cfg.kv_heads * model.cfg.head_dim // info.tensor_size
                             * (2 if self.dtype == "bf16" else 4))
        """Bytes one position's keys and values cost to exchange under context parallelism: K and V, all-gathered
        forward and their gradients reduce-scattered backward, in every layer (this rank's heads)."""
        self.clock = ComputeClock(model, info.device)
        """Each rank's measured compute and wait of a step (dp_compute_imbalance, dp_wait_s)."""
        self.inputs = StepInputs(self.data, cfg, info, vocab_size=model.cfg.vocab_size,
                                 cost=lambda row: self.flops.model_flops(len(doc) for doc in row))
        optimizer = build_optimizer(model, cfg.optim, info.device)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
        self.optimizer_fused = any(g.get("fused") for g in optimizer.param_groups)
        self.compile_counter = CompileCounter() if cfg.train.compile else None
        self.engine = parallelize(model, optimizer, scheduler, info, cfg.distributed, cfg.train.grad_clip, self.dtype,
                                  compile=cfg.train.compile,
                                  activation_checkpointing=cfg.train.activation_checkpointing)
        self.step = 0
        self.counters = {"valid_tokens": 0, "allocated_tokens": 0, "docs": 0, "elapsed_s": 0.0, "skipped_steps": 0,
                         "lockstep_wait_steps": self.inputs.rows.wait_steps}  # counted into by StepRows.take
        if mixture:
            self.counters["tokens_by_source"] = [0] * len(mixture)
        self.evaluator = self._build_evaluator() if cfg.train.eval_every else None
        self.task_scorer = self._build_task_scorer() if cfg.train.eval_tasks else None
        self.last_eval: EvalResult | None = None
        self._resume()
        if accepted is not None:  # every check passed: the run writes from here on
            accepted()
        self.wandb_group = cfg.logging.wandb.group or f"{cfg.model.n_layer}L-{cfg.train.seq_len}T-seed{cfg.seed}"
        self.metrics = MetricsLogger(
            self.run_dir, cfg.logging.wandb, cfg.resolved, [cfg.packing.layout, cfg.attention.backend], self.wandb_group,
            enabled=info.is_main, resume_step=self.step, log_every=cfg.logging.log_every,
        )
        self.doc_keys = DocKeysLog(self.run_dir, info, self.step) if cfg.logging.record_doc_keys else None
        if info.is_main:  # what trainer.report compares runs by
            (self.run_dir / CONFIG_FILE).write_text(json.dumps(cfg.resolved, indent=2, default=str))
        self.peak_flops = peak_flops(info.device)

    def _build_evaluator(self) -> Evaluator:
        cfg = self.cfg
        docs = self._preemptible("reading the held-out documents", lambda: load_eval_docs(
            cfg.data, self.data.tokenizer_dir, self.data.eos_id, cfg.train.seq_len, cfg.train.eval_docs,
            cfg.data.on_error))
        return Evaluator(docs, self.info, cfg.train.seq_len, cfg.train.eval_layout, cfg.train.micro_batch_tokens,
                         self.data.pad_id, every=cfg.train.eval_every, groups=self.groups)

    def _build_task_scorer(self) -> TaskScorer:
        """train.eval_tasks, loaded once (built-ins from the run's held-out data) and checked against the model's
        context before the first step."""
        cfg = self.cfg
        tasks, tok = load_suite(cfg.train.eval_tasks, "train.eval_tasks", lambda: cfg.data, self.data.tokenizer_dir,
                                cfg.model.max_seq_len)
        every = cfg.train.eval_every if cfg.train.eval_tasks_every is None else cfg.train.eval_tasks_every
        return TaskScorer(tasks, tok, self.info, cfg.train.eval_tasks_layout, cfg.train.micro_batch_tokens,
                          self.data.pad_id, every)

    def _check_hf_vocabulary(self) -> None:
        """A Hugging Face train.init_from whose config.json's vocabulary cannot hold the data's tokenizer: the data was
        prepared with another tokenizer (model.vocab_size comes from that config.json: setting it is refused)."""
        source, rows = self.cfg.train.init_from, self.cfg.model.vocab_size
        if not source or rows is None or rows >= self.data.vocab_size or not hf.is_hf_dir(source) or (
                Path(source) / store.META_FILE).is_file():
            return
        raise ConfigError(f"train.init_from={source}: its {hf.CONFIG_FILE} says vocab_size {rows}, fewer than the "
                          f"{self.data.vocab_size} ids of the data's tokenizer ({self.data.tokenizer_dir}): the data was "
                          f"prepared with another tokenizer; prepare it with the model's (python -m trainer.prepare ... "
                          f"--tokenizer {source})")

    def _init_from(self, model) -> dict | None:
        """train.init_from: the checkpoint's weights into the freshly built model (before any wrapping, so ZeRO-3
        partitions the loaded weights); optimizer, schedule, step and data start fresh. A requeued run that
        finds its own checkpoint resumes from that instead (train.resume), never from init_from again."""
        source, add = self.cfg.train.init_from, self.cfg.tokenizer.add_tokens
        if not source:  # tokenizer.add_tokens without init_from is refused with the config (cross_section_rules)
            return None
        record = init_from_checkpoint(model, source, self.data.tokenizer_dir, self.data.tokenizer_hash, list(add))
        if self.info.is_main:
            grown = f"; tokenizer extended by {add} (new rows = mean of the old)" if add else ""
            origin = record.get("architecture") or f"its step {record['step']}"
            print(f"init_from: weights of {source} ({origin}){grown}; optimizer, schedule, step and data start fresh")
        return record

    def _resume(self) -> None:
        path = self.resume_path
        if path is None:
            return
        is_checkpoint = (path / store.META_FILE).is_file()  # if not, the store's load below says so
        ckpt_hash = checkpoint_tokenizer_hash(path) if is_checkpoint else self.data.tokenizer_hash
        if ckpt_hash != self.data.tokenizer_hash:
            raise ConfigError(tokenizer_mismatch(path, ckpt_hash, self.data.tokenizer_dir, self.data.tokenizer_hash,
                                                 "train.resume"))
        if (path / store.CONVENTIONS_FILE).is_file():  # a fine-tuning run keeps the record of where it started
            self.init_record = checkpoint_conventions(path).get("init_from")
        meta, rank_states = self._preemptible(f"loading {path}", lambda: self.checkpointer.load(path, self.engine))
        self._preemptible(f"restoring the data stream of {path}",
                          lambda: self._load_stream_state(path, meta, rank_states))
        self.step = meta["step"]
        self.counters = {**self.counters, **meta["counters"]}
        self.inputs.rows.wait_steps = self.counters["lockstep_wait_steps"]  # an older checkpoint: from here
        self.resumed_at = self.step
        if self.info.is_main:  # the branch after this step, if any, is abandoned: set aside, never picked again
            set_aside_after(self.run_dir, self.step)
        try:
            self.data.rows.start()  # the readers restore their positions now: the line below says what that read
        except ReadInterrupted:  # by a preemption signal (its handler interrupts every read)
            if self.preemption.signal_name is None:
                raise
        self._stop_if_preempted(f"restoring the data readers' positions of {path}")
        read = self._resume_read()
        if self.info.is_main:
            print(f"resumed from {path} at step {self.step}; data position restored on all ranks: "
                  + " ".join(f"{k}={v}" for k, v in read.items()), flush=True)
            recorded = meta.get(TASKS_KEY)
            for line in self.task_scorer.changed_since(recorded) if self.task_scorer and isinstance(recorded, dict) else ():
                print(f"resume: warning: {line}", flush=True)
            written = ((meta.get("config") or {}).get("train") or {}).get("tokens_per_step")
            if written is not None and written != self.cfg.train.tokens_per_step:
                print(f"resume: train.tokens_per_step {written} -> {self.cfg.train.tokens_per_step}: the global batch "
                      f"of every step after {self.step} differs from the checkpoint's run (the learning-rate schedule "
                      "does not change with it)", flush=True)

    def _preemptible(self, phase: str, run: Callable):
        """Collective: `run()`, one phase of the start, then every rank stops (PreemptedAtStart) if a preemption
        signal reached any rank meanwhile. A signal cuts the phase short where it reads (the checkpoint's files
        hashed, every old rank's state read, the reshaped stream dealt: ReadInterrupted on that rank); the other
        ranks finish it and stop with it. Returns what `run` returned."""
        try:
            result = run()
        except ReadInterrupted:
            self._stop_if_preempted(phase)
            raise
        self._stop_if_preempted(phase)
        return result

    def _stop_if_preempted(self, phase: str) -> None:
        """Collective: every rank raises PreemptedAtStart if a preemption signal reached any rank so far."""
        if self.preemption.requested(self.info.device):
            signal_name = self.preemption.signal_name or "a signal on another rank"
            raise PreemptedAtStart(f"preempted ({signal_name}) while {phase}, before training: nothing was trained "
                                   f"or written; continue with the same command")

    def _load_stream_state(self, path: Path, meta: dict, rank_states: dict[int, dict]) -> None:
        """This rank's data stream state: its own on the shape the checkpoint was written on; on another number
        of ranks or data.num_workers, its part of every old rank's (trainer.data.reshape: each document of the
        interrupted epoch not yet trained on is trained on once, in another order than the uninterrupted run's).

        The stream belongs to the data ranks: under context and tensor parallelism the C x T ranks of a data rank
        hold one stream's state alike, so a checkpoint written at C x T = N by W ranks holds W / N streams (those of
        ranks 0, N, 2N, ...) and resumes on any layout whose data ranks are as many (the stream exactly) or not
        (dealt, as above)."""
        cfg, info, written = self.cfg, self.info, meta["world_size"]
        saved_dist = (meta.get("config") or {}).get("distributed") or {}
        per_stream = int(saved_dist.get("context_parallel") or 1) * int(saved_dist.get("tensor_parallel") or 1)
        streams = [r * per_stream for r in range(written // per_stream)]  # one rank of each old data rank
        if len(streams) == info.data_world and streams[info.data_rank] not in rank_states:
            rank_states = {**rank_states, **store.load_rank_states(path, [streams[info.data_rank]])}
        own = rank_states.get(streams[info.data_rank]) if len(streams) == info.data_world else None
        old_workers = (own or next(iter(rank_states.values())))["data"]["docs"]["num_workers"]
        if own is not None and old_workers == cfg.data.num_workers:
            return self.data.rows.load_state_dict(own["data"])
        if not set(streams) <= set(rank_states):  # another shape: every old stream's state is dealt
            rank_states = {**rank_states, **store.load_rank_states(path, [r for r in streams if r not in rank_states])}
        saved = (meta.get("config") or {}).get("data", {})
        written = len(streams)
        state = self.data.rows.reshaped_state([rank_states[r]["data"] for r in streams], cfg.data.num_workers,
                                              lockstep=cfg.data.epoch_lockstep,
                                              written_lockstep=saved.get("epoch_lockstep", True))
        if info.is_main:
            print(f"resume on another shape: written by {written} rank(s) x {old_workers} DataLoader worker(s), "
                  f"resumed on {info.data_world} x {cfg.data.num_workers}: what was left of epoch "
                  f"{state.epoch} is dealt over the new readers (each document once; the order "
                  "differs from the uninterrupted run's)", flush=True)
        self.data.rows.load_state(state)

    def fit(self) -> dict:
        """Train to train.max_steps, or until a preemption signal: then checkpoint the step reached and return."""
        cfg, info = self.cfg, self.info
        bar = tqdm(total=cfg.train.max_steps, initial=self.step, disable=not (info.is_main and cfg.logging.progress),
                   desc="train", dynamic_ncols=True)
        preemption = self.preemption  # installed at the start (__init__)
        preempted = None
        saved_step = self.step  # a resumed run's checkpoint is its first step's
        try:
            while self.step < cfg.train.max_steps:
                try:
                    stats, step_time = self._train_one_step()
                except ReadInterrupted as exn:  # the signal came while this step's rows were still being read
                    joint = isinstance(exn, StepInterrupted)  # raised on every rank at the same point
                    if not joint and (preemption.signal_name is None or info.world_size > 1):
                        raise
                    if self.step != saved_step:  # the step never ran: the checkpoint is the last finished one's
                        self.save()
                    preempted = preemption.signal_name or "a signal on another rank"
                    break
                bar.update(1)
                bar.set_postfix(loss=f"{stats.loss:.4f}", util=f"{stats.real_tokens / stats.allocated_tokens:.3f}",
                                tok_s=f"{stats.valid_tokens / step_time:,.0f}")
                saved = self.checkpointer.due(self.step)
                if saved:
                    self.save()
                    saved_step = self.step
                if preemption.requested(info.device):  # collective: every rank stops at this same step
                    if not saved:
                        self.save()
                    preempted = preemption.signal_name or "a signal on another rank"
                    break
        except KeyboardInterrupt:  # Ctrl-C: no save (the step in progress may be half applied); one line, not a trace
            raise KeyboardInterrupt(
                f"training stopped during step {self.step + 1}; nothing after step {self.step} was saved (last "
                f"checkpoint: {self.checkpointer.last or 'none written by this run'}); continue with "
                "train.resume=true and the same hydra.run.dir") from None
        finally:
            preemption.close()
            bar.close()
            interrupt_reads()  # a read still blocked (drawing ahead, in a worker) gives up: nothing more is trained on
            self.data.rows.close()  # DataLoader workers (and the prefetch thread) end here, however training ended
            allow_reads()
            if self.compile_counter is not None:
                self.compile_counter.close()
        if preempted and info.is_main:
            print(f"preempted ({preempted}) after step {self.step}; checkpoint: {self.checkpointer.last}; "
                  "continue with train.resume=true and the same hydra.run.dir", flush=True)
        summary = self.metrics.summary(self._summary(preempted))
        self.metrics.close()
        return summary

    def _train_one_step(self):
        """Build this rank's batches, run the step, count, evaluate and log. Returns (stats, step time)."""
        cfg, info = self.cfg, self.info
        t0 = time.perf_counter()
        rows, mbs, t_data = self.inputs.next(prefetch_next=self.step + 1 < cfg.train.max_steps)
        lr = self.engine.lr()  # the rate this step uses (the schedule advances inside the step)
        try:
            stats = train_step(self.engine, mbs, info, self.data.pad_id, cfg.loss.normalization, groups=self.groups,
                               clock=self.clock)
        except NonFiniteError as e:  # DeepSpeed's: stopped before its step
            if not self._first_after_resume(self.step + 1):
                raise
            raise NonFiniteError(self._nonfinite_message(self.step + 1, str(e))) from None
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        step_time = time.perf_counter() - t0
        self.step += 1
        if not stats.finite:
            message = self._nonfinite_message(self.step, f"non-finite loss ({stats.loss}) or gradient norm "
                                                         f"({stats.grad_norm})")
            if cfg.train.on_nonfinite == "stop":
                raise NonFiniteError(message)
            if self._first_after_resume(self.step):
                log.warning("%s (train.on_nonfinite=skip: the step was dropped)", message)
            self.counters["skipped_steps"] += 1
        self.counters["valid_tokens"] += stats.valid_tokens
        self.counters["allocated_tokens"] += stats.allocated_tokens
        self.counters["docs"] += stats.docs
        self.counters["elapsed_s"] += step_time
        if stats.source_tokens is not None:
            self.counters["tokens_by_source"] = [a + b for a, b in zip(self.counters["tokens_by_source"],
                                                                       stats.source_tokens, strict=True)]
        if self.doc_keys is not None:
            self.doc_keys.log(self.step, [doc.key for row in rows for doc in row])
        resumed = self.resume_read if self.resumed_at is not None and self.step == self.resumed_at + 1 else {}
        last = self.step == cfg.train.max_steps
        evaluation = self._evaluate() if self.evaluator is not None and self.evaluator.due(self.step, last) else {}
        if self.task_scorer is not None and self.task_scorer.due(self.step, last) and not self._stop_requested():
            evaluation = {**evaluation, **self._score_tasks()}
        if self.metrics.due(self.step, last, forced=bool(evaluation or resumed or not stats.finite)):
            flops = self._step_flops(rows, mbs, step_time)
            self._log(stats, lr, step_time, t_data, {**evaluation, **resumed, **flops})
        return stats, step_time

    def _first_after_resume(self, step: int) -> bool:
        return self.resumed_at is not None and step == self.resumed_at + 1

    def _nonfinite_message(self, step: int, what: str) -> str:
        """The line for a non-finite step `step`. On the first step after a resume, the checkpoint is the
        suspect (damaged weights or optimizer state train to NaN at once), not the learning rate."""
        if self._first_after_resume(step):
            return (f"step {step}: {what} on the first step after resuming from {self.resume_path}: that checkpoint "
                    "is the suspect (damaged weights or optimizer state?); resume from an earlier one (or start "
                    "from it with train.init_from to reset the optimizer)")
        if self.checkpointer.last is None and self.resumed_at is not None:  # nothing saved since the resume
            return (f"step {step}: {what}, {step - self.resumed_at} steps after resuming from {self.resume_path}, and "
                    "no checkpoint written since: that checkpoint is a suspect (damaged optimizer state trains to NaN "
                    "within a few steps); the update was not applied; resume from an earlier checkpoint, or lower "
                    "optim.lr if it trained well")
        return (f"step {step}: {what}; the update was not applied and no checkpoint of it was written (last good "
                f"checkpoint: {self.checkpointer.last or 'none: this run saved none yet'}); lower optim.lr, or set "
                "train.on_nonfinite=skip to drop such steps")

    _last_loss: float | None = None
    resumed_at: int | None = None
    """The step this run resumed from (None: a fresh start)."""
    resume_read: dict = {"resume_samples_read": None, "resume_bytes_read": None}

    def _resume_read(self) -> dict:
        """What the data readers of all ranks read from shards to restore their positions (collective)."""
        samples, nbytes = dist_sum([float(n) for n in self.data.rows.resume_read()], self.info.device,
                                   self.info.data_group)  # the ranks of a context or tensor group read the same
        self.resume_read = {"resume_samples_read": int(samples), "resume_bytes_read": int(nbytes)}
        return self.resume_read

    def _step_flops(self, rows: list, mbs: list, step_time: float) -> dict:
        """The step's model and hardware FLOPs over all ranks, and mfu / hfu where the peak is known (trainer.run.flops);
        with several data ranks each one's modeled work and measured compute and wait (ComputeClock). Collective: one
        all-reduce of 2 + 3 x data ranks numbers, on logged steps only."""
        model_flops, hardware_flops = self.flops.step_flops(rows, mbs)
        n, r = self.info.data_world, self.info.data_rank
        per_rank = [0.0] * 3 * n  # each data rank's modeled work, measured compute s and wait s, in thirds
        compute_s, wait_s = self.clock.read()
        per_rank[r], per_rank[n + r], per_rank[2 * n + r] = model_flops, compute_s, wait_s
        model_flops, hardware_flops, *per_rank = dist_sum(  # over the data group: each row once
            [model_flops, hardware_flops, *per_rank], self.info.device, self.info.data_group)
        peak = self.peak_flops * self.info.world_size if self.peak_flops else None
        out = flop_metrics(model_flops, hardware_flops, step_time, peak)
        if n > 1:
            out["dp_imbalance"] = imbalance(per_rank[:n])
            out["dp_compute_imbalance"] = imbalance(per_rank[n:2 * n])
            out["dp_wait_s"] = max(per_rank[2 * n:])
        if self.inputs.dealer is not None:
            out["dp_imbalance_drawn"] = self.inputs.dealer.drawn_imbalance
        if self.info.context is not None:  # how evenly the group shares this rank's micro-batches (host arithmetic)
            out["cp_imbalance"] = self.flops.context_imbalance(mbs, self.info.context_size, self.info.context.split)
            out["cp_kv_bytes"] = self.kv_row_bytes * sum(mb.plan.received_rows() for mb in mbs)
        return out

    preemption: PreemptionHandler
    """Installed when the run dir is claimed; closed when `fit` ends (or the start fails)."""

    def _evaluate(self) -> dict:
        """The eval's metrics; {} when a preemption signal (on any rank) abandoned it: the step is checkpointed
        right after, without waiting for the rest of the eval."""
        t0 = time.perf_counter()
        handler = self.preemption
        stop = (lambda: handler.requested(self.info.device)) if handler is not None else None
        try:
            self.last_eval = self.evaluator.run(self.engine, stop)
        except EvalInterrupted:
            log.warning("step %d: the eval was abandoned after %.1f s (a preemption signal)", self.step,
                        time.perf_counter() - t0)
            return {}
        return {**self.last_eval.metrics(), "eval_time_s": time.perf_counter() - t0}

    def _stop_requested(self) -> bool:
        """Collective: whether a preemption signal arrived on any rank (the step is then checkpointed first)."""
        return self.preemption is not None and self.preemption.requested(self.info.device)

    def _score_tasks(self) -> dict:
        """The metrics line's `tasks` (each task's metrics) and `tasks_time_s`."""
        t0 = time.perf_counter()
        return {"tasks": self.task_scorer.run(self.engine), "tasks_time_s": time.perf_counter() - t0}

    def _summary(self, preempted: str | None) -> dict:
        """summary.json: the run's totals and how it ran (trainer.run.metrics.run_summary)."""
        mixture = self.data.mixture
        return run_summary(
            final_step=self.step, final_loss=self._last_loss, last_eval=self.last_eval, counters=self.counters,
            groups=self.groups, source_weights=self.source_weights,
            mixture=mixture.summary() if mixture is not None else None, epochs=self._lockstep(),
            skipped_samples=self.data.rows.skipped(), packing_stats=self.data.rows.stats.state_dict(),
            resume_read=self.resume_read, compile_counter=self.compile_counter, device=self.info.device,
            loss_normalization=self.cfg.loss.normalization, wandb_group=self.wandb_group,
            world_size=self.info.world_size, dtype=self.dtype, optimizer_fused=self.optimizer_fused,
            preempted=preempted, run_dir=str(self.run_dir),
            checkpoint=str(self.checkpointer.last) if self.checkpointer.last else None)

    def _lockstep(self):
        """The ranks' epochs (StepRows) with data.epoch_lockstep, for the metrics; None without."""
        return self.inputs.rows if self.cfg.data.epoch_lockstep else None

    def _log(self, stats, lr: float, step_time: float, data_time: float, evaluation: dict | None) -> None:
        self._last_loss = stats.loss
        recompiles = self.compile_counter.recompiles if self.compile_counter is not None else None
        m = step_metrics(self.step, stats, lr, step_time, data_time, self.counters, self.groups, self.source_weights,
                         self.info.device, self.step <= self.cfg.train.warmup_marked_steps, self._lockstep(),
                         recompiles)
        self.metrics.log({**m, **(evaluation or {})})

    def save(self) -> None:
        meta = {"counters": self.counters, "engine": self.engine.name, "config": self.cfg.resolved}
        if self.task_scorer is not None:
            meta[TASKS_KEY] = self.task_scorer.digests()
        self.checkpointer.save(
            self.step, self.engine,
            rank_state={"data": self.data.rows.state_dict()},
            meta=meta,
            conventions={**conventions(self.cfg, self.data, self.engine.name, self.info.world_size, self.dtype),
                         "init_from": self.init_record},
            tokenizer_dir=self.data.tokenizer_dir,
            weights=self._weights_due(),
        )

    def _weights_due(self) -> bool:
        """Whether this save writes model.safetensors: always, except where the whole model exists on no rank
        (FSDP2, tensor parallelism: `engine.gathers_weights`) and gathering it costs each save seconds (its weights
        are in dcp/ or engine.pt): there at the run's last step, or at every save with train.save_weights=every."""
        return not self.engine.gathers_weights or self.cfg.train.save_weights == "every" or self.step >= self.cfg.train.max_steps


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def shared_run_dir(run_dir: str, info: DistInfo) -> str:
    """Rank 0's run directory on every rank (Hydra's timestamped default can differ by a second)."""
    return broadcast_object(str(Path(run_dir).resolve()) if info.is_main else None)


def write_summary(run_dir: Path, summary: dict) -> None:
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str))
