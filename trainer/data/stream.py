"""WebDataset shards -> documents -> token ids, split over ranks and DataLoader workers, resumable.

Each (rank, worker) pair is one *slot*. Every epoch the shard list is permuted with the seed, and slot
s of S reads shards[s::S], so across all ranks x workers every document is read exactly once per epoch.
Inside a slot, samples pass a shuffle buffer, are decoded and checked, tokenized in batches by the fast
tokenizer, and get EOS appended. With loss_on="assistant" (chat data) each document also gets a `loss_mask`,
computed from its text: only the assistant turns' tokens are targets (trainer.data.chat.assistant_token_mask).

The reading itself (shard cursor, shuffle buffer, resumable positions) is trainer.data.reader; running the
stream in DataLoader workers and handing out single documents is trainer.data.loader.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from trainer.data.batch import Document
from trainer.data.chat import assistant_token_mask
from trainer.data.config import LOSS_ON, ON_ERROR
from trainer.data.reader import DataStreamError, Item, ReadPosition, SlotReader, SlotState
from trainer.data.shards import TEXT_FIELD
from trainer.data.sources import READ_TIMEOUT_S

log = logging.getLogger(__name__)


class DocumentStream(IterableDataset):
    """Yields `(slot, state, documents)` chunks; `DocumentLoader` turns them into single documents."""

    def __init__(
        self,
        shards: Sequence[str],
        tokenizer_path: str | Path,
        eos_id: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        shuffle_buffer: int = 1000,
        chunk_docs: int = 64,
        on_error: str = "raise",
        epochs: int | None = None,
        expected_docs: dict[str, int] | None = None,
        retries: int = 2,
        retry_backoff_s: float = 1.0,
        read_timeout_s: float = READ_TIMEOUT_S,
        loss_on: str = "all",
    ) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if not read_timeout_s > 0:
            raise ValueError(f"read_timeout_s must be > 0, got {read_timeout_s}")
        if shuffle_buffer < 1:
            raise ValueError(f"shuffle_buffer must be >= 1 (1: no shuffling), got {shuffle_buffer}")
        if not shards:
            raise DataStreamError("no shards given")
        self.shards = [str(s) for s in shards]
        self.tokenizer_path = str(tokenizer_path)
        self.eos_id = eos_id
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.shuffle_buffer = shuffle_buffer
        self.chunk_docs = chunk_docs
        self.on_error = on_error
        self.epochs = epochs
        self.expected_docs = expected_docs or {}
        """Documents per shard file name (e.g. "train-000003.tar"), checked when a shard is read through."""
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        """Wait before the first retry of a shard; it doubles with each further one."""
        self.read_timeout_s = read_timeout_s
        """Seconds a shard command (curl, pipe:) may send nothing before the read counts as a transient failure."""
        self.loss_on = loss_on
        """'all': no loss_mask (every token a target); 'assistant': a loss_mask marking the assistant turns."""
        self.resume_states: dict[int, SlotState] = {}
        self.stop_epoch: int | None = None
        """Set by a lockstep DocumentLoader: every slot stops when it reaches this epoch."""
        self.worker_rotation = 0
        self.report_restore = False
        """Set by DocumentLoader after loading a state: every slot's first message reports what it read to restore."""
        self._tokenizer = None
        self._replaying = False

    # -- which shards a slot reads --------------------------------------------------------------

    def slot(self) -> tuple[int, int]:
        """(this slot's index, number of slots) from the rank and the DataLoader worker."""
        info = get_worker_info()
        workers = 1 if info is None else info.num_workers
        worker = 0 if info is None else (info.id + self.worker_rotation) % workers
        return self.rank * workers + worker, self.world_size * workers

    def epoch_shards(self, epoch: int, slot: int, num_slots: int) -> list[str]:
        """Shards of `slot` in `epoch`: a seeded permutation of all shards, then every num_slots-th."""
        if len(self.shards) < num_slots:
            raise DataStreamError(
                f"{len(self.shards)} shards cannot feed {num_slots} readers (ranks x DataLoader workers): "
                f"write more, smaller shards (trainer.prepare --docs-per-shard) or use fewer workers"
            )
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
        return [self.shards[i] for i in order[slot::num_slots]]

    # -- reading -------------------------------------------------------------------------------

    def _bad(self, state: SlotState, reason: str, message: str) -> None:
        if self.on_error == "raise":
            raise DataStreamError(message)
        if self._replaying:
            return  # counted before the checkpoint; the restored state already holds it
        state.skipped[reason] = state.skipped.get(reason, 0) + 1
        log.warning("skipped (%s): %s", reason, message)

    def _decode(self, item: Item, shards: list[str], state: SlotState) -> str | None:
        """The document text, or None (counted) for a bad sample under on_error=skip."""
        shard_index, _, key, data = item
        if data is None:
            return None  # unreadable shard, already reported
        shard = shards[shard_index]
        if isinstance(data, list):
            self._bad(state, "missing_text", f"{shard}: sample {key!r} has no {TEXT_FIELD!r} field (has {data})")
            return None
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exn:
            self._bad(state, "not_utf8", f"{shard}: sample {key!r} is not valid UTF-8 ({exn})")
            return None
        if not text.strip():
            self._bad(state, "empty", f"{shard}: sample {key!r} is an empty document")
            return None
        return text

    # -- the stream ----------------------------------------------------------------------------

    def _tokenize(self, keys: list[str], texts: list[str]) -> list[Document]:
        if not texts:
            return []
        if self._tokenizer is None:
            from trainer.data.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_path)
        docs = []
        encodings = self._tokenizer.encode_batch(texts, add_special_tokens=False)
        for key, text, enc in zip(keys, texts, encodings, strict=True):
            tokens = np.empty(len(enc.ids) + 1, dtype=np.int32)
            tokens[:-1] = enc.ids
            tokens[-1] = self.eos_id
            loss_mask = None
            if self.loss_on == "assistant":
                loss_mask = np.zeros(len(tokens), dtype=bool)  # the appended EOS stays an input only
                loss_mask[:-1] = assistant_token_mask(text, enc.offsets)
            docs.append(Document(key=key, tokens=tokens, loss_mask=loss_mask))
        return docs

    def __iter__(self) -> Iterator[tuple[int, SlotState, list[Document]]]:
        slot, num_slots = self.slot()
        resumed = self.resume_states.get(slot, SlotState())
        state = dataclasses.replace(resumed, skipped=dict(resumed.skipped), position=None, restore_read=None)
        reader = self._reader(slot, num_slots, state, resumed.position)
        try:
            if self.report_restore:  # before any document: what restoring the position read
                yield slot, self._snapshot(state, reader, restore_read=reader.restore_read if reader else (0, 0, 0.0)), []
            while reader is not None:
                keys: list[str] = []
                texts: list[str] = []
                while (item := reader.draw()) is not None:
                    state.drawn += 1
                    text = self._decode(item, reader.shards, state)
                    if text is not None:
                        keys.append(item[2])
                        texts.append(text)
                    if len(keys) == self.chunk_docs:
                        yield self._chunk(slot, state, reader, keys, texts)
                        keys, texts = [], []
                reader.close()
                state.epoch += 1
                state.drawn = 0
                # The epoch's last chunk goes out even when empty: it carries the skip counts and the epoch.
                yield self._chunk(slot, state, None, keys, texts)
                reader = self._reader(slot, num_slots, state, None)
        finally:  # also when the consumer stops early: no shard left open (a curl or pipe: command running)
            if reader is not None:
                reader.close()

    def _reader(self, slot: int, num_slots: int, state: SlotState, position: ReadPosition | None) -> SlotReader | None:
        """The slot's reader for `state.epoch`, at `position` (or at `state.drawn`); None when no epoch is left."""
        if (self.epochs is not None and state.epoch >= self.epochs) or (
            self.stop_epoch is not None and state.epoch >= self.stop_epoch
        ):
            return None
        shards = self.epoch_shards(state.epoch, slot, num_slots)
        seed = int(np.random.SeedSequence([self.seed, state.epoch, slot]).generate_state(1)[0])
        return SlotReader(self, shards, seed, state, position)

    def _chunk(self, slot: int, state: SlotState, reader: SlotReader | None, keys: list[str], texts: list[str]):
        docs = self._tokenize(keys, texts)
        state.docs += len(docs)
        return slot, self._snapshot(state, reader), docs

    def _snapshot(self, state: SlotState, reader: SlotReader | None, restore_read=None) -> SlotState:
        return dataclasses.replace(state, skipped=dict(state.skipped), restore_read=restore_read,
                                   position=reader.position() if reader is not None else None)
