"""WebDataset shards -> documents -> token ids, split over ranks and DataLoader workers, resumable.

Each (rank, worker) pair is one *slot*. Every epoch the shard list is permuted with the seed, and slot
s of S reads shards[s::S], so across all ranks x workers every document is read exactly once per epoch.
Inside a slot, samples pass a shuffle buffer, are decoded and checked, tokenized in batches by the fast
tokenizer, and get EOS appended. With loss_on="assistant" (chat data) each document also gets a `loss_mask`,
computed from its text: only the assistant turns' tokens are targets (trainer.data.chat.assistant_token_mask).

Example, 5 shards, 2 ranks x 2 workers (S = 4), epoch permutation [3, 0, 4, 1, 2]:
    rank 0 worker 0 (slot 0) reads shards [3, 2];  rank 0 worker 1 (slot 1) reads [0]
    rank 1 worker 0 (slot 2) reads [4];            rank 1 worker 1 (slot 3) reads [1]

Resuming: a slot's position is (epoch, samples drawn from its shuffle buffer this epoch). Everything
before tokenization is deterministic for the seed, so a resumed slot replays its epoch up to that
position without tokenizing (a sequential read of the shards it already consumed) and continues with
exactly the next document: nothing repeated, nothing skipped.

Shards are local paths, http(s) URLs or pipe: commands (trainer.data.sources reads them). A transient
failure (a transfer cut short, connection refused, HTTP 5xx, a failed command) restarts that shard from
its beginning, up to `retries` times; the samples it already gave are read again but not passed on, so
the sample sequence is the same as without the failure. Example: a shard of 200 samples cut after 120
-> the retry reads samples 1..120 silently and passes on 121..200.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from trainer.data.batch import Document
from trainer.data.chat import assistant_token_mask
from trainer.data.shards import TEXT_FIELD, non_sample_members
from trainer.data.sources import ShardReadError, read_shard, url_file_name
from trainer.data.workers import init_worker, shutdown_workers, track

log = logging.getLogger(__name__)

ON_ERROR = ("raise", "skip")
LOSS_ON = ("all", "assistant")


class DataStreamError(RuntimeError):
    """Bad input in a shard: the message names the shard and, where there is one, the sample key."""


@dataclass
class SlotState:
    """Where one (rank, worker) slot stands in its stream."""

    epoch: int = 0
    drawn: int = 0
    """Samples drawn from the shuffle buffer in this epoch (bad ones included)."""
    shard: str = ""
    """Shard being read when the state was taken (for reports; resuming uses `drawn`)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Samples skipped under on_error=skip, by reason, since the start of training."""
    docs: int = 0
    """Documents emitted since the start of training."""


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
        loss_on: str = "all",
    ) -> None:
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
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
        self.loss_on = loss_on
        """'all': no loss_mask (every token a target); 'assistant': a loss_mask marking the assistant turns."""
        self.resume_states: dict[int, SlotState] = {}
        self.stop_epoch: int | None = None
        """Set by a lockstep DocumentLoader: every slot stops when it reaches this epoch."""
        self.worker_rotation = 0
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

    def _raw_samples(self, shards: list[str], state: SlotState) -> Iterator[tuple[str, str, dict | None]]:
        """(shard, key, sample) in file order; sample None marks a shard that could not be read."""
        for shard in shards:
            state.shard = shard
            count = yield from self._shard_samples(shard, state)
            expected = self.expected_docs.get(url_file_name(shard))
            if count is not None and expected is not None and count != expected:
                self._bad(
                    state,
                    "truncated_shard",
                    f"{shard}: read {count} samples but the manifest lists {expected}{_why_short(shard)}; copy the shard "
                    "again or rebuild it with python -m trainer.prepare (one regular file <key>.<field> per field), "
                    "or set data.on_error=skip",
                )

    def _shard_samples(self, shard: str, state: SlotState) -> Generator[tuple[str, str, dict | None], None, int | None]:
        """Yields one shard's (shard, key, sample) and returns their count; None after an unreadable shard.

        A transient failure restarts the shard, skipping the `count` samples already given (the last of
        them must have the same key, or the shard changed between attempts).
        """
        count, key, attempt = 0, None, 0
        while True:
            try:
                for i, sample in enumerate(read_shard(shard)):
                    if i < count:  # given by an earlier attempt
                        if i == count - 1 and sample["__key__"] != key:
                            raise ShardReadError(f"sample {i + 1} is {sample['__key__']!r} on this attempt, "
                                                 f"{key!r} on the last: the shard changed", transient=False)
                        continue
                    key = sample["__key__"]
                    count += 1
                    yield shard, key, sample
                return count
            except ShardReadError as exn:
                where = f"after sample {key!r}" if key else "before its first sample"
                if not exn.transient or attempt == self.retries:
                    tries = f"; {attempt + 1} attempts" if attempt else ""
                    self._bad(state, "unreadable_shard", f"{shard}: cannot read shard ({where}{tries}): {exn}")
                    yield shard, key or "", None
                    return None
                delay = self.retry_backoff_s * 2**attempt
                attempt += 1
                again = f", skipping the {count} samples already passed on" if count else ""
                log.warning("%s: cannot read shard (%s): %s; retry %d of %d in %.1f s from the shard's start%s",
                            shard, where, exn, attempt, self.retries, delay, again)
                time.sleep(delay)

    def _shuffled(self, items: Iterator, rng: random.Random) -> Iterator:
        """Buffered shuffle: fill `shuffle_buffer` items, then emit a random one per item read."""
        buffer: list = []
        for item in items:
            if len(buffer) < self.shuffle_buffer:
                buffer.append(item)
                continue
            i = rng.randrange(len(buffer))
            buffer[i], item = item, buffer[i]
            yield item
        rng.shuffle(buffer)
        yield from buffer

    def _bad(self, state: SlotState, reason: str, message: str) -> None:
        if self.on_error == "raise":
            raise DataStreamError(message)
        if self._replaying:
            return  # counted before the checkpoint; the restored state already holds it
        state.skipped[reason] = state.skipped.get(reason, 0) + 1
        log.warning("skipped (%s): %s", reason, message)

    def _decode(self, shard: str, key: str, sample: dict | None, state: SlotState) -> str | None:
        """The document text, or None (counted) for a bad sample under on_error=skip."""
        if sample is None:
            return None  # unreadable shard, already reported
        if TEXT_FIELD not in sample:
            fields = sorted(k for k in sample if not k.startswith("__"))
            self._bad(state, "missing_text", f"{shard}: sample {key!r} has no {TEXT_FIELD!r} field (has {fields})")
            return None
        try:
            text = sample[TEXT_FIELD].decode("utf-8")
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
        state = dataclasses.replace(self.resume_states.get(slot, SlotState()))
        state.skipped = dict(state.skipped)
        while (self.epochs is None or state.epoch < self.epochs) and (
            self.stop_epoch is None or state.epoch < self.stop_epoch
        ):
            shards = self.epoch_shards(state.epoch, slot, num_slots)
            rng_seed = int(np.random.SeedSequence([self.seed, state.epoch, slot]).generate_state(1)[0])
            samples = self._shuffled(self._raw_samples(shards, state), random.Random(rng_seed))
            self._replaying = True
            for _ in range(state.drawn):  # replay to the resume position, no decoding or tokenizing
                next(samples)
            self._replaying = False
            keys: list[str] = []
            texts: list[str] = []
            for shard, key, sample in samples:
                state.drawn += 1
                text = self._decode(shard, key, sample, state)
                if text is not None:
                    keys.append(key)
                    texts.append(text)
                if len(keys) == self.chunk_docs:
                    yield self._chunk(slot, state, keys, texts)
                    keys, texts = [], []
            state.epoch += 1
            state.drawn = 0
            # The epoch's last chunk goes out even when empty: it carries the skip counts and the epoch.
            yield self._chunk(slot, state, keys, texts)

    def _chunk(self, slot: int, state: SlotState, keys: list[str], texts: list[str]):
        docs = self._tokenize(keys, texts)
        state.docs += len(docs)
        snapshot = dataclasses.replace(state, skipped=dict(state.skipped))
        return slot, snapshot, docs


class DocumentLoader:
    """Runs a `DocumentStream` in DataLoader workers and yields single documents, resumably.

    Chunks arrive round-robin from the workers, each tagged with its slot's state after it. The
    loader remembers the latest state per slot, how many chunks it consumed (which worker comes next)
    and the documents left in the current chunk, which is all a resumed run needs.
    """

    def __init__(self, stream: DocumentStream, num_workers: int = 0, prefetch_factor: int = 4,
                 lockstep: bool = False) -> None:
        self.stream = stream
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.lockstep = lockstep
        """One epoch per iteration: iterating ends when all this rank's slots have finished the epoch."""
        self.slot_states: dict[int, SlotState] = {}
        self.chunks_consumed = 0
        self.epoch_chunks = 0
        """Chunks consumed in the current lockstep epoch (which worker comes next)."""
        self.lockstep_epoch = 0
        """The epoch the current lockstep iteration covers. Kept, not derived from the slots: when every slot
        has delivered its last chunk but documents of it are still pending, the epoch has not ended yet."""
        self._pending: list[Document] = []

    def __iter__(self) -> Iterator[Document]:
        self.stream.resume_states = dict(self.slot_states)
        consumed = self.epoch_chunks if self.lockstep else self.chunks_consumed
        self.stream.worker_rotation = consumed % max(1, self.num_workers)
        self.stream.stop_epoch = self.lockstep_epoch + 1 if self.lockstep else None
        loader = DataLoader(
            self.stream,
            batch_size=None,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers else None,
            persistent_workers=False,
            collate_fn=_identity,
            worker_init_fn=functools.partial(init_worker, os.getpid()),
            # Its own generator: the DataLoader draws its base seed from it when iterated, never from the
            # global RNG, whose state a resumed run has just restored for dropout.
            generator=torch.Generator().manual_seed(0),
        )
        while self._pending:
            yield self._pending.pop(0)
        batches = iter(loader)
        track(batches)
        try:
            for slot, state, docs in batches:
                self.slot_states[slot] = state
                self.chunks_consumed += 1
                self.epoch_chunks += 1
                self._pending = list(docs)
                while self._pending:
                    yield self._pending.pop(0)
            self.epoch_chunks = 0  # every slot finished the epoch (lockstep) or the finite stream ended
            self.lockstep_epoch += 1
        finally:  # on exhaustion, on an error, and when the consumer closes this generator
            shutdown_workers(batches)

    def skipped(self) -> dict[str, int]:
        """Samples skipped under on_error=skip, summed over this rank's slots."""
        total: dict[str, int] = {}
        for state in self.slot_states.values():
            for reason, n in state.skipped.items():
                total[reason] = total.get(reason, 0) + n
        return total

    def state_dict(self) -> dict:
        return {
            "slot_states": {slot: dataclasses.asdict(s) for slot, s in self.slot_states.items()},
            "chunks_consumed": self.chunks_consumed,
            "epoch_chunks": self.epoch_chunks,
            "lockstep_epoch": self.lockstep_epoch,
            "num_workers": self.num_workers,
            "pending": [(d.key, d.tokens, d.loss_mask) for d in self._pending],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_workers"] != self.num_workers:
            raise ValueError(
                f"stream state was saved with {state['num_workers']} DataLoader workers; "
                f"this run has {self.num_workers} (the shard split depends on it)"
            )
        self.slot_states = {int(slot): SlotState(**s) for slot, s in state["slot_states"].items()}
        self.chunks_consumed = state["chunks_consumed"]
        self.epoch_chunks = state.get("epoch_chunks", 0)
        self.lockstep_epoch = state.get("lockstep_epoch", 0)
        self._pending = [Document(key=k, tokens=np.asarray(t), loss_mask=m) for k, t, m in state["pending"]]


def _why_short(shard: str) -> str:
    odd = non_sample_members(shard)
    if odd:
        return f"; it holds members that are not samples, which webdataset skips: {', '.join(odd)}"
    return " (truncated or replaced shard?)"


def _identity(x):
    return x

