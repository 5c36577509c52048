"""The data sections of the config: `data` (which shards, how they are read) and `packing` (how documents
become rows). Plain dataclasses checked on construction; trainer.config builds them from the composed Hydra
config, and every data component receives only its own section.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.errors import require_range

# The allowed values live here, not beside their code (batch.py, packing.py): prepare imports this module, and
# must not import torch (its worker processes stay light).
LAYOUTS = ("packed", "unpacked", "bucketed")
LONG_DOC_POLICIES = ("split", "truncate", "drop")

ON_ERROR = ("raise", "skip")
"""What a bad sample or an unreadable shard does: raise (an error naming shard and key) or skip (warn, count)."""

LOSS_ON = ("all", "assistant")

TRAIN_SPLIT, VAL_SPLIT = "train", "val"
"""The manifest's splits (trainer.prepare writes both): training reads data.split (default train), the eval val."""


@dataclass
class DataConfig:
    path: str | None = None
    """Directory written by `python -m trainer.prepare` (manifest.json, tokenizer/, shards). With `urls` it is
    optional: its manifest's per-shard document counts are then checked and its tokenizer is the default."""
    urls: str | list[str] | None = None
    """Training shards as WebDataset writes them, instead of the manifest's list: brace patterns
    (`/d/train-{000000..000013}.tar`), globs, local paths, http(s):// URLs, `pipe:` commands; a string or a list."""
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
    """'raise' or 'skip' (warn and count) for bad samples and for shards still unreadable after the retries."""
    retries: int = 2
    """Re-reads of a shard after a transient failure (connection refused or reset, a transfer cut short, HTTP
    408/429/5xx, a failed pipe: command), 1 s, 2 s, 4 s ... apart; each restarts the shard and skips the samples
    it already gave. Local files and HTTP 4xx are not retried. The only retries: curl runs without its own."""
    read_timeout_s: float = 60.0
    """Seconds a shard's command (curl for http(s), a pipe: command) may send no byte before the read counts as a
    transient failure (retried as above; then `error: URL: ... no data for N s`, or skipped under on_error=skip)."""

    loss_on: str = "all"
    """Which tokens are targets: 'all' (every token but each document's first) or 'assistant' (chat data only:
    the tokens of assistant turns, content and the turn's closing <|im_end|>; system/user turns and the
    template's role headers are inputs only)."""
    prefetch: bool = True
    """A background thread draws the next step's rows while the current step computes (trainer.data.pipeline.
    RowPrefetcher): the same rows, order and checkpoints as without it; False draws them at the start of each step."""
    epoch_lockstep: bool = True
    """Every reader (rank x DataLoader worker) finishes epoch e before any starts epoch e + 1: a rank whose
    readers are done packs what it holds and waits (contributing fewer rows) until every rank is done, so each
    document is trained on exactly once per epoch. False: each reader runs its own epochs (they drift apart)."""

    def __post_init__(self) -> None:
        if self.on_error not in ON_ERROR:
            raise ValueError(f"data.on_error must be 'raise' or 'skip', got {self.on_error!r}")
        if self.retries < 0:
            raise ValueError(f"data.retries must be >= 0, got {self.retries}")
        if not 0 < self.read_timeout_s <= 86400:  # also NaN
            raise ValueError(f"data.read_timeout_s must be in (0, 86400] seconds, got {self.read_timeout_s}")
        require_range("data.num_workers", self.num_workers, 0)
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
    """Documents longer than seq_len: 'split' into chunks of <= seq_len, 'truncate', or 'drop' (all counted)."""
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
