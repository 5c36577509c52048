"""A slot's reader: its shards of an epoch, read one sample at a time through a shuffle buffer, resumable.

Example, 5 shards, 2 ranks x 2 workers (S = 4), epoch permutation [3, 0, 4, 1, 2]:
    rank 0 worker 0 (slot 0) reads shards [3, 2];  rank 0 worker 1 (slot 1) reads [0]
    rank 1 worker 0 (slot 2) reads [4];            rank 1 worker 1 (slot 3) reads [1]

Resuming: a slot's position (`ReadPosition`) names the shard it is reading (its index in the slot's
shard list of the epoch), how many samples it took from it and the last one's key, the shuffle buffer's
items and the shuffle's RNG state. A resumed slot never opens the shards before the current one; it
reads the current one past the samples already taken without decoding them (and checks the last key),
refills the buffer, and continues with exactly the next document: nothing repeated, nothing skipped. What
it read to get there is reported (`DocumentLoader.resume_read`). Its cost is one shard at most, wherever
the epoch stood. Example, shards of 10,000 samples, buffer 1,000, preempted at sample 4,500 of the 90th
shard of the epoch: the resume reads 4,500 samples of that shard, not the 894,500 before them.

The buffer goes into the checkpoint as the samples themselves, except those of the shard being read,
which are references (shard, member) refilled as the resume reads past them. In the DataLoader workers
the buffer changes with every sample; each chunk carries only the items that entered it since the
slot's previous chunk, and `DocumentLoader` keeps a copy of every slot's buffer up to the chunk it
consumed. A checkpoint written before positions were saved (only `drawn`) still resumes: that slot
replays its epoch up to `drawn` samples, reading every shard before its position.

Resumed on another shape (trainer.data.reshape), a slot's shards of the rest of the epoch are dealt rather
than split: `SlotState.shards`, where a shard an old reader had read in part starts past its samples taken
(`SlotState.starts`), and the buffer may hold references into any of those shards."""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from trainer.data.shards import (
    ASSISTANT_FIELD,
    CHECK_BYTES,
    IDS_FIELD,
    TEXT_FIELD,
    StoredIds,
    ids_check,
    non_sample_members,
    wide_ids,
)
from trainer.data.sources import ReadCounter, ShardReadError, read_shard, url_file_name
from trainer.data.tars import TooLargeMember
from trainer.data.workers import sleep_unless_interrupted
from trainer.errors import UserError

log = logging.getLogger(__name__)


class DataStreamError(UserError, RuntimeError):
    """Bad input in a shard: the message names the shard and, where there is one, the sample key.

    RuntimeError too: torch re-raises a DataLoader worker's error as its type, called with one message."""


Stored = tuple[bytes, int, bytes | None, str]
"""A sample's stored token ids as a reader holds them: (the `ids` bytes, the size of its text in bytes, the
`assistant` ranges' bytes or None when the stream does not read them, the ids' dtype). Self-contained: a
checkpoint's buffered items resume whatever the next run reads. See trainer.data.shards."""

Refused = str
"""A sample refused as it was read, "<skip reason>: <what is wrong>", e.g. "too_large: is 30,000 bytes of
text" or "bad_ids: its ids are not ...": the stream reports it when it is drawn, as it reports a bad text then
(plain data: it may sit in a checkpoint's buffer)."""

Item = tuple[int, int, str, bytes | Stored | Refused | list[str] | None]
"""A sample as a slot's reader holds it: (shard index in the slot's list of the epoch, member index in the
shard, key, data). data: the `txt` bytes; its `Stored` ids when the stream reads stored ids and the sample has
them; a `Refused` sample; the field names of a sample without `txt`; None marks a shard that could not be read
(member -1). Example: (3, 17, "doc03_017", b"some text")."""


