"""The online packer, the offline references and `split_long`: hand-checked cases, then invariants."""

from __future__ import annotations

import math
import pickle
from collections import Counter
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.data.batch import Document, collate_rows, valid_targets
from trainer.data.packing import (
    OnlinePacker,
    PackingStats,
    best_fit_decreasing,
    first_fit_decreasing,
    greedy_concat,
    split_long,
)

PAD = 0


def doc(key: str, tokens, mask=None) -> Document:
    return Document(
        key=key,
        tokens=np.asarray(tokens, dtype=np.int64),
        loss_mask=None if mask is None else np.asarray(mask, dtype=bool),
    )


def docs_of_lengths(lengths: list[int]) -> list[Document]:
    """Document i has key f"d{i}" and tokens 1000 * i + [1, 2, ...], so every token is traceable."""
    return [doc(f"d{i}", 1000 * i + np.arange(1, n + 1)) for i, n in enumerate(lengths)]


def row_lengths(rows: list[list[Document]]) -> list[list[int]]:
    return [[len(d) for d in row] for row in rows]


def row_keys(rows: list[list[Document]]) -> list[list[str]]:
    return [[d.key for d in row] for row in rows]


# ---------------------------------------------------------------------------------------------
# split_long and PackingStats
# ---------------------------------------------------------------------------------------------


def test_split_long_split():
    stats = PackingStats()
    chunks = split_long(doc("k", [1, 2, 3, 4, 5, 6, 7, 8, 9]), 4, "split", stats)
    assert [c.key for c in chunks] == ["k#0", "k#1", "k#2"]
    assert [c.tokens.tolist() for c in chunks] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]
    assert stats == PackingStats(docs_in=1, tokens_in=9, docs_split=1, chunks_from_splits=3,
                                 tokens_without_start=5)


def test_split_long_split_exact_multiple_and_mask():
    stats = PackingStats()
    chunks = split_long(doc("k", [1, 2, 3, 4], mask=[0, 1, 1, 0]), 2, "split", stats)
    assert [c.tokens.tolist() for c in chunks] == [[1, 2], [3, 4]]
    assert [c.loss_mask.tolist() for c in chunks] == [[False, True], [True, False]]
    assert (stats.docs_split, stats.chunks_from_splits, stats.tokens_without_start) == (1, 2, 2)


def test_split_long_truncate():
    stats = PackingStats()
    out = split_long(doc("k", [1, 2, 3, 4, 5, 6, 7, 8, 9], mask=[1] * 9), 4, "truncate", stats)
    assert [(c.key, c.tokens.tolist(), c.loss_mask.tolist()) for c in out] == [
        ("k", [1, 2, 3, 4], [True] * 4)
    ]
    assert stats == PackingStats(docs_in=1, tokens_in=9, docs_truncated=1, tokens_truncated=5)


def test_split_long_drop():
    stats = PackingStats()
    assert split_long(doc("k", [1, 2, 3, 4, 5, 6, 7, 8, 9]), 4, "drop", stats) == []
    assert stats == PackingStats(docs_in=1, tokens_in=9, docs_dropped=1, tokens_dropped=9)


@pytest.mark.parametrize("policy", ["split", "truncate", "drop"])
def test_split_long_leaves_fitting_docs_alone(policy):
    stats = PackingStats()
    d = doc("k", [1, 2, 3, 4])
    assert split_long(d, 4, policy, stats) == [d]
    assert stats == PackingStats(docs_in=1, tokens_in=4)


def test_split_long_unknown_policy():
    with pytest.raises(ValueError, match="unknown long-document policy"):
        split_long(doc("k", [1, 2, 3]), 2, "wrap", PackingStats())


def test_stats_accumulate_over_a_stream_and_round_trip():
    stats = PackingStats()
    for i, n in enumerate([3, 9, 4, 10]):
        split_long(doc(f"k{i}", range(1, n + 1)), 4, "split", stats)
    assert stats == PackingStats(docs_in=4, tokens_in=26, docs_split=2, chunks_from_splits=6,
                                 tokens_without_start=(9 - 4) + (10 - 4))
    restored = PackingStats()
    restored.load_state_dict(stats.state_dict())
    assert restored == stats


# ---------------------------------------------------------------------------------------------
# Online packer: hand-checked
# ---------------------------------------------------------------------------------------------


