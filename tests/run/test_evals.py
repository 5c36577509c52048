"""Held-out evaluation: a fixed eval set whose val_loss does not depend on layout, micro-batch size or ranks.

The reference is plain PyTorch written here: every eval document run alone through the model, its
token losses summed with F.cross_entropy, divided by the number of targets.
"""

from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_distributed
from tests.helpers import make_trainer
from trainer.data.feed import load_eval_docs
from trainer.data.shards import load_manifest
from trainer.data.tokenizer import load_tokenizer, special_ids
from trainer.distributed.config import DistributedConfig
from trainer.distributed.engine import parallelize
from trainer.distributed.groups import DistInfo, init_distributed
from trainer.model import AttentionConfig, GPTConfig, build_model
from trainer.run.evals import EvalInterrupted, Evaluator

SEQ_LEN = 64
CPU = DistInfo(0, 1, 0, torch.device("cpu"))


def eval_docs(data):
    tok_dir = data / "tokenizer"
    ids = special_ids(load_tokenizer(tok_dir))
    return load_eval_docs(data, tok_dir, ids.eos, SEQ_LEN, max_docs=None), ids.pad


def model_and_engine(vocab: int, info: DistInfo, dropout: float = 0.0):
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, max_seq_len=SEQ_LEN, dropout=dropout)
    model = build_model(cfg, AttentionConfig(backend="sdpa_docs"), vocab_size=vocab)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    return model, parallelize(model, opt, sched, info, DistributedConfig(device="cpu"), grad_clip=0.0,
                              dtype="fp32")


def evaluate(rank: int, world_size: int, data, layout: str, mb_tokens: int) -> dict:
    info = init_distributed(DistributedConfig(device="cpu")) if world_size > 1 else CPU
    docs, pad = eval_docs(data)
    _, engine = model_and_engine(load_tokenizer(data / "tokenizer").get_vocab_size(), info)
    return vars(Evaluator(docs, info, SEQ_LEN, layout, mb_tokens, pad).run(engine))


@pytest.fixture(scope="module")
def packed_one_rank(demo_data):
    return evaluate(0, 1, demo_data, "packed", 4 * SEQ_LEN)


def test_eval_set_is_fixed_and_split_into_row_length_chunks(demo_data):
    docs, _ = eval_docs(demo_data)
    again, _ = eval_docs(demo_data)
    assert [d.key for d in docs] == [d.key for d in again]
    assert all(len(d) <= SEQ_LEN for d in docs)
    manifest = load_manifest(demo_data)
    whole = {d.key.split("#")[0] for d in docs}
    assert len(whole) == manifest["splits"]["val"]["docs"]  # every val document, nothing dropped
    assert sum(map(len, docs)) == manifest["splits"]["val"]["tokens"]  # every token (EOS included) once
    first = load_eval_docs(demo_data, demo_data / "tokenizer", 0, SEQ_LEN, max_docs=5)
    assert [d.key for d in first] == [d.key for d in docs[: len(first)]]
    assert len({d.key.split("#")[0] for d in first}) == 5


def test_val_loss_matches_plain_pytorch_per_document(demo_data, packed_one_rank):
    docs, _ = eval_docs(demo_data)
    model, _ = model_and_engine(load_tokenizer(demo_data / "tokenizer").get_vocab_size(), CPU)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for doc in docs:
            ids = torch.as_tensor(doc.tokens, dtype=torch.long)[None]  # (1, n): the document alone
            logits = model(ids).logits[0]
            total += F.cross_entropy(logits[:-1].double(), ids[0, 1:], reduction="sum").item()
            count += len(doc) - 1
    assert packed_one_rank["val_tokens"] == count
    assert packed_one_rank["val_docs"] == len(docs)
    assert abs(packed_one_rank["val_loss"] - total / count) <= 1e-5


@pytest.mark.parametrize("layout,mb_tokens", [("unpacked", 4 * SEQ_LEN), ("packed", SEQ_LEN)])
def test_val_loss_is_the_same_in_every_layout_and_micro_batch_size(demo_data, packed_one_rank, layout,
                                                                   mb_tokens):
    other = evaluate(0, 1, demo_data, layout, mb_tokens)
    assert (other["val_tokens"] == packed_one_rank["val_tokens"]
            and other["val_docs"] == packed_one_rank["val_docs"])
    assert abs(other["val_loss"] - packed_one_rank["val_loss"]) <= 1e-5


def test_val_loss_two_ranks_equals_one_rank(demo_data, packed_one_rank):
    results = run_distributed(evaluate, 2, args=(demo_data, "packed", 2 * SEQ_LEN))
    for r in results:
        assert r["val_tokens"] == packed_one_rank["val_tokens"]
        assert abs(r["val_loss"] - packed_one_rank["val_loss"]) <= 1e-5


def test_eval_draws_no_randomness_and_restores_train_mode(demo_data):
    docs, pad = eval_docs(demo_data)
    model, engine = model_and_engine(load_tokenizer(demo_data / "tokenizer").get_vocab_size(), CPU,
                                     dropout=0.5)
    evaluator = Evaluator(docs, CPU, SEQ_LEN, "packed", 4 * SEQ_LEN, pad)
    before = torch.get_rng_state()
    first, second = evaluator.run(engine), evaluator.run(engine)
    assert torch.equal(torch.get_rng_state(), before)  # dropout is off in eval: no draw from the RNG
    assert first.val_loss == second.val_loss
    assert model.training


def test_empty_val_split_is_a_clear_error(tmp_path):
    from trainer.prepare import prepare

    prepare("demo", tmp_path, vocab_size=300, max_docs=40, docs_per_shard=20, val_fraction=0.0)
    with pytest.raises(ValueError, match="'val' split has no documents.*train.eval_every=0"):
        load_eval_docs(tmp_path, tmp_path / "tokenizer", 0, SEQ_LEN, None)


def test_a_preemption_signal_abandons_the_eval_within_one_forward(demo_data, tmp_path):
    """`stop` is asked before each micro-batch: once it says so the eval ends there (EvalInterrupted), on
    every rank at the same micro-batch since the answer is collective; the Trainer's eval then returns no
    metrics and the run checkpoints the step at once (the preemption path of tests/run/test_cluster.py)."""
    docs, pad = eval_docs(demo_data)
    _, engine = model_and_engine(load_tokenizer(demo_data / "tokenizer").get_vocab_size(), CPU)
    evaluator = Evaluator(docs, CPU, SEQ_LEN, "packed", SEQ_LEN, pad)
    assert len(evaluator.batches) > 5
    forwards, asked = [], []
    real_forward = engine.eval_forward

    def counting(inputs):
        forwards.append(1)
        return real_forward(inputs)

    engine.eval_forward = counting
    with pytest.raises(EvalInterrupted):
        evaluator.run(engine, stop=lambda: asked.append(1) or len(asked) > 2)
    # stopped before the third forward, train mode restored
    assert len(forwards) == 2 and engine.module.training
    forwards.clear()
    assert (evaluator.run(engine, stop=lambda: False).val_tokens > 0
            and len(forwards) == len(evaluator.batches))


def test_the_trainer_abandons_its_eval_on_a_signal(demo_data, tmp_path):
    trainer = make_trainer(demo_data, tmp_path / "run", "train.eval_every=1")
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # recorded by the run's own handler (installed at its start)
        assert trainer.preemption.signal_name == "SIGTERM"
        assert trainer.held_out.run(SimpleNamespace(step=1)) == {} and trainer.held_out.last is None
    finally:
        trainer.preemption.close()
        trainer.data.rows.close()
