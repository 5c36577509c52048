"""The trainer: builds the parts from a `RunConfig` and owns the cadence (log, checkpoint, resume).

The optimizer step itself lives in `trainer.run.step`; wrapping for several ranks in `trainer.distributed.groups`.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from trainer.checkpoint import store as checkpoint
from trainer.checkpoint.weights import checkpoint_conventions, init_from_checkpoint, tokenizer_mismatch
from trainer.config import RunConfig
from trainer.data.batch import Batch, check_token_ids
from trainer.data.loader import DocumentLoader
from trainer.data.pipeline import RowPrefetcher, RowStream, micro_batches
from trainer.data.shards import load_manifest
from trainer.data.sources import ShardSource, resolve_source
from trainer.data.stream import DocumentStream
from trainer.data.tokenizer import load_tokenizer, special_ids, tokenizer_hash
from trainer.distributed.engine import parallelize, resolve_dtype
from trainer.distributed.groups import DistInfo, broadcast_object, dist_sum
from trainer.errors import ConfigError
from trainer.model import apply_activation_checkpointing, build_model
from trainer.model.compile import CompileCounter
from trainer.run.evaluate import EvalResult, Evaluator, load_eval_docs
from trainer.run.metrics import DocKeysLog, MetricsLogger, peak_flops, peak_mem_gb
from trainer.run.optim import build_optimizer, build_scheduler
from trainer.run.preemption import PreemptionHandler
from trainer.run.step import NonFiniteError, train_step

log = logging.getLogger(__name__)


@dataclass
class DataSource:
    rows: RowStream | RowPrefetcher
    """RowPrefetcher with data.prefetch (the default): the same interface and rows."""
    loader: DocumentLoader
    tokenizer_dir: Path
    tokenizer_hash: str
    vocab_size: int
    pad_id: int
    eos_id: int


def build_data(cfg: RunConfig, info: DistInfo) -> DataSource:
    """This rank's row stream over the training shards (its own slots of the rank x worker split).

    The shards and tokenizer come from `resolve_source` (data.path, or data.urls / data.tokenizer), checked
    here at startup: a pattern that matches nothing fails before any training.
    """
    source = resolve_source(cfg.data)
    check_loss_on(cfg.data.loss_on, source)
    tok = load_tokenizer(source.tokenizer_dir)
    ids = special_ids(tok, source.tokenizer_dir)
    stream = DocumentStream(
        source.train_urls,
        source.tokenizer_dir,
        ids.eos,
        seed=cfg.seed,
        rank=info.rank,
        world_size=info.world_size,
        shuffle_buffer=cfg.data.shuffle_buffer,
        on_error=cfg.data.on_error,
        expected_docs=source.expected_docs,
        retries=cfg.data.retries,
        loss_on=cfg.data.loss_on,
    )
    loader = DocumentLoader(stream, num_workers=cfg.data.num_workers, lockstep=cfg.data.epoch_lockstep)
    rows = RowStream(loader, cfg.train.seq_len, cfg.packing)
    return DataSource(
        rows=RowPrefetcher(rows) if cfg.data.prefetch else rows,
        loader=loader,
        tokenizer_dir=source.tokenizer_dir,
        tokenizer_hash=tokenizer_hash(source.tokenizer_dir),
        vocab_size=tok.get_vocab_size(),
        pad_id=ids.pad,
        eos_id=ids.eos,
    )


def check_loss_on(loss_on: str, source: ShardSource) -> None:
    """data.loss_on=assistant needs chat data: a manifest with a "chat" entry (trainer.prepare writes it for
    chat sources). Shards without a manifest (data.urls alone) cannot be checked: a warning."""
    if loss_on != "assistant":
        return
    if source.manifest is None:
        log.warning("data.loss_on=assistant: no manifest.json beside the shards, so nothing shows they hold ChatML "
                    "conversations; documents without assistant turns will give no targets")
        return
    if "chat" not in load_manifest(source.manifest.parent):
        raise ConfigError(f"data.loss_on=assistant needs chat data prepared with --source chat:PATH or demo-chat; "
                          f"{source.manifest.parent} holds plain text (or set data.loss_on=all)")


LOSS_DEFINITIONS = {
    "global_tokens": "sum of token cross-entropies over valid targets / valid targets of the whole optimizer step "
    "(all micro-batches, all ranks)",
    "document_mean": "mean token cross-entropy of each document (a chunk of a split document counts as one), "
    "averaged over the documents of the whole optimizer step (all ranks)",
    "micro_batch_mean": "mean token cross-entropy of each micro-batch, averaged over the micro-batches of all ranks",
    "row_mean": "mean token cross-entropy of each row, averaged over the rows of the whole optimizer step (all ranks)",
}


LOSS_ON_TARGETS = {
    "all": "every token but the first of each document or chunk",
    "assistant": "the tokens of assistant turns only (content and the closing <|im_end|>; a token counts if its "
    "characters overlap one); role headers, system/user turns, the newline after <|im_end|> and EOS are inputs "
    "(trainer.data.chat)",
}


def rows_for_rank(rows_per_step: int, info: DistInfo) -> int:
    """This rank's share of the logical batch. Example: 10 rows over 4 ranks -> 3, 3, 2, 2."""
    return rows_per_step // info.world_size + (info.rank < rows_per_step % info.world_size)


