"""WebDataset shards -> documents -> token ids, split over ranks and DataLoader workers, resumable.

Each (rank, worker) pair is one *slot*. Every epoch the shard list is permuted with the seed and split over
the slots balanced by the shards' tokens (`assign_shards`), so across all ranks x workers every document is
read exactly once per epoch, and with data.epoch_lockstep no rank waits long for another at the epoch's end.
Inside a slot, samples pass a shuffle buffer, are decoded and checked, tokenized in batches by the fast
tokenizer (or, when the shards store token ids encoded by the run's tokenizer, read as stored: the same
tokens), and are framed as the tokenizer frames a document: EOS appended, and BOS first where the tokenizer
starts every text with one (`bos_id`; trainer.data.tokenizer.SpecialIds.frame). With loss_on="assistant" (chat
data) each document also gets a `loss_mask`: only the assistant turns' tokens are targets
(trainer.data.chat.assistant_token_mask, from the text; or the ranges stored).

The reading itself (shard cursor, shuffle buffer, resumable positions) is trainer.data.reader; running the
stream in DataLoader workers and handing out single documents is trainer.data.loader.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from trainer.data import epochs as epoch_rules
from trainer.data.batch import Document
from trainer.data.chat import assistant_token_mask, ranges_mask, ranges_problem
from trainer.data.config import LOSS_ON, ON_ERROR
from trainer.data.reader import DataStreamError, Item, ReadPosition, SlotReader, SlotState, Stored
from trainer.data.shards import TEXT_FIELD, StoredIds, load_manifest, wide_ids
from trainer.data.sources import READ_TIMEOUT_S, url_file_name

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
        shard_tokens: Sequence[int] | None = None,
        name: str | None = None,
        source: int = 0,
        max_doc_bytes: int | None = None,
        stored_ids: StoredIds | None = None,
        manifest: str | Path | None = None,
        bos_id: int | None = None,
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
            source = f"source {name!r}: " if name else ""
            raise DataStreamError(f"{source}no training shards to read (the prepared split lists none: "
                                  "prepared from no documents, or every one went to val?)")
        self.shards = [str(s) for s in shards]
        self.tokens_known = shard_tokens is not None
        """Whether `shard_tokens` are the shards' real token counts (from the manifest)."""
        shard_tokens = [1] * len(self.shards) if shard_tokens is None else shard_tokens
        if len(shard_tokens) != len(self.shards):
            raise ValueError(f"{len(shard_tokens)} token counts for {len(self.shards)} shards")
        self.shard_tokens = [int(n) for n in shard_tokens]
        """Tokens per shard, which the readers' shares are balanced by (`manifest_tokens`); 1 each when
        unknown."""
        self.tokenizer_path = str(tokenizer_path)
        self.eos_id = eos_id
        self.bos_id = bos_id
        """Put before every document (SpecialIds.head: a tokenizer whose framing adds BOS); None: nothing."""
        self.framing = 1 + (bos_id is not None)
        """Tokens a document gets beyond its text's ids (SpecialIds.added), as the manifest counts them."""
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
        """Seconds a shard command (curl, pipe:) may send nothing before the read counts as a transient
        failure."""
        self.loss_on = loss_on
        self.max_doc_bytes = max_doc_bytes
        """A sample's largest text in bytes (data.max_doc_mb); larger: an error or a counted skip (too_large),
        before it is decoded and tokenized (~200x its size in memory)."""
        """'all': no loss_mask (every token a target); 'assistant': a loss_mask marking the assistant
        turns."""
        self.stored_ids = stored_ids
        """Read the token ids the shards store (trainer.data.shards.stored_ids: the run's tokenizer encoded
        them) instead of tokenizing the text; the same documents either way. None: tokenize every text."""
        entries = manifest_entries(manifest)
        self.expected_bytes = {name: entry["bytes"] for name, entry in entries.items() if "bytes" in entry}
        """Bytes per shard file name, from `manifest` (the one these shards are listed in:
        ShardSource.manifest), checked when a shard is read through."""
        self.expected_tokens = {name: entry["tokens"] for name, entry in entries.items() if "tokens" in entry}
        """Tokens per shard file name (framed), from `manifest`, else from `shard_tokens` when known; checked
        against the stored ids of a shard read through them."""
        if not entries and self.tokens_known:
            self.expected_tokens = {url_file_name(s): n
                                    for s, n in zip(self.shards, self.shard_tokens, strict=True)}
        self.name = name
        """The source's name in a mixture (data.sources), for errors and the documents' keys (`source_key`);
        None for the one source."""
        self.source = source
        """Its index in data.sources: every document's `source`."""
        self.resume_states: dict[int, SlotState] = {}
        self.stop_epoch: int | None = None
        """Set by a lockstep DocumentLoader: every slot stops when it reaches this epoch."""
        self.worker_rotation = 0
        self.report_restore = False
        """Set by DocumentLoader after loading a state: every slot's first message reports what it read to
        restore."""
        self._tokenizer = None
        self._replaying = False

    @property
    def max_member_bytes(self) -> int | None:
        """The largest shard member read (trainer.data.tars): data.max_doc_mb, times the ids' item size when
        they are read (a token covers one byte of text at least); a larger member is refused from its header,
        unread."""
        if self.max_doc_bytes is None:
            return None
        return self.max_doc_bytes * (np.dtype(self.stored_ids.dtype).itemsize if self.stored_ids else 1)

    # -- which shards a slot reads --------------------------------------------------------------

    def slot(self) -> tuple[int, int]:
        """(this slot's index, number of slots) from the rank and the DataLoader worker."""
        info = get_worker_info()
        workers = 1 if info is None else info.num_workers
        worker = 0 if info is None else (info.id + self.worker_rotation) % workers
        return self.rank * workers + worker, self.world_size * workers

    def epoch_shards(self, epoch: int, slot: int, num_slots: int, split: str = "by_tokens") -> list[str]:
        """Shards of `slot` in `epoch`, in reading order (`assign_shards`: the same split on every rank).
        `split` "every_nth" is the rule of checkpoints written before the split was balanced
        (SlotState.split): every num_slots-th shard of the epoch's permutation, so such a checkpoint still
        resumes mid-epoch exactly."""
        if len(self.shards) < num_slots:
            source = f"source {self.name!r}: " if self.name else ""
            raise DataStreamError(
                f"{source}{len(self.shards)} shards cannot feed {num_slots} readers "
                "(ranks x DataLoader workers): write more, smaller shards "
                "(trainer.prepare --docs-per-shard) or use fewer workers"
            )
        workers = num_slots // self.world_size
        return [self.shards[i] for i in self.split_shards(epoch, self.world_size, workers, split)[slot]]

    def split_shards(self, epoch: int, world_size: int, workers: int,
                     split: str = "by_tokens") -> list[list[int]]:
        """Shard indices of every slot of a world_size x workers shape in `epoch` (`epoch_shards` of each
        slot; trainer.data.reshape asks it for the shape a checkpoint was written on)."""
        if split == "every_nth":
            order = np.random.default_rng([self.seed, epoch]).permutation(len(self.shards))
            return [[int(i) for i in order[slot::world_size * workers]]
                    for slot in range(world_size * workers)]
        return assign_shards(self.shard_tokens, world_size, workers, self.seed, epoch)

    # -- reading -------------------------------------------------------------------------------

    def _bad(self, state: SlotState, reason: str, message: str) -> None:
        if self.on_error == "raise":
            raise DataStreamError(message)
        if self._replaying:
            return  # counted before the checkpoint; the restored state already holds it
        state.skipped[reason] = state.skipped.get(reason, 0) + 1
        log.warning("skipped (%s): %s", reason, message)

    def _decode(self, item: Item, shards: list[str], state: SlotState) -> str | Stored | None:
        """The document text, or its stored ids (checked), or None (counted) for a bad sample under
        on_error=skip. A sample is judged by its text's size whether its ids are read or not (the same
        documents either way)."""
        shard_index, _, key, data = item
        if data is None:
            return None  # unreadable shard, already reported
        shard = shards[shard_index]
        if isinstance(data, list):
            self._bad(state, "missing_text",
                      f"{shard}: sample {key!r} has no {TEXT_FIELD!r} field (has {data})")
            return None
        if isinstance(data, str):  # refused as it was read (trainer.data.reader.Refused)
            reason, _, why = data.partition(": ")
            if reason == "too_large":
                self._too_large(state, shard, key, why)
            else:
                self._bad(state, reason, f"{shard}: sample {key!r}: {why}; {BAD_IDS_HINT}")
            return None
        size = data[1] if isinstance(data, tuple) else len(data)
        if self.max_doc_bytes is not None and size > self.max_doc_bytes:
            self._too_large(state, shard, key, f"is {size:,} bytes of text")
            return None
        if isinstance(data, tuple):
            return self._check_stored(data, shard, key, state)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exn:
            self._bad(state, "not_utf8", f"{shard}: sample {key!r} is not valid UTF-8 ({exn})")
            return None
        if not text.strip():
            self._bad(state, "empty", f"{shard}: sample {key!r} is an empty document")
            return None
        return text

    def _check_stored(self, data: Stored, shard: str, key: str, state: SlotState) -> Stored | None:
        """Stored ids of whole values, and assistant ranges within them; else None, counted (a damaged
        shard)."""
        ids, _, ranges, dtype = data
        itemsize = np.dtype(dtype).itemsize
        problem = None
        if self.max_doc_bytes is not None and len(ids) // itemsize > self.max_doc_bytes:
            self._too_large(state, shard, key, f"has {len(ids) // itemsize:,} stored ids "
                                               "(a token covers a byte of text at least)")
            return None
        if not ids or len(ids) % itemsize:
            problem = f"its ids are {len(ids)} bytes, not whole {dtype} values"
        elif not ids[-1] and wide_ids(ids, dtype):  # O(1) but for a last value 0
            problem = (f"its ids read as <u4 values (every second {dtype} value is 0: written as uint32), "
                       f"but the manifest says {dtype}")
        elif self.loss_on == "assistant" and ranges is None:  # buffered by a run with loss_on=all, resumed
            problem = ("its stored ids were read without their assistant ranges "
                       "(data.loss_on changed on resume?)")
        elif ranges is not None and (why := ranges_problem(ranges, len(ids) // itemsize)) is not None:
            problem = f"its assistant ranges are bad: {why}"
        if problem is None:
            return data
        self._bad(state, "bad_ids", f"{shard}: sample {key!r}: {problem}; {BAD_IDS_HINT}")
        return None

    def _too_large(self, state: SlotState, shard: str, key: str, what: str) -> None:
        """A sample over data.max_doc_mb; `what`, e.g. "is 30,000 bytes of text"."""
        self._bad(state, "too_large", f"{shard}: sample {key!r} {what}, over data.max_doc_mb="
                                      f"{self.max_doc_bytes / 2**20:.3g} (tokenizing one document takes "
                                      "~200x its size in memory): raise data.max_doc_mb, or skip such "
                                      "documents with data.on_error=skip")

    def _out_of_vocabulary(self, items: list[Item], payloads: list[str | Stored], shards: list[str],
                           state: SlotState) -> set[int]:
        """Which payloads hold a stored id at or over the tokenizer's vocabulary, each reported as a damaged
        sample (bad_ids, naming shard and key). One max over the chunk's stored ids: ~0.1 us a document."""
        vocab = self.stored_ids.vocab_size if self.stored_ids is not None else None
        stored = [p for p in payloads if p.__class__ is tuple]
        if vocab is None or not stored or vocab >= 1 << 8 * np.dtype(stored[0][3]).itemsize:
            return set()
        if (len({p[3] for p in stored}) == 1
                and np.frombuffer(b"".join(p[0] for p in stored), stored[0][3]).max() < vocab):
            return set()
        bad = set()
        for i, (item, payload) in enumerate(zip(items, payloads, strict=True)):
            top = None if isinstance(payload, str) else int(np.frombuffer(payload[0], payload[3]).max())
            if top is not None and top >= vocab:
                bad.add(i)
                self._bad(state, "bad_ids", f"{shards[item[0]]}: sample {item[2]!r}: its stored ids hold "
                                            f"{top}, outside the vocabulary ({vocab} tokens) of the "
                                            f"tokenizer the manifest says encoded them; {BAD_IDS_HINT}")
        return bad

    # -- the stream ----------------------------------------------------------------------------

    def _documents(self, items: list[Item], payloads: list[str | Stored], shards: list[str], state: SlotState
                   ) -> list[Document]:
        """The chunk's documents (`items`: the samples drawn, of `shards`), in order: a text tokenized (in one
        batch with the chunk's other texts), stored ids read as they are (those outside the vocabulary
        reported and left out); each framed: [BOS] (when bos_id) + ids + [EOS]. Both give the same tokens and
        loss mask (tests/data/test_stored_ids); the framing tokens are never in the loss mask."""
        bad = self._out_of_vocabulary(items, payloads, shards, state)
        if bad:
            items = [item for i, item in enumerate(items) if i not in bad]
            payloads = [p for i, p in enumerate(payloads) if i not in bad]
        keys = [item[2] for item in items]
        texts = [p for p in payloads if isinstance(p, str)]
        encodings = iter(self._encode(texts) if texts else ())
        docs = []
        for key, payload in zip(keys, payloads, strict=True):
            # a mixture's source: its documents' keys say which (two sources may share sample keys)
            if self.name:
                key = source_key(self.name, key)
            if isinstance(payload, str):
                enc = next(encodings)
                ids, n = enc.ids, len(enc.ids)
            else:
                ids = np.frombuffer(payload[0], dtype=payload[3])
                n = len(ids)
            head = self.framing - 1
            tokens = np.empty(n + self.framing, dtype=np.int32)
            tokens[head:-1] = ids
            tokens[-1] = self.eos_id
            if head:
                tokens[0] = self.bos_id
            loss_mask = None
            if self.loss_on == "assistant":
                loss_mask = np.zeros(n + self.framing, dtype=bool)  # BOS and EOS stay inputs only
                loss_mask[head:-1] = (assistant_token_mask(payload, enc.offsets) if isinstance(payload, str)
                                      else ranges_mask(payload[2], n))
            docs.append(Document(key=key, tokens=tokens, loss_mask=loss_mask, source=self.source))
        return docs

    def _encode(self, texts: list[str]) -> list:
        if self._tokenizer is None:
            from trainer.data.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.tokenizer_path)
        # Offsets only for the assistant mask; encode_batch_fast gives the same ids without them, ~1.5x
        # faster.
        encode = getattr(self._tokenizer, "encode_batch_fast", None)
        if self.loss_on == "assistant" or encode is None:
            encode = self._tokenizer.encode_batch
        return encode(texts, add_special_tokens=False)

    def __iter__(self) -> Iterator[tuple[int, SlotState, list[Document]]]:
        slot, num_slots = self.slot()
        resumed = self.resume_states.get(slot, SlotState())
        state = dataclasses.replace(resumed, skipped=dict(resumed.skipped), position=None, restore_read=None)
        reader = self._reader(slot, num_slots, state, resumed.position)
        try:
            if self.report_restore:  # before any document: what restoring the position read
                yield slot, self._snapshot(state, reader,
                                           restore_read=reader.restore_read if reader else (0, 0, 0.0)), []
            while reader is not None:
                items: list[Item] = []  # the samples of `texts`
                texts: list[str | Stored] = []
                while (item := reader.draw()) is not None:
                    state.drawn += 1
                    text = self._decode(item, reader.shards, state)
                    if text is not None:
                        items.append(item)
                        texts.append(text)
                    if len(items) == self.chunk_docs:
                        yield self._chunk(slot, state, reader, reader.shards, items, texts)
                        items, texts = [], []
                reader.close()
                state.epoch = epoch_rules.after(state.epoch)
                state.drawn = 0
                # the next epoch: this shape's split
                state.split, state.shards, state.starts = "by_tokens", None, {}
                # The epoch's last chunk goes out even when empty: it carries the skip counts and the epoch.
                yield self._chunk(slot, state, None, reader.shards, items, texts)
                reader = self._reader(slot, num_slots, state, None)
        finally:  # also when the consumer stops early: no shard left open (a curl or pipe: command running)
            if reader is not None:
                reader.close()

    def _reader(self, slot: int, num_slots: int, state: SlotState,
                position: ReadPosition | None) -> SlotReader | None:
        """The slot's reader for `state.epoch`, at `position` (or at `state.drawn`); None when no epoch is
        left."""
        if epoch_rules.reader_stops(state.epoch, self.epochs, self.stop_epoch):
            return None
        if state.split == "reshaped":  # dealt by a resume on another shape (trainer.data.reshape)
            shards = list(state.shards)
        else:
            shards = self.epoch_shards(state.epoch, slot, num_slots, state.split)
        seed = int(np.random.SeedSequence([self.seed, state.epoch, slot]).generate_state(1)[0])
        return SlotReader(self, shards, seed, state, position)

    def _chunk(self, slot: int, state: SlotState, reader: SlotReader | None, shards: list[str],
               items: list[Item], texts: list[str | Stored]):
        """The chunk of `texts` (of `items`, samples of `shards`), with the state at `reader`'s position
        (None: the epoch's end)."""
        docs = self._documents(items, texts, shards, state)
        state.docs += len(docs)
        return slot, self._snapshot(state, reader), docs

    def _snapshot(self, state: SlotState, reader: SlotReader | None, restore_read=None) -> SlotState:
        return dataclasses.replace(state, skipped=dict(state.skipped), restore_read=restore_read,
                                   position=reader.position() if reader is not None else None)


BAD_IDS_HINT = "the shard is damaged: prepare it again, or set data.on_error=skip"
"""The end of a bad_ids message: what to do."""


def manifest_entries(manifest: str | Path | None) -> dict[str, dict]:
    """Each shard's manifest entry ({"name", "docs", "tokens", "bytes"}), by file name, from `manifest` (a
    manifest.json); {} without one."""
    if manifest is None:
        return {}
    splits = load_manifest(Path(manifest).parent)["splits"].values()
    return {shard["name"]: shard for split in splits for shard in split["shards"]}


def source_key(source: str, key: str) -> str:
    """A mixture's document key: the source's name, "/", the sample's key (names hold no "/": the first one
    splits). Example: ("code", "train--17") -> "code/train--17" (a chunk of it: "code/train--17#2")."""
    return f"{source}/{key}"


# -- which shards each slot reads: balanced by tokens -------------------------------------------


def assign_shards(tokens: Sequence[int], world_size: int, workers: int, seed: int,
                  epoch: int) -> list[list[int]]:
    """Shard indices of every slot (rank * workers + worker) in `epoch`, each in reading order: the epoch's
    seeded permutation of the shards, split by `balance_shards`. Every rank computes the same split alone."""
    order = np.random.default_rng([seed, epoch]).permutation(len(tokens))
    return balance_shards([int(i) for i in order], tokens, world_size, workers)


def balance_shards(order: Sequence[int], tokens: Sequence[int], world_size: int,
                   workers: int) -> list[list[int]]:
    """Split the shards over world_size x workers slots so that each rank, then each of its workers, holds
    about the same tokens: largest shard first (equal sizes in `order`), each to the rank with the fewest
    tokens so far, then within each rank to the worker with the fewest (greedy longest-processing-time,
    `lpt`). Ranks come first because the lockstep wait is between ranks. Each slot reads its shards in
    `order`; every slot gets one at least. With equal sizes (none known) this deals `order` out like cards:
    every S-th shard to each slot.

    Example: order [3, 0, 4, 1, 2], tokens [50, 10, 40, 30, 20], 2 ranks x 1 worker. By size 0, 2, 3, 4, 1:
    0 -> rank 0 (50), 2 -> rank 1 (40), 3 -> rank 1 (70), 4 -> rank 0 (70), 1 -> rank 0 (80, a tie goes to the
    rank with fewer shards, then the lower one). Slots [[0, 4, 1], [3, 2]]: 80 and 70 tokens (every 2nd shard
    of `order` would give [3, 4, 2] and [0, 1]: 90 and 60).
    """
    position = {shard: p for p, shard in enumerate(order)}
    # stable: equal sizes keep the permutation's order
    by_size = sorted(order, key=lambda shard: -tokens[shard])
    slots = []
    for rank_shards in _binned(by_size, lpt(by_size, tokens, [0] * world_size, at_least=workers), world_size):
        worker_of = lpt(rank_shards, tokens, [0] * workers, at_least=1)
        for worker_shards in _binned(rank_shards, worker_of, workers):
            slots.append(sorted(worker_shards, key=position.__getitem__))
    return slots


def lpt(items: Sequence[int], weight: Sequence[float], loads: Sequence[float],
        at_least: int = 0) -> list[int]:
    """The bin of each of `items` (largest first; greedy longest-processing-time): the bin with the least load
    so far (ties: fewer items, then the lower bin), starting from `loads`; except that once the items left are
    just enough to give every bin `at_least`, they go only to bins that have fewer. Shared by the epoch's
    shard split (`balance_shards`) and the deal of a reshaped resume (trainer.data.reshape).

    Example: weights 5, 3, 2 into loads [0, 4] -> bins [0, 1, 0]; weights 9, 1, 1 into 2 empty bins,
    at_least 1 -> [0, 1, 1]; weights 100, 1, 1, 1, at_least 2 -> [0, 1, 1, 0] (greedy alone would give
    [0, 1, 1, 1]).
    """
    heap = [(load, 0, b) for b, load in enumerate(loads)]  # (load, items, bin)
    heapq.heapify(heap)
    out = []
    owed = len(loads) * at_least  # items still needed by the bins below at_least
    for k, item in enumerate(items):
        load, count, b = heapq.heappop(heap)
        while len(items) - k == owed and count >= at_least:  # only just enough left: such a bin is done
            load, count, b = heapq.heappop(heap)
        out.append(b)
        owed -= count < at_least
        heapq.heappush(heap, (load + weight[item], count + 1, b))
    return out


def _binned(items: Sequence[int], bins_of: Sequence[int], num_bins: int) -> list[list[int]]:
    """`items` grouped by their bins, each bin's in the order of `items`. Example: [7, 8, 9], [1, 0, 1] ->
    [[8], [7, 9]]."""
    out: list[list[int]] = [[] for _ in range(num_bins)]
    for item, b in zip(items, bins_of, strict=True):
        out[b].append(item)
    return out


def manifest_tokens(shards: Sequence[str], manifest: str | Path | None) -> list[int] | None:
    """Tokens of each shard, by its file name, from `manifest` (the run's manifest.json, which
    trainer.data.sources.resolve_source finds: data.path's, or the one beside local data.urls shards); None
    without one, or when it does not list every shard (their sizes are not known).

    Example: ["https://h/d/train-000000.tar", "pipe:cat /e/train-000001.tar"], /d/manifest.json
    -> [38427, 31894]."""
    entries = manifest_entries(manifest)
    if not entries:
        return None
    tokens = [entries.get(url_file_name(s), {}).get("tokens") for s in shards]
    return None if None in tokens else tokens
