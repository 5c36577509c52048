"""The inputs of each optimizer step: this rank's data stream, and the micro-batches it lays out per step.

`build_data` assembles the stream (shards -> documents -> packed rows, trainer.data); `StepInputs` draws a step's
rows (in lockstep with the other ranks at an epoch's end), lays them out as micro-batches for the configured
layout, checks the token ids on the host, and pins them when bound for a GPU, in the prefetch thread when
data.prefetch draws the next step's rows while the current one computes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.config import RunConfig
from trainer.data.batch import Batch, check_token_ids
from trainer.data.config import SINGLE_SOURCE
from trainer.data.loader import DocumentLoader
from trainer.data.mixture import Mixture
from trainer.data.pipeline import RowPrefetcher, RowStream, micro_batches
from trainer.data.shards import load_manifest
from trainer.data.sources import ShardSource, resolve_source
from trainer.data.stream import DocumentStream, manifest_tokens
from trainer.data.tokenizer import load_tokenizer, special_ids, tokenizer_hash
from trainer.data.workers import ReadInterrupted
from trainer.distributed.groups import DistInfo, dist_sum
from trainer.errors import ConfigError

log = logging.getLogger(__name__)


class StepInterrupted(ReadInterrupted):
    """A preemption signal stopped a read of this step's rows: raised by `StepInputs.next` on every rank at the
    same point, before the step ran, so the ranks can checkpoint the last finished step together."""


@dataclass
class DataSource:
    rows: RowStream | RowPrefetcher
    """RowPrefetcher with data.prefetch (the default): the same interface and rows."""
    loader: DocumentLoader | Mixture
    tokenizer_dir: Path
    tokenizer_hash: str
    vocab_size: int
    pad_id: int
    eos_id: int
    mixture: Mixture | None = None
    """The mixture of data.sources (the same object as `loader`, and the row stream `rows` draws from); None for one
    source."""


def build_data(cfg: RunConfig, info: DistInfo) -> DataSource:
    """This rank's row stream over the training shards (its own slots of the rank x worker split), of one source
    or of the mixture of data.sources (trainer.data.mixture: one row stream per source, rows mixed by weight).

    The shards and tokenizer come from `resolve_source` (data.path, or data.urls / data.tokenizer; per source of a
    mixture), checked here at startup: a pattern that matches nothing fails before any training.
    """
    mixture = cfg.data.mixture()
    parts = [(src.name, resolve_source(cfg.data.for_source(src)), src.weight) for src in mixture] or [
        (SINGLE_SOURCE, resolve_source(cfg.data), 1.0)]
    for _, source, _ in parts:
        check_loss_on(cfg.data.loss_on, source)
    tokenizer_dir = parts[0][1].tokenizer_dir
    token_hash = tokenizer_hash(tokenizer_dir)
    for name, source, _ in parts[1:]:
        if tokenizer_hash(source.tokenizer_dir) != token_hash:
            raise ConfigError(f"data.sources: source {name!r} was prepared with another tokenizer "
                              f"({source.tokenizer_dir}) than {parts[0][0]!r} ({tokenizer_dir}); prepare every source "
                              "with the same one (python -m trainer.prepare --tokenizer DIR)")
    tok = load_tokenizer(tokenizer_dir)
    ids = special_ids(tok, tokenizer_dir)
    seeds = _source_seeds(cfg.seed, len(mixture))
    streams = []
    for index, (name, source, _) in enumerate(parts):
        stream = _stream(cfg, info, source, tokenizer_dir, ids.eos, seeds[index], index, name if mixture else None)
        # A mixture's sources are read one pass at a time whatever data.epoch_lockstep: the mixture ends its epochs.
        loader = DocumentLoader(stream, num_workers=cfg.data.num_workers,
                                lockstep=cfg.data.epoch_lockstep or bool(mixture))
        streams.append(RowStream(loader, cfg.train.seq_len, cfg.packing))
    rows, loader = streams[0], streams[0].docs
    if mixture:  # each source packed alone, its rows mixed by weight
        rows = loader = Mixture(streams, [p[0] for p in parts], [p[2] for p in parts], cfg.data.mix_exhausted,
                                lockstep=cfg.data.epoch_lockstep)
    return DataSource(
        rows=RowPrefetcher(rows) if cfg.data.prefetch else rows,
        loader=loader,
        tokenizer_dir=tokenizer_dir,
        tokenizer_hash=token_hash,
        vocab_size=tok.get_vocab_size(),
        pad_id=ids.pad,
        eos_id=ids.eos,
        mixture=loader if mixture else None,
    )


def _source_seeds(seed: int, num_sources: int) -> list[int]:
    """The seed of each source's stream: the run's for one source; for a mixture, one per source drawn from it
    (two sources over the same shards then read them in different orders)."""
    if not num_sources:
        return [seed]
    return [int(s) for s in np.random.SeedSequence([seed, 1]).generate_state(num_sources)]


def _stream(cfg: RunConfig, info: DistInfo, source: ShardSource, tokenizer_dir: Path, eos_id: int, seed: int,
            index: int, name: str | None) -> DocumentStream:
    return DocumentStream(
        source.train_urls,
        tokenizer_dir,
        eos_id,
        seed=seed,
        rank=info.rank,
        world_size=info.world_size,
        shuffle_buffer=cfg.data.shuffle_buffer,
        on_error=cfg.data.on_error,
        expected_docs=source.expected_docs,
        retries=cfg.data.retries,
        read_timeout_s=cfg.data.read_timeout_s,
        loss_on=cfg.data.loss_on,
        shard_tokens=manifest_tokens(source.train_urls, source.manifest),  # the readers are balanced by them
        name=name,
        source=index,
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


def rows_for_rank(rows_per_step: int, info: DistInfo) -> int:
    """This rank's share of the logical batch. Example: 10 rows over 4 ranks -> 3, 3, 2, 2."""
    return rows_per_step // info.world_size + (info.rank < rows_per_step % info.world_size)



