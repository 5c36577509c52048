"""Context parallelism (trainer/distributed/context.py): one packed row split over the ranks of a group gives
the loss and EVERY parameter's gradient of the whole row on one rank, on real gloo process groups, for both
strategies.

The rows are laid out by the trainer's own collate_rows (positions reset per document, -100 at each document
start, EOS kept as a target, a padding tail), with a document longer than a chunk, documents crossing every
chunk boundary and single-token documents. Three references: the model on one rank (CP = 1), and, sharing no
code with the model's attention or loss, a plain-PyTorch forward written here (each document alone through the
same weights, softmax attention with an explicit causal mask, cross entropy of each next token).
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.helpers import plain_document_loss
from trainer.data.batch import IGNORE_INDEX, Document, collate_rows
from trainer.distributed.context import ContextGroup, with_row_plans, zigzag_positions
from trainer.model import AttentionConfig, GPTConfig, build_model, model_inputs

VOCAB, L = 61, 32
ROWS = [[20, 1, 1, 10], [5, 3, 7, 9]]  # row 1 ends in a padding tail of 8
"""Document lengths per row: at CP = 4 the chunks are 4 positions long, so the 20-token document spans five
chunks and every chunk boundary of row 0 cuts a document; two documents of one token."""


def make_batch(layout: str = "packed", rows=ROWS, seed: int = 0, change: tuple[int, int] | None = None):
    """A batch of the trainer's collate_rows; `change` = (document number, token index): that token
    altered."""
    rng = np.random.default_rng(seed)
    docs, number = [], 0
    for row in rows:
        docs.append([])
        for n in row:
            tokens = rng.integers(4, VOCAB, size=n)
            tokens[-1] = 1  # EOS, kept as a target
            if change is not None and change[0] == number:
                tokens[change[1]] = (tokens[change[1]] + 7) % VOCAB
            docs[-1].append(Document(key=f"d{number}", tokens=tokens))
            number += 1
    if layout != "packed":
        docs = [[d] for row in docs for d in row]
    return collate_rows(docs, L, 0, layout)


LLAMA = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", mlp_hidden=48, bias=False, n_kv_head=1,
             tie_embeddings=False)
"""pos_emb="llama" in the cases: the Llama family with ONE kv head, fewer than the CP degree (replicated per
query head before attention, so ulysses splits 4 heads over 4 ranks)."""


def model(pos_emb: str = "learned", isolate: bool = True, backend: str = "sdpa_docs"):
    torch.manual_seed(0)
    shape = LLAMA if pos_emb == "llama" else dict(pos_emb=pos_emb)
    cfg = GPTConfig(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32, max_seq_len=L, **shape)
    return build_model(cfg, AttentionConfig(backend=backend, isolate_documents=isolate))


def grads(m) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in m.named_parameters()}


def whole(m, batch) -> tuple[float, int, dict]:
    """CP = 1: the model on one rank."""
    m.zero_grad()
    out = m(**model_inputs(batch))
    out.loss_sum.backward()
    return out.loss_sum.item(), int(out.num_targets), grads(m)


def reference_loss(m, batch) -> torch.Tensor:
    """The summed next-token cross entropy of every document, each alone, through the weights of `m` in plain
    PyTorch: no packing, no cu_seqlens, no trainer attention or loss code
    (tests.helpers.plain_document_loss)."""
    total = torch.zeros(())
    params = dict(m.named_parameters())
    for b, lengths in enumerate(ROWS):
        ids = batch.input_ids[b]
        bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        for a, e in zip(bounds, bounds[1:], strict=False):
            total = total + plain_document_loss(params, m.cfg, ids[a:e])
    return total


def _cp_rank(rank, world, size, strategy, layout, pos_emb, isolate, backend, change=None, split="zigzag"):
    """One rank of DP = world / size x CP = size: its group's batch (seed = its data rank), its share,
    summed."""
    dp_rank = rank // size
    groups = [dist.new_group(list(range(g * size, (g + 1) * size))) for g in range(world // size)]
    cp = ContextGroup(groups[dp_rank], size, rank % size, strategy, split)
    m = model(pos_emb, isolate, backend)
    batch = make_batch(layout, seed=dp_rank, change=change)
    inputs = model_inputs(with_row_plans([batch], cp, isolate_documents=isolate)[0])
    out = m(**inputs, return_logits=True)
    out.loss_sum.backward()
    loss = out.loss_sum.detach().clone()
    count = out.num_targets.clone()
    dist.all_reduce(loss)
    dist.all_reduce(count)
    g = grads(m)
    for t in g.values():
        dist.all_reduce(t)
    return loss.item(), int(count), g, out.logits.detach(), inputs["attention_context"].local


def reference_sums(world, size, layout, pos_emb, isolate, backend):
    """CP = 1 over the same data ranks: loss, targets and gradients summed over their batches."""
    m = model(pos_emb, isolate, backend)
    m.zero_grad()
    loss, count = 0.0, 0
    for dp_rank in range(world // size):
        out = m(**model_inputs(make_batch(layout, seed=dp_rank)))
        out.loss_sum.backward()
        loss, count = loss + out.loss_sum.item(), count + int(out.num_targets)
    return loss, count, grads(m)


CASES = [  # (world, CP size, strategy, layout, pos_emb, split)
    (2, 2, "allgather", "packed", "learned", "zigzag"),
    (2, 2, "allgather", "packed", "learned", "balanced"),
    (4, 4, "allgather", "packed", "rope", "zigzag"),
    (4, 4, "ulysses", "packed", "rope", "balanced"),
    (4, 2, "allgather", "packed", "learned", "balanced"),  # DP 2 x CP 2
    (2, 2, "allgather", "unpacked", "learned", "balanced"),
    (2, 2, "ulysses", "bucketed", "learned", "zigzag"),
    (2, 2, "allgather", "packed", "llama", "balanced"),
    (4, 4, "ulysses", "packed", "llama", "zigzag"),
    (2, 2, "allgather", "packed", "learned", "documents"),  # issue 55: short documents whole
    (4, 4, "allgather", "packed", "rope", "documents"),
    (4, 2, "allgather", "packed", "learned", "documents"),  # DP 2 x CP 2
    (2, 2, "ulysses", "packed", "llama", "documents"),
]


PLAIN = [("allgather", "zigzag"), ("ulysses", "zigzag"), ("allgather", "documents")]
"""(strategy, split) of the comparisons with the plain-PyTorch reference (packed, learned positions,
CP = 2)."""
PROBES = [("allgather", "balanced"), ("ulysses", "zigzag"), ("allgather", "documents")]
"""(strategy, split) of the leakage probe."""


def _all_runs(rank, world, cases, plain, probes):
    """Every run of one world size in one spawn (a spawn costs seconds; each run makes its own groups)."""
    out = {("case", c): _cp_rank(rank, world, *c[1:5], True, "sdpa_docs", None, c[5]) for c in cases}
    for strategy, split in plain:
        out[("plain", strategy, split)] = _cp_rank(rank, world, 2, strategy, "packed", "learned", True,
                                                   "sdpa_docs", None, split)
    for strategy, split in probes:
        for isolate in (True, False):
            for change in (None, (0, 3)):
                run = _cp_rank(rank, world, 2, strategy, "packed", "learned", isolate, "sdpa_docs", change,
                               split)
                out[("probe", strategy, split, isolate, change)] = run[3:]
    return out


@pytest.fixture(scope="module")
def cp_runs() -> dict[int, list[dict]]:
    return {2: run_distributed(_all_runs, 2, ([c for c in CASES if c[0] == 2], PLAIN, PROBES)),
            4: run_distributed(_all_runs, 4, ([c for c in CASES if c[0] == 4], [], []))}


@pytest.mark.parametrize("world, size, strategy, layout, pos_emb, split", CASES)
def test_loss_and_every_gradient_equal_cp1(cp_runs, world, size, strategy, layout, pos_emb, split):
    results = [r[("case", (world, size, strategy, layout, pos_emb, split))] for r in cp_runs[world]]
    ref_loss, ref_count, ref_grads = reference_sums(world, size, layout, pos_emb, True, "sdpa_docs")
    for loss, count, g, _, _ in results:
        assert count == ref_count  # every target counted once over the group
        assert abs(loss - ref_loss) <= 1e-6 * max(1.0, abs(ref_loss)), (loss, ref_loss)
        for name, ref in ref_grads.items():
            # fp32 sums in another order: within 1e-6 of the tensor's scale (an element-wise rtol fails on a
            # small element of a large gradient: c_proj.bias of 26 off by 3e-6 on some CPUs' kernels)
            err, scale = (g[name] - ref).abs().max().item(), max(1.0, ref.abs().max().item())
            assert err <= 1e-6 * scale, f"{name}: {err:.3g} off (scale {scale:.3g})"


def test_the_cp1_model_equals_the_plain_pytorch_reference():
    """The CP = 1 side of the comparisons above against code that shares nothing with the model's attention
    and loss: loss and every gradient."""
    m = model()
    batch = make_batch()
    loss, count, g = whole(m, batch)
    ref_model = model()
    ref = reference_loss(ref_model, batch)
    ref.backward()
    assert abs(loss - ref.item()) <= 1e-6 * abs(ref.item()), (loss, ref.item())  # fp32 sums: relative
    assert count == int((batch.labels[:, 1:] != IGNORE_INDEX).sum())
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(g[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy, split", PLAIN)
def test_cp_equals_the_plain_pytorch_reference(cp_runs, strategy, split):
    loss, count, g, _, _ = cp_runs[2][0][("plain", strategy, split)]
    ref_model = model()
    ref = reference_loss(ref_model, make_batch())
    ref.backward()
    assert abs(loss - ref.item()) <= 1e-6 * abs(ref.item()), (loss, ref.item())  # fp32 sums: relative
    for name, p in ref_model.named_parameters():
        torch.testing.assert_close(g[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("strategy, split", PROBES)
def test_no_logit_of_another_document_changes_on_any_rank(cp_runs, strategy, split):
    """Leakage probe: one token of document 0 changed; on every rank, every logit of every other document is
    unchanged (and with document isolation off, some do change: the probe can see leakage)."""
    def logits_by_position(isolate, change):
        full = torch.zeros(2 * L, VOCAB)
        for r in cp_runs[2]:
            logits, local = r[("probe", strategy, split, isolate, change)]
            full[torch.as_tensor(local)] = logits.reshape(-1, VOCAB)
        return full

    doc0 = torch.zeros(2 * L, dtype=torch.bool)
    doc0[:20] = True
    for isolate in (True, False):
        before, after = logits_by_position(isolate, None), logits_by_position(isolate, (0, 3))
        changed = (before - after).abs().amax(-1) > 1e-6
        assert changed[:20].any()  # the changed document itself sees it
        if isolate:
            assert not changed[~doc0].any(), changed.nonzero().flatten().tolist()
        else:
            assert changed[20:L].any()  # row 0's later documents read document 0


def test_the_balanced_split_deals_chunks_by_work_with_equal_positions_per_rank():
    """row_positions('balanced'): every rank as many positions, every position once, and on rows of many
    documents a smaller work imbalance than zigzag's (here the test's rows at N = 2 and 4, and one long
    document: even)."""
    from trainer.data.deal import imbalance
    from trainer.distributed.context import rank_pairs, row_positions

    batch = make_batch()
    cu = batch.cu_seqlens.numpy().astype(np.int64)
    for size in (2, 4):
        positions = row_positions(cu, 2, L, size, "balanced")
        assert positions.shape == (size, 2, L // size)
        for b in range(2):
            assert sorted(positions[:, b].reshape(-1).tolist()) == list(range(L))
        assert imbalance(rank_pairs(cu, 2, L, size, "balanced")) < imbalance(
            rank_pairs(cu, 2, L, size, "zigzag"))
    assert rank_pairs(np.array([0, 12, 16]), 1, 16, 2, "balanced") == [44.0, 44.0]  # the docstring's example
    assert rank_pairs(np.array([0, 12, 16]), 1, 16, 2, "zigzag") == [20.0, 68.0]
    with pytest.raises(ValueError, match="cannot be cut into 16 equal chunks"):
        row_positions(cu, 2, 24, 2, "balanced")


def test_zigzag_gives_each_rank_a_cheap_and_a_dear_chunk():
    assert zigzag_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert sorted(np.concatenate([zigzag_positions(24, 3, r) for r in range(3)]).tolist()) == list(range(24))
    with pytest.raises(ValueError, match="cannot be cut into 2 x 3"):
        zigzag_positions(20, 3, 0)


# ---------------------------------------------------------------------------------------------------
# The trainer: real runs of `python -m trainer.train` under torchrun
# ---------------------------------------------------------------------------------------------------

LONG = ["experiment=long_context_cpu", "model=tiny", "train.max_steps=6", "train.checkpoint_every=3",
        "train.tokens_per_step=2048", "train.micro_batch_tokens=1024", "data.num_workers=0",
        "data.shuffle_buffer=64", "logging.progress=false", "logging.wandb.mode=disabled"]


def long_run(run_dir, data, *overrides, launcher=None):
    import os
    import subprocess
    import sys

    from tests.helpers import ROOT

    cmd = (launcher or [sys.executable, "-m"]) + ["trainer.train", f"data.path={data}",
                                                  f"hydra.run.dir={run_dir}", *LONG, *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def assert_same_losses(a, b, steps):
    from tests.helpers import metrics

    ma, mb = {m["step"]: m for m in metrics(a)}, {m["step"]: m for m in metrics(b)}
    assert sorted(mb) == list(steps)
    for step in steps:
        assert (ma[step]["valid_tokens"] == mb[step]["valid_tokens"]
                and ma[step]["docs"] == mb[step]["docs"]), step
        assert abs(ma[step]["loss"] - mb[step]["loss"]) <= 1e-6, (step, ma[step]["loss"], mb[step]["loss"])


def test_experiment_long_context_under_torchrun_equals_cp1_and_resumes_across_cp_sizes(demo_data, tmp_path):
    """experiment=long_context_cpu (rows of 1,024 over 2 ranks) under torchrun: every step's loss, valid
    tokens and documents equal the CP = 1 run's; its step-3 checkpoint resumed at CP = 1, and CP = 1's resumed
    at CP = 2 (ulysses), continue with the uninterrupted run's losses. (A resume at CP = 4 takes the same
    path, data rank 0's stream on every rank of the group; it was run here until the suite's time needed its
    ~25 s.)"""
    import shutil

    from tests.helpers import torchrun
    from trainer.checkpoint import store

    ref, cp2 = tmp_path / "cp1", tmp_path / "cp2"
    long_run(ref, demo_data, "distributed.context_parallel=1")
    out = long_run(cp2, demo_data, launcher=torchrun()).stdout
    assert_same_losses(ref, cp2, range(1, 7))
    for src, dest, extra, launcher in ((cp2, "cp2_to_1", ["distributed.context_parallel=1"], None),
                                       (ref, "cp1_to_2", ["distributed.context_parallel_strategy=ulysses"],
                                        torchrun())):
        # resumed from step 3: steps 4-6 are set aside, then redone
        resumed = shutil.copytree(src, tmp_path / dest)
        long_run(resumed, demo_data, *extra, f"train.resume={store.checkpoint_dir(resumed, 3)}",
                 launcher=launcher)
        assert_same_losses(ref, resumed, range(1, 7))
    assert "run dir:" in out
    from tests.helpers import metrics

    logged = [m["cp_imbalance"] for m in metrics(cp2) if "cp_imbalance" in m]
    assert logged and all(0.0 <= x < 1.0 for x in logged)  # the work of rank 0's group, max / mean - 1
    assert all("cp_imbalance" not in m for m in metrics(ref))


def test_deepspeed_with_cp_equals_ddp_with_cp_and_a_cp_checkpoint_resumes_on_more_data_ranks(demo_data,
                                                                                             tmp_path):
    """DeepSpeed ZeRO-2 at CP = 2 trains the same losses as DDP at CP = 2 (and so as CP = 1; ZeRO-3's
    gathering is the same with or without CP, and a sharded engine under CP is proven in-process for FSDP2 at
    DP 2 x CP 2, tests/distributed/test_fsdp.py). A CP = 2 checkpoint (one data rank) resumed on 2 data ranks
    at CP = 1: the stream's rest of the epoch is dealt over them (trainer.data.reshape), the run goes on to
    its last step."""
    import shutil

    from tests.harness import require_module
    from tests.helpers import metrics, torchrun
    from trainer.checkpoint import store

    require_module("deepspeed", "pip install -e '.[deepspeed]'")
    ddp, ds = tmp_path / "ddp", tmp_path / "ds"
    long_run(ddp, demo_data, "train.max_steps=4", launcher=torchrun())
    long_run(ds, demo_data, "train.max_steps=4", "distributed=deepspeed_zero2",
             "distributed.context_parallel=2", launcher=torchrun())
    assert_same_losses(ddp, ds, range(1, 5))
    wider = shutil.copytree(ddp, tmp_path / "wider")
    out = long_run(wider, demo_data, "train.max_steps=6", "distributed.context_parallel=1",
                   f"train.resume={store.checkpoint_dir(wider, 3)}", launcher=torchrun()).stdout
    assert "resume on another shape: written by 1 rank(s)" in out and "resumed on 2 x 0" in out, out
    assert [m["step"] for m in metrics(wider)] == list(range(1, 7))


def test_rank_work_counts_the_pairs_of_each_ranks_queries_and_zigzag_evens_one_long_document():
    """rank_pairs against a count written here (each query at p of a document from s sees p - s + 1 keys); a
    row that is one document is split exactly evenly by zigzag, a contiguous split is not (rank 1 of 2 has 3x
    the pairs of rank 0)."""
    from trainer.data.deal import imbalance
    from trainer.distributed.context import query_pairs, rank_pairs

    cu = np.array([0, 5, 6, 16])  # documents of 5, 1, 10 positions in one row of 16
    expected = []
    for r in range(2):
        total = 0
        for p in zigzag_positions(16, 2, r):
            s = max(c for c in cu[:-1] if c <= p)
            total += p - s + 1
        expected.append(float(total))
    assert rank_pairs(cu, 1, 16, 2) == expected
    one = np.array([0, 64])
    assert imbalance(rank_pairs(one, 1, 64, 4)) == 0.0
    contiguous = [query_pairs(one, np.arange(0, 32)), query_pairs(one, np.arange(32, 64))]
    assert contiguous[1] / contiguous[0] == pytest.approx((32 * 33 / 2 + 32 * 32) / (32 * 33 / 2))
    assert imbalance([10.0, 12.0]) == pytest.approx(12 / 11 - 1)


def test_the_documents_split_keeps_short_documents_whole_and_exchanges_only_split_ones():
    """distributed.context_parallel_split=documents (issue 55): every position once, as many per rank; a
    document longer than a rank's share (16) zigzagged over every rank, the short ones whole but for the few
    split to fill a rank's last room; and each rank receives only the split documents' keys and values: on 16
    rows of 64 positions holding one document of 20 and short ones, CP = 4, under half of what the all-gather
    of whole rows moves."""
    from trainer.distributed.context import ContextShard, document_positions

    assert document_positions(np.array([0, 3, 6, 7, 8]), 8, 2).tolist() == [[0, 1, 2, 6], [3, 4, 5, 7]]
    assert document_positions(np.array([0, 8]), 8, 2).tolist() == [[0, 1, 6, 7], [2, 3, 4, 5]]  # zigzag's
    lengths = [[20, 5, 6, 3, 4, 6, 8, 7, 5], [7, 20, 2, 9, 3, 8, 8, 1, 6]] * 8
    cu = np.concatenate([[0], np.cumsum([n for row in lengths for n in row])])
    size, seq_len = 4, 64
    shards = {split: ContextShard(ContextGroup(None, size, 0, "allgather", split), torch.as_tensor(cu), 16,
                                  seq_len)
              for split in ("balanced", "documents")}
    positions = shards["documents"].positions
    for b, row in enumerate(lengths):
        assert sorted(positions[:, b].reshape(-1).tolist()) == list(range(seq_len))
        starts = np.concatenate([[0], np.cumsum(row)])
        holders = [len({r for r in range(size) if np.isin(np.arange(s, e), positions[r, b]).any()})
                   for s, e in itertools.pairwise(starts)]
        # the long one over every rank
        assert [h for h, n in zip(holders, row, strict=True) if n > 16] == [size]
        assert sum(h > 1 for h, n in zip(holders, row, strict=True) if n <= 16) <= size - 1, holders
    ratio = shards["documents"].received_rows() / shards["balanced"].received_rows()
    assert ratio <= 0.5, ratio
