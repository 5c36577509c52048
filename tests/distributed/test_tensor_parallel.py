"""Tensor parallelism (trainer/distributed/tensor.py) on real gloo groups: the same losses, gradient norms,
every parameter's gradient (gathered) and optimizer state as one rank, to 1e-6, for TP = 2, DP 2 x TP 2 and
TP 2 x CP 2, through the real engine and step (parallelize + train_step, SGD with momentum, gradient clipping
on).

The one-rank reference is the unsplit model on every data rank's micro-batches (the union), in this process.
Two models: GPT-2 with a vocabulary of 61 (odd: padded to 62 over two ranks, the padding must stay out of the
softmax) and rows of 31 positions (the sequence shards padded too); Llama with 4 heads and 2 kv heads, SwiGLU,
an untied head. A vocabulary-parallel loss that gathered and averaged logits (Megatron-LM#7452's loss +
log N), or that let the padding column into the softmax, fails the loss comparison;
`test_vocab_parallel_cross_entropy` checks that function alone against F.cross_entropy, with a plain-PyTorch
logsumexp written here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import in_worlds, run_distributed
from trainer.data.batch import IGNORE_INDEX, Document, collate_rows
from trainer.distributed.config import DistributedConfig
from trainer.distributed.context import with_row_plans
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo, init_distributed
from trainer.distributed.tensor import Layout, layouts, padded_vocab, tensor_parallel_problems
from trainer.model import AttentionConfig, GPTConfig, build_model
from trainer.run.step import train_step

GPT2 = dict(vocab_size=61, n_layer=2, n_head=4, n_embd=32, max_seq_len=32)
LLAMA = dict(vocab_size=64, n_layer=2, n_head=4, n_kv_head=2, n_embd=32, max_seq_len=32, pos_emb="rope",
             norm="rmsnorm", mlp="swiglu", mlp_hidden=48, bias=False, tie_embeddings=False)
MODELS = {"gpt2": (GPT2, 31), "llama": (LLAMA, 32)}
"""name -> (model shape, row length)."""
STEPS = 2
CPU = torch.device("cpu")


def batches(name: str, step: int, data_rank: int) -> list:
    """Two packed micro-batches of documents (EOS = 1 kept as a target), different per step and data rank."""
    shape, L = MODELS[name]
    rng = np.random.default_rng(100 * step + data_rank)
    out = []
    for lengths in ([12, 1, 9, 9], [20, 5, 3]):  # the second ends in a padding tail
        docs = []
        for i, n in enumerate(lengths):
            tokens = rng.integers(2, shape["vocab_size"], size=n)
            tokens[-1] = 1
            docs.append(Document(key=f"s{step}r{data_rank}d{i}", tokens=tokens))
        out.append(collate_rows([docs], L, 0, "packed"))
    return out


def build(name: str, chunk: int = 0):
    torch.manual_seed(0)
    model = build_model(GPTConfig(**MODELS[name][0]), AttentionConfig(backend="sdpa_docs"),
                        loss_chunk_tokens=chunk)
    with torch.no_grad():  # no weight left at its init: the norms and biases too
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    # SGD with momentum: the weights a direct function of the gradients (Adam's m / sqrt(v) turns rounding in
    # a near-zero gradient into a whole step), and a state tensor per parameter (its momentum) to gather and
    # split.
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    return model, opt, sched


def train(name: str, info: DistInfo, cfg: DistributedConfig, data_ranks: list[int],
          resume: dict | str | None = None, first: int = 0, save: str | None = None, chunk: int = 0,
          compile: bool = False) -> dict:
    """Steps `first`..STEPS - 1 on the micro-batches of `data_ranks`; per step the loss, the norm and the
    gathered gradients; a replicated engine's (whole) state after each step. `resume`: a whole state to load,
    or the DCP directory of a sharded engine's; `save`: where a sharded engine writes its shards after step 0;
    `chunk`: loss.chunk_tokens; `compile`: train.compile (parallelize compiles the split blocks)."""
    from torch.distributed.tensor import DTensor

    model, opt, sched = build(name, chunk)
    engine = parallelize(model, opt, sched, info, cfg, grad_clip=0.5, dtype="fp32", compile=compile)
    if isinstance(resume, str):
        engine.load_shards(Path(resume))
    elif resume is not None:
        engine.load_state_dict(resume)
    grads: list[dict] = []
    apply = engine.apply_gradients

    def recording_apply():  # the gradients the update uses: reduced, clipped, gathered whole
        g = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        g = {n: v.full_tensor() if isinstance(v, DTensor) else v for n, v in g.items()}
        grads.append(engine.tensor.full_state(g))
        apply()

    engine.apply_gradients = recording_apply
    out = {"loss": [], "norm": [], "grads": grads, "state": []}
    for step in range(first, STEPS):
        mbs = [mb for d in data_ranks for mb in batches(name, step, d)]
        if info.context is not None:  # this rank's positions of each row (as trainer.run.inputs plans them)
            mbs = with_row_plans(mbs, info.context)
        stats = train_step(engine, mbs, info, 0)
        out["loss"].append(stats.loss)
        out["norm"].append(stats.grad_norm)
        out["valid"] = stats.valid_tokens
        if engine.shard_format is not None:
            if save is not None and step == 0:
                engine.save_shards(Path(save))
        else:
            out["state"].append(copied(engine.state_dict()))  # a replicated engine's are the live tensors
    out["weights"] = engine.full_weights()
    return out


def copied(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: copied(v) for k, v in x.items()}
    if isinstance(x, list):
        return [copied(v) for v in x]
    return x


def _rank(rank, world, name, tp, cp, resume=None, first=0, engine="ddp", save=None, chunk=0, compile=False):
    cfg = DistributedConfig(device="cpu", engine=engine, tensor_parallel=tp, context_parallel=cp)
    info = init_distributed(cfg)
    # a whole state, mapped as the store maps engine.pt under TP
    if resume is not None and resume.endswith(".pt"):
        from trainer.checkpoint.safe_io import load_state

        resume = load_state(resume, map_location="cpu", mmap=True)
    out = train(name, info, cfg, [info.data_rank], resume, first, save, chunk, compile)
    out["dims"] = (info.data_rank, info.dims.context_rank, info.dims.tensor_rank)
    return out


def one_rank(name: str, data_world: int, resume=None, first=0) -> dict:
    return train(name, DistInfo(0, 1, 0, CPU), DistributedConfig(device="cpu"), list(range(data_world)),
                 resume, first)


def _meta_rank(rank, world, name, engine, tp):
    """The weights at step 0 of a model built on the meta device and materialized by parallelize, gathered."""
    cfg = DistributedConfig(device="cpu", engine=engine, tensor_parallel=tp)
    info = init_distributed(cfg)
    torch.manual_seed(0)
    model = build_model(GPTConfig(**MODELS[name][0]), AttentionConfig(backend="sdpa_docs"), meta=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = parallelize(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
                         info, cfg, 0.0, "fp32")
    assert not any(p.is_meta for p in model.parameters())
    assert ({id(p) for group in opt.param_groups for p in group["params"]}
            == {id(p) for p in model.parameters()})
    # the RNG where a one-rank build leaves it
    return {"weights": engine.full_weights(), "after": torch.rand(4)}


def candidates():
    from trainer.tasks.scoring import Candidate

    rng = np.random.default_rng(7)
    return [Candidate(tuple(rng.integers(2, 61, size=q).tolist()),
                      tuple(rng.integers(2, 61, size=c).tolist()))
            for q, c in ((5, 3), (9, 1), (2, 7), (12, 4), (3, 3), (7, 6))]


def shared_queries():
    """Candidates that share their queries, as an item's choices do (the tree layout's trunks)."""
    from trainer.tasks.scoring import Candidate

    cands = candidates()
    return cands + [Candidate(cands[3].query, choice.choice) for choice in cands[:3]]


def _score_rank(rank, world):
    """Task scoring (trainer.tasks.scoring.score, as train.eval_tasks runs it) on a model split over 2 tensor
    ranks."""
    from trainer.tasks.scoring import score

    cfg = DistributedConfig(device="cpu", tensor_parallel=2)
    info = init_distributed(cfg)
    torch.manual_seed(0)
    model = build_model(GPTConfig(**GPT2), AttentionConfig(backend="sdpa_docs"), meta=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    parallelize(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0), info, cfg, 0.0, "fp32")
    out = {}
    for layout in ("packed", "tree"):
        got = score(model, shared_queries(), layout, 0, 64, "cpu", info)
        out[layout] = got.loglikelihoods, got.greedy
    return out


META = [("gpt2", "ddp", 1, 1), ("llama", "ddp", 2, 2), ("gpt2", "ddp", 2, 2), ("llama", "fsdp2", 1, 2),
        ("gpt2", "fsdp2", 1, 2), ("llama", "ddp", 2, 4), ("gpt2", "fsdp2", 2, 4)]
"""(model, engine, tensor_parallel, world) of the meta-device builds."""


def phases() -> list:
    return [
        (2, _rank, ("gpt2", 2, 1)),
        (2, _rank, ("llama", 2, 1)),
        (4, _rank, ("gpt2", 2, 1)),   # DP 2 x TP 2
        (4, _rank, ("llama", 2, 2)),  # TP 2 x CP 2
        *((world, _meta_rank, (name, engine, tp)) for name, engine, tp, world in META),
        (2, _score_rank, ()),
    ]


FSDP = {  # FSDP2 x TP: (world, tp, resume, first, save) of the phases after `phases()`'s, in order
    "DP 2 x TP 2": (4, 2, None, 0, "fsdp-tp2"),       # trained, step 0 saved
    "TP 2 -> TP 1": (2, 1, "fsdp-tp2", 1, None),      # that checkpoint resumed, no tensor parallelism
    "DP 2": (2, 1, None, 0, "fsdp-tp1"),              # trained without TP, step 0 saved
    "TP 1 -> TP 2": (4, 2, "fsdp-tp1", 1, None),      # resumed split over two tensor ranks
}
TP1_TO_DP2_TP2 = len(phases()) + len(FSDP)
"""The phase resuming the one-rank DDP run's state (whole tensors, engine.pt's) on DP 2 x TP 2."""
CHUNKED = ("gpt2", "llama")
"""TP 2 with loss.chunk_tokens=7 (chunks that do not divide the rows; GPT-2's padded vocabulary), after the
rest."""
ONE_RANK_STEP0 = "one-rank-step0.pt"
"""The one-rank run's state after step 0 (gpt2, two data ranks' micro-batches), written by the `spawned`
fixture."""


def all_phases(root: str) -> list:
    fsdp = [(world, _rank, ("gpt2", tp, 1, resume and f"{root}/{resume}", first, "fsdp2",
                            save and f"{root}/{save}"))
            for world, tp, resume, first, save in FSDP.values()]
    chunked = [(2, _rank, (name, 2, 1, None, 0, "ddp", None, 7)) for name in CHUNKED]
    compiled = (2, _rank, ("llama", 2, 1, None, 0, "ddp", None, 0, True))
    fsdp_cp = (4, _rank, ("llama", 2, 2, None, 0, "fsdp2"))  # FSDP2 over the context group x TP 2
    return [*phases(), *fsdp, (4, _rank, ("gpt2", 2, 1, f"{root}/{ONE_RANK_STEP0}", 1)), *chunked, compiled,
            fsdp_cp]


def _spawned(rank, world, root):
    return in_worlds(rank, world, root, all_phases(root))


@pytest.fixture(scope="module")
def spawned(tmp_path_factory, references):
    root = tmp_path_factory.mktemp("tp")
    torch.save(references[("gpt2", 2)]["state"][0], root / ONE_RANK_STEP0)
    ranks = run_distributed(_spawned, world_size=4, args=(str(root),))
    return [[r[i] for r in ranks if i in r] for i in range(len(all_phases(str(root))))] + [root]


@pytest.fixture(scope="module")
def references():
    return {(name, d): one_rank(name, d) for name in MODELS for d in (1, 2)}


def assert_close(got: dict, want: dict, what: str, tol: float = 1e-6) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        if isinstance(want[k], torch.Tensor):
            assert got[k].shape == want[k].shape, f"{what}: {k}"
            err = (got[k] - want[k]).abs().max().item()
            scale = max(1.0, want[k].abs().max().item())
            assert err <= tol * scale, f"{what}: {k} differs by {err:.3g}"
        elif isinstance(want[k], dict):
            assert_close(got[k], want[k], f"{what}.{k}", tol)
        else:
            assert got[k] == want[k], f"{what}: {k}"


def assert_same_steps(ranks: list[dict], want: dict, what: str, first: int = 0) -> None:
    """Every rank's losses, gradient norms and gathered gradients of steps `first`.. == the reference run's,
    1e-6."""
    for rank, got in enumerate(ranks):
        np.testing.assert_allclose(got["loss"], want["loss"][first:], rtol=1e-6, atol=0,
                                   err_msg=f"{what} {rank}")
        np.testing.assert_allclose(got["norm"], want["norm"][first:], rtol=1e-6, atol=0,
                                   err_msg=f"{what} {rank}")
        assert len(got["grads"]) == STEPS - first, what
        for step, g in enumerate(got["grads"], start=first):
            assert_close(g, want["grads"][step], f"{what} rank {rank} step {step} gradients")


CASES = [(0, "gpt2", 1, "TP 2"), (1, "llama", 1, "TP 2"), (2, "gpt2", 2, "DP 2 x TP 2"),
         (3, "llama", 1, "TP 2 x CP 2")]


@pytest.mark.parametrize("phase,name,data_world,what", CASES, ids=[f"{c[1]}-{c[3]}" for c in CASES])
def test_same_step_as_one_rank(spawned, references, phase, name, data_world, what):
    want = references[(name, data_world)]
    for rank, got in enumerate(spawned[phase]):
        np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-6, atol=0,
                                   err_msg=f"{what} rank {rank} loss")
        np.testing.assert_allclose(got["norm"], want["norm"], rtol=1e-6, atol=0,
                                   err_msg=f"{what} rank {rank} norm")
        assert got["valid"] == want["valid"]
        for step in range(STEPS):
            assert_close(got["grads"][step], want["grads"][step], f"{what} rank {rank} step {step} gradients")
            if rank > 0:  # the state is gathered onto rank 0, which writes checkpoints, alone
                assert got["state"][step] == {}
                continue
            assert_close(got["state"][step]["model"], want["state"][step]["model"],
                         f"{what} rank {rank} weights")
            assert_close(got["state"][step]["optimizer"]["state"], want["state"][step]["optimizer"]["state"],
                         f"{what} rank {rank} optimizer state")
    assert_close(spawned[phase][0]["weights"], want["weights"], f"{what} full_weights")
    assert all(r["weights"] == {} for r in spawned[phase][1:])  # rank 0's alone, as every engine


def test_layout_of_the_world(spawned):
    """rank = (data_rank x context + context rank) x tensor + tensor rank: the tensor group innermost."""
    assert [r["dims"] for r in spawned[2]] == [(0, 0, 0), (0, 0, 1), (1, 0, 0), (1, 0, 1)]  # DP 2 x TP 2
    assert [r["dims"] for r in spawned[3]] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]  # TP 2 x CP 2


def test_resume_across_tensor_sizes(spawned, references):
    """TP 2 -> TP 1: the TP 2 run's state after step 0 (whole tensors) resumes on one rank with the
    uninterrupted run's loss; TP 1 -> TP 2 is the DP 2 x TP 2 phase's twin below."""
    want = references[("llama", 1)]
    saved = spawned[1][0]["state"][0]
    resumed = one_rank("llama", 1, resume=saved, first=1)
    np.testing.assert_allclose(resumed["loss"], want["loss"][1:], rtol=1e-6, atol=0)
    assert_close(resumed["state"][0]["model"], want["state"][1]["model"], "TP2 -> TP1 weights")


def test_vocab_parallel_cross_entropy():
    """The loss on vocabulary shards == F.cross_entropy of the whole logits, and == logsumexp - target logit
    written here; the padding column takes no probability; gradients too."""
    got = run_distributed(_vocab_ce, world_size=2)
    torch.manual_seed(1)
    logits = torch.randn(7, 61, dtype=torch.float64).float().requires_grad_()
    targets = torch.tensor([0, 60, 30, 31, IGNORE_INDEX, 5, 59])
    want = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="none")
    plain = torch.where(targets != IGNORE_INDEX,
                        logits.logsumexp(-1) - logits.gather(1, targets.clamp(min=0)[:, None]).squeeze(1),
                        0.0)
    (want * torch.arange(1.0, 8.0)).sum().backward()
    for ce, grad in got:
        torch.testing.assert_close(ce, want.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ce, plain.detach(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(grad, logits.grad, rtol=1e-6, atol=1e-6)


def _vocab_ce(rank, world):
    from trainer.distributed.tensor import VocabShard

    torch.manual_seed(1)
    logits = torch.randn(7, 61, dtype=torch.float64).float()
    targets = torch.tensor([0, 60, 30, 31, IGNORE_INDEX, 5, 59])
    vp = padded_vocab(61, world)
    shard = Layout(1, (vp,), vp).shard(logits, world, rank).requires_grad_()
    ce = VocabShard(None, rank * vp // world, 61).cross_entropy(shard, targets)
    (ce * torch.arange(1.0, 8.0)).sum().backward()
    full_grad = [torch.empty_like(shard.grad) for _ in range(world)]
    torch.distributed.all_gather(full_grad, shard.grad)
    return ce.detach(), Layout(1, (vp,), vp).join(full_grad, 61)


def test_layouts_split_each_part_of_the_fused_projections():
    """c_attn = q | k | v and c_fc = gate | up: a rank holds its slice of each part, and join undoes shard."""
    cfg = GPTConfig(**LLAMA)
    lay = layouts(cfg, 2)["blocks.0.attn.c_attn.weight"]
    assert lay.parts == (32, 16, 16)
    rows = torch.arange(64.0)[:, None]
    assert lay.shard(rows, 2, 0).squeeze(1).tolist() == [*range(0, 16), *range(32, 40), *range(48, 56)]
    assert layouts(cfg, 2)["blocks.0.mlp.c_fc.weight"].parts == (48, 48)
    for name, lay in layouts(GPTConfig(**GPT2), 2).items():
        full = torch.randn(61 if name in ("wte.weight", "lm_head.weight") else sum(lay.parts), 3)
        if lay.dim == 1:
            full = full.T.contiguous()
        joined = lay.join([lay.shard(full, 2, r) for r in range(2)], full.shape[lay.dim])
        assert torch.equal(joined, full), name


@pytest.mark.parametrize("shape,size,needle", [
    (dict(GPT2, mlp_hidden=48), 3, "model.n_head (4) must be a multiple of 3"),
    (LLAMA, 4, "key/value heads (model.n_kv_head: 2) must be a multiple of 4"),
    (dict(LLAMA, mlp_hidden=50, n_kv_head=4), 4, "MLP width (model.mlp_hidden: 50) must be a multiple of 4"),
])
def test_shapes_that_do_not_split(shape, size, needle):
    problems = tensor_parallel_problems(GPTConfig(**shape), size)
    assert len(problems) == 1 and needle in problems[0]


def test_a_real_tensor_parallel_run_is_the_one_rank_run(checkpoint, demo_data, tmp_path):
    """`torchrun --nproc_per_node=2 -m trainer.train distributed.tensor_parallel=2`: the session's one-rank
    run (tests/conftest.py `checkpoint`: 3 steps, eval on) again, with each layer split over two ranks: the
    same losses and val loss, and its model.safetensors (gathered whole, the padding dropped) the one-rank
    run's weights; its step-2 checkpoint resumes on one rank with the one-rank run's step 3."""
    from safetensors.torch import load_file

    from tests.helpers import CHECKPOINT_SEQ_LEN, latest_checkpoint, metrics, run_train, torchrun
    from trainer.checkpoint import store
    from trainer.checkpoint.weights import load_weights

    tp2, tp1 = tmp_path / "tp2", tmp_path / "tp1"
    common = ("train.max_steps=3", f"train.seq_len={CHECKPOINT_SEQ_LEN}")
    run_train(tp2, demo_data, *common, "train.checkpoint_every=2", "distributed.tensor_parallel=2",
              launcher=torchrun(2))
    got, want = metrics(tp2), metrics(checkpoint.parent.parent)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for key in ("loss", "val_loss", "valid_tokens"):
        assert [m.get(key) is None for m in got] == [m.get(key) is None for m in want], key
        values = [(g[key], w[key]) for g, w in zip(got, want, strict=True) if w.get(key) is not None]
        assert values and all(g == pytest.approx(w, rel=1e-6) for g, w in values), (key, values)
    a, b = (load_file(latest_checkpoint(tp2) / "model.safetensors"),
            load_file(checkpoint / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in b:
        assert a[k].shape == b[k].shape and (a[k] - b[k]).abs().max() < 1e-5, k
    # Step 2's checkpoint, not the run's last: no model.safetensors (train.save_weights=end), its whole
    # weights in engine.pt; resumed on ONE rank (TP 2 -> TP 1, data stream included), step 3 is the
    # uninterrupted run's.
    mid = store.checkpoint_dir(tp2, 2)
    assert not (mid / store.WEIGHTS_FILE).exists() and load_weights(mid).keys() == b.keys()
    run_train(tp1, demo_data, *common, f"train.resume={mid}")
    assert [m["step"] for m in metrics(tp1)] == [3]
    assert metrics(tp1)[0]["loss"] == pytest.approx(want[2]["loss"], rel=1e-6)


@pytest.mark.parametrize("i", range(len(META)), ids=["-".join(map(str, m)) for m in META])
def test_a_meta_build_has_the_one_rank_weights_bit_for_bit(spawned, i):
    """Weights never built whole: built on the meta device, split (TP) or sharded (FSDP2), then each rank
    draws its part: the same seed gives the CPU build's weights exactly (torch.equal), and leaves the RNG
    where it would."""
    name, engine, tp, world = META[i]
    torch.manual_seed(0)
    want = build_model(GPTConfig(**MODELS[name][0]), AttentionConfig(backend="sdpa_docs")).state_dict()
    after = torch.rand(4)
    got = spawned[4 + i]
    assert got[0]["weights"].keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[0]["weights"][k], v), k
    assert all(torch.equal(r["after"], after) for r in got)


def test_task_scoring_on_a_split_model_is_the_one_rank_scoring(spawned):
    """train.eval_tasks under tensor parallelism: the tensor group scores the same rows together, the logits
    gathered over the vocabulary shards; every choice's log-likelihood and greedy match == the one-rank
    model's, packed and in the tree layout (issue 57)."""
    from trainer.tasks.scoring import score

    torch.manual_seed(0)
    model = build_model(GPTConfig(**GPT2), AttentionConfig(backend="sdpa_docs"))
    want = score(model, shared_queries(), "packed", 0, 64, "cpu")
    for ranks in spawned[4 + len(META)]:
        for lls, greedy in ranks.values():
            np.testing.assert_allclose(lls, want.loglikelihoods, rtol=1e-6)
            assert greedy == want.greedy


