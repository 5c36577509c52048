"""Bin packing of documents into rows of length T: the online packer and the offline references.

The online packer holds a bounded buffer of documents. Each emitted row starts with the OLDEST
buffered document (so no document waits more than `buffer_size` rows, and long and short documents
leave in stream order rather than longest first), and the rest of the row is filled best-fit-decreasing
from the buffer: repeatedly the longest document that still fits the space left. Where that would end
the row short of full (the gap left is smaller than every buffered document), two documents that fill
the space exactly are taken instead, the most even such pair, provided short documents are plentiful
(pairs spend them, and documents longer than T/2 can only share a row with short ones). At the end of
the stream `flush()` packs what is left with offline best-fit-decreasing. bench/RESULTS.md measures
the result against offline BFD over the whole corpus.

Example, T = 10, buffer_size = 3, documents arriving A(4) B(5) C(3) D(3) E(6) F(5) G(2) H(4):
    push D (4 buffered > 3): oldest A(4); longest <= 6 is B(5), but its gap of 1 is smaller than
                             any buffered document, and C(3) + D(3) fill 6 exactly -> [A, C, D]   (10/10)
    push G (4 buffered > 3): oldest B(5); longest <= 5 is F(5)                     -> [B, F]      (10/10)
    flush, E(6) G(2) H(4) left: best-fit-decreasing -> [E, H] (10/10), [G] (2/10), ordered by oldest

Documents longer than T never reach the packer whole: `split_long` cuts them into chunks of at most T
(or truncates or drops them, by policy), and `PackingStats` counts what it did.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from trainer.data.batch import Document
from trainer.data.config import LONG_DOC_POLICIES

SHORTS_PER_LONG_FOR_PAIRS = 2  # see OnlinePacker._shorts_to_spare


@dataclass
class PackingStats:
    """What happened to documents on their way into rows. Nothing disappears uncounted."""

    docs_in: int = 0
    tokens_in: int = 0
    docs_split: int = 0
    chunks_from_splits: int = 0
    tokens_without_start: int = 0
    """Tokens of the chunks after a split document's first: trained without their document's start in view
    (the packing papers' concatenate-and-split cost)."""
    docs_truncated: int = 0
    tokens_truncated: int = 0
    docs_dropped: int = 0
    tokens_dropped: int = 0

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        for name, value in state.items():
            setattr(self, name, int(value))


def split_long(doc: Document, max_len: int, policy: str, stats: PackingStats) -> list[Document]:
    """Make `doc` fit a row of `max_len`: unchanged if it fits, else split / truncate / drop.

    Example, max_len = 4, tokens [1 2 3 4 5 6 7 8 9]:
        split    -> key#0 [1 2 3 4], key#1 [5 6 7 8], key#2 [9]   (each chunk is its own segment; 5 tokens
                                                                    counted as trained without their start)
        truncate -> [1 2 3 4]                                      (5 tokens counted as truncated)
        drop     -> []                                             (9 tokens counted as dropped)
    """
    if policy not in LONG_DOC_POLICIES:
        raise ValueError(f"unknown long-document policy {policy!r}; expected one of {LONG_DOC_POLICIES}")
    stats.docs_in += 1
    stats.tokens_in += len(doc)
    if len(doc) <= max_len:
        return [doc]
    if policy == "split":
        n_chunks = math.ceil(len(doc) / max_len)
        stats.docs_split += 1
        stats.chunks_from_splits += n_chunks
        stats.tokens_without_start += len(doc) - max_len
        return [
            Document(
                key=f"{doc.key}#{i}",
                tokens=doc.tokens[i * max_len : (i + 1) * max_len],
                loss_mask=None if doc.loss_mask is None else doc.loss_mask[i * max_len : (i + 1) * max_len],
                source=doc.source,
            )
            for i in range(n_chunks)
        ]
    if policy == "truncate":
        stats.docs_truncated += 1
        stats.tokens_truncated += len(doc) - max_len
        mask = None if doc.loss_mask is None else doc.loss_mask[:max_len]
        return [Document(key=doc.key, tokens=doc.tokens[:max_len], loss_mask=mask, source=doc.source)]
    if policy == "drop":
        stats.docs_dropped += 1
        stats.tokens_dropped += len(doc)
        return []
    raise ValueError(f"unknown long-document policy {policy!r}; expected one of {LONG_DOC_POLICIES}")


class OnlinePacker:
    """Streams documents in, rows of at most `seq_len` tokens out: oldest document first, best fit after.

    `push(doc)` returns the rows that became ready (one per push once the buffer holds more than
    `buffer_size` documents); `flush()` empties the buffer at the end of the stream (offline BFD over
    what is left). Deterministic: among documents of equal length the oldest goes first, and nothing
    here is random. A document waits at most `buffer_size` rows: each row takes the oldest document
    (flushed rows come out ordered by their oldest document), and at most `buffer_size` documents are
    older than one that arrives.
    """

    def __init__(self, seq_len: int, buffer_size: int = 1024) -> None:
        if seq_len < 1 or buffer_size < 1:
            raise ValueError(f"seq_len and buffer_size must be >= 1, got {seq_len} and {buffer_size}")
        self.seq_len = seq_len
        self.buffer_size = buffer_size
        self._lengths: list[int] = []  # sorted, one entry per buffered document
        self._by_length: dict[int, deque[tuple[int, Document]]] = {}  # length -> (arrival, doc), oldest first
        self._arrivals: deque[tuple[int, int]] = deque()  # (arrival, length) in arrival order, taken ones too
        self._taken: set[int] = set()  # arrivals already packed by best fit, dropped lazily from _arrivals
        self._next_arrival = 0
        # For the exact-pair search: byte n is 1 while some buffered document has n tokens.
        self._has_length = bytearray(seq_len + 1)

    def __len__(self) -> int:
        return len(self._lengths)

    def push(self, doc: Document) -> list[list[Document]]:
        n = len(doc)
        if not 0 < n <= self.seq_len:
            raise ValueError(f"document {doc.key!r} has {n} tokens; the packer takes 1..{self.seq_len} "
                             "(split first)")
        self._add(doc, n)
        if len(self._lengths) > self.buffer_size:
            return [self._emit_row()]
        return []

    def flush(self) -> list[list[Document]]:
        """Every buffered document, packed by offline best-fit-decreasing, rows ordered by their oldest
        document.

        The buffer no longer refills at the end of the stream, so the oldest-first rule would pack its last
        rows from an ever smaller choice; BFD sees the whole remainder at once.
        """
        docs = self.buffered()
        # Indices are arrival ranks: sorted, each row is in arrival order and the rows in order of their
        # oldest.
        bins = sorted(sorted(b) for b in best_fit_decreasing([len(d) for d in docs], self.seq_len))
        self.__init__(self.seq_len, self.buffer_size)
        return [[docs[i] for i in b] for b in bins]

    def pack(self, docs: Iterable[Document]) -> Iterator[list[Document]]:
        """All rows for a finite stream of documents that already fit (see `split_long`)."""
        for doc in docs:
            yield from self.push(doc)
        yield from self.flush()

    def _add(self, doc: Document, n: int) -> None:
        entry = (self._next_arrival, doc)
        self._next_arrival += 1
        bisect.insort(self._lengths, n)
        queue = self._by_length.get(n)
        if queue is None:
            queue = self._by_length[n] = deque()
            self._has_length[n] = 1
        queue.append(entry)
        self._arrivals.append((entry[0], n))

    def _take(self, n: int, index: int) -> tuple[int, Document]:
        """Remove the oldest buffered document of length n; `index` is any position of n in _lengths."""
        queue = self._by_length[n]
        entry = queue.popleft()
        if not queue:
            del self._by_length[n]
            self._has_length[n] = 0
        del self._lengths[index]
        return entry

    def _emit_row(self) -> list[Document]:
        """The oldest document, then best fit: the longest document that fits the space left, until none does.

        One exception, the pair completion: when the longest that fits would leave a gap smaller than every
        buffered document (so the row would end there, not full), two documents that fill the space exactly
        are taken instead, if there are any and short documents are plentiful (`_shorts_to_spare`).
        """
        lengths, arrivals, taken = self._lengths, self._arrivals, self._taken
        while arrivals[0][0] in taken:
            taken.discard(arrivals.popleft()[0])
        _, n = arrivals.popleft()
        # The oldest document is also the oldest of its length, so it heads that length's queue.
        row, space = [self._take(n, bisect.bisect_left(lengths, n))[1]], self.seq_len - n
        while space > 0:
            i = bisect.bisect_right(lengths, space) - 1
            if i < 0:
                break
            n = lengths[i]
            if space - n < lengths[0] and n < space and self._shorts_to_spare():
                pair = self._exact_pair(space)
                if pair is not None:
                    for m in pair:
                        arrival, doc = self._take(m, bisect.bisect_left(lengths, m))
                        taken.add(arrival)
                        row.append(doc)
                    break
            arrival, doc = self._take(n, i)
            taken.add(arrival)
            row.append(doc)
            space -= n
        return row

    def _shorts_to_spare(self) -> bool:
        """Whether buffered documents of <= T/2 tokens outnumber those of (T/2, T) at least 2 to 1.

        A completing pair spends two short documents where best fit spends one. A document longer than T/2
        has only short ones to share its row with, so where there are few short documents to a long one
        (lengths around T/2), spending them on pairs leaves later long documents alone in poor rows.
        """
        lengths, half = self._lengths, self.seq_len // 2
        shorts = bisect.bisect_right(lengths, half)
        return shorts >= SHORTS_PER_LONG_FOR_PAIRS * (bisect.bisect_left(lengths, self.seq_len) - shorts)

    def _exact_pair(self, space: int) -> tuple[int, int] | None:
        """Lengths b >= c of two buffered documents with b + c == space, b as small as possible, or None.

        The most even split leaves the shortest documents for the gaps only they can fill.
        Example, space 10, buffered lengths {2, 3, 4, 7, 8}: half = 5, b runs over 5..9 and c over 5..1;
        both = [0, 0, 1, 1, 0] (7 + 3, 8 + 2) -> (7, 3).
        """
        if space < 2:
            return None
        half = (space + 1) // 2
        has = np.frombuffer(self._has_length, dtype=np.bool_)
        # both[k]: b = half + k and c = space - b buffered
        both = has[half:space] & has[space - half : 0 : -1]
        k = int(both.argmax())  # the first True (or 0 if none)
        if both[k] and 2 * (half + k) == space and len(self._by_length[half + k]) < 2:
            both[k] = False  # b == c needs two documents of that length
            k = int(both.argmax())
        return (half + k, space - half - k) if both[k] else None

    def buffered(self) -> list[Document]:
        """The buffered documents in arrival order."""
        docs = {arrival: doc for queue in self._by_length.values() for arrival, doc in queue}
        return [docs[arrival] for arrival, _ in self._arrivals if arrival not in self._taken]

    def state_dict(self) -> dict:
        """The buffered documents (tokens included), so a resumed run packs exactly as this one would."""
        return {
            "seq_len": self.seq_len,
            "buffer_size": self.buffer_size,
            "docs": [d.to_state() for d in self.buffered()],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["seq_len"] != self.seq_len:
            raise ValueError(f"packer state is for seq_len={state['seq_len']}, this packer has "
                             f"{self.seq_len}")
        self.__init__(self.seq_len, self.buffer_size)
        for saved in state["docs"]:
            doc = Document.from_state(saved)
            self._add(doc, len(doc))


# ---------------------------------------------------------------------------------------------
# Offline references for the benchmark and the tests. They take lengths, return bins of indices.
# ---------------------------------------------------------------------------------------------


def greedy_concat(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Next-fit in stream order: start a new row whenever the next document does not fit."""
    bins: list[list[int]] = []
    space = 0
    for i, n in enumerate(lengths):
        if not bins or n > space:
            bins.append([])
            space = capacity
        bins[-1].append(i)
        space -= n
    return bins


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Offline FFD: longest first, each into the first open bin with room (max segment tree, O(n log n))."""
    if any(n < 1 for n in lengths):
        raise ValueError("document lengths must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    tree = [0] * (2 * size)  # max remaining space per subtree; unopened bins hold 0 until opened
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        if tree[1] >= n:
            node = 1
            while node < size:
                node = 2 * node if tree[2 * node] >= n else 2 * node + 1
            b = node - size
        else:
            b = len(bins)
            bins.append([])
            node = size + b
            tree[node] = capacity
        bins[b].append(i)
        tree[node] -= n
        node //= 2
        while node:
            tree[node] = max(tree[2 * node], tree[2 * node + 1])
            node //= 2
    return bins


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Offline BFD: longest first, each into the open bin whose remaining space fits it most tightly."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    spaces: list[tuple[int, int]] = []  # sorted (remaining space, bin id)
    bins: list[list[int]] = []
    for i in order:
        n = lengths[i]
        j = bisect.bisect_left(spaces, (n, -1))
        if j < len(spaces):
            space, b = spaces.pop(j)
        else:
            space, b = capacity, len(bins)
            bins.append([])
        bins[b].append(i)
        if space - n > 0:
            bisect.insort(spaces, (space - n, b))
    return bins
