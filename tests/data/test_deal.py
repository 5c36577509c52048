"""trainer.data.deal: a step's rows dealt over the data ranks by modeled work (data.balance=rows)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from trainer.data.batch import Document
from trainer.data.deal import check_deal, deal_rows, drawn_rows, imbalance_of
from trainer.distributed.groups import DistInfo
from trainer.run.inputs import RowDealer


def test_hand_checked_deals():
    assert deal_rows([9, 8, 1, 1], [2, 2]) == [[0, 3], [1, 2]]  # drawn 17 / 2, dealt 10 / 9
    assert deal_rows([9, 1, 1, 1, 8, 2], [3, 3]) == [[0, 1, 2], [4, 5, 3]]
    assert deal_rows([5, 4, 3, 3, 2, 1], [4, 2]) == [[0, 3, 4, 5], [1, 2]]  # uneven counts kept: 11 / 7
    assert deal_rows([], [0, 0]) == [[], []]
    assert imbalance_of([9, 8, 1, 1], drawn_rows([2, 2])) == pytest.approx(17 / 9.5 - 1)
    assert imbalance_of([9, 8, 1, 1], [[0, 3], [1, 2]]) == pytest.approx(10 / 9.5 - 1)
    with pytest.raises(ValueError, match="3 rows cannot fill ranks of \\[2, 2\\] rows"):
        deal_rows([1, 2, 3], [2, 2])


@given(st.lists(st.integers(0, 4), min_size=1, max_size=8).flatmap(
    lambda counts: st.tuples(st.just(counts), st.lists(st.floats(0, 1e6), min_size=sum(counts),
                                                       max_size=sum(counts)))))
def test_every_row_once_each_rank_its_count_heaviest_first_and_the_same_deal_every_time(case):
    counts, costs = case
    dealt = deal_rows(costs, counts)
    assert sorted(i for rows in dealt for i in rows) == list(range(len(costs)))  # no row twice, none lost
    assert [len(rows) for rows in dealt] == counts
    assert all([costs[i] for i in rows] == sorted((costs[i] for i in rows), reverse=True) for rows in dealt)
    assert deal_rows(list(costs), list(counts)) == dealt  # every rank computes the same deal


@given(st.lists(st.floats(1, 1e6), min_size=8, max_size=64))
def test_with_equal_counts_no_two_ranks_differ_by_more_than_the_heaviest_row(costs):
    """Rows in falling cost, each to the least-loaded rank with room: a rank that fills early holds rows at
    least as heavy as every later one, so the spread stays within one row's cost."""
    ranks = 4
    counts = [len(costs) // ranks + (r < len(costs) % ranks) for r in range(ranks)]
    dealt = deal_rows(costs, counts)
    work = [sum(costs[i] for i in rows) for rows in dealt]
    assert max(work) - min(work) <= max(costs) * 1.000001 + 1e-9


def test_a_wrong_deal_is_refused_before_any_row_moves():
    """A deal that gives a rank a row twice (and so another to no rank), or changes a rank's row count, would
    change the step's objective: RowDealer checks every deal (check_deal) and stops with what is wrong."""
    import numpy as np

    rows = [[Document(key=f"r{i}", tokens=np.arange(n))] for i, n in enumerate([5, 3, 2])]
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    cost = lambda row: sum(len(d) ** 2 for d in row)  # noqa: E731
    assert RowDealer(cost, info).deal(rows) == rows  # one rank: the deal is the draw
    for wrong, message in (([[0, 0, 2]], "row 0 dealt 2 times, row 1 to no rank"),
                           ([[0, 1]], "row 2 to no rank, rank 0 holds 2 rows, drew 3"),
                           ([[0, 1, 7]], "names row 7 of a step of 3 rows")):
        with pytest.raises(RuntimeError, match=message):
            RowDealer(cost, info, deal=lambda costs, counts, wrong=wrong: wrong).deal(rows)
    check_deal(deal_rows([3.0, 2.0, 1.0], [2, 1]), [2, 1])  # the rule's own deals pass
