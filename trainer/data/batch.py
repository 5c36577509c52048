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

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch

from trainer.data.config import LAYOUTS
from trainer.errors import UserError

IGNORE_INDEX = -100

@dataclass
class Document:
    """One tokenized document, EOS included as its last token.

    `loss_mask` (optional, bool, same length as `tokens`) marks which tokens count as targets, e.g.
    only the assistant's tokens in chat fine-tuning. It composes with boundary and padding masking:
    a token is a target iff it is not a segment start, not padding, and `loss_mask` allows it.
    """

    key: str
    """Stable identifier: the WebDataset `__key__` (with `#k` appended for the k-th chunk of a split
    document)."""
    tokens: np.ndarray
    """(n,) int64 token ids."""
    loss_mask: np.ndarray | None = None
    """(n,) bool, True = this token is a target; None = every token is."""
    source: int = 0
    """Index of the source it came from in data.sources (in the order listed;
    trainer.data.config.DataConfig.mixture); 0 without a mixture."""

    def __len__(self) -> int:
        return len(self.tokens)

    def to_state(self) -> tuple:
        """Plain data for a checkpoint: (key, tokens, loss_mask, source)."""
        return self.key, self.tokens, self.loss_mask, self.source

    @classmethod
    def from_state(cls, state: Sequence) -> Document:
        """A document from `to_state`'s tuple, or from the (key, tokens, loss_mask) of older checkpoints."""
        key, tokens, mask, *source = state
        return cls(key=key, tokens=np.asarray(tokens), loss_mask=None if mask is None else np.asarray(mask),
                   source=int(source[0]) if source else 0)


class RowShare(Protocol):
    """Which positions of a micro-batch's rows this rank computes, and how attention joins them to the
    others'."""

    def cut(self, inputs: dict) -> dict:
        """The model's forward kwargs of the whole rows (trainer.model.model_inputs) -> this rank's."""
        ...

    def received_rows(self) -> int:
        """Positions whose keys and values this rank receives from the others, per layer (the cp_kv_bytes
        metric)."""
        ...


