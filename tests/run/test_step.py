"""The step's objective on real gloo ranks: sum of token losses / global valid targets, however split.

Same logical batches, different splits (ranks with uneven token counts, gradient accumulation,
layouts) must end with the same parameters. SGD with momentum makes the parameters a direct function
of the gradients (Adam's normalization would hide a wrong scale: it is invariant to it).
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tests.harness import run_distributed
from tests.helpers import MODEL, PAD, SEQ_LEN, assert_same_params, make_steps, split
from trainer.config import NORMALIZATIONS
from trainer.data.batch import Document
from trainer.data.config import PackingConfig
from trainer.data.packing import OnlinePacker
from trainer.data.pipeline import micro_batches
from trainer.distributed.config import DistributedConfig
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo, init_distributed
from trainer.model import AttentionConfig, build_model
from trainer.run.inputs import RowDealer
from trainer.run.step import ComputeClock, train_step


def train(rank: int, world_size: int, shares: list[list[list[Document]]], layout: str, mb_tokens: int,
          normalization: str = "global_tokens", balance: bool = False, engine: str = "ddp",
          straggle: float = 0.0) -> dict:
    """Run one optimizer step per logical batch; `shares[step][rank]` are this rank's documents (packed into
    rows, then, with `balance`, the step's rows dealt over the ranks by modeled work:
    trainer.run.inputs.RowDealer). `straggle`: rank 1's first block sleeps that long in every forward (a slow
    rank); each step's ComputeClock reading is returned under "clock"."""
    torch.manual_seed(0)
    info = (init_distributed(DistributedConfig(device="cpu")) if world_size > 1
            else DistInfo(0, 1, 0, torch.device("cpu")))
    model = build_model(MODEL, AttentionConfig(backend="sdpa_docs"))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    engine = parallelize(model, opt, sched, info, DistributedConfig(device="cpu", engine=engine),
                         grad_clip=0.0, dtype="fp32")
    cfg = PackingConfig(layout=layout)
    first = {}  # the first step's gradients (whole), as the optimizer is about to apply them

    def keep_first(*_):
        if not first:
            first.update({n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                          for n, p in model.named_parameters()})
    opt.register_step_pre_hook(keep_first)
    clock = ComputeClock(model, info.device)
    if straggle and rank == 1:
        model.blocks[0].register_forward_pre_hook(lambda *_: time.sleep(straggle))
    losses, counts, dealt, clocked = [], [], [], []
    dealer = RowDealer(lambda row: sum(len(d) ** 2 for d in row), info) if balance else None
    for step_docs in shares:
        rows = list(OnlinePacker(SEQ_LEN, buffer_size=8).pack(step_docs[rank]))
        if dealer is not None:
            rows = dealer.deal(rows)
            dealt.append(([d.key for row in rows for d in row], dealer.drawn_imbalance))
        mbs = micro_batches(rows, cfg, SEQ_LEN, mb_tokens, PAD)
        stats = train_step(engine, mbs, info, PAD, normalization, clock=clock)
        clocked.append(clock.read())
        losses.append(stats.loss)
        counts.append(stats.valid_tokens)
    whole = {k: v.full_tensor() if hasattr(v, "full_tensor") else v  # FSDP2
             for k, v in model.state_dict().items()}
    return {"params": {k: v.detach().clone() for k, v in whole.items()}, "losses": losses,
            "valid": counts, "dealt": dealt, "clock": clocked, "first": first}


@pytest.fixture(scope="module")
def steps():
    return make_steps()


@pytest.fixture(scope="module")
def one_rank(steps):
    return train(0, 1, split(steps, [1.0]), "packed", mb_tokens=2 * SEQ_LEN)


SCENARIOS = {  # name: (fractions of each step's documents for rank 0 and rank 1, layout, micro-batch tokens)
    "uneven_packed": ([0.25, 0.75], "packed", 2 * SEQ_LEN),
    "rank1_empty": ([1.0, 0.0], "packed", 2 * SEQ_LEN),
    "unpacked": ([0.6, 0.4], "unpacked", 3 * SEQ_LEN),
    "document_mean": ([0.25, 0.75], "packed", 2 * SEQ_LEN),
}


def train_scenarios(rank: int, world_size: int, steps) -> dict:
    """All two-rank scenarios in one spawn of the process group (spawning costs seconds per rank)."""
    out = {name: train(rank, world_size, split(steps, fr), layout, mb,
                       normalization=name if name in NORMALIZATIONS else "global_tokens",
                       straggle=0.2 if name == "uneven_packed" else 0.0)
           for name, (fr, layout, mb) in SCENARIOS.items()}
    out["balanced"] = train(rank, world_size, split(steps, [0.25, 0.75]), "packed", 2 * SEQ_LEN, balance=True)
    out["balanced_unpacked"] = train(rank, world_size, split(steps, [0.25, 0.75]), "unpacked", 3 * SEQ_LEN,
                                     balance=True)
    out["balanced_fsdp2"] = train(rank, world_size, split(steps, [0.25, 0.75]), "packed", 2 * SEQ_LEN,
                                  balance=True, engine="fsdp2")
    return out


@pytest.fixture(scope="module")
def two_ranks(steps):
    return run_distributed(train_scenarios, 2, args=(steps,))


