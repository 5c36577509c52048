"""The data sections of the config: `data` (which shards, how they are read) and `packing` (how documents
become rows). Plain dataclasses checked on construction; trainer.config builds them from the composed Hydra
config, and every data component receives only its own section.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from trainer.errors import require_range

# The allowed values live here, not beside their code (batch.py, packing.py): prepare imports this module, and
# must not import torch (its worker processes stay light).
LAYOUTS = ("packed", "unpacked", "bucketed")
LONG_DOC_POLICIES = ("split", "truncate", "drop")

ON_ERROR = ("raise", "skip")
"""What a bad sample or an unreadable shard does: raise (an error naming shard and key) or skip (warn,
count)."""
BALANCE = ("none", "rows")
"""data.balance: each rank its own rows, or the step's rows dealt by modeled work (trainer.data.deal)."""

LOSS_ON = ("all", "assistant")

MIX_EXHAUSTED = ("stop", "restart")
"""What a mixture does when one source runs out of documents: end the epoch, or read that source again."""

SOURCE_KEYS = ("name", "path", "urls", "val_urls", "weight")
SOURCE_NAME = re.compile(r"[A-Za-z0-9_.-]+")
"""A source name: it becomes part of metric keys and file names (token_loss_by_source.<name>)."""

TRAIN_SPLIT, VAL_SPLIT = "train", "val"
"""The manifest's splits (trainer.prepare writes both): training reads data.split (default train), the eval
val."""


@dataclass(frozen=True)
class SourceConfig:
    """One part of a data mixture (an entry of data.sources): its shards and its weight."""

    name: str
    """Names the source in metrics, the report and errors (letters, digits, _ . -)."""
    path: str | None = None
    """A directory written by trainer.prepare, as data.path."""
    urls: str | list[str] | None = None
    """Or shard URLs, as data.urls."""
    val_urls: str | list[str] | None = None
    """Held-out shards of this source, as data.val_urls (default: its manifest's val split)."""
    weight: float = 1.0
    """Its share of the mixture's document tokens: weight / sum of the weights."""


