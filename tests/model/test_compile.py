"""train.compile: per-block torch.compile that never recompiles for a batch's document boundaries, keeps
activation checkpointing compiled, counts recompilations, and trains to the same losses as eager on CPU.

Fast tests trace with dynamo's eager backend (guards and graph breaks are dynamo's, whatever the backend); the
slow ones run inductor, the default backend.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from tests.helpers import make_trainer, metrics, run_train
from trainer.data.batch import Batch, Document, collate_rows
from trainer.errors import ConfigError
from trainer.model import AttentionConfig, GPTConfig, build_model, model_inputs
from trainer.model.compile import CompileCounter, compile_blocks
from trainer.model.gpt import apply_activation_checkpointing

T = 64


def packed_batches(n: int, seed: int = 0) -> list[Batch]:
    """n packed (2, T) micro-batches; the number and lengths of documents, so cu_seqlens' length and
    max_seqlen, change from batch to batch."""
    rng = np.random.default_rng(seed)
    batches = []
    for _ in range(n):
        rows = []
        for _ in range(2):
            row, used, longest = [], 0, int(rng.integers(8, T))
            while used < T - 4:
                size = min(int(rng.integers(3, longest + 1)), T - used)
                row.append(Document(f"d{used}", rng.integers(0, 97, size)))
                used += size
            rows.append(row)
        batches.append(collate_rows(rows, T, 0, "packed"))
    return batches


LLAMA = dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", mlp_hidden=48, bias=False, n_head=4, n_kv_head=2,
             tie_embeddings=False)
"""The Llama family (RMSNorm, SwiGLU, RoPE, GQA, untied head) at the same size."""


def tiny(backend: str, recompute: str = "none", family: str = "gpt2") -> torch.nn.Module:
    torch.manual_seed(0)
    shape = {"n_head": 2, **(LLAMA if family == "llama" else {})}
    model = build_model(GPTConfig(vocab_size=97, n_layer=2, n_embd=32, max_seq_len=T, **shape),
                        AttentionConfig(backend=backend))
    return apply_activation_checkpointing(model, recompute)


def forward_backward(model, batch: Batch) -> tuple[float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(**model_inputs(batch))
    out.loss_sum.backward()
    return float(out.loss_sum.detach()), model.blocks[0].mlp.c_fc.weight.grad.clone()


class RecordingBackend:
    """A torch.compile backend that keeps the graphs it is given and runs them as they are."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        self.graphs.append(gm)
        return gm.forward

    def ops(self) -> str:
        """Every node's target, in the graphs and their subgraphs (a checkpointed region is one)."""
        return " ".join(str(node.target) for gm in self.graphs for sub in gm.modules()
                        if isinstance(sub, torch.fx.GraphModule) for node in sub.graph.nodes)


@pytest.mark.parametrize(("backend", "recompute", "family"), [
    ("sdpa_docs", "none", "gpt2"), ("dense", "none", "gpt2"), ("sdpa_docs", "none", "llama"),
    pytest.param("sdpa_docs", "selective", "gpt2", marks=pytest.mark.slow),
    pytest.param("sdpa_docs", "full", "gpt2", marks=pytest.mark.slow),
])
def test_new_document_boundaries_never_recompile_and_the_block_body_is_compiled(backend, recompute, family):
    """Ten batches whose cu_seqlens length and max_seqlen all differ: dynamo compiles the block once and never
    again, whatever the attention backend and activation checkpointing; the MLP (gelu) is in the compiled
    graphs (with `full`, compiling the module call instead would run the checkpointed block eagerly);
    parameter names are unchanged; and the values are eager's, exactly (the eager backend runs the traced
    graphs unfused)."""
    torch._dynamo.reset()
    batches = packed_batches(10)
    assert len({b.max_seqlen for b in batches}) > 3 and len({b.cu_seqlens.numel() for b in batches}) > 3
    eager = tiny(backend, recompute, family)
    record = RecordingBackend()
    compiled = compile_blocks(copy.deepcopy(eager), backend=record)
    assert list(compiled.state_dict()) == list(eager.state_dict())
    counter = CompileCounter()
    try:
        for batch in batches:
            (loss_c, grad_c), (loss_e, grad_e) = (forward_backward(compiled, batch),
                                                  forward_backward(eager, batch))
            assert loss_c == loss_e and torch.equal(grad_c, grad_e)
    finally:
        counter.close()
    assert counter.compiles > 0 and counter.recompiles == 0, (counter.compiles, counter.recompiles,
                                                              counter.reasons())
    assert ("gelu" if family == "gpt2" else "silu") in record.ops()