def conventions(cfg: RunConfig, data: DataSource, engine_name: str, world_size: int, dtype: str = "fp32") -> dict:
    """What a later run needs to rebuild the same inputs and objective (saved beside the weights).

    dtype: train.dtype as the run resolved it ('fp32' or 'bf16', see trainer.distributed.engine.resolve_dtype).
    """
    return {
        "layout": cfg.packing.layout,
        "packing": {
            "algorithm": "online best-fit-decreasing over a bounded buffer (trainer.data.packing.OnlinePacker)",
            "buffer_size": cfg.packing.buffer_size,
            "row_length": cfg.train.seq_len,
            "long_docs": cfg.packing.long_docs,
            "unpacked_pad_to": cfg.packing.pad_to,
            "same_documents_in_every_layout": True,
        },
        "positions": {"scheme": cfg.model.pos_emb, "reset_at_document_start": cfg.packing.reset_positions},
        "attention": {"backend": cfg.attention.backend, "isolate_documents": cfg.attention.isolate_documents},
        "labels": {
            "shifted": "inside the loss (labels are stored unshifted)",
            "ignore_index": -100,
            "ignored": ["first position of every document or chunk", "padding", "loss-masked tokens"],
            "eos": "appended to every document and kept as a target"
            + (" (with loss_on=assistant: an input only)" if cfg.data.loss_on == "assistant" else ""),
            "loss_on": cfg.data.loss_on,
            "targets": LOSS_ON_TARGETS[cfg.data.loss_on],
        },
        "loss": {
            "normalization": cfg.loss.normalization,
            "definition": LOSS_DEFINITIONS[cfg.loss.normalization],
        },
        "eval": {
            "split": "val", "order": "manifest shards permuted with seed 0, file order, no shuffle",
            "docs": cfg.train.eval_docs, "long_docs": "split", "layout": cfg.train.eval_layout,
            "val_loss": "sum of token cross-entropies / eval targets (all ranks)",
        },
        "tokenizer": {"files": "tokenizer/", "sha256": data.tokenizer_hash, "vocab_size": data.vocab_size},
        "engine": engine_name,
        "dtype": dtype,
        "world_size": world_size,
        "tokens_per_step": cfg.train.tokens_per_step,
    }


