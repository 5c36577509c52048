"""Boundaries, positions and targets of `collate_rows`: hand-checked tiny rows, then invariants."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.data.batch import IGNORE_INDEX, Batch, Document, collate_rows, flatten, valid_targets

PAD = 0
X = IGNORE_INDEX


def doc(key: str, tokens: list[int], mask: list[int] | None = None) -> Document:
    return Document(
        key=key,
        tokens=np.asarray(tokens, dtype=np.int64),
        loss_mask=None if mask is None else np.asarray(mask, dtype=bool),
    )


def seed_docs() -> list[Document]:
    """The seed's lengths [3, 2, 5, 2]; token ids are distinct and never the pad id."""
    return [
        doc("a", [11, 12, 13]),
        doc("b", [21, 22]),
        doc("c", [31, 32, 33, 34, 35]),
        doc("d", [41, 42]),
    ]


# ---------------------------------------------------------------------------------------------
# Hand-checked rows
# ---------------------------------------------------------------------------------------------


def test_seed_example_exact_fit():
    b = collate_rows([seed_docs()], row_len=12, pad_id=PAD, layout="packed")
    assert b.shape == (1, 12)
    assert b.input_ids.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34, 35, 41, 42]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1]]
    # -100 exactly at the document starts [0, 3, 5, 10]; each EOS (13, 22, 35, 42) stays a target.
    assert b.labels.tolist() == [[X, 12, 13, X, 22, X, 32, 33, 34, 35, X, 42]]
    assert b.cu_seqlens.dtype == torch.int32
    assert b.cu_seqlens.tolist() == [0, 3, 5, 10, 12]
    assert type(b.max_seqlen) is int and b.max_seqlen == 5
    assert b.input_ids.dtype == b.labels.dtype == b.position_ids.dtype == torch.int64
    assert (b.num_docs, b.num_tokens, b.num_valid_targets, b.num_allocated) == (4, 12, 8, 12)
    assert b.doc_keys == ("a", "b", "c", "d")
    assert b.layout == "packed"


def test_seed_example_padded_tail_is_its_own_segment():
    b = collate_rows([seed_docs()], row_len=14, pad_id=PAD, layout="packed")
    assert b.input_ids.tolist() == [[11, 12, 13, 21, 22, 31, 32, 33, 34, 35, 41, 42, PAD, PAD]]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 4, 0, 1, 0, 1]]
    assert b.labels.tolist() == [[X, 12, 13, X, 22, X, 32, 33, 34, 35, X, 42, X, X]]
    assert b.cu_seqlens.tolist() == [0, 3, 5, 10, 12, 14]
    assert b.cu_seqlens.dtype == torch.int32
    assert b.max_seqlen == 5
    assert (b.num_docs, b.num_tokens, b.num_valid_targets, b.num_allocated) == (4, 12, 8, 14)


def test_padding_is_masked_even_when_pad_id_looks_like_a_token():
    # The pad id is 42, the same as d's EOS: d's EOS must stay a target, padding must not.
    b = collate_rows([seed_docs()], row_len=14, pad_id=42, layout="packed")
    assert b.labels.tolist() == [[X, 12, 13, X, 22, X, 32, 33, 34, 35, X, 42, X, X]]


def test_continuous_positions_keep_boundaries():
    b = collate_rows([seed_docs()], row_len=14, pad_id=PAD, layout="packed", reset_positions=False)
    assert b.position_ids.tolist() == [list(range(14))]
    # Only positions change: labels and boundaries are those of the reset layout.
    assert b.labels.tolist() == [[X, 12, 13, X, 22, X, 32, 33, 34, 35, X, 42, X, X]]
    assert b.cu_seqlens.tolist() == [0, 3, 5, 10, 12, 14]


def test_collate_docstring_example_two_rows():
    a, b_, c = doc("A", [1, 2, 3]), doc("B", [4, 5]), doc("C", [6, 7, 8, 9])
    b = collate_rows([[a, b_], [c]], row_len=5, pad_id=PAD, layout="packed")
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, PAD]]
    assert b.cu_seqlens.tolist() == [0, 3, 5, 9, 10]
    assert b.position_ids.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 0]]
    assert b.labels.tolist() == [[X, 2, 3, X, 5], [X, 7, 8, 9, X]]
    assert b.max_seqlen == 4
    assert b.doc_keys == ("A", "B", "C")


