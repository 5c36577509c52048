"""Documents -> rows -> micro-batches, with one switch for the layout.

Every layout draws its documents from the same place: the online packer's rows. A logical batch is
a number of packer rows; the layout only decides how the documents of those rows are laid out:

    packed    the rows as they are, each padded at its tail to seq_len
    unpacked  one document per row, padded to the longest document of the micro-batch (or to seq_len)
    bucketed  documents sorted by length, grouped, each group padded to its own longest

So `packing=packed` and `packing=unpacked` with the same seed see the same documents in every
optimizer step, with the same targets; only the padding and the speed differ.

Example, seq_len = 8, packer rows [[A(5), B(3)], [C(6), D(2)]], micro_batch_tokens = 16:
    packed    -> one (2, 8) micro-batch: [A B], [C D]                  16 positions, all real
    unpacked  -> (2, 5): [A], [B . .]   then (2, 6): [C], [D . . . .]   (stream order; a group closes
                 when rows x longest would pass 16)                       22 positions, 16 real
    bucketed  -> (2, 6): [C], [A .]     then (2, 3): [B], [D .]           18 positions, 16 real
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from trainer.data.batch import LAYOUTS, Batch, Document, collate_rows, flatten
from trainer.data.packing import LONG_DOC_POLICIES, OnlinePacker, PackingStats, split_long

PAD_TO = ("longest", "seq_len")


@dataclass
class PackingConfig:
    """How documents become rows (the `packing` config group)."""

    layout: str = "packed"
    """'packed' | 'unpacked' | 'bucketed': the one switch of an ablation."""
    buffer_size: int = 1024
    """Documents the online packer holds to choose from; larger packs tighter and reorders more."""
    long_docs: str = "split"
    """Documents longer than seq_len: 'split' into chunks of <= seq_len, 'truncate', or 'drop' (all counted)."""
    reset_positions: bool = True
    """Position ids restart at 0 in every document (False: 0..L-1 per row, the continuous ablation)."""
    pad_to: str = "longest"
    """Unpacked rows are padded to the micro-batch's 'longest' document or to 'seq_len'."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"packing.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.long_docs not in LONG_DOC_POLICIES:
            raise ValueError(f"packing.long_docs must be one of {LONG_DOC_POLICIES}, got {self.long_docs!r}")
        if self.pad_to not in PAD_TO:
            raise ValueError(f"packing.pad_to must be one of {PAD_TO}, got {self.pad_to!r}")


class RowStream:
    """Pulls documents, splits the long ones, packs them online, and hands out rows on demand."""

    def __init__(self, docs: Iterable[Document], seq_len: int, cfg: PackingConfig) -> None:
        self.docs = docs
        self.seq_len = seq_len
        self.cfg = cfg
        self.packer = OnlinePacker(seq_len, cfg.buffer_size)
        self.stats = PackingStats()
        self._ready: deque[list[Document]] = deque()
        self._doc_iter: Iterator[Document] | None = None
        self.exhausted = False

    def take(self, num_rows: int) -> list[list[Document]]:
        """The next `num_rows` rows (fewer only when a finite stream has ended)."""
        if self._doc_iter is None:
            self._doc_iter = iter(self.docs)
        while len(self._ready) < num_rows and not self.exhausted:
            doc = next(self._doc_iter, None)
            if doc is None:
                self.exhausted = True
                self._ready.extend(self.packer.flush())
                break
            for piece in split_long(doc, self.seq_len, self.cfg.long_docs, self.stats):
                self._ready.extend(self.packer.push(piece))
        return [self._ready.popleft() for _ in range(min(num_rows, len(self._ready)))]

    def next_epoch(self) -> None:
        """Continue after the end of a finite (lockstep: one epoch) document stream: iterate it again."""
        self._doc_iter = None
        self.exhausted = False

    def close(self) -> None:
        """Stop reading: closes the document iterator (and with it any DataLoader workers)."""
        if self._doc_iter is not None and hasattr(self._doc_iter, "close"):
            self._doc_iter.close()
        self._doc_iter = None

    def state_dict(self) -> dict:
        docs_state = self.docs.state_dict() if hasattr(self.docs, "state_dict") else None
        return {
            "docs": docs_state,
            "packer": self.packer.state_dict(),
            "ready": [[(d.key, d.tokens, d.loss_mask) for d in row] for row in self._ready],
            "stats": self.stats.state_dict(),
            "exhausted": self.exhausted,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["docs"] is not None:
            self.docs.load_state_dict(state["docs"])
        self.packer.load_state_dict(state["packer"])
        self._ready = deque([[Document(k, t, m) for k, t, m in row] for row in state["ready"]])
        self.stats.load_state_dict(state["stats"])
        self._doc_iter = None
        self.exhausted = state.get("exhausted", False)  # a rank waiting at an epoch end keeps waiting


def micro_batches(
    rows: Sequence[Sequence[Document]],
    cfg: PackingConfig,
    seq_len: int,
    micro_batch_tokens: int,
    pad_id: int,
) -> list[Batch]:
    """Lay out one logical batch (packer rows) as micro-batches of at most `micro_batch_tokens` positions.

    A micro-batch always holds at least one row, so a single document of seq_len fits any budget.
    """
    if not rows:
        return []
    if cfg.layout == "packed":
        per_mb = max(1, micro_batch_tokens // seq_len)
        return [
            collate_rows(rows[i : i + per_mb], seq_len, pad_id, "packed", cfg.reset_positions)
            for i in range(0, len(rows), per_mb)
        ]
    docs = flatten(rows)
    if cfg.layout == "bucketed":
        docs = sorted(docs, key=len, reverse=True)  # stable: equal lengths keep stream order
    fixed = seq_len if (cfg.layout == "unpacked" and cfg.pad_to == "seq_len") else None
    return [
        collate_rows([[d] for d in group], fixed or max(map(len, group)), pad_id, cfg.layout, cfg.reset_positions)
        for group in _group_by_budget(docs, micro_batch_tokens, fixed)
    ]


def _group_by_budget(docs: list[Document], budget: int, fixed_len: int | None) -> list[list[Document]]:
    """Consecutive groups whose padded size (rows x longest, or rows x fixed_len) stays within `budget`.

    Example, budget 12, lengths [5, 3, 6, 2] -> [[5, 3], [6, 2]] (3 x 6 = 18 > 12 closes the first group).
    """
    groups: list[list[Document]] = []
    current: list[Document] = []
    longest = 0
    for doc in docs:
        longest_if_added = fixed_len or max(longest, len(doc))
        if current and (len(current) + 1) * longest_if_added > budget:
            groups.append(current)
            current, longest_if_added = [], fixed_len or len(doc)
        current.append(doc)
        longest = longest_if_added
    if current:
        groups.append(current)
    return groups