@dataclass
class ReadPosition:
    """Where a slot's reader stands inside an epoch: enough to continue without reading the shards before
    it."""

    shard_index: int = 0
    """Index of the shard being read in the slot's shard list of this epoch (the list's length once all are
    read)."""
    taken: int = 0
    """Samples taken from that shard so far: a resume reads past them without decoding them."""
    last_key: str = ""
    """Key of the last of them, checked when the shard is opened again (a changed shard cannot be resumed)."""
    rng: tuple = ()
    """The shuffle's `random.Random.getstate()`."""
    draining: bool = False
    """Every shard is read: the buffer was shuffled once and is being emptied."""
    buffer: list[Item] | None = None
    """The shuffle buffer's items; None in the chunks a worker sends, which carry `changes` instead."""
    changes: tuple[int, dict[int, Item]] | None = None
    """(buffer size, {position: item}) changed since the slot's previous chunk (`ShuffleBuffer.changes`)."""

    def with_changes_applied(self, buffer: list[Item]) -> ReadPosition:
        """This position with `buffer` (the slot's buffer at its previous chunk, updated in place) as its
        buffer.

        Example: buffer [a, b, c], changes (2, {1: d}) -> [a, d].
        """
        size, changed = self.changes
        del buffer[size:]
        buffer.extend([None] * (size - len(buffer)))
        for i, item in changed.items():
            buffer[i] = item
        return dataclasses.replace(self, buffer=buffer, changes=None)

    def to_dict(self) -> dict:
        """Plain data for a checkpoint, cheap enough to take at every step (the items are shared, not copied).
        Buffered samples of the shard being read become references (shard, member, "", None): a resume reads
        past them anyway. The others keep their text bytes (torch.save pickles bytes as latin-1 text: ASCII at
        its size, other bytes at twice theirs)."""
        current = self.shard_index
        buffer = [(item[0], item[1], "", None) if item[0] == current and item[1] >= 0 else item
                  for item in self.buffer]
        return {"shard_index": current, "taken": self.taken, "last_key": self.last_key, "rng": self.rng[1],
                "draining": self.draining, "buffer": buffer}

    @classmethod
    def from_dict(cls, d: dict) -> ReadPosition:
        return cls(shard_index=d["shard_index"], taken=d["taken"], last_key=d["last_key"],
                   rng=(3, tuple(d["rng"]), None), draining=d["draining"],
                   buffer=[tuple(item) for item in d["buffer"]])


@dataclass
class SlotState:
    """Where one (rank, worker) slot stands in its stream."""

    epoch: int = 0
    drawn: int = 0
    """Samples drawn from the shuffle buffer in this epoch (bad ones included)."""
    shard: str = ""
    """Shard being read when the state was taken (for reports)."""
    skipped: dict[str, int] = field(default_factory=dict)
    """Samples skipped under on_error=skip, by reason, since the start of training."""
    docs: int = 0
    """Documents emitted since the start of training."""
    position: ReadPosition | None = None
    """Where the reader stands in the epoch. None at the epoch's start, and in checkpoints written before it
    was saved: then `drawn` says where, and the epoch is replayed up to it."""
    restore_read: tuple[int, int, float] | None = None
    """Only in a resumed slot's first message: samples and bytes it read to restore its position, and
    seconds."""
    split: str = "by_tokens"
    """How this epoch's shards were split over the slots (trainer.data.stream.DocumentStream.epoch_shards):
    "by_tokens", or "every_nth" in a state from a checkpoint written before the split was balanced by tokens,
    whose epoch then ends on the split it began with (the next one is balanced), or "reshaped": the slot's
    shards of this epoch are `shards`, dealt by a resume on another number of ranks or workers
    (trainer.data.reshape)."""
    shards: list[str] | None = None
    """With split="reshaped": this slot's shards for the rest of the epoch, in reading order. The first
    `position.shard_index` of them are already read (the buffered samples that came from them name them)."""
    starts: dict[int, tuple[int, str]] = field(default_factory=dict)
    """With split="reshaped": shards of `shards` that readers of the old shape read in part, by index:
    (samples taken from it, the last one's key). The reader continues each of them there."""

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("position", "restore_read")}
        d["skipped"] = dict(self.skipped)
        d["starts"] = dict(self.starts)
        d["position"] = None if self.position is None else self.position.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> SlotState:
        position = d.get("position")
        starts = {int(i): (int(taken), str(key)) for i, (taken, key) in d.get("starts", {}).items()}
        return cls(**{**d, "skipped": dict(d["skipped"]), "split": d.get("split", "every_nth"),
                      "starts": starts,
                      "position": None if position is None else ReadPosition.from_dict(position)})


