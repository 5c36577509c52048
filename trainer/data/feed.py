"""The data room's face to a training run: `trainer.run` imports this module and no other of trainer.data.

    build_data(...)       this rank's row source over the training shards, of one source or a mixture
                          (`DataSource`)
    load_eval_docs(...)   the held-out documents, in a fixed order, split to seq_len
    eval_batches(...)     this rank's share of them, laid out as micro-batches
    StepRows              each step's rows, agreed across ranks at an epoch's end (trainer.data.epochs)
    micro_batches, ...    rows laid out for a layout, and the batch types and rules the step reads
                          (re-exported)

Everything else (readers, packer, mixer, states, the reshaped resume) stays behind `DataSource.rows`, a
trainer.data.pipeline.RowSource.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.batch import (
    IGNORE_INDEX,
    NO_GROUPS,
    Batch,
    Document,
    LossGroups,
    check_token_ids,
    collate_rows,
    length_bucket_names,
    source_counts,
)
from trainer.data.config import SINGLE_SOURCE, VAL_SPLIT, DataConfig, PackingConfig
from trainer.data.deal import check_deal, deal_rows, drawn_rows, imbalance, imbalance_of
from trainer.data.epochs import StepInterrupted, StepRows
from trainer.data.loader import DocumentLoader
from trainer.data.mixture import Mixture
from trainer.data.packing import OnlinePacker, PackingStats, split_long
from trainer.data.pipeline import RowPrefetcher, RowSource, RowStream, micro_batches
from trainer.data.shards import MANIFEST_FILE, StoredIds, load_manifest, stored_ids
from trainer.data.sources import ShardSource, ShardSourceError, resolve_source
from trainer.data.stream import DocumentStream, manifest_tokens
from trainer.data.tokenizer import (
    FramedTokenizer,
    SpecialIds,
    load_tokenizer,
    special_ids,
    tokenizer_hash,
    tokenizer_ids,
)
from trainer.data.workers import ReadInterrupted, allow_reads, check_interrupt, interrupt_reads
from trainer.errors import ConfigError

__all__ = [
    "IGNORE_INDEX", "MANIFEST_FILE", "NO_GROUPS", "VAL_SPLIT", "Batch", "DataSource", "Document",
    "FramedTokenizer", "LossGroups", "ReadInterrupted",
    "RowPrefetcher", "RowSource", "ShardSourceError", "StepInterrupted", "StepRows", "allow_reads",
    "build_data", "check_token_ids", "collate_rows",
    "check_deal", "deal_rows", "drawn_rows", "imbalance", "imbalance_of",
    "eval_batches", "interrupt_reads", "length_bucket_names", "load_eval_docs", "micro_batches",
    "source_counts",
]

log = logging.getLogger(__name__)


@dataclass
class DataSource:
    """This rank's training data: its row source and the tokenizer's facts."""

    rows: RowSource
    """A RowStream (one source) or a Mixture (data.sources), behind a RowPrefetcher with data.prefetch (the
    default): the same interface and rows."""
    tokenizer_dir: Path
    tokenizer_hash: str
    vocab_size: int
    pad_id: int
    eos_id: int
    mixture: Mixture | None = None
    """The mixture of data.sources (the row source `rows` draws from), for its per-source summary; None for
    one source."""


def build_data(data: DataConfig, packing: PackingConfig, seq_len: int, seed: int, rank: int,
               world_size: int) -> DataSource:
    """Rank `rank` of `world_size`'s row source over the training shards (its own slots of the rank x worker
    split), of one source or of the mixture of data.sources (trainer.data.mixture: one row stream per source,
    rows mixed by weight).

    The shards and tokenizer come from `resolve_source` (data.path, or data.urls / data.tokenizer; per source
    of a mixture), checked here at startup: a pattern that matches nothing fails before any training.
    """
    mixture = data.mixture()
    parts = [(src.name, resolve_source(data.for_source(src)), src.weight) for src in mixture] or [
        (SINGLE_SOURCE, resolve_source(data), 1.0)]
    for _, source, _ in parts:
        check_loss_on(data.loss_on, source)
    tokenizer_dir = parts[0][1].tokenizer_dir
    token_hash = tokenizer_hash(tokenizer_dir)
    for name, source, _ in parts[1:]:
        if tokenizer_hash(source.tokenizer_dir) != token_hash:
            raise ConfigError(f"data.sources: source {name!r} was prepared with another tokenizer "
                              f"({source.tokenizer_dir}) than {parts[0][0]!r} ({tokenizer_dir}); prepare "
                              "every source with the same one (python -m trainer.prepare --tokenizer DIR)")
    tok = load_tokenizer(tokenizer_dir)
    ids = special_ids(tok, tokenizer_dir)
    seeds = _source_seeds(seed, len(mixture))
    streams = []
    for index, (name, source, _) in enumerate(parts):
        stream = _stream(data, rank, world_size, source, tokenizer_dir, ids, seeds[index], index,
                         name if mixture else None, _stored_ids(source, token_hash, data.loss_on))
        # A mixture's sources are read one pass at a time whatever data.epoch_lockstep: the mixture ends its
        # epochs.
        loader = DocumentLoader(stream, num_workers=data.num_workers,
                                lockstep=data.epoch_lockstep or bool(mixture))
        streams.append(RowStream(loader, seq_len, packing))
    rows: RowSource = streams[0]
    if mixture:  # each source packed alone, its rows mixed by weight
        rows = Mixture(streams, [p[0] for p in parts], [p[2] for p in parts], data.mix_exhausted,
                       lockstep=data.epoch_lockstep)
    return DataSource(
        rows=RowPrefetcher(rows) if data.prefetch else rows,
        tokenizer_dir=tokenizer_dir,
        tokenizer_hash=token_hash,
        vocab_size=tok.get_vocab_size(),
        pad_id=ids.pad,
        eos_id=ids.eos,
        mixture=rows if mixture else None,
    )


def _source_seeds(seed: int, num_sources: int) -> list[int]:
    """The seed of each source's stream: the run's for one source; for a mixture, one per source drawn from it
    (two sources over the same shards then read them in different orders)."""
    if not num_sources:
        return [seed]
    return [int(s) for s in np.random.SeedSequence([seed, 1]).generate_state(num_sources)]


def _stored_ids(source: ShardSource, token_hash: str, loss_on: str) -> StoredIds | None:
    """How the source's stream reads stored token ids: those its manifest lists as encoded by the run's
    tokenizer (`token_hash`); None (tokenize the text) without a manifest, or with ids of another tokenizer or
    none."""
    if source.manifest is None:
        return None
    return stored_ids(load_manifest(source.manifest.parent), token_hash, loss_on == "assistant")


def _stream(data: DataConfig, rank: int, world_size: int, source: ShardSource, tokenizer_dir: Path,
            ids: SpecialIds, seed: int, index: int, name: str | None,
            stored: StoredIds | None) -> DocumentStream:
    return DocumentStream(
        source.train_urls,
        tokenizer_dir,
        ids.eos,
        bos_id=ids.bos if ids.add_bos else None,
        seed=seed,
        rank=rank,
        world_size=world_size,
        shuffle_buffer=data.shuffle_buffer,
        on_error=data.on_error,
        expected_docs=source.expected_docs,
        retries=data.retries,
        read_timeout_s=data.read_timeout_s,
        loss_on=data.loss_on,
        max_doc_bytes=data.max_doc_bytes,
        shard_tokens=manifest_tokens(source.train_urls, source.manifest),  # the readers are balanced by them
        name=name,
        source=index,
        stored_ids=stored,
        # each shard read through is checked against its entry (samples, bytes, tokens)
        manifest=source.manifest,
    )


def check_loss_on(loss_on: str, source: ShardSource) -> None:
    """data.loss_on=assistant needs chat data: a manifest with a "chat" entry (trainer.prepare writes it for
    chat sources). Shards without a manifest (data.urls alone) cannot be checked: a warning."""
    if loss_on != "assistant":
        return
    if source.manifest is None:
        log.warning("data.loss_on=assistant: no manifest.json beside the shards, so nothing shows they hold "
                    "ChatML conversations; documents without assistant turns will give no targets")
        return
    if "chat" not in load_manifest(source.manifest.parent):
        raise ConfigError("data.loss_on=assistant needs chat data prepared with --source chat:PATH or "
                          f"demo-chat; {source.manifest.parent} holds plain text (or set data.loss_on=all)")


def load_eval_docs(data: DataConfig | str | Path, tokenizer_dir: Path, eos_id: int, seq_len: int,
                   max_docs: int | None, on_error: str = "raise") -> list[Document]:
    """The first `max_docs` held-out documents in a fixed order, each split into chunks of <= seq_len, framed
    as in training (BOS first where the tokenizer of `tokenizer_dir` frames documents so; `eos_id` last).

    `data` is the run's data config (held-out shards: data.val_urls, else the manifest's val split;
    data.loss_on: which tokens are targets, as in training) or a prepared directory (every token a target).
    Example: max_docs=3 over val shards whose fixed order is [v7, v2, v9, ...] with
    len(v2) = 2.5 x seq_len -> [v7, v2#0, v2#1, v2#2, v9].

    With data.sources: the first `max_docs` documents of each source (its val_urls, else its manifest's val
    split), source after source, tagged with its index. A source without held-out shards is left out (one
    warning names them); an error if no source has any. Raises ReadInterrupted once a preemption signal's
    handler has called trainer.data.workers.interrupt_reads (within one read or chunk), as the training
    stream's reads do.
    """
    if data is None:
        raise ShardSourceError("load_eval_docs needs the data config (cfg.data) when data.urls is used")
    if not isinstance(data, DataConfig):
        data = DataConfig(path=str(data))
    mixture = data.mixture()
    if not mixture:
        source = resolve_source(data)
        if not source.val_urls:
            if source.manifest is not None and data.val_urls is None:
                raise ShardSourceError(f"{source.manifest}: the '{VAL_SPLIT}' split has no documents; set "
                                       "data.val_urls=SHARDS, prepare with --val-fraction > 0, or set "
                                       "train.eval_every=0")
            raise ShardSourceError("no held-out shards for the eval: data.urls is set but data.val_urls is "
                                   "not; set data.val_urls=SHARDS (same syntax as data.urls) or "
                                   "train.eval_every=0")
        return _read_eval_docs(data, source, tokenizer_dir, eos_id, seq_len, max_docs, on_error)
    resolved = [(i, src.name, data.for_source(src)) for i, src in enumerate(mixture)]
    resolved = [(i, name, cfg, resolve_source(cfg)) for i, name, cfg in resolved]
    left_out = [name for _, name, _, source in resolved if not source.val_urls]
    if len(left_out) == len(resolved):
        raise ShardSourceError("no held-out shards for the eval in any of data.sources "
                               f"({', '.join(left_out)}): give a source val_urls=SHARDS, prepare its "
                               "directory with --val-fraction > 0, or set train.eval_every=0")
    if left_out:
        log.warning("data.sources %s: no held-out shards (no val_urls, no '%s' split in the manifest): left "
                    "out of the eval (val_token_loss_by_source null for them)", ", ".join(left_out),
                    VAL_SPLIT)
    return [doc for i, name, cfg, source in resolved if source.val_urls
            for doc in _read_eval_docs(cfg, source, tokenizer_dir, eos_id, seq_len, max_docs, on_error, name,
                                       i)]


def _read_eval_docs(data: DataConfig, source: ShardSource, tokenizer_dir: Path, eos_id: int, seq_len: int,
                    max_docs: int | None, on_error: str, name: str | None = None,
                    index: int = 0) -> list[Document]:
    """`load_eval_docs` of one source whose held-out shards are `source.val_urls`; a mixture's source `index`
    named `name`, whose documents the stream tags and keys as in training. Bounded as the training stream is
    (a shard's damage is one error, a document over data.max_doc_mb is refused from its tar header), and it
    gives way to a preemption signal (trainer.data.workers.interrupt_reads: ReadInterrupted) between reads and
    chunks."""
    ids = tokenizer_ids(tokenizer_dir)
    stream = DocumentStream(
        source.val_urls, tokenizer_dir, eos_id, bos_id=ids.bos if ids.add_bos else None, seed=0,
        shuffle_buffer=1, epochs=1,
        on_error=on_error, expected_docs=source.expected_docs, retries=data.retries, loss_on=data.loss_on,
        read_timeout_s=data.read_timeout_s, name=name, source=index, max_doc_bytes=data.max_doc_bytes,
        # Held-out shards of data.val_urls may come from another dataset than the manifest's: their text is
        # read, and they are not checked against its entries.
        stored_ids=None if data.val_urls is not None else _stored_ids(source, tokenizer_hash(tokenizer_dir),
                                                                      data.loss_on),
        manifest=None if data.val_urls is not None else source.manifest,
    )
    docs: list[Document] = []
    for _slot, _state, chunk in stream:  # one reader, in this process: no DataLoader, no rank split
        # a preemption signal ends the start here, as it ends a step's reads (ReadInterrupted)
        check_interrupt()
        docs.extend(chunk)
        if max_docs is not None and len(docs) >= max_docs:
            break
    if not docs:
        shards = ", ".join(map(str, source.val_urls[:3])) + (", ..." if len(source.val_urls) > 3 else "")
        why = (" (data.on_error=skip skipped what it could not read: see the warnings above)"
               if on_error == "skip" else "")
        raise ShardSourceError(f"the eval read no document from its {len(source.val_urls)} held-out shard(s) "
                               f"[{shards}]{why}; check those shards, or set train.eval_every=0")
    stats = PackingStats()
    return [piece for doc in docs[:max_docs] for piece in split_long(doc, seq_len, "split", stats)]


def eval_batches(docs: list[Document], rank: int, world_size: int, seq_len: int, layout: str,
                 micro_batch_tokens: int, pad_id: int) -> list[Batch]:
    """Rank `rank`'s share of the eval set (documents rank, rank + W, ...), packed in one go (a buffer holding
    them all) and laid out as micro-batches of `layout`."""
    mine = docs[rank::world_size]
    rows = list(OnlinePacker(seq_len, buffer_size=max(1, len(mine))).pack(mine))
    return micro_batches(rows, PackingConfig(layout=layout), seq_len, micro_batch_tokens, pad_id)