def _step_docs(name: str, step: int, data_rank: int) -> list[torch.Tensor]:
    """The documents `batches` packs, as token tensors (the same draws)."""
    shape, _ = MODELS[name]
    rng = np.random.default_rng(100 * step + data_rank)
    out = []
    for lengths in ([12, 1, 9, 9], [20, 5, 3]):
        for n in lengths:
            tokens = rng.integers(2, shape["vocab_size"], size=n)
            tokens[-1] = 1
            out.append(torch.as_tensor(tokens))
    return out


@pytest.mark.parametrize("phase,data_world", [(0, 1), (2, 2)], ids=["TP 2", "DP 2 x TP 2"])
def test_the_split_step_is_plain_pytorch_s(spawned, phase, data_world):
    """Against code that shares nothing with the trainer's model, loss or split: each document alone through
    the starting weights in plain PyTorch (tests.helpers.plain_document_loss: explicit causal softmax,
    F.cross_entropy), summed over the step's documents of every data rank and divided by their targets. The TP
    ranks' first loss, gradient norm and (clipped) gradients are that, to 1e-6."""
    from tests.helpers import plain_document_loss

    model, _, _ = build("gpt2")  # the same starting weights as every run of the test
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    docs = [d for r in range(data_world) for d in _step_docs("gpt2", 0, r)]
    targets = sum(len(d) - 1 for d in docs)
    loss = sum(plain_document_loss(params, model.cfg, d) for d in docs) / targets
    grads = dict(zip(params, torch.autograd.grad(loss, list(params.values())), strict=True))
    norm = torch.sqrt(sum(g.double().pow(2).sum() for g in grads.values())).item()
    scale = min(1.0, 0.5 / (norm + 1e-6))  # grad_clip=0.5, as torch's clip_grad_norm_
    for rank, got in enumerate(spawned[phase]):
        assert got["loss"][0] == pytest.approx(loss.item(), rel=1e-6), rank
        assert got["norm"][0] == pytest.approx(norm, rel=1e-6), rank
        assert_close(got["grads"][0], {n: g * scale for n, g in grads.items()}, f"rank {rank} gradients")


