"""Documents and the one `Batch` type that every layout produces.

Document boundaries have one canonical form, built here and nowhere else: token ids, position ids,
unshifted labels with -100 at every segment start and on padding, and int32 `cu_seqlens` with a
leading 0 over the flattened rows, plus a Python-int `max_seqlen` (no `.item()` in the forward pass).

Worked example (the seed's): documents of lengths [3, 2, 5, 2] packed into one row of T = 12.

    input_ids    = [a0 a1 a2 | b0 b1 | c0 c1 c2 c3 c4 | d0 d1]
    position_ids = [ 0  1  2 |  0  1 |  0  1  2  3  4 |  0  1]
    labels       = [-100 a1 a2 | -100 b1 | -100 c1 c2 c3 c4 | -100 d1]
    cu_seqlens   = [0, 3, 5, 10, 12]          (int32)   max_seqlen = 5

Labels are NOT shifted: the loss shifts them internally (logits at t predict labels[t + 1]), so -100
at a document's first position means "the last token of the previous document never gets this token
as its target". Each document's last token is its EOS, and it stays a target.

With T = 14 the row gets a padding segment of 2 at its tail: input_ids end in [pad pad], labels in
[-100 -100], positions in [0 1], and cu_seqlens = [0, 3, 5, 10, 12, 14]. Padding is its own segment,
so no real token ever attends to it and it is never a target.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

IGNORE_INDEX = -100

LAYOUTS = ("packed", "unpacked", "bucketed")


@dataclass
class Document:
    """One tokenized document, EOS included as its last token.

    `loss_mask` (optional, bool, same length as `tokens`) marks which tokens count as targets, e.g.
    only the assistant's tokens in chat fine-tuning. It composes with boundary and padding masking:
    a token is a target iff it is not a segment start, not padding, and `loss_mask` allows it.
    """

    key: str
    """Stable identifier: the WebDataset `__key__` (with `#k` appended for the k-th chunk of a split document)."""
    tokens: np.ndarray
    """(n,) int64 token ids."""
    loss_mask: np.ndarray | None = None
    """(n,) bool, True = this token is a target; None = every token is."""

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class Batch:
    """One micro-batch in any layout. Tensors are (B, L); `cu_seqlens` covers the B * L flattened positions."""

    input_ids: torch.Tensor
    """(B, L) int64 token ids; padding holds the pad id."""
    labels: torch.Tensor
    """(B, L) int64, unshifted: a copy of input_ids with -100 at segment starts, padding and loss-masked tokens."""
    position_ids: torch.Tensor
    """(B, L) int64, reset to 0 at each segment (or 0..L-1 per row with continuous positions)."""
    cu_seqlens: torch.Tensor
    """(S + 1,) int32 cumulative segment lengths over the flattened rows, leading 0, ending at B * L."""
    max_seqlen: int
    """Longest segment, a Python int computed on the host."""
    layout: str
    """'packed', 'unpacked' or 'bucketed'."""
    num_docs: int
    """Documents (chunks of split documents count once each) in this micro-batch."""
    num_tokens: int
    """Non-padding positions."""
    num_valid_targets: int
    """Positions whose label is not -100: the loss's share of the denominator."""
    doc_keys: tuple[str, ...] = field(default_factory=tuple)
    """Keys of the documents in the order they were laid out."""

    @property
    def num_allocated(self) -> int:
        """Positions computed, padding included."""
        return self.input_ids.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """Tensors to `device`; `cu_seqlens` stays int32, counts stay Python ints."""
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        return Batch(
            input_ids=move(self.input_ids),
            labels=move(self.labels),
            position_ids=move(self.position_ids),
            cu_seqlens=move(self.cu_seqlens),
            max_seqlen=self.max_seqlen,
            layout=self.layout,
            num_docs=self.num_docs,
            num_tokens=self.num_tokens,
            num_valid_targets=self.num_valid_targets,
            doc_keys=self.doc_keys,
        )