def test_continuous_positions_restart_at_each_row():
    a, b_, c = doc("A", [1, 2, 3]), doc("B", [4, 5]), doc("C", [6, 7, 8, 9])
    b = collate_rows([[a, b_], [c]], row_len=5, pad_id=PAD, layout="packed", reset_positions=False)
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]]


def test_loss_mask_composes_with_boundaries_and_padding():
    # a: mask off its middle token; b: mask allows its start (must stay -100 anyway);
    # c: no mask (every non-start token counts); padding: 2 tokens at the tail.
    a = doc("a", [11, 12, 13], mask=[1, 0, 1])
    b_ = doc("b", [21, 22], mask=[1, 0])
    c = doc("c", [31, 32, 33])
    batch = collate_rows([[a, b_, c]], row_len=10, pad_id=PAD, layout="packed")
    assert batch.labels.tolist() == [[X, X, 13, X, X, X, 32, 33, X, X]]
    assert batch.num_valid_targets == 3 == valid_targets(a) + valid_targets(b_) + valid_targets(c)
    # Boundaries and positions do not depend on the loss mask.
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8, 10]
    assert batch.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 0, 1]]


def test_loss_mask_in_a_later_row_only():
    plain = doc("p", [1, 2, 3])
    masked = doc("m", [4, 5, 6], mask=[0, 0, 1])
    b = collate_rows([[plain], [masked]], row_len=4, pad_id=PAD, layout="unpacked")
    assert b.labels.tolist() == [[X, 2, 3, X], [X, X, 6, X]]
    assert b.num_valid_targets == 3


def test_valid_targets_docstring_example():
    assert valid_targets(doc("x", [5, 9, 2])) == 2
    assert valid_targets(doc("x", [5, 9, 2], mask=[1, 0, 1])) == 1
    assert valid_targets(doc("x", [7])) == 0
    # A mask on the first token never counts: the first token is nobody's target.
    assert valid_targets(doc("x", [5, 9], mask=[1, 0])) == 0


def test_unpacked_layout_one_doc_per_row():
    docs = seed_docs()
    b = collate_rows([[d] for d in docs], row_len=5, pad_id=PAD, layout="unpacked")
    assert b.shape == (4, 5)
    assert b.cu_seqlens.tolist() == [0, 3, 5, 7, 10, 15, 17, 20]
    assert b.labels.tolist() == [
        [X, 12, 13, X, X],
        [X, 22, X, X, X],
        [X, 32, 33, 34, 35],
        [X, 42, X, X, X],
    ]
    assert b.num_valid_targets == sum(valid_targets(d) for d in docs) == 8
    assert b.num_tokens == 12 and b.num_allocated == 20


def test_empty_row_is_one_padding_segment():
    b = collate_rows([[doc("a", [1, 2])], []], row_len=3, pad_id=PAD, layout="packed")
    assert b.cu_seqlens.tolist() == [0, 2, 3, 6]
    assert b.labels.tolist() == [[X, 2, X], [X, X, X]]
    assert b.num_tokens == 2 and b.num_docs == 1


def test_collate_rejects_bad_input():
    with pytest.raises(ValueError, match="more than row_len"):
        collate_rows([seed_docs()], row_len=11, pad_id=PAD, layout="packed")
    with pytest.raises(ValueError, match="unknown layout"):
        collate_rows([seed_docs()], row_len=12, pad_id=PAD, layout="ragged")
    with pytest.raises(ValueError, match="at least one row"):
        collate_rows([], row_len=12, pad_id=PAD, layout="packed")


def test_batch_to_device_keeps_types():
    b = collate_rows([seed_docs()], row_len=14, pad_id=PAD, layout="packed").to_device("cpu")
    assert b.cu_seqlens.dtype == torch.int32
    assert type(b.max_seqlen) is int and b.max_seqlen == 5
    assert (b.num_docs, b.num_tokens, b.num_valid_targets) == (4, 12, 8)
    assert b.doc_keys == ("a", "b", "c", "d")


def test_flatten():
    a, b_, c = seed_docs()[:3]
    assert flatten([[a, b_], [c]]) == [a, b_, c]