def test_online_packer_docstring_example():
    # T = 10, buffer 3, arrivals A(4) B(5) C(3) D(3) E(6) F(5) G(2) H(4), then the end of the stream.
    packer = OnlinePacker(seq_len=10, buffer_size=3)
    docs = [doc(k, range(1, n + 1)) for k, n in zip("ABCDEFGH", [4, 5, 3, 3, 6, 5, 2, 4], strict=True)]
    pushed = [row_keys(packer.push(d)) for d in docs]
    # D: A(4) opens; best fit B(5) would leave a gap of 1, smaller than any buffered doc: C + D fill 6.
    # G: B(5) opens; F(5) fits exactly.
    assert pushed == [[], [], [], [["A", "C", "D"]], [], [], [["B", "F"]], []]
    assert len(packer) == 3
    assert row_keys(packer.flush()) == [["E", "H"], ["G"]]  # BFD over E(6) G(2) H(4)
    assert len(packer) == 0


def test_online_packer_lengths_arriving_longest_first():
    # T = 10, lengths [7, 5, 4, 3, 2, 2, 1], all flushed: best-fit-decreasing, rows in order of their oldest.
    packer = OnlinePacker(seq_len=10, buffer_size=16)
    docs = docs_of_lengths([7, 5, 4, 3, 2, 2, 1])
    assert [packer.push(d) for d in docs] == [[]] * 7
    rows = packer.flush()
    assert row_lengths(rows) == [[7, 3], [5, 4, 1], [2, 2]]
    assert row_keys(rows) == [["d0", "d3"], ["d1", "d2", "d6"], ["d4", "d5"]]  # equal lengths: FIFO


def test_online_packer_oldest_opens_the_row_even_if_short():
    # T = 10, buffer 2: the third push overflows; the oldest, s(2), opens the row, then best fit l(8).
    packer = OnlinePacker(seq_len=10, buffer_size=2)
    assert packer.push(doc("s", range(2))) == []
    assert packer.push(doc("m", range(5))) == []
    assert row_keys(packer.push(doc("l", range(8)))) == [["s", "l"]]
    assert row_keys(packer.flush()) == [["m"]]


def test_online_packer_emits_one_row_when_buffer_overflows():
    packer = OnlinePacker(seq_len=10, buffer_size=3)
    assert packer.push(doc("a", range(6))) == []
    assert packer.push(doc("b", range(3))) == []
    assert packer.push(doc("c", range(5))) == []
    # Fourth document overflows the buffer: the row is [6, 3] (longest, then longest that fits in 4).
    rows = packer.push(doc("d", range(1)))
    assert row_keys(rows) == [["a", "b", "d"]]
    assert row_keys(packer.flush()) == [["c"]]


def test_pair_completion_takes_the_most_even_exact_pair():
    # T = 20, buffer 5: A(10) opens with 10 to fill from [2, 3, 7, 8, 9]. Best fit 9 would leave 1 (less
    # than the shortest, 2); of the exact pairs 8 + 2 and 7 + 3 the more even one is taken.
    packer = OnlinePacker(seq_len=20, buffer_size=5)
    for d in [doc("A", range(10))] + docs_of_lengths([2, 3, 7, 8, 9]):
        rows = packer.push(d)
    assert row_lengths(rows) == [[10, 7, 3]]
    assert row_keys(packer.flush()) == [["d0", "d3", "d4"]]  # 2 + 8 + 9 = 19 in one row


def test_pair_completion_needs_two_documents_of_an_equal_length():
    # T = 10, A(4) opens with 6 to fill from [5, 3, 2, 4]: best fit 5 leaves 1; 3 + 3 would be the most
    # even pair but there is one 3, so 4 + 2.
    packer = OnlinePacker(seq_len=10, buffer_size=4)
    for d in [doc("A", range(4))] + docs_of_lengths([5, 3, 2, 4]):
        rows = packer.push(d)
    assert row_lengths(rows) == [[4, 4, 2]]