class ReadPolicy(Protocol):
    """What a reader needs of its stream's settings (trainer.data.stream.DocumentStream is one)."""

    retries: int
    retry_backoff_s: float
    read_timeout_s: float
    expected_docs: dict[str, int]
    shuffle_buffer: int
    stored_ids: StoredIds | None
    expected_bytes: dict[str, int]
    expected_tokens: dict[str, int]
    framing: int
    max_member_bytes: int | None
    _replaying: bool

    def _bad(self, state: SlotState, reason: str, message: str) -> None:
        """Raise DataStreamError(message), or count the skip under `reason` (on_error=skip)."""


class ShardCursor:
    """A slot's shards of one epoch, read in order one sample at a time, with retries.

    Its position is (shard index, samples taken from that shard, key of the last one). `seek` opens the shard
    at that position, reading past the samples taken before without decoding them: a resume. A transient
    failure (a transfer cut short, connection refused, HTTP 5xx, a failed command, no data for read_timeout_s)
    reopens the shard the same way, up to `retries` times, so the samples come out as without the failure.
    Example: a shard of 200 samples cut after 120 -> the retry reads samples 1..120 silently and passes on
    121..200.
    """

    def __init__(self, stream: ReadPolicy, shards: list[str], state: SlotState, index: int = 0,
                 taken: int = 0, last_key: str = "") -> None:
        self.stream = stream
        self.shards = shards
        self.state = state
        """The slot's state, where bad shards are counted."""
        self.index, self.taken, self.last_key = index, taken, last_key
        self.read = ReadCounter()
        """Samples and bytes read from the shards, skipped ones included."""
        self._attempt = 0
        self._samples: Iterator[dict] | None = None  # the open shard, past its `taken` samples
        self._failed: Item | None = None  # the marker of a shard that could not be read, next to pull
        self._wanted: dict[int, Item] = {}
        self._opened_at = 0  # self.read.bytes when the open shard was opened
        self._tokens: int | None = None  # the open shard's stored ids so far, framed; None: not all stored
        stored = stream.stored_ids
        self._itemsize = np.dtype(stored.dtype).itemsize if stored is not None else 1
        self._check_bytes = CHECK_BYTES if stored is not None and stored.checked else 0

    def pull(self) -> Item | None:
        """The next sample of the epoch, or None once every shard is read."""
        while True:
            if self._failed is not None:
                item, self._failed = self._failed, None
                return item
            if self.index == len(self.shards):
                return None
            try:
                if self._samples is None:
                    self._samples = self._open()
                sample = next(self._samples, None)
            except ShardReadError as exn:
                self._retry_or_fail(exn)
                continue
            if sample is None:
                self._check_shard()
                self._next_shard()
                continue
            self.taken += 1
            self.last_key = sample["__key__"]
            if self._tokens is not None:
                self._count(sample)
            return self.index, self.taken - 1, self.last_key, _data(sample, self.stream.stored_ids)

    def seek(self, wanted: set[int]) -> dict[int, Item]:
        """Open the current shard past the samples taken from it before; return those of them listed in
        `wanted` (member indices), read on the way. A shard that cannot be read is counted and left, as in
        `pull`."""
        self._wanted = dict.fromkeys(wanted)
        while self.taken and self._samples is None and self._failed is None:
            try:
                self._samples = self._open()
            except ShardReadError as exn:
                self._retry_or_fail(exn)
        found = {m: item for m, item in self._wanted.items() if item is not None}
        self._wanted = {}
        return found

    def _open(self) -> Iterator[dict]:
        """The current shard, read past its first `taken` samples (the last one's key must be `last_key`)."""
        url = self.shards[self.index]
        self.state.shard = url
        counted = self.stream.stored_ids is not None and url_file_name(url) in self.stream.expected_tokens
        self._opened_at, self._tokens = self.read.bytes, 0 if counted else None  # tokens only where checked
        samples = read_shard(url, self.read, self.stream.read_timeout_s, self.stream.max_member_bytes)
        found = {}
        try:
            for i in range(self.taken):
                sample = next(samples, None)
                if sample is None:
                    raise ShardReadError(f"it now ends after {i} samples; {self.taken} were read from it "
                                         "before: the shard changed", transient=False)
                if self._tokens is not None:
                    self._count(sample)
                if i in self._wanted:
                    found[i] = (self.index, i, sample["__key__"], _data(sample, self.stream.stored_ids))
            if self.taken and sample["__key__"] != self.last_key:
                raise ShardReadError(f"sample {self.taken} is now {sample['__key__']!r}, it was "
                                     f"{self.last_key!r}: the shard changed", transient=False)
        except BaseException:
            samples.close()
            raise
        self._wanted.update(found)
        return samples

    def _retry_or_fail(self, exn: ShardReadError) -> None:
        """After a failed read: wait and let the next pull reopen the shard, or count it as unreadable and
        move on."""
        self._close()
        url = self.shards[self.index]
        where = f"after sample {self.last_key!r}" if self.last_key else "before its first sample"
        if not exn.transient or self._attempt == self.stream.retries:
            tries = f"; {self._attempt + 1} attempts" if self._attempt else ""
            self.stream._bad(self.state, "unreadable_shard",
                             f"{url}: cannot read shard ({where}{tries}): {exn}")
            self._failed = (self.index, -1, self.last_key, None)
            self._next_shard()
            return
        delay = self.stream.retry_backoff_s * 2**self._attempt
        self._attempt += 1
        again = f", skipping the {self.taken} samples already passed on" if self.taken else ""
        log.warning("%s: cannot read shard (%s): %s; retry %d of %d in %.1f s from the shard's start%s",
                    url, where, exn, self._attempt, self.stream.retries, delay, again)
        sleep_unless_interrupted(delay)  # a preemption signal ends the wait (ReadInterrupted)

    def _count(self, sample: dict) -> None:
        """Add a sample's stored ids to the shard's tokens (+ its framing: EOS, and BOS if any, as the
        manifest counts); a sample without them (read from its text) leaves the shard's tokens unknown."""
        ids = sample.get(IDS_FIELD)
        if not isinstance(ids, bytes):
            self._tokens = None
            return
        self._tokens += (len(ids) - self._check_bytes) // self._itemsize + self.stream.framing

    def _check_shard(self) -> None:
        """A shard read to its end must be the one the manifest lists: as many samples, as many bytes, and
        from stored ids as many tokens (ids of another tokenizer or dtype, a shard of another dataset copied
        in)."""
        url = self.shards[self.index]
        name = url_file_name(url)
        expected = self.stream.expected_docs.get(name)
        if expected is not None and self.taken != expected:
            self.stream._bad(
                self.state,
                "truncated_shard",
                f"{url}: read {self.taken} samples but the manifest lists {expected}{_why_short(url)}; "
                "copy the shard again or rebuild it with python -m trainer.prepare (one regular file "
                "<key>.<field> per field), or set data.on_error=skip",
            )
            return
        found = None
        size, tokens = self.stream.expected_bytes.get(name), self.stream.expected_tokens.get(name)
        if size is not None and self.read.bytes - self._opened_at != size:
            found = f"it is {self.read.bytes - self._opened_at:,} bytes, the manifest lists {size:,}"
        elif tokens is not None and self._tokens is not None and self._tokens != tokens:
            found = (f"its stored ids are {self._tokens:,} tokens (EOS included), the manifest lists "
                     f"{tokens:,}: ids of another tokenizer or dtype than the manifest's "
                     f"{self.stream.stored_ids.dtype}")
        if found is not None:
            self.stream._bad(self.state, "shard_mismatch", f"{url}: not the shard the manifest lists: "
                             f"{found} (a shard of another dataset or tokenizer copied in, or damaged); copy "
                             "the dataset's own shard again or prepare the dataset again, or set "
                             "data.on_error=skip")

    def _next_shard(self) -> None:
        self._close()
        self.index, self._attempt = self.index + 1, 0
        # read in part on another shape
        self.taken, self.last_key = self.state.starts.get(self.index, (0, ""))

    def _close(self) -> None:
        if self._samples is not None:
            self._samples.close()  # read_shard's finally: close the file, stop curl or the command
            self._samples = None

    def close(self) -> None:
        self._close()


