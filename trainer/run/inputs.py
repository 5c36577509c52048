"""The inputs of each optimizer step: this rank's data stream, and the micro-batches it lays out per step.

`build_data` assembles the stream from the run's config (trainer.data.feed: shards -> documents -> packed
rows); `StepInputs` draws a step's rows (agreed with the other ranks at an epoch's end:
trainer.data.epochs.StepRows), lays them out as micro-batches for the configured layout, checks the token ids
on the host, plans this rank's share of their positions under context parallelism (Batch.plan), and pins them
when bound for a GPU, in the prefetch thread when data.prefetch draws the next step's rows while the current
one computes.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from trainer.config import RunConfig
from trainer.data.feed import (
    Batch,
    DataSource,
    RowPrefetcher,
    StepRows,
    check_deal,
    check_token_ids,
    deal_rows,
    drawn_rows,
    imbalance_of,
    micro_batches,
)
from trainer.data.feed import build_data as build_data_source
from trainer.distributed.context import with_row_plans
from trainer.distributed.groups import DistInfo, dist_sum, gather_objects


def build_data(cfg: RunConfig, info: DistInfo) -> DataSource:
    """This rank's data source for the run `cfg` (trainer.data.feed.build_data): the stream of its data rank
    (the ranks of a context-parallel group read one stream, each holding a share of its rows' positions)."""
    return build_data_source(cfg.data, cfg.packing, cfg.train.seq_len, cfg.seed, info.data_rank,
                             info.data_world)


def rows_for_rank(rows_per_step: int, info: DistInfo) -> int:
    """This data rank's share of the logical batch. Example: 10 rows over 4 data ranks -> 3, 3, 2, 2."""
    return rows_per_step // info.data_world + (info.data_rank < rows_per_step % info.data_world)


class RowDealer:
    """data.balance=rows: the rows every data rank drew for a step, dealt over the data group by modeled work
    (trainer.data.deal.deal_rows; `cost(row)`: the row's model FLOPs, trainer.run.flops). Every rank computes
    the same deal from the same costs (the ranks of a context or tensor group, which drew the same rows, too),
    and keeps as many rows as it drew. Collective over the data group: an all-gather of the rows' costs, then,
    if the deal moves any, one of the rows that leave their rank (the rows that stay never cross the network).

    The data stream's state is what each rank read, not what it trained: a checkpoint holds each rank's read
    position, and a resume deals the same drawn rows the same way."""

    def __init__(self, cost: Callable[[list], float], info: DistInfo, deal: Callable = deal_rows) -> None:
        """`deal(costs, counts)`: the rule (trainer.data.deal.deal_rows); whatever it returns is checked
        (check_deal: every row once, each rank its count) before any row moves."""
        self.cost, self.info, self.rule = cost, info, deal
        self.drawn_imbalance: float | None = None
        """The last step's modeled imbalance (max / mean - 1 over the data ranks) of the rows as drawn."""

    def deal(self, rows: list) -> list:
        """This rank's rows of the step after the deal (its heaviest first; as drawn if the deal is no
        better)."""
        shares = gather_objects([self.cost(row) for row in rows], self.info.data_group)
        counts, costs = [len(share) for share in shares], [c for share in shares for c in share]
        drawn, dealt = drawn_rows(counts), self.rule(costs, counts)
        check_deal(dealt, counts)
        self.drawn_imbalance = imbalance_of(costs, drawn)
        # LPT is a heuristic: never worse than as drawn
        if imbalance_of(costs, dealt) >= self.drawn_imbalance:
            return rows
        rank = self.info.data_rank
        mine = dict(zip(drawn[rank], rows, strict=True))  # {index in the step: row}
        staying = set(dealt[rank])
        for moved in gather_objects({i: row for i, row in mine.items() if i not in staying},
                                    self.info.data_group):
            mine.update(moved)
        return [mine[i] for i in dealt[rank]]


class StepInputs:
    """This rank's micro-batches of each optimizer step (see the module docstring)."""

    def __init__(self, data: DataSource, cfg: RunConfig, info: DistInfo, vocab_size: int,
                 cost: Callable[[list], float] | None = None) -> None:
        self.data = data
        self.cfg = cfg
        self.info = info
        self.vocab_size = vocab_size
        """The model's embedding rows: every token id must be below it."""
        self.rows_per_rank = rows_for_rank(cfg.train.rows_per_step, info)
        # The agreement at an epoch's end is among the data ranks (over the ranks of this context rank: each
        # context rank's column agrees alike, on the same streams).
        self.rows = StepRows(data.rows, info.data_world, cfg.train.rows_per_step, cfg.data.epoch_lockstep,
                             lambda values: dist_sum(values, info.device, info.data_group))
        self.dealer = RowDealer(cost, info) if cfg.data.balance == "rows" and info.data_world > 1 else None
        """data.balance=rows over several data ranks (`cost`: a row's modeled work); None: each rank its own
        rows."""

    def next(self, prefetch_next: bool) -> tuple[list, list[Batch], float]:
        """(this step's rows, its micro-batches, seconds spent waiting for them). Collective (the lockstep
        all-reduces). prefetch_next: start drawing the next step's rows in the background (data.prefetch)."""
        t0 = time.perf_counter()
        rows = self.rows.take(self.rows_per_rank)
        if self.dealer is not None:  # other rows than drawn: laid out below, never in the background
            rows = self.dealer.deal(rows)
        prefetcher = self.data.rows if isinstance(self.data.rows, RowPrefetcher) else None
        mbs = prefetcher.prepared(rows) if prefetcher else None  # laid out in the background with the rows
        if mbs is None:
            mbs = self.lay_out(rows)
        if prefetcher and prefetch_next:  # drawn while this step computes
            prefetcher.prefetch(self.rows_per_rank, self.lay_out if self.dealer is None else None)
        return rows, mbs, time.perf_counter() - t0

    def lay_out(self, rows: list) -> list[Batch]:
        """A step's rows as micro-batches, checked, and pinned when bound for CUDA (in the prefetch thread,
        when the rows were drawn there)."""
        cfg = self.cfg
        mbs = micro_batches(rows, cfg.packing, cfg.train.seq_len, cfg.train.micro_batch_tokens,
                            self.data.pad_id)
        for mb in mbs:  # on the host, before any kernel can index out of range
            check_token_ids(mb, self.vocab_size)
        if self.info.context is not None:  # this rank's positions, planned here on the host (Batch.plan)
            mbs = with_row_plans(mbs, self.info.context, cfg.attention.isolate_documents)
        if self.info.device.type == "cuda":
            # this rank's GPU, also in the prefetch thread (not GPU 0's)
            with torch.cuda.device(self.info.device):
                mbs = [mb.pin_memory() for mb in mbs]  # Batch.to_device then copies without waiting
        return mbs
