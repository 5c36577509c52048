"""The trainer: builds the parts from a `RunConfig`, then runs the loop.

    for each optimizer step until train.max_steps (or a preemption signal):
        micro-batches = inputs.next()                 trainer.run.inputs
        stats = train_step(engine, micro-batches)     trainer.run.step
        for part in parts:                            trainer.run.parts: non-finite, counting, held-out eval,
            if part.due(step): part.run(step)         tasks, FLOPs, metrics line, checkpoint, in that order
        stop if a preemption signal reached any rank  trainer.run.preemption (the step checkpointed first)

Each part owns its own rule (cadence, file layout, what is logged); the loop only calls them in order. A
resume restores the engine (trainer.run.checkpointer, files: trainer.checkpoint.store) and the data stream, on
any shape (trainer.checkpoint.streams). Wrapping for several ranks happens once, in
trainer.distributed.engine.parallelize.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from trainer.checkpoint import store
from trainer.checkpoint.streams import restore_stream, resume_read
from trainer.checkpoint.weights import checkpoint_conventions, checkpoint_tokenizer_hash, tokenizer_mismatch
from trainer.config import RunConfig, resolve_dtype
from trainer.data.feed import LossGroups, ReadInterrupted, StepInterrupted, allow_reads, interrupt_reads
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo, broadcast_object
from trainer.errors import ConfigError, NonFiniteError
from trainer.model import build_model
from trainer.model.compile import CompileCounter
from trainer.registry import CONFIG_FILE, SUMMARY_FILE
from trainer.run.checkpointer import Checkpointer, check_init_vocabulary, check_resumable, init_from
from trainer.run.conventions import conventions
from trainer.run.evals import build_evaluator, build_task_scorer
from trainer.run.flops import flop_model
from trainer.run.inputs import StepInputs, build_data
from trainer.run.metrics import DocKeysLog, MetricsLogger, peak_flops, run_summary
from trainer.run.optim import build_optimizer, build_scheduler
from trainer.run.parts import (
    Counting,
    HeldOut,
    Logging,
    NonFinite,
    Part,
    Resumed,
    Saving,
    StepEnd,
    StepFlops,
    Tasks,
)
from trainer.run.preemption import PreemptionHandler
from trainer.run.run_dir import claim_run_dir, input_dirs, set_aside_after, unlock_run_dir
from trainer.run.step import ComputeClock, train_step


class Trainer:
    def __init__(self, cfg: RunConfig, info: DistInfo, accepted: Callable[[], None] | None = None) -> None:
        """`accepted`: called once the run dir is this run's (locked, the start and the checkpoint checked),
        before the run writes its files: the command writes its own record there (Hydra's files, the job
        log)."""
        self.cfg = cfg
        self.info = info
        self.run_dir = Path(cfg.run_dir)
        claim_run_dir(self.run_dir, cfg.train.resume, cfg.train.overwrite, info,  # before anything is written
                      input_dirs(cfg))
        # From here a preemption signal is recorded, not fatal: the long phases of the start (loading a
        # checkpoint, dealing a reshaped resume, the readers replaying shards to their positions) end at the
        # next check.
        self.preemption = PreemptionHandler()
        """Installed when the run dir is claimed; closed when `fit` ends (or the start fails)."""
        try:
            self._build(accepted)
        except BaseException:  # refused after all (e.g. a checkpoint that does not fit): the run dir as found
            self.preemption.close()
            unlock_run_dir(self.run_dir, refused=True)
            raise

    def _starting(self, phase: str, run: Callable):
        """`run()`, one phase of the start, which a preemption signal ends on every rank
        (PreemptionHandler.during)."""
        return self.preemption.during(phase, run, self.info.device)

    def _build(self, accepted: Callable[[], None] | None) -> None:
        cfg, info = self.cfg, self.info
        self.dtype = resolve_dtype(cfg.train.dtype, info.device)
        """train.dtype as run: 'auto' resolved to 'bf16' (CUDA with bf16) or 'fp32'."""
        _seed_everything(cfg.seed)
        self.checkpointer = Checkpointer(self.run_dir, info, cfg.train.checkpoint_every, cfg.train.keep_last,
                                         cfg.train.max_steps, cfg.train.save_weights)
        self.resumed = Resumed(path=self._starting("verifying the checkpoint to resume from",
                                                   lambda: self.checkpointer.resume_path(cfg.train.resume)))
        if self.resumed.path is not None:  # before the data and the model are built from this config
            check_resumable(self.resumed.path, cfg.resolved)
        self.data = build_data(cfg, info)
        mixture = cfg.data.mixture()
        self.groups = LossGroups(tuple(cfg.logging.length_buckets), tuple(s.name for s in mixture),
                                 tuple(cfg.logging.position_buckets))
        """The loss groups of the step's and the eval's metrics: data.sources x logging.length_buckets x
        logging.position_buckets."""
        self.source_weights = [s.weight for s in mixture]
        # A fresh run builds on the meta device: parallelize gives each rank its part of the one-rank weights
        # (trainer.distributed.engine.materialize), the whole model never built. A resumed or init_from run
        # loads whole weights anyway; DeepSpeed takes a built model.
        meta = self.resumed.path is None and not cfg.train.init_from and cfg.distributed.engine != "deepspeed"
        check_init_vocabulary(cfg, self.data)
        model = build_model(cfg.model, cfg.attention, vocab_size=self.data.vocab_size,
                            loss_chunk_tokens=cfg.loss.chunk_tokens, meta=meta)
        self.init_record = init_from(model, cfg, self.data, info) if self.resumed.path is None else None
        if not meta:
            model = model.to(info.device)
        self.flops = flop_model(model, cfg.attention, cfg.train.activation_checkpointing, info.device,
                                self.dtype)  # before wrapping: ZeRO-3 partitions the parameters
        kv_row_bytes = (2 * 2 * model.cfg.n_layer * model.cfg.kv_heads * model.cfg.head_dim
                        // info.tensor_size * (2 if self.dtype == "bf16" else 4))
        """Bytes one position's keys and values cost to exchange under context parallelism: K and V,
        all-gathered forward and their gradients reduce-scattered backward, in every layer (this rank's
        heads)."""
        self.clock = ComputeClock(model, info.device)
        """Each rank's measured compute and wait of a step (dp_compute_imbalance, dp_wait_s)."""
        self.inputs = StepInputs(self.data, cfg, info, vocab_size=model.cfg.vocab_size,
                                 cost=lambda row: self.flops.model_flops(len(doc) for doc in row))
        optimizer = build_optimizer(model, cfg.optim, info.device)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
        self.optimizer_fused = any(g.get("fused") for g in optimizer.param_groups)
        self.compile_counter = CompileCounter() if cfg.train.compile else None
        self.engine = parallelize(model, optimizer, scheduler, info, cfg.distributed, cfg.train.grad_clip,
                                  self.dtype, compile=cfg.train.compile,
                                  activation_checkpointing=cfg.train.activation_checkpointing)
        self.step = 0
        self.counters = {"valid_tokens": 0, "allocated_tokens": 0, "docs": 0, "elapsed_s": 0.0,
                         "skipped_steps": 0,
                         "lockstep_wait_steps": self.inputs.rows.wait_steps}  # counted into by StepRows.take
        if mixture:
            self.counters["tokens_by_source"] = [0] * len(mixture)
        evaluator = build_evaluator(cfg, self.data, info, self.groups, self._starting)
        self.task_scorer = build_task_scorer(cfg, self.data, info)
        self._resume()
        if accepted is not None:  # every check passed: the run writes from here on
            accepted()
        self.wandb_group = (cfg.logging.wandb.group
                            or f"{cfg.model.n_layer}L-{cfg.train.seq_len}T-seed{cfg.seed}")
        self.metrics = MetricsLogger(
            self.run_dir, cfg.logging.wandb, cfg.resolved, [cfg.packing.layout, cfg.attention.backend],
            self.wandb_group, enabled=info.is_main, resume_step=self.step, log_every=cfg.logging.log_every,
        )
        if info.is_main:  # what trainer.report compares runs by
            (self.run_dir / CONFIG_FILE).write_text(json.dumps(cfg.resolved, indent=2, default=str))
        self.lockstep = self.inputs.rows if cfg.data.epoch_lockstep else None
        """The ranks' epochs (StepRows) with data.epoch_lockstep, for the metrics; None without."""
        doc_keys = DocKeysLog(self.run_dir, info, self.step) if cfg.logging.record_doc_keys else None
        self.nonfinite = NonFinite(cfg.train.on_nonfinite, self.resumed, self.checkpointer, self.counters)
        self.held_out = (HeldOut(evaluator, self.engine, self.preemption, info) if evaluator is not None
                         else None)
        self.logging = Logging(self.metrics, self.counters, self.groups, self.source_weights, info,
                               cfg.train.warmup_marked_steps, self.lockstep, self.compile_counter)
        self.saving = Saving(self.checkpointer, self.save, saved=self.step)
        self.parts: list[Part] = [
            self.nonfinite,
            Counting(self.counters, doc_keys, self.resumed),
            *([self.held_out] if self.held_out is not None else []),
            *([Tasks(self.task_scorer, self.engine, self.preemption, info)]
              if self.task_scorer is not None else []),
            StepFlops(self.flops, self.clock, info, peak_flops(info.device), self.inputs.dealer, kv_row_bytes,
                      logged=self.logging.due),
            self.logging,
            self.saving,
        ]
        """What runs after each step, in this order (trainer.run.parts)."""

    def _resume(self) -> None:
        path = self.resumed.path
        if path is None:
            return
        is_checkpoint = (path / store.META_FILE).is_file()  # if not, the store's load below says so
        ckpt_hash = checkpoint_tokenizer_hash(path) if is_checkpoint else self.data.tokenizer_hash
        if ckpt_hash != self.data.tokenizer_hash:
            raise ConfigError(tokenizer_mismatch(path, ckpt_hash, self.data.tokenizer_dir,
                                                 self.data.tokenizer_hash, "train.resume"))
        # a fine-tuning run keeps the record of where it started
        if (path / store.CONVENTIONS_FILE).is_file():
            self.init_record = checkpoint_conventions(path).get("init_from")
        record, rank_states = self._starting(f"loading {path}",
                                             lambda: self.checkpointer.load(path, self.engine))
        data = self.cfg.data
        self._starting(f"restoring the data stream of {path}", lambda: restore_stream(
            self.data.rows, path, record, rank_states, self.info, data.num_workers, data.epoch_lockstep))
        self.step = self.resumed.at = record.step
        self.counters.update(record.counters)
        self.inputs.rows.wait_steps = self.counters["lockstep_wait_steps"]  # an older checkpoint: from here
        # the branch after this step, if any, is abandoned: set aside, never picked again
        if self.info.is_main:
            set_aside_after(self.run_dir, self.step)
        try:
            # the readers restore their positions now: the line below says what that read
            self.data.rows.start()
        except ReadInterrupted:  # by a preemption signal (its handler interrupts every read)
            if self.preemption.signal_name is None:
                raise
        self.preemption.stop_if_requested(f"restoring the data readers' positions of {path}",
                                          self.info.device)
        self.resumed.read = resume_read(self.data.rows, self.info)
        if self.info.is_main:
            print(f"resumed from {path} at step {self.step}; data position restored on all ranks: "
                  + " ".join(f"{k}={v}" for k, v in self.resumed.read.items()), flush=True)
            scorer = self.task_scorer
            for line in scorer.changed_since(record.tasks) if scorer and record.tasks is not None else ():
                print(f"resume: warning: {line}", flush=True)
            written = record.section("train").get("tokens_per_step")
            if written is not None and written != self.cfg.train.tokens_per_step:
                print(f"resume: train.tokens_per_step {written} -> {self.cfg.train.tokens_per_step}: the "
                      f"global batch of every step after {self.step} differs from the checkpoint's run (the "
                      "learning-rate schedule does not change with it)", flush=True)

    def fit(self) -> dict:
        """Train to train.max_steps, or until a preemption signal: then checkpoint the step reached and
        return."""
        cfg, info = self.cfg, self.info
        bar = tqdm(total=cfg.train.max_steps, initial=self.step,
                   disable=not (info.is_main and cfg.logging.progress), desc="train", dynamic_ncols=True)
        preemption = self.preemption  # installed at the start (__init__)
        preempted = None
        try:
            while self.step < cfg.train.max_steps:
                try:
                    end = self._train_one_step()
                except ReadInterrupted as exn:  # the signal came while this step's rows were still being read
                    joint = isinstance(exn, StepInterrupted)  # raised on every rank at the same point
                    if not joint and (preemption.signal_name is None or info.world_size > 1):
                        raise
                    # the step never ran: the checkpoint is the last finished one's
                    self.saving.ensure(self.step)
                    preempted = preemption.signal_name or "a signal on another rank"
                    break
                for part in self.parts:
                    if part.due(end):
                        end.line.update(part.run(end))
                bar.update(1)
                stats = end.stats
                bar.set_postfix(loss=f"{stats.loss:.4f}",
                                util=f"{stats.real_tokens / stats.allocated_tokens:.3f}",
                                tok_s=f"{stats.valid_tokens / end.step_time:,.0f}")
                if preemption.requested(info.device):  # collective: every rank stops at this same step
                    self.saving.ensure(self.step)
                    preempted = preemption.signal_name or "a signal on another rank"
                    break
        except KeyboardInterrupt:  # Ctrl-C: no save (the step in progress may be half applied), one line
            raise KeyboardInterrupt(
                f"training stopped during step {self.step + 1}; nothing after step {self.step} was saved "
                f"(last checkpoint: {self.checkpointer.last or 'none written by this run'}); continue with "
                "train.resume=true and the same hydra.run.dir") from None
        finally:
            preemption.close()
            bar.close()
            # a read still blocked (drawing ahead, in a worker) gives up: nothing more is trained on
            interrupt_reads()
            # DataLoader workers (and the prefetch thread) end here, however training ended
            self.data.rows.close()
            allow_reads()
            if self.compile_counter is not None:
                self.compile_counter.close()
        if preempted and info.is_main:
            print(f"preempted ({preempted}) after step {self.step}; checkpoint: {self.checkpointer.last}; "
                  "continue with train.resume=true and the same hydra.run.dir", flush=True)
        summary = self.metrics.summary(self._summary(preempted))
        self.metrics.close()
        return summary

    def _train_one_step(self) -> StepEnd:
        """Build this rank's batches and run the step: what the parts then read."""
        cfg, info = self.cfg, self.info
        t0 = time.perf_counter()
        rows, mbs, t_data = self.inputs.next(prefetch_next=self.step + 1 < cfg.train.max_steps)
        lr = self.engine.lr()  # the rate this step uses (the schedule advances inside the step)
        try:
            stats = train_step(self.engine, mbs, info, self.data.pad_id, cfg.loss.normalization,
                               groups=self.groups, clock=self.clock)
        except NonFiniteError as e:  # DeepSpeed's: stopped before its step
            if not self.resumed.first_after(self.step + 1):
                raise
            raise NonFiniteError(self.nonfinite.message(self.step + 1, str(e))) from None
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        step_time = time.perf_counter() - t0
        self.step += 1
        return StepEnd(self.step, self.step == cfg.train.max_steps, stats, rows, mbs, lr, step_time, t_data)

    def _summary(self, preempted: str | None) -> dict:
        """summary.json: the run's totals and how it ran (trainer.run.metrics.run_summary)."""
        mixture = self.data.mixture
        return run_summary(
            final_step=self.step, final_loss=self.logging.last_loss,
            last_eval=self.held_out.last if self.held_out is not None else None, counters=self.counters,
            groups=self.groups, source_weights=self.source_weights,
            mixture=mixture.summary() if mixture is not None else None, epochs=self.lockstep,
            skipped_samples=self.data.rows.skipped(), packing_stats=self.data.rows.stats.state_dict(),
            resume_read=self.resumed.read, compile_counter=self.compile_counter, device=self.info.device,
            loss_normalization=self.cfg.loss.normalization, wandb_group=self.wandb_group,
            world_size=self.info.world_size, dtype=self.dtype, optimizer_fused=self.optimizer_fused,
            preempted=preempted, run_dir=str(self.run_dir),
            checkpoint=str(self.checkpointer.last) if self.checkpointer.last else None)

    def save(self) -> None:
        """Collective: the checkpoint of the step reached."""
        meta = {"counters": self.counters, "engine": self.engine.name, "config": self.cfg.resolved}
        if self.task_scorer is not None:
            meta[store.TASKS_KEY] = self.task_scorer.digests()
        self.checkpointer.save(
            self.step, self.engine,
            rank_state={"data": self.data.rows.state_dict()},
            meta=meta,
            conventions={**conventions(self.cfg, self.data, self.engine.name, self.info.world_size,
                                       self.dtype),
                         "init_from": self.init_record},
            tokenizer_dir=self.data.tokenizer_dir,
            weights=self.checkpointer.weights_due(self.step, self.engine),
        )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def shared_run_dir(run_dir: str, info: DistInfo) -> str:
    """Rank 0's run directory on every rank (Hydra's timestamped default can differ by a second)."""
    return broadcast_object(str(Path(run_dir).resolve()) if info.is_main else None)


def write_summary(run_dir: Path, summary: dict) -> None:
    (run_dir / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, default=str))