class ShuffleBuffer:
    """Buffered shuffle of one epoch's samples: fill to `size`; then each new item takes the place of a random
    one, which is drawn; once every shard is read, shuffle what is left and drain it.

    Example, size 2, items a b c d: [a], [a b]; c replaces b (b drawn) -> [a c]; d replaces a (a drawn) ->
    [d c]; end of the shards: shuffled to [c d], c drawn, then d. `changes` lists what changed since its last
    call.
    """

    def __init__(self, size: int, rng: random.Random, items: list[Item] | None = None,
                 draining: bool = False) -> None:
        self.size = size
        self.rng = rng
        self.items: list[Item] = items if items is not None else []
        """While draining: in reverse order, so that pop() draws them in the shuffled order."""
        self.draining = draining
        self._changed: set[int] = set(range(len(self.items)))

    def push(self, item: Item) -> Item | None:
        """Add a sample read; once the buffer is full, the one it replaces (drawn), else None."""
        if len(self.items) < self.size:
            self.items.append(item)
            self._changed.add(len(self.items) - 1)
            return None
        i = self.rng.randrange(len(self.items))
        out, self.items[i] = self.items[i], item
        self._changed.add(i)
        return out

    def start_draining(self) -> None:
        self.rng.shuffle(self.items)
        self.items.reverse()
        self.draining = True
        self._changed = set(range(len(self.items)))

    def pop(self) -> Item | None:
        return self.items.pop() if self.items else None

    def changes(self) -> tuple[int, dict[int, Item]]:
        """(size, {position: item}) of the positions changed since the last call. Example: size 3, [a b c],
        then c replaced by d and b by e -> (3, {1: e, 2: d}); after two pops while draining -> (1, {})."""
        size = len(self.items)
        changed = {i: self.items[i] for i in sorted(self._changed) if i < size}
        self._changed = set()
        return size, changed