class StepInputs:
    """This rank's micro-batches of each optimizer step (see the module docstring)."""

    def __init__(self, data: DataSource, cfg: RunConfig, info: DistInfo, vocab_size: int) -> None:
        self.data = data
        self.cfg = cfg
        self.info = info
        self.vocab_size = vocab_size
        """The model's embedding rows: every token id must be below it."""
        self.rows_per_rank = rows_for_rank(cfg.train.rows_per_step, info)
        self.lockstep_wait_steps = [0]
        """Per epoch (the ranks' agreed epochs, from 0), the steps in which some rank had fewer rows than its share
        because its readers had finished the epoch (data.epoch_lockstep; the same on every rank)."""

    def next(self, prefetch_next: bool) -> tuple[list, list[Batch], float]:
        """(this step's rows, its micro-batches, seconds spent waiting for them). Collective (the lockstep
        all-reduces). prefetch_next: start drawing the next step's rows in the background (data.prefetch)."""
        t0 = time.perf_counter()
        rows = self.take_rows(self.rows_per_rank)
        prefetcher = self.data.rows if isinstance(self.data.rows, RowPrefetcher) else None
        mbs = prefetcher.prepared(rows) if prefetcher else None  # laid out in the background with the rows
        if mbs is None:
            mbs = self.lay_out(rows)
        if prefetcher and prefetch_next:
            prefetcher.prefetch(self.rows_per_rank, self.lay_out)  # drawn while this step computes
        return rows, mbs, time.perf_counter() - t0

    def take_rows(self, n_rows: int) -> list:
        """This rank's rows of the next step. With data.epoch_lockstep, a rank whose readers finished the epoch
        has packed what it held and contributes fewer (or no) rows until every rank has finished; then all
        start the next epoch together. Collective with several ranks (two tiny all-reduces per step with
        lockstep, one without); raises StepInterrupted on every rank if a preemption signal stopped a read."""
        rows_stream = self.data.rows
        if not self.cfg.data.epoch_lockstep:
            return self._take_agreed(n_rows)[0] if self.info.world_size > 1 else self._take_alone(n_rows)
        for _ in range(3):
            (waiting,) = dist_sum([float(rows_stream.exhausted)], self.info.device)
            if waiting == self.info.world_size:  # every rank is done with the epoch
                rows_stream.next_epoch()
                self.lockstep_wait_steps.append(0)
            rows, total = self._take_agreed(n_rows)
            if total > 0:
                self.lockstep_wait_steps[-1] += total < self.cfg.train.rows_per_step  # fewer only at an epoch's end
                return rows
        raise RuntimeError("a whole epoch gave no documents on any rank (empty or all-skipped training shards?)")

    def _take_alone(self, n_rows: int) -> list:
        try:
            return self.data.rows.take(n_rows)
        except ReadInterrupted as exn:
            raise StepInterrupted(str(exn)) from exn

    def _take_agreed(self, n_rows: int) -> tuple[list, float]:
        """take(n_rows) and the number of rows taken over all ranks (collective). A read interrupted on any rank
        (a preemption signal while its source stalled) abandons the step on every rank, before it runs: the ranks
        that got their rows put them back (RowStream.unread), so the checkpoint of the last finished step holds
        them, and all raise StepInterrupted here together. Without this, the interrupted rank would leave while
        the others wait in this step's collectives."""
        try:
            rows, interrupted = self.data.rows.take(n_rows), None
        except ReadInterrupted as exn:
            rows, interrupted = [], exn
        total, n_interrupted = dist_sum([float(len(rows)), float(interrupted is not None)], self.info.device)
        if n_interrupted:
            if rows:
                self.data.rows.unread(rows)
            raise StepInterrupted(str(interrupted) if interrupted else
                                  f"a preemption signal stopped a shard read on {int(n_interrupted)} other rank(s)")
        return rows, total

    def lay_out(self, rows: list) -> list[Batch]:
        """A step's rows as micro-batches, checked, and pinned when bound for CUDA (in the prefetch thread, when
        the rows were drawn there)."""
        cfg = self.cfg
        mbs = micro_batches(rows, cfg.packing, cfg.train.seq_len, cfg.train.micro_batch_tokens, self.data.pad_id)
        for mb in mbs:  # on the host, before any kernel can index out of range
            check_token_ids(mb, self.vocab_size)
        if self.info.device.type == "cuda":
            with torch.cuda.device(self.info.device):  # this rank's GPU, also in the prefetch thread (not GPU 0's)
                mbs = [mb.pin_memory() for mb in mbs]  # Batch.to_device then copies without waiting
        return mbs