def test_two_uneven_ranks_equal_one_rank(steps, one_rank, two_ranks):
    shares = split(steps, SCENARIOS["uneven_packed"][0])
    tokens = [[sum(map(len, s[r])) for s in shares] for r in range(2)]
    assert all(t1 > 2 * t0 for t0, t1 in zip(*tokens, strict=True))  # rank 1 holds > 2x the tokens of rank 0
    for r in two_ranks:
        result = r["uneven_packed"]
        assert_same_params(result["params"], one_rank["params"])
        np.testing.assert_allclose(result["losses"], one_rank["losses"], rtol=1e-6)
        assert result["valid"] == one_rank["valid"]


def test_the_clock_measures_a_slow_rank_and_the_faster_ones_wait(two_ranks):
    """ComputeClock (dp_compute_imbalance, dp_wait_s; issue 55): rank 1 of "uneven_packed" sleeps 0.2 s in its
    first block's forward, every step. Its measured compute holds the sleep; rank 0 waits for it at the
    gradient all-reduce, after its own backward, for most of that time; rank 1 itself barely waits."""
    fast, slow = (r["uneven_packed"]["clock"] for r in two_ranks)
    for (fast_compute, fast_wait), (slow_compute, slow_wait) in zip(fast, slow, strict=True):
        assert slow_compute >= 0.2
        assert fast_wait >= 0.15 and fast_wait > 3 * slow_wait, (fast, slow)
        assert fast_compute + fast_wait >= 0.2  # rank 0's step lasted as long as the slow rank's compute


def test_a_rank_without_documents_still_joins_the_step(one_rank, two_ranks):
    for r in two_ranks:
        assert_same_params(r["rank1_empty"]["params"], one_rank["params"])


def test_two_ranks_unpacked_equal_one_rank_packed(one_rank, two_ranks):
    assert_same_params(two_ranks[1]["unpacked"]["params"], one_rank["params"])


def test_gradient_accumulation_one_vs_many_micro_batches(steps):
    one = train(0, 1, split(steps, [1.0]), "packed", mb_tokens=64 * SEQ_LEN)
    many = train(0, 1, split(steps, [1.0]), "packed", mb_tokens=SEQ_LEN)
    assert_same_params(one["params"], many["params"])


@pytest.mark.parametrize("layout", ["unpacked", "bucketed"])
def test_layouts_end_with_the_same_parameters(steps, one_rank, layout):
    other = train(0, 1, split(steps, [1.0]), layout, mb_tokens=2 * SEQ_LEN)
    assert other["valid"] == one_rank["valid"]
    np.testing.assert_allclose(other["losses"], one_rank["losses"], rtol=1e-6)
    assert_same_params(other["params"], one_rank["params"])


def test_document_mean_over_two_uneven_ranks_equals_one_rank(steps, two_ranks):
    """The document count of the denominator is global too: no rank averages over its own documents."""
    one = train(0, 1, split(steps, [1.0]), "unpacked", mb_tokens=SEQ_LEN, normalization="document_mean")
    for r in two_ranks:
        np.testing.assert_allclose(r["document_mean"]["losses"], one["losses"], rtol=1e-6)
        assert_same_params(r["document_mean"]["params"], one["params"])


def test_rows_dealt_by_work_train_the_same_step_as_one_rank_and_plain_pytorch(steps, one_rank, two_ranks):
    """data.balance=rows (issue 55): the rows the two uneven ranks drew are re-dealt by modeled work (here sum
    s^2: rows moved, the drawn imbalance shrunk), under DDP and FSDP2, and unpacked (the same packer rows
    dealt, then each document laid out as its own row); the losses, valid targets and final weights are the
    one-rank run's, and step 0's loss and every gradient are each document alone in plain PyTorch, summed,
    over the step's targets (1e-6; the gradients to 1e-6 of each tensor's largest entry)."""
    from tests.helpers import plain_document_loss

    ranks = [r["balanced"] for r in two_ranks]
    for r in ranks + [r[arm] for r in two_ranks for arm in ("balanced_fsdp2", "balanced_unpacked")]:
        np.testing.assert_allclose(r["losses"], one_rank["losses"], rtol=1e-6)
        assert r["valid"] == one_rank["valid"]
        assert_same_params(r["params"], one_rank["params"])
    for s, step_docs in enumerate(steps):  # every document of the step trained once, on one rank
        keys = ranks[0]["dealt"][s][0] + ranks[1]["dealt"][s][0]
        assert sorted(keys) == sorted(d.key for d in step_docs)
    drawn = [split(steps, [0.25, 0.75])[s][1] for s in range(len(steps))]
    # rows moved
    assert any(set(ranks[1]["dealt"][s][0]) != {d.key for d in drawn[s]} for s in range(len(steps)))
    torch.manual_seed(0)
    params = dict(build_model(MODEL, AttentionConfig(backend="sdpa_docs")).named_parameters())
    targets = sum(len(d) - 1 for d in steps[0])
    loss = sum(plain_document_loss(params, MODEL, torch.as_tensor(d.tokens)) for d in steps[0]) / targets
    assert abs(loss.item() - ranks[0]["losses"][0]) <= 1e-6 * abs(loss.item())
    loss.backward()
    for r in ranks + [r["balanced_fsdp2"] for r in two_ranks]:
        for name, p in params.items():
            assert (r["first"][name] - p.grad).abs().max().item() <= 1e-6 * p.grad.abs().max().item(), name