class SlotReader:
    """One slot's samples in one epoch: its shards in order (`ShardCursor`) through the `ShuffleBuffer`.

    Built at a `ReadPosition`, it opens the shard being read, reads past the samples taken from it (refilling
    the buffer's references to them) and continues with the sample an uninterrupted reader would draw next.
    Built without one, at `state.drawn` > 0 (a checkpoint from before positions were saved), it replays the
    epoch.
    """

    def __init__(self, stream: ReadPolicy, shards: list[str], seed: int, state: SlotState,
                 position: ReadPosition | None) -> None:
        t0 = time.perf_counter()
        self.shards = shards
        rng = random.Random(seed)
        self._stream, self._state = stream, state
        self._read_ahead = ReadCounter()  # shards other than the current one, read for their buffered samples
        if position is None:
            self.cursor = ShardCursor(stream, shards, state, 0, *state.starts.get(0, (0, "")))
            self.buffer = ShuffleBuffer(stream.shuffle_buffer, rng)
            if state.drawn:
                self._replay(stream, state.drawn)
        else:
            rng.setstate(position.rng)
            self.cursor = ShardCursor(stream, shards, state, position.shard_index, position.taken,
                                      position.last_key)
            self.buffer = ShuffleBuffer(stream.shuffle_buffer, rng, list(position.buffer), position.draining)
            self._refill(position.shard_index)
        read = (self.cursor.read.samples + self._read_ahead.samples,
                self.cursor.read.bytes + self._read_ahead.bytes)
        self.restore_read = (*read, time.perf_counter() - t0)
        """(samples, bytes, seconds) it took to get to the position."""

    def _refill(self, shard_index: int) -> None:
        """Read the current shard up to the position, taking the buffered samples saved as references to it.

        After a resume on another shape (trainer.data.reshape) the buffer may also hold references to a later
        shard of the slot's list that an old reader read in part (`SlotState.starts`): that shard's read part
        is read now for them, and again when the reader gets to it. Example: shards [a, b], b started at 40
        samples, buffer [ref(a, 3), ref(b, 17)] -> a read to its position (sample 3 taken on the way), b's
        first 40 samples read for sample 17."""
        items = self.buffer.items
        refs: dict[int, dict[int, int]] = {}  # shard index -> {member: position in the buffer}
        for i, item in enumerate(items):
            if item[3] is None and item[1] >= 0:
                refs.setdefault(item[0], {})[item[1]] = i
        for index, members in sorted(refs.items()):
            if index == shard_index:
                found = self.cursor.seek(set(members))
            elif index in self._state.starts and index > shard_index:
                cursor = ShardCursor(self._stream, self.shards, self._state, index,
                                     *self._state.starts[index])
                try:
                    found = cursor.seek(set(members))
                finally:
                    cursor.close()
                    self._read_ahead.samples += cursor.read.samples
                    self._read_ahead.bytes += cursor.read.bytes
            else:
                raise DataStreamError(f"bad stream state: buffered references to shard {index} of "
                                      f"{len(self.shards)}, which is neither the current one ({shard_index}) "
                                      "nor one read in part before")
            for member, i in members.items():
                # Missing only if the shard could not be read again (counted as unreadable): drop the sample.
                items[i] = found.get(member, (index, -1, "", None))

    def _replay(self, stream: ReadPolicy, drawn: int) -> None:
        stream._replaying = True  # bad shards met again were counted before the checkpoint
        try:
            for _ in range(drawn):
                self.draw()
        finally:
            stream._replaying = False

    def draw(self) -> Item | None:
        """The next sample of the epoch, or None at its end."""
        while not self.buffer.draining:
            item = self.cursor.pull()
            if item is None:
                self.buffer.start_draining()
                break
            out = self.buffer.push(item)
            if out is not None:
                return out
        return self.buffer.pop()

    def position(self) -> ReadPosition:
        """Where the reader stands now, with the buffer changes since the last call (not the buffer)."""
        c = self.cursor
        return ReadPosition(shard_index=c.index, taken=c.taken, last_key=c.last_key,
                            rng=self.buffer.rng.getstate(), draining=self.buffer.draining,
                            changes=self.buffer.changes())

    def close(self) -> None:
        self.cursor.close()