@pytest.mark.parametrize("i,what", list(enumerate(FSDP)), ids=list(FSDP))
def test_fsdp2_with_tensor_parallel_is_ddp(spawned, references, i, what):
    """FSDP2 x TP: each rank's tensor-parallel shards sharded again over the fsdp group (data x context).
    Losses, gradient norms and every gradient (gathered over both) == the one-rank run on the union of the
    data ranks' micro-batches (the DDP reference), to 1e-6, and the weights after the last step. The DCP
    checkpoint holds the whole tensors (their rows over every rank), so it resumes across tensor sizes both
    ways, with the uninterrupted run's later losses."""
    world, tp, resume, first, save = FSDP[what]
    want = references[("gpt2", 2)]
    assert_same_steps(spawned[len(phases()) + i], want, what, first)
    assert all(got["weights"] == {} for got in spawned[len(phases()) + i][1:])
    assert_close(spawned[len(phases()) + i][0]["weights"], want["weights"], f"{what} full_weights")


def test_an_fsdp2_tensor_parallel_checkpoint_holds_the_one_rank_weights(spawned, references):
    """The DCP checkpoint FSDP2 x TP 2 wrote after step 0, read whole on one process without a group
    (trainer.distributed.fsdp.read_dcp_weights, as export and init_from read it): the one-rank run's weights
    after step 0, the vocabulary padding dropped."""
    from trainer.distributed.fsdp import read_dcp_weights

    want = references[("gpt2", 2)]["state"][0]["model"]
    got = read_dcp_weights(spawned[-1] / "fsdp-tp2", {k: tuple(v.shape) for k, v in want.items()})
    assert_close(got, want, "read_dcp_weights")