def test_pair_completion_waits_for_plentiful_short_docs():
    # T = 10, A(4) opens with 6 to fill. Best fit B(5) leaves a gap of 1 and C(3) + D(3) would fill it, but
    # the buffer holds as many long docs (7, 8, 9 > T/2) as short ones (5, 3, 3): the pair would spend two
    # short docs the long ones need, so best fit stands.
    packer = OnlinePacker(seq_len=10, buffer_size=6)
    for d in [doc("A", range(4))] + docs_of_lengths([5, 3, 3, 7, 8, 9]):
        rows = packer.push(d)
    assert row_lengths(rows) == [[4, 5]]
    # With short docs twice as many as long ones, the pair is taken.
    packer = OnlinePacker(seq_len=10, buffer_size=6)
    for d in [doc("A", range(4))] + docs_of_lengths([5, 3, 3, 2, 7, 8]):
        rows = packer.push(d)
    assert row_lengths(rows) == [[4, 3, 3]]


def test_flush_packs_what_is_left_by_best_fit_decreasing():
    # T = 10, left at the end: 3, 3, 4, 6, 4. The oldest-first rule would give [3, 6], [3, 4], [4] (3 rows);
    # BFD fills [6, 4] and [4, 3, 3] (2 rows), handed out in arrival order: [3, 3, 4], then [4, 6].
    packer = OnlinePacker(seq_len=10, buffer_size=16)
    for d in docs_of_lengths([3, 3, 4, 6, 4]):
        assert packer.push(d) == []
    assert row_keys(packer.flush()) == [["d0", "d1", "d4"], ["d2", "d3"]]
    assert len(packer) == 0 and packer.flush() == []


def test_online_packer_rejects_docs_that_do_not_fit():
    packer = OnlinePacker(seq_len=4, buffer_size=2)
    with pytest.raises(ValueError, match="split first"):
        packer.push(doc("long", range(5)))
    with pytest.raises(ValueError, match="split first"):
        packer.push(doc("empty", []))
    with pytest.raises(ValueError):
        OnlinePacker(seq_len=0)
    with pytest.raises(ValueError):
        OnlinePacker(seq_len=4, buffer_size=0)


def test_online_packer_state_refuses_other_seq_len():
    packer = OnlinePacker(seq_len=8, buffer_size=4)
    packer.push(doc("a", range(3)))
    with pytest.raises(ValueError, match="seq_len"):
        OnlinePacker(seq_len=16, buffer_size=4).load_state_dict(packer.state_dict())


# ---------------------------------------------------------------------------------------------
# Offline references: hand-checked
# ---------------------------------------------------------------------------------------------


def test_greedy_concat_keeps_stream_order():
    assert greedy_concat([4, 5, 2, 6, 4], 10) == [[0, 1], [2, 3], [4]]
    assert greedy_concat([], 10) == []


def test_ffd_and_bfd_differ_where_they_should():
    # Capacity 10, lengths [8, 7, 5, 4, 1]: bins [8|2 left], [7|3 left], [5, 4|1 left], then the 1
    # goes to the FIRST bin with room under FFD (8's) and the TIGHTEST under BFD (5+4's).
    assert first_fit_decreasing([8, 7, 5, 4, 1], 10) == [[0, 4], [1], [2, 3]]
    assert best_fit_decreasing([8, 7, 5, 4, 1], 10) == [[0], [1], [2, 3, 4]]


def test_offline_empty_input():
    assert first_fit_decreasing([], 10) == []
    assert best_fit_decreasing([], 10) == []


# ---------------------------------------------------------------------------------------------
# Naive references the fast implementations must agree with
# ---------------------------------------------------------------------------------------------