@dataclass
class DataConfig:
    path: str | None = None
    """Directory written by `python -m trainer.prepare` (manifest.json, tokenizer/, shards). With `urls` it is
    optional: its manifest's per-shard document counts are then checked and its tokenizer is the default."""
    urls: str | list[str] | None = None
    """Training shards as WebDataset writes them, instead of the manifest's list: brace patterns
    (`/d/train-{000000..000013}.tar`), globs, local paths, http(s):// URLs, `pipe:` commands; a string or a
    list."""
    val_urls: str | list[str] | None = None
    """Held-out shards (same syntax) for the eval; default: the val split of the manifest, if there is one."""
    tokenizer: str | None = None
    """Directory holding tokenizer.json; default: the one of the prepared directory (data.path)."""
    split: str = TRAIN_SPLIT
    """Split of the manifest to train on (data.path without data.urls)."""
    num_workers: int = 1
    """DataLoader workers per rank (tokenization runs there)."""
    shuffle_buffer: int = 1000
    """Documents in each reader's shuffle buffer."""
    on_error: str = "raise"
    """'raise' or 'skip' (warn and count) for bad samples and for shards still unreadable after the
    retries."""
    retries: int = 2
    """Re-reads of a shard after a transient failure (connection refused or reset, a transfer cut short, HTTP
    408/429/5xx, a failed pipe: command), 1 s, 2 s, 4 s ... apart; each restarts the shard and skips the
    samples it already gave. Local files and HTTP 4xx are not retried. The only retries: curl runs without its
    own."""
    read_timeout_s: float = 60.0
    """Seconds a shard's command (curl for http(s), a pipe: command) may send no byte before the read counts
    as a transient failure (retried as above; then `error: URL: ... no data for N s`, or skipped under
    on_error=skip)."""

    max_doc_mb: float = 8.0
    """One document's largest text in MB: a larger sample is an error naming it (or under data.on_error=skip a
    counted skip, too_large), before it is tokenized (tokenizing one document whole takes ~200x its size in
    memory; trainer.prepare bounds its documents the same way, --max-doc-mb)."""

    loss_on: str = "all"
    """Which tokens are targets: 'all' (every token but each document's first) or 'assistant' (chat data only:
    the tokens of assistant turns, content and the turn's closing <|im_end|>; system/user turns and the
    template's role headers are inputs only)."""
    prefetch: bool = True
    """A background thread draws the next step's rows while the current step computes (trainer.data.pipeline.
    RowPrefetcher): the same rows, order and checkpoints as without it; False draws them at the start of each
    step."""
    sources: list[dict] | None = None
    """A mixture instead of one source: [{name, path or urls, val_urls (optional), weight}, ...]. Each step's
    document tokens come from the sources in the proportions of their weights, within a row
    (trainer.data.mixture: each source packed alone, its rows mixed), in every layout. data.path / data.urls /
    data.val_urls must then be null; data.tokenizer, data.split and the reading settings apply to every
    source."""
    mix_exhausted: str = "stop"
    """A mixture's epoch, when one source has no documents left: 'stop' ends the epoch there (the weights hold
    to its end; what the other sources had left of their pass is not trained in it), 'restart' reads that
    source again (a new pass) and ends the epoch when every source has been read through once. Each epoch
    every source starts a new pass."""
    balance: str = "none"
    """How a step's rows are dealt over the data ranks: 'none' (each rank computes the rows it drew) or 'rows'
    (the rows the data ranks drew for a step are re-dealt by modeled work, so every rank computes about the
    same: trainer.data.deal; the same documents per step, the same loss)."""
    epoch_lockstep: bool = True
    """Every reader (rank x DataLoader worker) finishes epoch e before any starts epoch e + 1: a rank whose
    readers are done packs what it holds and waits (contributing fewer rows) until every rank is done, so each
    document is trained on exactly once per epoch. False: each reader runs its own epochs (they drift
    apart)."""

    def __post_init__(self) -> None:
        if self.balance not in BALANCE:
            raise ValueError(f"data.balance must be one of {BALANCE}, got {self.balance!r}")
        if self.on_error not in ON_ERROR:
            raise ValueError(f"data.on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.retries < 0:
            raise ValueError(f"data.retries must be >= 0, got {self.retries}")
        if not 0 < self.read_timeout_s <= 86400:  # also NaN
            raise ValueError(f"data.read_timeout_s must be in (0, 86400] seconds, got {self.read_timeout_s}")
        require_range("data.num_workers", self.num_workers, 0)
        if not (isinstance(self.max_doc_mb, (int, float)) and 0 < self.max_doc_mb < float("inf")):  # also NaN
            raise ValueError(f"data.max_doc_mb must be a finite number > 0, got {self.max_doc_mb}")
        require_range("data.shuffle_buffer", self.shuffle_buffer, 1)
        for key in ("path", "tokenizer", "split"):
            if getattr(self, key) == "":
                raise ValueError(f"data.{key} must not be an empty string")
        if self.loss_on not in LOSS_ON:
            raise ValueError(f"data.loss_on must be one of {LOSS_ON}, got {self.loss_on!r}")
        for key in ("urls", "val_urls"):
            value = getattr(self, key)
            if not (value is None or isinstance(value, str) or (isinstance(value, list) and value
                                                                 and all(isinstance(v, str) for v in value))):
                raise ValueError(f"data.{key} must be a string or a non-empty list of strings, got {value!r}")
        if self.mix_exhausted not in MIX_EXHAUSTED:
            raise ValueError(f"data.mix_exhausted must be one of {MIX_EXHAUSTED}, got {self.mix_exhausted!r}")
        if self.sources is not None:
            self.mixture()  # checked here, at startup

    @property
    def max_doc_bytes(self) -> int:
        return int(self.max_doc_mb * 2**20)

    def mixture(self) -> list[SourceConfig]:
        """The sources of data.sources, checked; [] without a mixture.

        Example: [{name: code, path: data/code, weight: 0.7}, {name: prose, path: data/prose, weight: 0.3}] ->
        [SourceConfig("code", "data/code", weight=0.7), SourceConfig("prose", "data/prose", weight=0.3)]."""
        if self.sources is None:
            return []
        if not isinstance(self.sources, list) or not self.sources:
            raise ValueError(f"data.sources must be a non-empty list of {{name, path or urls, weight}}, "
                             f"got {self.sources!r}")
        if self.path is not None or self.urls is not None or self.val_urls is not None:
            raise ValueError("data.sources replaces data.path, data.urls and data.val_urls: give each source "
                             "its own path or urls (and val_urls), and set those three to null")
        out: list[SourceConfig] = []
        for i, entry in enumerate(self.sources):
            where = f"data.sources[{i}]"
            if not isinstance(entry, dict):
                raise ValueError(f"{where} must hold keys {{name, path or urls, weight}}, got {entry!r}")
            unknown = sorted(set(entry) - set(SOURCE_KEYS))
            if unknown:
                raise ValueError(f"{where}: unknown key(s) {unknown}; expected some of {list(SOURCE_KEYS)}")
            name = entry.get("name")
            if not isinstance(name, str) or not SOURCE_NAME.fullmatch(name):
                raise ValueError(f"{where}.name must be a name of letters, digits, '_', '.' or '-', got "
                                 f"{name!r}")
            if name in {s.name for s in out}:
                raise ValueError(f"{where}.name {name!r} names two sources")
            weight = entry.get("weight", 1.0)
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (
                    math.isfinite(weight) and weight > 0):
                raise ValueError(f"{where}.weight ({name}) must be a number > 0, got {weight!r}")
            if entry.get("path") is None and entry.get("urls") is None:
                raise ValueError(f"{where} ({name}) needs path (a directory written by trainer.prepare) "
                                 "or urls")
            if entry.get("path") is not None and (isinstance(entry["path"], (list, dict))
                                                  or entry["path"] == ""):
                raise ValueError(f"{where}.path ({name}) must be a directory, got {entry['path']!r}")
            for key in ("urls", "val_urls"):
                value = entry.get(key)
                if not (value is None or (isinstance(value, str) and value) or (
                        isinstance(value, list) and value and all(isinstance(v, str) for v in value))):
                    raise ValueError(f"{where}.{key} ({name}) must be a string or a non-empty list of "
                                     f"strings, got {value!r}")
            path = entry.get("path")
            out.append(SourceConfig(name=name, path=None if path is None else str(path),
                                    urls=entry.get("urls"), val_urls=entry.get("val_urls"),
                                    weight=float(weight)))
        check_shares([s.name for s in out], [s.weight for s in out])
        return out

    def for_source(self, source: SourceConfig) -> DataConfig:
        """This config with one source of the mixture as its only data (what trainer.data.sources
        resolves)."""
        return replace(self, path=source.path, urls=source.urls, val_urls=source.val_urls, sources=None)


MIN_SHARE = 1e-9
"""The smallest share of the tokens a source may have: below it the mixer would never draw it (or divide by a
share that rounds to 0)."""


def check_shares(names: list[str], weights: list[float]) -> None:
    """A ValueError unless the weights, normalized, give every source a share of at least MIN_SHARE.

    Example: weights [1e300, 1e-300]
    -> "data.sources: the weights give b a share of 1e-600 of the tokens ..."."""
    total = sum(weights)
    if not math.isfinite(total):
        raise ValueError(f"data.sources: the weights {weights} add up to {total}: give them on a smaller "
                         "scale (only their ratios count)")
    for name, weight in zip(names, weights, strict=True):
        if weight / total < MIN_SHARE:
            raise ValueError(f"data.sources: the weights {weights} give {name} a share of "
                             f"{weight / total:.3g} of the tokens, below {MIN_SHARE:g}: it would never be "
                             "drawn; raise its weight or drop it")


SINGLE_SOURCE = "data"
"""The name of the one source of a run without data.sources (Document.source 0)."""


PAD_TO = ("longest", "seq_len")
"""Unpacked rows are padded to the micro-batch's longest document, or to seq_len."""


@dataclass
class PackingConfig:
    """How documents become rows (the `packing` config group)."""

    layout: str = "packed"
    """'packed' | 'unpacked' | 'bucketed': the one switch of an ablation."""
    buffer_size: int = 1024
    """Documents the online packer holds to choose from; larger packs tighter and reorders more."""
    long_docs: str = "split"
    """Documents longer than seq_len: 'split' into chunks of <= seq_len, 'truncate', or 'drop' (all
    counted)."""
    reset_positions: bool = True
    """Position ids restart at 0 in every document (False: 0..L-1 per row, the continuous ablation)."""
    pad_to: str = "longest"
    """Unpacked rows are padded to the micro-batch's 'longest' document or to 'seq_len'."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"packing.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.long_docs not in LONG_DOC_POLICIES:
            raise ValueError(f"packing.long_docs must be one of {LONG_DOC_POLICIES}, got {self.long_docs!r}")
        if self.pad_to not in PAD_TO:
            raise ValueError(f"packing.pad_to must be one of {PAD_TO}, got {self.pad_to!r}")
        require_range("packing.buffer_size", self.buffer_size, 1)