@pytest.mark.slow
def test_flex_attention_runs_inside_compiled_blocks_for_evaluation():
    """flex has no backward on CPU; under no_grad (evaluation) it runs from the compiled blocks, with new
    boundaries every batch and no recompilation. (On CUDA flex_compile compiles its kernel there, nested.)"""
    torch._dynamo.reset()
    eager = tiny("flex")
    eager.attention.flex_compile = False  # eager flex: seconds instead of a minute of compiling on CPU
    compiled = compile_blocks(copy.deepcopy(eager), backend="eager")
    counter = CompileCounter()
    try:
        with torch.no_grad():
            for batch in packed_batches(4):
                assert (float(compiled(**model_inputs(batch)).loss_sum)
                        == float(eager(**model_inputs(batch)).loss_sum))
    finally:
        counter.close()
    assert counter.compiles > 0 and counter.recompiles == 0


def test_a_new_row_length_recompiles_once_then_never():
    """Unpacked rows change length every micro-batch: the first change makes the dims dynamic (one
    recompilation per compiled frame), later lengths reuse the dynamic graphs."""
    torch._dynamo.reset()
    rng = np.random.default_rng(0)
    model = compile_blocks(tiny("sdpa_docs"), backend="eager")
    counter = CompileCounter()
    try:
        seen = []
        for length in (40, 23, 57, 31, 12, 64, 45):
            batch = collate_rows([[Document("a", rng.integers(0, 97, length))]], length, 0, "unpacked")
            forward_backward(model, batch)
            seen.append(counter.recompiles)
    finally:
        counter.close()
    assert counter.compiles > 0 and seen[0] == 0
    assert 0 < seen[1] <= counter.compiles - seen[1]  # each frame at most once...
    assert seen[1:] == [seen[1]] * (len(seen) - 1)  # ...and never again


def test_compile_counter_counts_recompilations():
    torch._dynamo.reset()
    counter = CompileCounter()
    fn = torch.compile(lambda x: x * 2, backend="eager")
    try:
        fn(torch.ones(3))
        assert (counter.compiles, counter.recompiles) == (1, 0)
        fn(torch.ones(3, dtype=torch.float64))  # a dtype guard fails: compiled again
        assert (counter.compiles, counter.recompiles) == (2, 1)
        assert any("dtype" in reason for reason in counter.reasons())
    finally:
        counter.close()
    fn(torch.ones(3, dtype=torch.int64))
    assert counter.compiles == 2  # closed: no longer counting


def test_compile_under_zero3_is_refused_before_anything_is_built(tmp_path):
    with pytest.raises(ConfigError, match="ZeRO-3"):
        make_trainer(tmp_path / "no_data", tmp_path / "run", "train.compile=true",
                     "distributed=deepspeed_zero3")


@pytest.mark.slow
def test_inductor_blocks_match_eager_within_float_noise():
    """Inductor's fused kernels round differently: the losses of the same weights and batches agree to ~1e-7
    relative (measured: at most 2e-4 on a summed loss of ~3,000), and so do the gradients."""
    torch._dynamo.reset()
    eager = tiny("sdpa_docs")
    compiled = compile_blocks(copy.deepcopy(eager))
    for batch in packed_batches(3):
        (loss_c, grad_c), (loss_e, grad_e) = forward_backward(compiled, batch), forward_backward(eager, batch)
        assert abs(loss_c - loss_e) <= 1e-5 * abs(loss_e)
        torch.testing.assert_close(grad_c, grad_e, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_compiled_training_run_gives_the_eager_losses(demo_data, tmp_path):
    """`python -m trainer.train train.compile=true` for 8 steps: the same losses as eager within float noise
    (measured on 50-step runs of this config: compiled vs eager, and eager with 1 vs 2 threads, differ by
    <= 1e-6 over the first 25 steps; chaotic growth to ~1e-3 comes later), no recompilation in training, the
    counts in metrics and summary.json, and the dtype that `auto` resolved to (fp32 on CPU)."""
    common = ("train.max_steps=8", "train.eval_every=0", "train.checkpoint_every=8")
    run_train(tmp_path / "eager", demo_data, *common)
    run_train(tmp_path / "compiled", demo_data, *common, "train.compile=true")
    eager, compiled = metrics(tmp_path / "eager"), metrics(tmp_path / "compiled")
    assert [m["docs"] for m in eager] == [m["docs"] for m in compiled]
    diff = max(abs(a["loss"] - b["loss"]) for a, b in zip(eager, compiled, strict=True))
    assert diff <= 1e-5, diff
    assert all(m["compile_recompiles"] == 0 for m in compiled) and "compile_recompiles" not in eager[0]
    summary = json.loads((tmp_path / "compiled" / "summary.json").read_text())
    assert summary["compile"] is True and summary["compile_frames"] > 0 and summary["compile_recompiles"] == 0
    assert summary["dtype"] == "fp32" and summary["optimizer_fused"] is False
    assert json.loads((tmp_path / "eager" / "summary.json").read_text())["compile"] is False
    conventions = json.loads((tmp_path / "compiled" / "checkpoints" / "step_000008"
                              / "conventions.json").read_text())
    assert conventions["dtype"] == "fp32"