def naive_online(lengths: list[int], seq_len: int, buffer_size: int) -> list[list[int]]:
    """The online packer's documented rule, written the slow obvious way: indices out.

    Each row starts with the oldest buffered document, then repeatedly takes the longest buffered
    document that still fits (the oldest among equal lengths). Except: when that one would leave a gap
    smaller than every buffered document, and documents of <= T/2 are at least twice as many as those of
    (T/2, T), and two buffered documents fill the space exactly, the most even such pair (the oldest of
    each length) ends the row. At the end, what is left is packed by best-fit-decreasing, each row in
    arrival order, rows in order of their oldest document.
    """
    buffer: list[int] = []  # indices in arrival order

    def exact_pair(space: int) -> list[int] | None:
        for b in range((space + 1) // 2, space):
            of_b = [i for i in buffer if lengths[i] == b]
            of_c = [i for i in buffer if lengths[i] == space - b]
            if b == space - b and len(of_b) >= 2:
                return of_b[:2]
            if b != space - b and of_b and of_c:
                return [of_b[0], of_c[0]]
        return None

    def emit() -> list[int]:
        row = [buffer.pop(0)]
        space = seq_len - lengths[row[0]]
        while True:
            fits = [i for i in buffer if lengths[i] <= space]
            if not fits:
                break
            best = max(fits, key=lambda i: (lengths[i], -i))  # longest; ties: earliest arrival
            shorts = sum(lengths[i] <= seq_len // 2 for i in buffer)
            longs = sum(seq_len // 2 < lengths[i] < seq_len for i in buffer)
            gap = space - lengths[best]
            if 0 < gap < min(lengths[i] for i in buffer) and shorts >= 2 * longs:
                pair = exact_pair(space)
                if pair is not None:
                    for i in pair:
                        buffer.remove(i)
                    row += pair
                    break
            buffer.remove(best)
            row.append(best)
            space -= lengths[best]
        return row

    rows = []
    for i in range(len(lengths)):
        buffer.append(i)
        if len(buffer) > buffer_size:
            rows.append(emit())
    bins = naive_fit_decreasing([lengths[i] for i in buffer], seq_len, best=True)
    return rows + sorted(sorted(buffer[j] for j in b) for b in bins)


def naive_fit_decreasing(lengths: list[int], capacity: int, best: bool) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties by index
    bins: list[list[int]] = []
    space: list[int] = []
    for i in order:
        open_ = [b for b in range(len(bins)) if space[b] >= lengths[i]]
        if not open_:
            bins.append([])
            space.append(capacity)
            b = len(bins) - 1
        elif best:
            b = min(open_, key=lambda b: (space[b], b))
        else:
            b = open_[0]
        bins[b].append(i)
        space[b] -= lengths[i]
    return bins


# ---------------------------------------------------------------------------------------------
# Property-based tests
# ---------------------------------------------------------------------------------------------

seq_lens = st.integers(1, 64)
buffer_sizes = st.integers(1, 40)


@st.composite
def stream(draw, max_docs: int = 60, with_masks: bool = False, min_docs: int = 0, short_only: bool = False):
    """(T, documents) with lengths up to 2T, so some need splitting; or short ones, from some shortest
    length up to T/3 (where best fit leaves gaps and the packer completes rows with pairs), maybe mixed with
    some of (T/2, T] (which can switch the pairs off); token ids trace back to their doc."""
    seq_len = draw(seq_lens)
    if short_only or draw(st.booleans(), label="short docs"):
        longest = max(1, seq_len // 3)
        length = st.integers(draw(st.integers(1, longest), label="shortest"), longest)
        if seq_len >= 2 and draw(st.booleans(), label="and long ones"):
            length = st.one_of(length, length, st.integers(seq_len // 2 + 1, seq_len))
    else:
        length = st.integers(1, 2 * seq_len)
    lengths = draw(st.lists(length, min_size=min_docs, max_size=max_docs))
    docs = docs_of_lengths(lengths)
    if with_masks:
        for d in docs:
            if draw(st.booleans()):
                d.loss_mask = np.asarray(draw(st.lists(st.booleans(), min_size=len(d), max_size=len(d))))
    return seq_len, docs


def split_all(docs: list[Document], seq_len: int) -> list[Document]:
    stats = PackingStats()
    out = [c for d in docs for c in split_long(d, seq_len, "split", stats)]
    assert stats.docs_in == len(docs)
    assert stats.tokens_in == sum(len(c) for c in out)
    return out


def token_multiset(docs: list[Document], seq_len: int) -> Counter:
    """(original key, position in the original document, token), undoing `split_long`'s `#k` keys."""
    out: Counter = Counter()
    for d in docs:
        key, _, chunk = d.key.partition("#")
        offset = int(chunk) * seq_len if chunk else 0
        out.update((key, offset + i, int(t)) for i, t in enumerate(d.tokens))
    return out


def pack_online(docs: list[Document], seq_len: int, buffer_size: int) -> list[list[Document]]:
    return list(OnlinePacker(seq_len, buffer_size).pack(docs))


@settings(max_examples=80, deadline=None)
@given(stream(), buffer_sizes)
def test_online_rows_conserve_every_token(t_docs, buffer_size):
    seq_len, docs = t_docs
    chunks = split_all(docs, seq_len)
    rows = pack_online(chunks, seq_len, buffer_size)
    assert all(row for row in rows), "no empty rows"
    assert all(sum(len(d) for d in row) <= seq_len for row in rows), "no row longer than T"
    # Every chunk appears in exactly one row, whole: no document straddles rows.
    out = [d for row in rows for d in row]
    assert sorted(id(d) for d in out) == sorted(id(d) for d in chunks)
    # ... and so every token of every document appears exactly once (through the collated tensors).
    if rows:
        batch = collate_rows(rows, row_len=seq_len, pad_id=PAD, layout="packed")
        ids = batch.input_ids.numpy()
        seen: Counter = Counter()
        for r, row in enumerate(rows):
            offset = 0
            for d in row:
                key, _, chunk = d.key.partition("#")
                base = int(chunk) * seq_len if chunk else 0
                seen.update((key, base + i, int(t)) for i, t in enumerate(ids[r, offset : offset + len(d)]))
                offset += len(d)
        assert seen == token_multiset(docs, seq_len)
    assert len(rows) >= math.ceil(sum(len(c) for c in chunks) / seq_len), "never beats the lower bound"


@settings(max_examples=80, deadline=None)
@given(stream(), buffer_sizes)
def test_online_matches_naive_reference(t_docs, buffer_size):
    seq_len, docs = t_docs
    chunks = split_all(docs, seq_len)
    index = {id(d): i for i, d in enumerate(chunks)}
    rows = pack_online(chunks, seq_len, buffer_size)
    assert [[index[id(d)] for d in row] for row in rows] == naive_online(
        [len(c) for c in chunks], seq_len, buffer_size
    )


@settings(max_examples=60, deadline=None)
@given(stream(with_masks=True), buffer_sizes, st.integers(1, 6))
def test_packed_batches_are_consistent(t_docs, buffer_size, rows_per_batch):
    seq_len, docs = t_docs
    rows = pack_online(split_all(docs, seq_len), seq_len, buffer_size)
    for start in range(0, len(rows), rows_per_batch):
        group = rows[start : start + rows_per_batch]
        b = collate_rows(group, row_len=seq_len, pad_id=PAD, layout="packed")
        cu = b.cu_seqlens.tolist()
        assert cu[0] == 0 and cu[-1] == len(group) * seq_len
        assert b.max_seqlen == max(hi - lo for lo, hi in pairwise(cu))
        pos = b.position_ids.flatten().tolist()
        labels = b.labels.flatten().tolist()
        ids = b.input_ids.flatten().tolist()
        starts = set(cu[:-1])
        pad = set()
        for r, row in enumerate(group):
            used = sum(len(d) for d in row)
            pad.update(range(r * seq_len + used, (r + 1) * seq_len))
        masked = set()
        for r, row in enumerate(group):
            offset = r * seq_len
            for d in row:
                if d.loss_mask is not None:
                    masked.update(offset + int(i) for i in np.flatnonzero(~d.loss_mask.astype(bool)))
                offset += len(d)
        for lo, hi in pairwise(cu):
            assert pos[lo:hi] == list(range(hi - lo))
        for t in range(len(labels)):
            if t in starts or t in pad or t in masked:
                assert labels[t] == -100, t
            else:
                assert labels[t] == ids[t], t
        assert b.num_valid_targets == sum(valid_targets(d) for row in group for d in row)


@settings(max_examples=60, deadline=None)
@given(stream(with_masks=True), buffer_sizes, st.integers(1, 8))
def test_valid_targets_identical_across_layouts(t_docs, buffer_size, group_size):
    seq_len, docs = t_docs
    chunks = split_all(docs, seq_len)
    expected = sum(valid_targets(d) for d in chunks)
    if not chunks:
        return

    packed_rows = pack_online(chunks, seq_len, buffer_size)
    packed = collate_rows(packed_rows, row_len=seq_len, pad_id=PAD, layout="packed")

    longest = max(len(d) for d in chunks)
    unpacked = collate_rows([[d] for d in chunks], row_len=longest, pad_id=PAD, layout="unpacked")

    by_length = sorted(chunks, key=len)
    groups = [by_length[i : i + group_size] for i in range(0, len(by_length), group_size)]
    bucketed = [
        collate_rows([[d] for d in g], row_len=max(len(d) for d in g), pad_id=PAD, layout="bucketed")
        for g in groups
    ]

    assert packed.num_valid_targets == expected
    assert unpacked.num_valid_targets == expected
    assert sum(b.num_valid_targets for b in bucketed) == expected
    # The same tokens in every layout, and padding the only difference in allocation.
    total = sum(len(d) for d in chunks)
    assert packed.num_tokens == unpacked.num_tokens == sum(b.num_tokens for b in bucketed) == total
    assert packed.num_docs == unpacked.num_docs == sum(b.num_docs for b in bucketed) == len(chunks)


@settings(max_examples=40, deadline=None)
@given(stream(), buffer_sizes)
def test_online_packer_is_deterministic(t_docs, buffer_size):
    seq_len, docs = t_docs
    chunks = split_all(docs, seq_len)
    first = pack_online(chunks, seq_len, buffer_size)
    # A second run over fresh copies of the same documents.
    copies = [doc(d.key, d.tokens.copy()) for d in chunks]
    second = pack_online(copies, seq_len, buffer_size)
    assert row_keys(first) == row_keys(second)
    if first:
        a = collate_rows(first, row_len=seq_len, pad_id=PAD, layout="packed")
        b = collate_rows(second, row_len=seq_len, pad_id=PAD, layout="packed")
        assert a.input_ids.equal(b.input_ids) and a.labels.equal(b.labels)
        assert a.position_ids.equal(b.position_ids) and a.cu_seqlens.equal(b.cu_seqlens)


@settings(max_examples=80, deadline=None)
@given(stream(with_masks=True), buffer_sizes, st.data())
def test_online_packer_resumes_from_state_dict(t_docs, buffer_size, data):
    seq_len, docs = t_docs
    chunks = split_all(docs, seq_len)
    cut = data.draw(st.integers(0, len(chunks)), label="cut")

    uninterrupted = pack_online(chunks, seq_len, buffer_size)

    before = OnlinePacker(seq_len, buffer_size)
    rows = [row for d in chunks[:cut] for row in before.push(d)]
    state = pickle.loads(pickle.dumps(before.state_dict()))  # as a checkpoint would store it
    after = OnlinePacker(seq_len, buffer_size)
    after.load_state_dict(state)
    assert len(after) == len(before)
    rows += [row for d in chunks[cut:] for row in after.push(d)]
    rows += after.flush()

    assert row_keys(rows) == row_keys(uninterrupted)
    for resumed_row, row in zip(rows, uninterrupted, strict=True):
        for x, y in zip(resumed_row, row, strict=True):
            assert x.tokens.tolist() == y.tokens.tolist()
            assert (x.loss_mask is None) == (y.loss_mask is None)
            if x.loss_mask is not None:
                assert x.loss_mask.tolist() == y.loss_mask.tolist()


# Streams long enough to overflow small buffers, so most rows come from `push`, not from `flush`.
overflowing = st.tuples(stream(min_docs=20, max_docs=100), st.integers(1, 12))
overflowing_short = st.tuples(stream(min_docs=20, max_docs=100, short_only=True), st.integers(1, 12))


@settings(max_examples=200, deadline=None)
@given(overflowing_short)
def test_online_matches_naive_reference_where_pairs_complete_rows(t_docs_buffer):
    (seq_len, docs), buffer_size = t_docs_buffer
    chunks = split_all(docs, seq_len)
    index = {id(d): i for i, d in enumerate(chunks)}
    rows = pack_online(chunks, seq_len, buffer_size)
    assert [[index[id(d)] for d in row] for row in rows] == naive_online(
        [len(c) for c in chunks], seq_len, buffer_size
    )


def waits(chunks: list[Document], packer: OnlinePacker) -> list[int]:
    """Rows each item waited: rows emitted after it arrived and before the row holding it."""
    arrived_at: dict[int, int] = {}
    waited: list[int] = []
    emitted = 0
    for d in chunks:
        arrived_at[id(d)] = emitted
        for row in packer.push(d):
            waited += [emitted - arrived_at.pop(id(x)) for x in row]
            emitted += 1
    for row in packer.flush():
        waited += [emitted - arrived_at.pop(id(x)) for x in row]
        emitted += 1
    assert not arrived_at, "every item left"
    return waited


@settings(max_examples=80, deadline=None)
@given(st.one_of(overflowing, overflowing_short))
def test_every_document_leaves_within_buffer_size_rows(t_docs_buffer):
    # At most buffer_size documents are older than one that arrives, and every row (pushed or flushed)
    # holds the oldest document left, so none waits more than buffer_size rows.
    (seq_len, docs), buffer_size = t_docs_buffer
    chunks = split_all(docs, seq_len)
    assert max(waits(chunks, OnlinePacker(seq_len, buffer_size)), default=0) <= buffer_size


def test_the_wait_bound_is_reached():
    # T = 10, buffer 3, documents of 10 (a row each): d3 arrives behind d0, d1, d2 and leaves after their
    # three rows, pushed out by d4, d5, d6.
    waited = waits(docs_of_lengths([10] * 7), OnlinePacker(seq_len=10, buffer_size=3))
    assert waited == [0, 1, 2, 3, 3, 3, 3]


@settings(max_examples=80, deadline=None)
@given(st.one_of(overflowing, overflowing_short), st.data())
def test_online_packer_resumes_twice_and_its_state_is_the_buffer(t_docs_buffer, data):
    (seq_len, docs), buffer_size = t_docs_buffer
    chunks = split_all(docs, seq_len)
    first = data.draw(st.integers(0, len(chunks)), label="first cut")
    second = data.draw(st.integers(first, len(chunks)), label="second cut")
    uninterrupted = pack_online(chunks, seq_len, buffer_size)

    packer, rows = OnlinePacker(seq_len, buffer_size), []
    for lo, hi in ((0, first), (first, second)):
        rows += [row for d in chunks[lo:hi] for row in packer.push(d)]
        state = pickle.loads(pickle.dumps(packer.state_dict()))
        # The state is the buffered documents and the two sizes, nothing that grows with the stream.
        assert set(state) == {"seq_len", "buffer_size", "docs"}
        assert [saved[0] for saved in state["docs"]] == [d.key for d in packer.buffered()]
        assert len(state["docs"]) == len(packer) <= buffer_size
        packer = OnlinePacker(seq_len, buffer_size)
        packer.load_state_dict(state)
    rows += [row for d in chunks[second:] for row in packer.push(d)] + packer.flush()
    assert row_keys(rows) == row_keys(uninterrupted)


@settings(max_examples=60, deadline=None)
@given(st.one_of(overflowing, overflowing_short))
def test_flush_ends_an_epoch_and_the_next_packs_like_a_fresh_packer(t_docs_buffer):
    # RowStream flushes at the end of each epoch (each rank's, under epoch lockstep) and then pushes the
    # next epoch into the same packer: nothing may carry over.
    (seq_len, docs), buffer_size = t_docs_buffer
    chunks = split_all(docs, seq_len)
    packer = OnlinePacker(seq_len, buffer_size)
    epoch_1 = list(packer.pack(chunks))
    assert len(packer) == 0 and packer.flush() == []
    epoch_2 = list(packer.pack(chunks))
    assert row_keys(epoch_1) == row_keys(epoch_2) == row_keys(pack_online(chunks, seq_len, buffer_size))


def check_bins(bins: list[list[int]], lengths: list[int], capacity: int) -> None:
    assert sorted(i for b in bins for i in b) == list(range(len(lengths))), "every index exactly once"
    assert all(b for b in bins), "no empty bins"
    assert all(sum(lengths[i] for i in b) <= capacity for b in bins), "capacity respected"
    assert len(bins) >= math.ceil(sum(lengths) / capacity)


offline_input = seq_lens.flatmap(
    lambda cap: st.tuples(st.just(cap), st.lists(st.integers(1, cap), max_size=80))
)


@settings(max_examples=100, deadline=None)
@given(offline_input)
def test_offline_packings_are_valid_and_match_naive(cap_lengths):
    capacity, lengths = cap_lengths
    ffd = first_fit_decreasing(lengths, capacity)
    bfd = best_fit_decreasing(lengths, capacity)
    greedy = greedy_concat(lengths, capacity)
    for bins in (ffd, bfd, greedy):
        check_bins(bins, lengths, capacity)
    assert greedy == sorted(greedy), "greedy keeps stream order"
    assert [i for b in greedy for i in b] == list(range(len(lengths)))
    assert ffd == naive_fit_decreasing(lengths, capacity, best=False)
    assert bfd == naive_fit_decreasing(lengths, capacity, best=True)


@settings(max_examples=50, deadline=None)
@given(offline_input, buffer_sizes)
def test_online_never_beats_the_lower_bound(cap_lengths, buffer_size):
    capacity, lengths = cap_lengths
    rows = pack_online(docs_of_lengths(lengths), capacity, buffer_size)
    assert len(rows) >= math.ceil(sum(lengths) / capacity)