def test_resume_from_one_rank_on_data_2_x_tensor_2(spawned, references):
    """TP 1 -> DP 2 x TP 2: the one-rank run's state after step 0 (whole tensors, as engine.pt holds them)
    loaded on four ranks, each keeping its shards: step 1's loss and gradients are the uninterrupted run's."""
    want = references[("gpt2", 2)]
    for rank, got in enumerate(spawned[TP1_TO_DP2_TP2]):
        np.testing.assert_allclose(got["loss"], want["loss"][1:], rtol=1e-6, atol=0, err_msg=f"rank {rank}")
        assert_close(got["grads"][0], want["grads"][1], f"rank {rank} step 1 gradients")
    assert_close(spawned[TP1_TO_DP2_TP2][0]["state"][0]["model"], want["state"][1]["model"],
                 "weights after step 1")


@pytest.mark.parametrize("i,name", list(enumerate(CHUNKED)), ids=list(CHUNKED))
def test_a_chunked_loss_on_vocabulary_shards_is_the_one_rank_plain_loss(spawned, references, i, name):
    """loss.chunk_tokens under TP 2: each chunk's logits exist only as this rank's vocabulary columns, the
    logsumexp and the target's logit joined over the group (VocabShard.chunk_stats), the padding column out of
    the softmax: losses, norms and every gradient == the one-rank run with whole logits (no chunking),
    1e-6."""
    assert_same_steps(spawned[TP1_TO_DP2_TP2 + 1 + i], references[(name, 1)], f"{name} chunked")