# ---------------------------------------------------------------------------------------------
# Invariants over random rows
# ---------------------------------------------------------------------------------------------


def check_batch_invariants(batch: Batch, rows: list[list[Document]], row_len: int) -> None:
    """Everything that must hold between rows and the tensors built from them."""
    num_rows = len(rows)
    assert batch.shape == (num_rows, row_len)
    cu = batch.cu_seqlens.tolist()
    assert batch.cu_seqlens.dtype == torch.int32
    assert cu[0] == 0 and cu[-1] == num_rows * row_len
    assert all(lo < hi for lo, hi in pairwise(cu)), "segments are non-empty"
    seg_lens = np.diff(cu)
    assert type(batch.max_seqlen) is int and batch.max_seqlen == int(seg_lens.max())

    ids = batch.input_ids.flatten().numpy()
    labels = batch.labels.flatten().numpy()
    pos = batch.position_ids.flatten().numpy()
    # Segment boundaries never cross a row boundary.
    row_starts = set(range(0, num_rows * row_len, row_len))
    assert row_starts <= set(cu[:-1])
    for lo, hi in pairwise(cu):
        assert pos[lo:hi].tolist() == list(range(hi - lo)), "positions restart at every segment"
        assert labels[lo] == IGNORE_INDEX, "no segment's first token is a target"

    # Expected labels, built doc by doc from the rows.
    expected = np.full(num_rows * row_len, IGNORE_INDEX, dtype=np.int64)
    expected_starts = []
    for r, row in enumerate(rows):
        offset = r * row_len
        for d in row:
            n = len(d)
            assert ids[offset : offset + n].tolist() == d.tokens.tolist()
            mask = np.ones(n, dtype=bool) if d.loss_mask is None else d.loss_mask.astype(bool)
            mask[0] = False
            expected[offset : offset + n][mask] = d.tokens[mask]
            expected_starts.append(offset)
            offset += n
        if offset < (r + 1) * row_len:
            expected_starts.append(offset)  # the padding segment
            assert (ids[offset : (r + 1) * row_len] == PAD).all()
    assert labels.tolist() == expected.tolist()
    assert cu[:-1] == expected_starts
    assert batch.num_tokens == sum(len(d) for row in rows for d in row)
    assert batch.num_valid_targets == int((labels != IGNORE_INDEX).sum())
    assert batch.num_valid_targets == sum(valid_targets(d) for row in rows for d in row)
    assert batch.doc_keys == tuple(d.key for row in rows for d in row)


@st.composite
def rows_strategy(draw):
    row_len = draw(st.integers(1, 24))
    num_rows = draw(st.integers(1, 4))
    rows = []
    k = 0
    for _ in range(num_rows):
        space = row_len
        row = []
        while space > 0 and draw(st.booleans()):
            n = draw(st.integers(1, space))
            tokens = draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
            mask = draw(st.none() | st.lists(st.booleans(), min_size=n, max_size=n))
            row.append(doc(f"d{k}", tokens, mask))
            k += 1
            space -= n
        rows.append(row)
    return rows, row_len


@settings(max_examples=150, deadline=None)
@given(rows_strategy(), st.sampled_from(["packed", "unpacked", "bucketed"]))
def test_collate_invariants(rows_and_len, layout):
    rows, row_len = rows_and_len
    batch = collate_rows(rows, row_len=row_len, pad_id=PAD, layout=layout)
    check_batch_invariants(batch, rows, row_len)
    assert batch.layout == layout


@settings(max_examples=50, deadline=None)
@given(rows_strategy())
def test_continuous_positions_change_nothing_but_positions(rows_and_len):
    rows, row_len = rows_and_len
    reset = collate_rows(rows, row_len=row_len, pad_id=PAD, layout="packed")
    cont = collate_rows(rows, row_len=row_len, pad_id=PAD, layout="packed", reset_positions=False)
    assert cont.position_ids.tolist() == [list(range(row_len))] * len(rows)
    assert torch.equal(reset.input_ids, cont.input_ids)
    assert torch.equal(reset.labels, cont.labels)
    assert torch.equal(reset.cu_seqlens, cont.cu_seqlens)
    assert reset.max_seqlen == cont.max_seqlen