@dataclass
class Batch:
    """One micro-batch in any layout. Tensors are (B, L); `cu_seqlens` covers the B * L flattened
    positions."""

    input_ids: torch.Tensor
    """(B, L) int64 token ids; padding holds the pad id."""
    labels: torch.Tensor
    """(B, L) int64, unshifted: a copy of input_ids with -100 at segment starts, padding and loss-masked
    tokens."""
    position_ids: torch.Tensor
    """(B, L) int64, reset to 0 at each segment (or 0..L-1 per row with continuous positions)."""
    cu_seqlens: torch.Tensor
    """(S + 1,) int32 cumulative segment lengths over the flattened rows, leading 0, ending at B * L."""
    max_seqlen: int
    """Longest segment, a Python int computed on the host."""
    layout: str
    """'packed', 'unpacked' or 'bucketed'; 'tree' for scoring (collate_trees)."""
    num_docs: int
    """Documents (chunks of split documents count once each) in this micro-batch."""
    num_tokens: int
    """Non-padding positions."""
    num_valid_targets: int
    """Positions whose label is not -100: the loss's share of the denominator."""
    doc_keys: tuple[str, ...] = field(default_factory=tuple)
    """Keys of the documents in the order they were laid out."""
    segment_sources: tuple[int, ...] = field(default_factory=tuple)
    """Per segment of `cu_seqlens`: its document's `source`, -1 for a padding segment (host-side, for the
    per-source metrics: `loss_groups`, `source_counts`)."""
    loss_weights: torch.Tensor | None = None
    """(B, L) float weight of each target, aligned with `labels` (set by the step for the loss normalizations
    that weigh targets, trainer.run.step.loss_weights); None: every target weighs 1."""
    loss_groups: torch.Tensor | None = None
    """(B, L) int64 group of each target, aligned with `labels`, -1 for none (set by the step and the eval for
    the per-group token losses: `LossGroups.ids`); None: no per-group sums."""
    num_loss_groups: int = 0
    branches: torch.Tensor | None = None
    """Tree layout only (collate_trees): (B, L) int64, 0 on a tree's trunk (and outside trees), i on its i-th
    branch: a position attends within its document to the trunk and to its own branch."""
    predictors: torch.Tensor | None = None
    """Tree layout only: (B, L) int64, the row position whose logits predict this token, -1 where it is no
    target (a branch's first token is predicted from the trunk's last position, as every other branch's
    is)."""
    plan: RowShare | None = None
    """This rank's share of the rows' positions, planned on the host when the micro-batch is laid out (context
    parallelism: trainer.distributed.context.RowPlan); trainer.model.model_inputs cuts the forward kwargs by
    it. None: the rows are this rank's whole."""

    @property
    def num_allocated(self) -> int:
        """Positions computed, padding included."""
        return self.input_ids.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.input_ids.shape)

    def to_device(self, device: torch.device | str) -> Batch:
        """This batch on `device`, without making the host wait: the one way a batch reaches the device (the
        training step, the eval, and the loss weights with them). Bound for CUDA, tensors not yet pinned are
        pinned first: a non-blocking copy from ordinary (pageable) memory is synchronous, so the host would
        wait for the kernels already queued; from pinned memory it is queued behind them and the host runs on.
        On the CPU nothing is copied. `cu_seqlens` stays int32, counts stay Python ints."""
        device = torch.device(device)

        def move(t: torch.Tensor) -> torch.Tensor:
            if device.type == "cuda" and not t.is_pinned():
                t = t.pin_memory()
            return t.to(device, non_blocking=True)

        return self._map(move)

    def pin_memory(self) -> Batch:
        """The tensors in page-locked host memory (see `to_device`), e.g. in the prefetch thread, ahead of the
        step. Needs CUDA; pin only batches bound for a GPU."""
        return self._map(torch.Tensor.pin_memory)

    def _map(self, fn) -> Batch:
        """A copy with `fn` applied to each tensor; the host-side fields are shared."""
        def maybe(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return replace(self, input_ids=fn(self.input_ids), labels=fn(self.labels),
                       position_ids=fn(self.position_ids), cu_seqlens=fn(self.cu_seqlens),
                       loss_weights=maybe(self.loss_weights), loss_groups=maybe(self.loss_groups),
                       branches=maybe(self.branches), predictors=maybe(self.predictors))


def length_bucket_names(edges: Sequence[int]) -> list[str]:
    """Names of the document-length buckets of `edges`. Example: [64, 256] -> ["<=64", "<=256", ">256"]."""
    return [f"<={e}" for e in edges] + ([f">{edges[-1]}"] if edges else [])


@dataclass(frozen=True)
class LossGroups:
    """The groups whose token losses a run sums, a metric: a target's group is its segment's source x length
    bucket x the bucket of its position in the segment, id = (source * num_buckets + bucket) * num_positions +
    position bucket. Without a mixture, length buckets and position buckets there are none (0 groups: no
    per-group sums at all).

    Example: sources ("code", "prose"), edges (64,) -> 4 groups: 0 code <=64, 1 code >64, 2 prose <=64,
    3 prose >64. Sources () and edges (64,) -> 2 groups, one per bucket (every document is source 0). Edges ()
    and positions (8,) -> 2 groups: the targets at positions 1..8 of their document, and those after.
    """

    edges: tuple[int, ...] = ()
    """logging.length_buckets; () = one bucket."""
    sources: tuple[str, ...] = ()
    """The names of data.sources; () without a mixture."""
    positions: tuple[int, ...] = ()
    """logging.position_buckets: edges of a target's position in its segment (its token's index from the
    segment's first, which is never a target); () = one bucket."""

    @property
    def num_buckets(self) -> int:
        return len(self.edges) + 1

    @property
    def num_sources(self) -> int:
        return max(1, len(self.sources))

    @property
    def num_positions(self) -> int:
        return len(self.positions) + 1

    @property
    def size(self) -> int:
        """G, the number of groups (0: nothing measured)."""
        if not (self.edges or self.sources or self.positions):
            return 0
        return self.num_sources * self.num_buckets * self.num_positions

    def ids(self, batch: Batch) -> torch.Tensor:
        """(B, L) int64: the group of each position: its segment's (its document, or a chunk of a split one,
        as trained: the unit attention isolates) source and length bucket k = the first edge >= the segment's
        length (len(edges) above them all), and the bucket of its index in the segment the same way; -1 on
        padding segments (they hold no target).

        Example: one row [a0 a1 a2 | b0 b1 | pad], sources of a, b = 1, 0, edges (2,), 2 sources ->
        [[3 3 3 0 0 -1]] (a: source 1, bucket >2; b: source 0, bucket <=2). With positions (1,) as well: 8
        groups, [[6 6 7 0 0 -1]] (a0 and a1 at indices 0 and 1 <= 1, a2 at index 2 > 1; b0 and b1 <= 1).
        """
        seg_lens_S = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long().cpu()
        source_S = _segment_sources(batch, self.num_sources)
        # first edge >= length
        bucket_S = torch.bucketize(seg_lens_S, torch.tensor(self.edges, dtype=torch.long))
        group_S = torch.where(source_S >= 0, source_S * self.num_buckets + bucket_S, -1)
        group_N = torch.repeat_interleave(group_S, seg_lens_S)
        if self.positions:
            start_N = torch.repeat_interleave(batch.cu_seqlens[:-1].long().cpu(), seg_lens_S)
            index_N = torch.arange(len(group_N)) - start_N
            position_N = torch.bucketize(index_N, torch.tensor(self.positions, dtype=torch.long))
            group_N = torch.where(group_N >= 0, group_N * self.num_positions + position_N, -1)
        return group_N.view(batch.shape)


NO_GROUPS = LossGroups()
"""No loss groups: the plain loss path, no per-group sums (no mixture, no length buckets)."""


def source_counts(batch: Batch, num_sources: int) -> tuple[list[int], list[int]]:
    """Per source: the tokens (non-padding positions) and the documents (chunks count once each) of `batch`.

    Example: one row [a0 a1 a2 | b0 b1 | pad], sources of a, b = 1, 0, 2 sources -> ([2, 3], [1, 1]).
    """
    seg_lens_S = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long().cpu()
    source_S = _segment_sources(batch, num_sources)
    real_S = source_S >= 0
    tokens = torch.zeros(num_sources, dtype=torch.long).index_add_(0, source_S[real_S], seg_lens_S[real_S])
    return tokens.tolist(), torch.bincount(source_S[real_S], minlength=num_sources).tolist()


def _segment_sources(batch: Batch, num_sources: int) -> torch.Tensor:
    """(S,) int64 `batch.segment_sources`, checked against cu_seqlens and the number of sources."""
    source_S = torch.tensor(batch.segment_sources, dtype=torch.long)
    if len(source_S) != len(batch.cu_seqlens) - 1:
        raise ValueError(f"the batch records the source of {len(source_S)} segment(s) but cu_seqlens has "
                         f"{len(batch.cu_seqlens) - 1}: build batches with collate_rows")
    if len(source_S) and int(source_S.max()) >= num_sources:
        raise ValueError(f"a document of source {int(source_S.max())} in a run of {num_sources} source(s)")
    return source_S


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
    seg_sources: list[int] = []
    loss_mask = None
    keys: list[str] = []
    for r, row in enumerate(rows):
        used = 0
        for doc in row:
            seg_lens.append(len(doc))
            seg_is_pad.append(False)
            seg_sources.append(doc.source)
            used += len(doc)
            keys.append(doc.key)
        if used > row_len:
            raise ValueError(f"row {r} holds {used} tokens, more than row_len={row_len}")
        if used:
            start = r * row_len
            flat_ids[start : start + used] = (np.concatenate([doc.tokens for doc in row]) if len(row) > 1
                                              else row[0].tokens)
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
            seg_sources.append(-1)

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
        segment_sources=tuple(seg_sources),
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


class TokenIdError(UserError, ValueError):
    """A batch holds token ids the model has no embedding for."""


def check_token_ids(batch: Batch, vocab_size: int) -> None:
    """Raise TokenIdError if an id in `batch.input_ids` is negative or >= vocab_size, naming the documents.

    Such ids mean the data was tokenized with another tokenizer than the one the model was built for.
    Unchecked, they fail deep in the embedding (an IndexError on CPU, a device-side assert on CUDA) without
    saying which data is at fault. Call it on the host batch, before `to_device`: one pass over the ids.
    Example: vocab_size 512, id 600 in document "json__decoder" -> "token id 600 is outside the model's
    vocabulary (vocab_size 512) in document 'json__decoder' ...".
    """
    ids_N = batch.input_ids.reshape(-1)
    bad_N = (ids_N < 0) | (ids_N >= vocab_size)
    if not bool(bad_N.any()):
        return
    bad_ids = ids_N[bad_N]
    worst = int(bad_ids.max()) if int(bad_ids.max()) >= vocab_size else int(bad_ids.min())
    positions = torch.nonzero(bad_N).flatten().tolist()
    keys = _segment_keys(batch)
    if keys is None:  # cannot tell documents from padding: name the rows
        kind, where = "rows", sorted({str(p // batch.input_ids.shape[1]) for p in positions}, key=int)
    else:
        segment_of = np.searchsorted(np.asarray(batch.cu_seqlens.tolist()[1:]), positions, side="right")
        names = (repr(keys[s]) if keys[s] is not None else "padding" for s in segment_of)
        kind, where = "document(s)", list(dict.fromkeys(names))
    named = f"{kind} " + ", ".join(where[:5]) + (f" and {len(where) - 5} more" if len(where) > 5 else "")
    fix = f", or raise model.vocab_size to at least {worst + 1}" if worst >= vocab_size else ""
    raise TokenIdError(
        f"token id {worst} is outside the model's vocabulary (vocab_size {vocab_size}) in {named} "
        f"({len(positions)} position(s) of this micro-batch): the data was tokenized with another tokenizer "
        f"than the one the model was built for; train on data prepared with the model's tokenizer "
        f"(python -m trainer.prepare --tokenizer DIR){fix}"
    )


def _segment_keys(batch: Batch) -> list[str | None] | None:
    """The document key of each segment of `cu_seqlens`, None for a row's padding tail; None if ambiguous.

    collate_rows lays out each row as its documents, then one padding segment if room is left: padding
    ends its row, has only -100 labels and repeats one id. A one-token document at the end of a row looks
    the same; then the count of documents disagrees with `doc_keys` and the answer is None.
    Example: rows [[A(3), B(2)], [C(4)]], row_len 5 -> segments [3, 2 | 4, 1] -> ['A', 'B', 'C', None].
    """
    row_len = batch.input_ids.shape[1]
    ids_N, labels_N = batch.input_ids.reshape(-1), batch.labels.reshape(-1)
    is_pad = [
        end % row_len == 0
        and bool((labels_N[start:end] == IGNORE_INDEX).all())
        and bool((ids_N[start:end] == ids_N[start]).all())
        for start, end in itertools.pairwise(batch.cu_seqlens.tolist())
    ]
    if len(is_pad) - sum(is_pad) != len(batch.doc_keys):
        return None
    keys = iter(batch.doc_keys)
    return [None if pad else next(keys) for pad in is_pad]


@dataclass(frozen=True)
class Tree:
    """One item laid out as a tree document (the `tree` scoring layout): its context once, the trunk, then
    each continuation, a branch, attending to the trunk and to itself only, its positions continuing from the
    trunk's end. Scoring only: a branch's first token is predicted from the trunk's last position, so the
    shift is not t - 1 there (Batch.predictors says where each target is predicted from).

    Example, trunk [q0 q1 q2], branches [c0 c1] and [d0], at the start of a row:
        input_ids    = [q0 q1 q2 c0 c1 d0]
        position_ids = [ 0  1  2  3  4  3]
        branches     = [ 0  0  0  1  1  2]
        predictors   = [-1 -1 -1  2  3  2]      c0 and d0 are both predicted by q2's logits
        labels       = [-100 -100 -100 c0 c1 d0]
        attention    q* causal among themselves; c0, c1 see q* and the c before them; d0 sees q* and itself
    """

    key: str
    trunk: np.ndarray
    """(n,) int64 token ids of the shared context."""
    branches: tuple[np.ndarray, ...]
    """Each continuation's token ids (at least one token each)."""

    def __len__(self) -> int:
        return len(self.trunk) + sum(len(b) for b in self.branches)

    def document(self) -> Document:
        """The tree's tokens as one packable document: the trunk, then the branches in order."""
        return Document(key=self.key, tokens=np.concatenate([self.trunk, *self.branches]).astype(np.int64))


def collate_trees(rows: Sequence[Sequence[Tree]], row_len: int, pad_id: int) -> Batch:
    """Lay out `rows` of trees (each row's trees left to right, a padding segment at its tail) as a tree
    batch: each tree one segment of cu_seqlens, with its positions, branch ids, targets (every branch token)
    and the position predicting each (`Tree` shows one); the attention mask follows from cu_seqlens and
    `branches` (trainer.model.attention.TreeSegments)."""
    batch = collate_rows([[tree.document() for tree in row] for row in rows], row_len, pad_id, "packed")
    n = len(rows) * row_len
    # padding's kept
    positions, branches = batch.position_ids.reshape(-1).numpy().copy(), np.zeros(n, dtype=np.int64)
    predictors, labels = np.full(n, -1, dtype=np.int64), np.full(n, IGNORE_INDEX, dtype=np.int64)
    for r, row in enumerate(rows):
        start = 0  # in the row
        for tree in row:
            trunk = len(tree.trunk)
            positions[r * row_len + start:r * row_len + start + trunk] = np.arange(trunk)
            at = start + trunk
            for i, branch in enumerate(tree.branches, start=1):
                span = slice(r * row_len + at, r * row_len + at + len(branch))
                positions[span] = trunk + np.arange(len(branch))
                branches[span] = i
                predictors[span] = np.concatenate([[start + trunk - 1], at + np.arange(len(branch) - 1)])
                labels[span] = branch
                at += len(branch)
            start = at
    shape = batch.input_ids.shape
    targets = int((labels != IGNORE_INDEX).sum())
    return replace(batch, layout="tree", position_ids=torch.from_numpy(positions).view(shape),
                   labels=torch.from_numpy(labels).view(shape),
                   branches=torch.from_numpy(branches).view(shape),
                   predictors=torch.from_numpy(predictors).view(shape), num_valid_targets=targets)