def collate_rows(
    rows: Sequence[Sequence[Document]],
    row_len: int,
    pad_id: int,
    layout: str,
    reset_positions: bool = True,
) -> Batch:
    """Lay out `rows` (each a list of documents, placed left to right) as a (len(rows), row_len) batch.

    Every layout goes through here: packed rows hold several documents, unpacked and bucketed rows
    hold one. The tail of each row is one padding segment.

    Example: rows = [[A(3), B(2)], [C(4)]], row_len = 5
        segments   = [3, 2 | 4, 1(pad)]    cu_seqlens = [0, 3, 5, 9, 10]
        positions  = [[0 1 2 0 1], [0 1 2 3 0]]
        labels     = [[-100 a1 a2 -100 b1], [-100 c1 c2 c3 -100]]
    """
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    num_rows = len(rows)
    if num_rows == 0:
        raise ValueError("collate_rows needs at least one row")

    flat_ids = np.full(num_rows * row_len, pad_id, dtype=np.int64)
    seg_lens: list[int] = []
    seg_is_pad: list[bool] = []
    loss_mask = None
    keys: list[str] = []
    for r, row in enumerate(rows):
        used = 0
        for doc in row:
            seg_lens.append(len(doc))
            seg_is_pad.append(False)
            used += len(doc)
            keys.append(doc.key)
        if used > row_len:
            raise ValueError(f"row {r} holds {used} tokens, more than row_len={row_len}")
        if used:
            start = r * row_len
            flat_ids[start : start + used] = np.concatenate([doc.tokens for doc in row]) if len(row) > 1 else row[0].tokens
        if any(doc.loss_mask is not None for doc in row):
            if loss_mask is None:
                loss_mask = np.ones(num_rows * row_len, dtype=bool)
            offset = r * row_len
            for doc in row:
                if doc.loss_mask is not None:
                    loss_mask[offset : offset + len(doc)] = doc.loss_mask
                offset += len(doc)
        if used < row_len:
            seg_lens.append(row_len - used)
            seg_is_pad.append(True)

    seg_lens_np = np.asarray(seg_lens, dtype=np.int64)
    cu = np.zeros(len(seg_lens) + 1, dtype=np.int64)
    np.cumsum(seg_lens_np, out=cu[1:])
    starts = cu[:-1]

    labels = flat_ids.copy()
    labels[starts] = IGNORE_INDEX
    is_pad = np.repeat(np.asarray(seg_is_pad, dtype=bool), seg_lens_np)
    labels[is_pad] = IGNORE_INDEX
    if loss_mask is not None:
        labels[~loss_mask] = IGNORE_INDEX

    if reset_positions:
        positions = np.arange(num_rows * row_len, dtype=np.int64) - np.repeat(starts, seg_lens_np)
    else:
        positions = np.tile(np.arange(row_len, dtype=np.int64), num_rows)

    num_tokens = int(num_rows * row_len - is_pad.sum())
    return Batch(
        input_ids=torch.from_numpy(flat_ids).view(num_rows, row_len),
        labels=torch.from_numpy(labels).view(num_rows, row_len),
        position_ids=torch.from_numpy(positions).view(num_rows, row_len),
        cu_seqlens=torch.from_numpy(cu.astype(np.int32)),
        max_seqlen=int(seg_lens_np.max()),
        layout=layout,
        num_docs=len(keys),
        num_tokens=num_tokens,
        num_valid_targets=int((labels != IGNORE_INDEX).sum()),
        doc_keys=tuple(keys),
    )


def valid_targets(doc: Document) -> int:
    """Targets a document contributes in any layout: every token but its first, minus loss-masked ones.

    Example: tokens [5, 9, 2(EOS)] -> 2 targets (9 and EOS); with loss_mask [1, 0, 1] -> 1 (EOS).
    """
    if doc.loss_mask is None:
        return max(0, len(doc) - 1)
    return int(doc.loss_mask[1:].sum())


def flatten(rows: Iterable[Sequence[Document]]) -> list[Document]:
    return [doc for row in rows for doc in row]
