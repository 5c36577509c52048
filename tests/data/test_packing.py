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
    assert stats == PackingStats(docs_in=1, tokens_in=9, docs_split=1, chunks_from_splits=3)


def test_split_long_split_exact_multiple_and_mask():
    stats = PackingStats()
    chunks = split_long(doc("k", [1, 2, 3, 4], mask=[0, 1, 1, 0]), 2, "split", stats)
    assert [c.tokens.tolist() for c in chunks] == [[1, 2], [3, 4]]
    assert [c.loss_mask.tolist() for c in chunks] == [[False, True], [True, False]]
    assert (stats.docs_split, stats.chunks_from_splits) == (1, 2)


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
    assert stats == PackingStats(docs_in=4, tokens_in=26, docs_split=2, chunks_from_splits=6)
    restored = PackingStats()
    restored.load_state_dict(stats.state_dict())
    assert restored == stats


# ---------------------------------------------------------------------------------------------
# Online packer: hand-checked
# ---------------------------------------------------------------------------------------------


def test_online_packer_docstring_example():
    # T = 10, arrivals A(3) B(7) C(2) D(5) E(4) F(1) G(2), then the end of the stream.
    packer = OnlinePacker(seq_len=10, buffer_size=16)
    docs = [doc(k, range(1, n + 1)) for k, n in zip("ABCDEFG", [3, 7, 2, 5, 4, 1, 2], strict=True)]
    assert [packer.push(d) for d in docs] == [[]] * 7
    assert len(packer) == 7
    rows = packer.flush()
    assert row_keys(rows) == [["A", "B"], ["C", "D", "G", "F"], ["E"]]
    assert len(packer) == 0


def test_online_packer_lengths_arriving_longest_first():
    # T = 10, lengths [7, 5, 4, 3, 2, 2, 1] arriving in that order: the oldest document opens each row.
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
    document that still fits (the oldest among equal lengths).
    """
    buffer: list[int] = []  # indices in arrival order

    def emit() -> list[int]:
        row = [buffer.pop(0)]
        space = seq_len - lengths[row[0]]
        while True:
            fits = [i for i in buffer if lengths[i] <= space]
            if not fits:
                break
            best = max(fits, key=lambda i: (lengths[i], -i))  # longest; ties: earliest arrival
            buffer.remove(best)
            row.append(best)
            space -= lengths[best]
        return row

    rows = []
    for i in range(len(lengths)):
        buffer.append(i)
        if len(buffer) > buffer_size:
            rows.append(emit())
    while buffer:
        rows.append(emit())
    return rows


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
def stream(draw, max_docs: int = 60, with_masks: bool = False):
    """(T, documents) with lengths up to 2T, so some need splitting; token ids trace back to their doc."""
    seq_len = draw(seq_lens)
    lengths = draw(st.lists(st.integers(1, 2 * seq_len), max_size=max_docs))
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