def _data(sample: dict, stored: StoredIds | None) -> bytes | Stored | Refused | list[str]:
    """An `Item`'s data: the sample's stored ids if `stored` says to read them and it has them (all of them: a
    sample without is read from its text, as if none were stored), else its text bytes, or the names of its
    fields if it has no text; `Refused` if a member it needs was over the bound
    (trainer.data.tars.TooLargeMember)."""
    if TEXT_FIELD not in sample:
        return sorted(k for k in sample if not k.startswith("__"))
    text = sample[TEXT_FIELD]
    if type(text) is TooLargeMember:
        return _too_large(text)
    if stored is None or IDS_FIELD not in sample or (stored.assistant and ASSISTANT_FIELD not in sample):
        return text
    return _stored(sample, text, stored)


def _stored(sample: dict, text: bytes, stored: StoredIds) -> bytes | Stored | Refused:
    """A sample's stored ids, after the checks that need its text (the buffer keeps only the ids): a text the
    text path refuses (empty, not UTF-8) is handed on as its text, to be refused alike (the same documents
    either way); ids that are not those prepare wrote for this text (their check, `StoredIds.checked`) are
    refused (bad_ids). Every document pays this: plain Python, no call it can do without."""
    member = sample[IDS_FIELD]
    ranges = sample[ASSISTANT_FIELD] if stored.assistant else None
    if type(member) is TooLargeMember or type(ranges) is TooLargeMember:
        return _too_large(member if type(member) is TooLargeMember else ranges)
    # else ASCII beginning with a visible character
    if not (text and 33 <= text[0] <= 126 and text.isascii()):
        try:
            if not text.decode("utf-8").strip():
                return text
        except UnicodeDecodeError:
            return text
    if not stored.checked:
        return member, len(text), ranges, stored.dtype
    ids = member[:-CHECK_BYTES]
    if len(member) < CHECK_BYTES or ids_check(ids, text) != int.from_bytes(member[-CHECK_BYTES:], "little"):
        wide = wide_ids(member, stored.dtype) or wide_ids(ids, stored.dtype)
        why = (f"they read as <u4 values, every second {stored.dtype} value 0 (written as uint32; the "
               f"manifest says {stored.dtype})" if wide
               else "the ids of another sample or text, or damaged bytes")
        return f"bad_ids: its ids are not those prepare stored for its text (their check differs: {why})"
    return ids, len(text), ranges, stored.dtype


def _too_large(member: TooLargeMember) -> Refused:
    """A sample with a member over the bound, which was not read.
    Example: "too_large: is 30,000 bytes of text"."""
    if member.field == TEXT_FIELD:
        return f"too_large: is {member.size:,} bytes of text"
    return f"too_large: has a {member.field!r} member of {member.size:,} bytes (not read)"


def _why_short(shard: str) -> str:
    odd = non_sample_members(shard)
    if odd:
        return f"; it holds members that are not samples, which webdataset skips: {', '.join(odd)}"
    return " (truncated or replaced shard?)"


