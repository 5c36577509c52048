"""Shared setup for the model tests."""

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine OpenMP threads that wait
    for each other make each small matmul ~10x slower. Restored after each module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