def test_compiled_split_blocks_train_as_the_one_rank_model(spawned, references):
    """train.compile under TP 2 (torch.compile of each split block, inductor; dynamo traces the
    sequence-parallel collectives into the graphs, the attention call stays eager as without TP): losses,
    norms and every gradient == the one-rank eager run (Llama: GQA, SwiGLU, untied head), 1e-6."""
    assert_same_steps(spawned[TP1_TO_DP2_TP2 + 1 + len(CHUNKED)], references[("llama", 1)], "compiled")


def test_fsdp2_over_context_ranks_with_tensor_parallel_is_the_one_rank_run(spawned, references):
    """Every dimension at once: 4 ranks as CP 2 x TP 2, FSDP2 sharding each tensor shard over the context
    group (the fsdp group is data x context): losses, norms and every gradient == the one-rank run, 1e-6."""
    want = references[("llama", 1)]
    assert_same_steps(spawned[TP1_TO_DP2_TP2 + 2 + len(CHUNKED)], want, "FSDP2 x CP 2 x TP 2")
    assert all(got["weights"] == {} for got in spawned[TP1_TO_DP2_TP2 + 2 + len(CHUNKED)][1:])
    assert_close(spawned[TP1_TO_DP2_TP2 + 2 + len(CHUNKED)][0]["weights"], want["weights"], "full_weights")