class Trainer:
    def __init__(self, cfg: RunConfig, info: DistInfo) -> None:
        self.cfg = cfg
        self.info = info
        self.run_dir = Path(cfg.run_dir)
        if cfg.train.on_nonfinite == "skip" and cfg.distributed.engine != "ddp":
            raise ConfigError("train.on_nonfinite=skip needs distributed.engine=ddp (DeepSpeed clips and applies the "
                             "update in one call, so a non-finite step cannot be dropped); use train.on_nonfinite=stop")
        if cfg.train.compile and cfg.distributed.engine == "deepspeed" and cfg.distributed.zero_stage == 3:
            raise ConfigError("train.compile=true does not run under ZeRO-3 (its per-module hooks gather the weights "
                              "inside the compiled blocks): use distributed=deepspeed_zero2, or train.compile=false")
        self.dtype = resolve_dtype(cfg.train.dtype, info.device)
        """train.dtype as run: 'auto' resolved to 'bf16' (CUDA with bf16) or 'fp32'."""
        _seed_everything(cfg.seed)
        self.data = build_data(cfg, info)
        self.resume_path = self._resume_path()
        model = build_model(cfg.model, cfg.attention, vocab_size=self.data.vocab_size,
                            loss_chunk_tokens=cfg.loss.chunk_tokens)
        apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
        self.init_record = self._init_from(model) if self.resume_path is None else None
        model = model.to(info.device)
        self.model_vocab_size = model.cfg.vocab_size
        self.n_params = sum(p.numel() for p in model.parameters())  # before wrapping: ZeRO-3 partitions them
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_scheduler(optimizer, cfg.optim, cfg.train.max_steps)
        self.optimizer_fused = any(g.get("fused") for g in optimizer.param_groups)
        self.compile_counter = CompileCounter() if cfg.train.compile else None
        self.engine = parallelize(model, optimizer, scheduler, info, cfg.distributed, cfg.train.grad_clip, self.dtype,
                                  compile=cfg.train.compile)
        self.step = 0
        self.counters = {"valid_tokens": 0, "allocated_tokens": 0, "docs": 0, "elapsed_s": 0.0, "skipped_steps": 0}
        self.last_checkpoint: Path | None = None
        self.evaluator = self._build_evaluator() if cfg.train.eval_every else None
        self.last_eval: EvalResult | None = None
        self._resume()
        self.wandb_group = cfg.logging.wandb.group or f"{cfg.model.n_layer}L-{cfg.train.seq_len}T-seed{cfg.seed}"
        self.metrics = MetricsLogger(
            self.run_dir, cfg.logging.wandb, cfg.resolved, [cfg.packing.layout, cfg.attention.backend], self.wandb_group,
            enabled=info.is_main, resume_step=self.step,
        )
        self.doc_keys = DocKeysLog(self.run_dir, info.rank, self.step) if cfg.logging.record_doc_keys else None
        if info.is_main:  # what trainer.report compares runs by
            (self.run_dir / "config.json").write_text(json.dumps(cfg.resolved, indent=2, default=str))
        self.flops_per_token = 6 * self.n_params  # + attention, ignored: an estimate for MFU
        self.peak_flops = peak_flops(info.device)

    def _build_evaluator(self) -> Evaluator:
        cfg = self.cfg
        docs = load_eval_docs(cfg.data, self.data.tokenizer_dir, self.data.eos_id, cfg.train.seq_len,
                              cfg.train.eval_docs, cfg.data.on_error)
        return Evaluator(docs, self.info, cfg.train.seq_len, cfg.train.eval_layout, cfg.train.micro_batch_tokens,
                         self.data.pad_id)

    def _resume_path(self) -> Path | None:
        """The checkpoint train.resume names (true: the run dir's latest), or None: a fresh start."""
        resume = self.cfg.train.resume
        if resume is False or resume in ("false", "False"):
            return None
        if self.info.is_main:
            for partial in checkpoint.incomplete_checkpoints(self.run_dir):
                print(f"resume: ignoring incomplete checkpoint {partial} (its save was interrupted; never loaded)")
        path = checkpoint.latest_checkpoint(self.run_dir) if resume in (True, "true", "True") else Path(resume)
        if path is None and self.info.is_main:
            print(f"resume: no checkpoint in {self.run_dir / 'checkpoints'}; starting from step 0")
        return path

    def _init_from(self, model) -> dict | None:
        """train.init_from: the checkpoint's weights into the freshly built model (before any wrapping, so ZeRO-3
        partitions the loaded weights); optimizer, schedule, step and data start fresh. A requeued run that
        finds its own checkpoint resumes from that instead (train.resume), never from init_from again."""
        source, add = self.cfg.train.init_from, self.cfg.tokenizer.add_tokens
        if not source:
            if add:
                raise ConfigError(f"tokenizer.add_tokens={add} extends the tokenizer of train.init_from's checkpoint: "
                                  "set train.init_from=CHECKPOINT too")
            return None
        record = init_from_checkpoint(model, source, self.data.tokenizer_dir, self.data.tokenizer_hash, list(add))
        if self.info.is_main:
            grown = f"; tokenizer extended by {add} (new rows = mean of the old)" if add else ""
            print(f"init_from: weights of {source} (its step {record['step']}){grown}; optimizer, schedule, step "
                  "and data start fresh")
        return record

    def _resume(self) -> None:
        path = self.resume_path
        if path is None:
            return
        ckpt_hash = checkpoint_conventions(path)["tokenizer"]["sha256"] if (path / "conventions.json").is_file() else None
        if ckpt_hash is not None and ckpt_hash != self.data.tokenizer_hash:
            raise ConfigError(tokenizer_mismatch(path, self.data.tokenizer_dir, self.data.tokenizer_hash, "train.resume"))
        if (path / "conventions.json").is_file():  # a fine-tuning run keeps the record of where it started
            self.init_record = checkpoint_conventions(path).get("init_from")
        meta, rank_state = checkpoint.load_checkpoint(path, self.info, self.engine)
        self.data.rows.load_state_dict(rank_state["data"])
        self.step = meta["step"]
        self.counters = {**self.counters, **meta["counters"]}
        self.resumed_at = self.step
        self.data.loader.start()  # the readers restore their positions now: the line below says what that read
        read = self._resume_read()
        if self.info.is_main:
            print(f"resumed from {path} at step {self.step}; data position restored on all ranks: "
                  + " ".join(f"{k}={v}" for k, v in read.items()), flush=True)

    def fit(self) -> dict:
        """Train to train.max_steps, or until a preemption signal: then checkpoint the step reached and return."""
        cfg, info = self.cfg, self.info
        bar = tqdm(total=cfg.train.max_steps, initial=self.step, disable=not (info.is_main and cfg.logging.progress),
                   desc="train", dynamic_ncols=True)
        preemption = PreemptionHandler()
        preempted = None
        try:
            while self.step < cfg.train.max_steps:
                stats, step_time = self._train_one_step()
                bar.update(1)
                bar.set_postfix(loss=f"{stats.loss:.4f}", util=f"{stats.real_tokens / stats.allocated_tokens:.3f}",
                                tok_s=f"{stats.valid_tokens / step_time:,.0f}")
                every = cfg.train.checkpoint_every
                saved = (every and self.step % every == 0) or self.step == cfg.train.max_steps
                if saved:
                    self.save()
                if preemption.requested(info.device):  # collective: every rank stops at this same step
                    if not saved:
                        self.save()
                    preempted = preemption.signal_name or "a signal on another rank"
                    break
        finally:
            preemption.close()
            bar.close()
            self.data.rows.close()  # DataLoader workers (and the prefetch thread) end here, however training ended
            if self.compile_counter is not None:
                self.compile_counter.close()
        if preempted and info.is_main:
            print(f"preempted ({preempted}) after step {self.step}; checkpoint: {self.last_checkpoint}; "
                  "continue with train.resume=true and the same hydra.run.dir", flush=True)
        ev = self.last_eval
        summary = self.metrics.summary({
            "final_step": self.step,
            "final_loss": self._last_loss,
            "final_val_loss": ev.val_loss if ev else None,
            "final_val_ppl": ev.val_ppl if ev else None,
            "val_tokens": ev.val_tokens if ev else None,
            "val_docs": ev.val_docs if ev else None,
            "loss_normalization": self.cfg.loss.normalization,
            "wandb_group": self.wandb_group,
            "world_size": info.world_size,
            "elapsed_s": self.counters["elapsed_s"],
            "peak_mem_gb": peak_mem_gb(info.device),
            "total_valid_tokens": self.counters["valid_tokens"],
            "total_allocated_tokens": self.counters["allocated_tokens"],
            "total_docs": self.counters["docs"],
            "skipped_steps": self.counters["skipped_steps"],
            "skipped_samples": self.data.loader.skipped(),
            **self.resume_read,
            "packing_stats": self.data.rows.stats.state_dict(),
            "dtype": self.dtype,
            "optimizer_fused": self.optimizer_fused,
            **self._compile_summary(),
            "preempted": preempted,
            "run_dir": str(self.run_dir),
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
        })
        self.metrics.close()
        return summary

    def _compile_summary(self) -> dict:
        """train.compile's counts for summary.json: dynamo compilations, recompilations and their latest reasons."""
        counter = self.compile_counter
        if counter is None:
            return {"compile": False, "compile_frames": None, "compile_recompiles": None}
        return {"compile": True, "compile_frames": counter.compiles, "compile_recompiles": counter.recompiles,
                "compile_recompile_reasons": counter.reasons()}

    def _take_rows(self, n_rows: int) -> list:
        """This rank's rows of the next step. With data.epoch_lockstep, a rank whose readers finished the epoch
        has packed what it held and contributes fewer (or no) rows until every rank has finished; then all
        start the next epoch together. Collective (two tiny all-reduces per step)."""
        rows_stream = self.data.rows
        if not self.cfg.data.epoch_lockstep:
            return rows_stream.take(n_rows)
        for _ in range(3):
            (waiting,) = dist_sum([float(rows_stream.exhausted)], self.info.device)
            if waiting == self.info.world_size:  # every rank is done with the epoch
                rows_stream.next_epoch()
            rows = rows_stream.take(n_rows)
            (total,) = dist_sum([float(len(rows))], self.info.device)
            if total > 0:
                return rows
        raise RuntimeError("a whole epoch gave no documents on any rank (empty or all-skipped training shards?)")

    def _lay_out(self, rows: list) -> list[Batch]:
        """A step's rows as micro-batches, checked, and pinned when bound for CUDA (in the prefetch thread, when
        the rows were drawn there)."""
        cfg = self.cfg
        mbs = micro_batches(rows, cfg.packing, cfg.train.seq_len, cfg.train.micro_batch_tokens, self.data.pad_id)
        for mb in mbs:  # on the host, before any kernel can index out of range
            check_token_ids(mb, self.model_vocab_size)
        if self.info.device.type == "cuda":
            with torch.cuda.device(self.info.device):  # this rank's GPU, also in the prefetch thread (not GPU 0's)
                mbs = [mb.pin_memory() for mb in mbs]  # trainer.run.step.to_device then copies without waiting
        return mbs

    def _train_one_step(self):
        """Build this rank's batches, run the step, count, evaluate and log. Returns (stats, step time)."""
        cfg, info = self.cfg, self.info
        t0 = time.perf_counter()
        n_rows = rows_for_rank(cfg.train.rows_per_step, info)
        rows = self._take_rows(n_rows)
        prefetcher = self.data.rows if isinstance(self.data.rows, RowPrefetcher) else None
        mbs = prefetcher.prepared(rows) if prefetcher else None  # laid out in the background with the rows
        if mbs is None:
            mbs = self._lay_out(rows)
        if prefetcher and self.step + 1 < cfg.train.max_steps:
            prefetcher.prefetch(n_rows, self._lay_out)  # the next step's rows, drawn while this step computes
        t_data = time.perf_counter() - t0
        lr = self.engine.lr()  # the rate this step uses (the schedule advances inside the step)
        stats = train_step(self.engine, mbs, info, self.data.pad_id, cfg.loss.normalization)
        if info.device.type == "cuda":
            torch.cuda.synchronize(info.device)
        step_time = time.perf_counter() - t0
        self.step += 1
        if not stats.finite:
            if cfg.train.on_nonfinite == "stop":
                raise NonFiniteError(
                    f"step {self.step}: non-finite loss ({stats.loss}) or gradient norm ({stats.grad_norm}); the "
                    f"update was not applied and no checkpoint of it was written (last good checkpoint: "
                    f"{self.last_checkpoint}); lower optim.lr, or set train.on_nonfinite=skip to drop such steps")
            self.counters["skipped_steps"] += 1
        self.counters["valid_tokens"] += stats.valid_tokens
        self.counters["allocated_tokens"] += stats.allocated_tokens
        self.counters["docs"] += stats.docs
        self.counters["elapsed_s"] += step_time
        if self.doc_keys is not None:
            self.doc_keys.log(self.step, [doc.key for row in rows for doc in row])
        resumed = self.resume_read if self.resumed_at is not None and self.step == self.resumed_at + 1 else {}
        last = self.step == cfg.train.max_steps
        evaluation = self._evaluate() if self._eval_due(last) else None
        if evaluation or resumed or self.step % cfg.logging.log_every == 0 or last or not stats.finite:
            self._log(stats, lr, step_time, t_data, {**(evaluation or {}), **resumed})
        return stats, step_time

    _last_loss: float | None = None
    resumed_at: int | None = None
    """The step this run resumed from (None: a fresh start)."""
    resume_read: dict = {"resume_samples_read": None, "resume_bytes_read": None}

    def _resume_read(self) -> dict:
        """What the data readers of all ranks read from shards to restore their positions (collective)."""
        samples, nbytes = dist_sum([float(n) for n in self.data.loader.resume_read()], self.info.device)
        self.resume_read = {"resume_samples_read": int(samples), "resume_bytes_read": int(nbytes)}
        return self.resume_read

    def _eval_due(self, last: bool) -> bool:
        return self.evaluator is not None and (last or self.step % self.cfg.train.eval_every == 0)

    def _evaluate(self) -> dict:
        t0 = time.perf_counter()
        self.last_eval = self.evaluator.run(self.engine)
        return {**vars(self.last_eval), "eval_time_s": time.perf_counter() - t0}

    def _log(self, stats, lr: float, step_time: float, data_time: float, evaluation: dict | None) -> None:
        self._last_loss = stats.loss
        m = {
            "step": self.step,
            "loss": stats.loss,
            "token_loss": stats.token_loss,
            "lr": lr,
            "grad_norm": stats.grad_norm,
            "valid_tokens": stats.valid_tokens,
            "allocated_tokens": stats.allocated_tokens,
            "token_utilization": stats.real_tokens / stats.allocated_tokens,
            "docs": stats.docs,
            "docs_per_row": stats.docs / stats.rows,
            "valid_tokens_per_s": stats.valid_tokens / step_time,
            "allocated_tokens_per_s": stats.allocated_tokens / step_time,
            "step_time_s": step_time,
            "data_time_s": data_time,
            "elapsed_s": self.counters["elapsed_s"],
            "skipped_steps": self.counters["skipped_steps"],
            "nonfinite": not stats.finite,
            "peak_mem_gb": peak_mem_gb(self.info.device),
            "warmup": self.step <= self.cfg.train.warmup_marked_steps,
        }
        if self.compile_counter is not None:
            m["compile_recompiles"] = self.compile_counter.recompiles
        if self.peak_flops:
            m["mfu"] = self.flops_per_token * stats.real_tokens / step_time / (self.peak_flops * self.info.world_size)
        self.metrics.log({**m, **(evaluation or {})})

    def save(self) -> None:
        meta = {"counters": self.counters, "engine": self.engine.name, "config": self.cfg.resolved}
        self.last_checkpoint = checkpoint.save_checkpoint(
            self.run_dir, self.step, self.info, self.engine,
            rank_state={"data": self.data.rows.state_dict()},
            meta=meta,
            conventions={**conventions(self.cfg, self.data, self.engine.name, self.info.world_size, self.dtype),
                         "init_from": self.init_record},
            tokenizer_dir=self.data.tokenizer_dir,
            keep_last=self.cfg.train.keep_last,
        )


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def shared_run_dir(run_dir: str, info: DistInfo) -> str:
    """Rank 0's run directory on every rank (Hydra's timestamped default can differ by a second)."""
    return broadcast_object(str(Path(run_dir).resolve()) if info.is_main else None)


def write_summary(run_dir: Path, summary: dict) -> None:
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
