"""Host-to-device copies of batches: pinned and non-blocking on CUDA, plain on CPU,
the same values either way."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from trainer.data.batch import Document, collate_rows


def batch():
    rows = [[Document("a", np.arange(5)), Document("b", np.arange(3))], [Document("c", np.arange(7))]]
    return collate_rows(rows, 8, 0, "packed")


def test_to_device_on_cpu_copies_nothing_and_pins_nothing():
    host = batch()
    moved = host.to_device(torch.device("cpu"))
    assert moved.input_ids.data_ptr() == host.input_ids.data_ptr()  # .to(cpu) is a no-op
    assert (moved.max_seqlen, moved.doc_keys, moved.cu_seqlens.dtype) == (host.max_seqlen, host.doc_keys,
                                                                          torch.int32)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batches_bound_for_cuda_are_pinned_and_arrive_intact():
    host = batch()
    pinned = host.pin_memory()
    assert all(t.is_pinned()
               for t in (pinned.input_ids, pinned.labels, pinned.position_ids, pinned.cu_seqlens))
    assert not host.input_ids.is_pinned()  # a copy: the host batch is left as it was
    moved = replace(host, loss_weights=torch.rand(host.shape)).to_device(torch.device("cuda"))
    torch.cuda.synchronize()
    assert moved.loss_weights.device.type == "cuda"  # the loss weights travel with the batch
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens"):
        got, want = getattr(moved, name), getattr(host, name)
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
    assert moved.max_seqlen == host.max_seqlen and moved.cu_seqlens.dtype == torch.int32


def test_loss_weights_travel_with_the_batch_into_the_model_inputs():
    from trainer.model import model_inputs

    host = batch()
    assert "loss_weights" not in model_inputs(host)
    weights = torch.rand(host.shape)
    moved = replace(host, loss_weights=weights).to_device(torch.device("cpu"))
    assert (model_inputs(moved)["loss_weights"] is moved.loss_weights
            and torch.equal(moved.loss_weights, weights))
