"""tests.harness.run_distributed: a rank that fails while another waits in one of the trainer's collectives
(trainer.distributed.groups.dist_sum) fails the call with the failing rank's traceback within the timeout,
instead of hanging the suite."""

from __future__ import annotations

import time

import pytest
import torch

from tests.harness import run_distributed
from trainer.distributed.groups import dist_sum


def _one_rank_fails(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("rank 1 gave up")
    total = 0.0
    for _ in range(3):  # rank 0 waits for a partner that never comes
        total += dist_sum([1.0], torch.device("cpu"))[0]
    return int(total)


def test_a_rank_that_fails_while_another_waits_is_reported_within_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)still running after 10 s.*ValueError: rank 1 gave up"):
        run_distributed(_one_rank_fails, 2, timeout_s=10)
    assert time.monotonic() - t0 < 60
