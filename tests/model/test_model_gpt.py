"""The GPT module itself: configs, builder, forward contract, single-device imports."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import trainer.model
from trainer.data.batch import Document, collate_rows
from trainer.model import AttentionConfig, GPTConfig, ModelOutput, build_model, model_inputs

ROOT = Path(__file__).resolve().parents[2]
MODEL_YAMLS = sorted((ROOT / "configs" / "model").glob("*.yaml"))
ATTENTION_YAMLS = sorted((ROOT / "configs" / "attention").glob("*.yaml"))


def tiny(**overrides):
    torch.manual_seed(0)
    cfg = GPTConfig(**{**dict(vocab_size=50, n_layer=2, n_head=4, n_embd=64, max_seq_len=64), **overrides})
    return build_model(cfg, AttentionConfig(backend="sdpa_docs"))


def test_yaml_files_exist():
    assert {p.stem for p in MODEL_YAMLS} >= {"tiny", "small", "gpt2-124m"}
    assert {p.stem for p in ATTENTION_YAMLS} >= {"auto", "flash", "torch_varlen", "flex", "sdpa_docs",
                                                 "dense"}


@pytest.mark.parametrize("path", MODEL_YAMLS + ATTENTION_YAMLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_yaml_key_has_a_one_line_comment(path):
    for line in path.read_text().splitlines():
        if re.match(r"^\w+:", line):
            assert "#" in line, f"{path.name}: key without a comment: {line!r}"


@pytest.mark.parametrize("path", MODEL_YAMLS, ids=lambda p: p.name)
def test_model_yaml_keys_are_exactly_the_config_fields(path):
    # Composed as the trainer composes it (max_seq_len may follow train.seq_len by interpolation).
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        composed = compose(config_name="config", overrides=[f"model={path.stem}"])
    cfg = OmegaConf.to_container(composed.model, resolve=True)
    assert set(cfg) == {f.name for f in dataclasses.fields(GPTConfig)}
    assert cfg["vocab_size"] is None  # taken from the tokenizer at build time
    model_cfg = GPTConfig(**cfg)
    with torch.device("meta"):  # shapes only: gpt2-124m without allocating it
        model = build_model(model_cfg, AttentionConfig(), vocab_size=50257)
    assert model.cfg.vocab_size == 50257


def test_gpt2_124m_has_124m_parameters_with_the_padded_gpt2_vocab():
    cfg = GPTConfig(**OmegaConf.to_container(OmegaConf.load(ROOT / "configs/model/gpt2-124m.yaml")))
    with torch.device("meta"):
        model = build_model(cfg, AttentionConfig(), vocab_size=50304)
    assert 123e6 < model.num_params() < 126e6


@pytest.mark.parametrize("path", ATTENTION_YAMLS, ids=lambda p: p.name)
def test_attention_yamls_build_attention_configs(path):
    cfg = AttentionConfig(**OmegaConf.to_container(OmegaConf.load(path)))
    assert cfg.backend == path.stem and cfg.isolate_documents


def test_build_model_takes_the_vocab_size_from_the_tokenizer_unless_set():
    base = GPTConfig(n_layer=1, n_head=2, n_embd=16, max_seq_len=16)
    assert build_model(base, AttentionConfig(), vocab_size=37).wte.num_embeddings == 37
    with pytest.raises(ValueError, match="tokenizer"):
        build_model(base, AttentionConfig())
    padded = dataclasses.replace(base, vocab_size=64)
    assert build_model(padded, AttentionConfig(), vocab_size=50).wte.num_embeddings == 64
    with pytest.raises(ValueError, match="cannot hold"):
        build_model(dataclasses.replace(base, vocab_size=32), AttentionConfig(), vocab_size=50)


def test_config_validation():
    with pytest.raises(ValueError, match="pos_emb"):
        GPTConfig(pos_emb="alibi")
    with pytest.raises(ValueError, match="divisible"):
        GPTConfig(n_embd=65, n_head=4)


def test_forward_contract():
    model = tiny()
    ids = torch.randint(0, 50, (2, 10))
    labels = ids.clone()
    labels[:, 0] = -100
    out = model(ids, labels=labels)
    assert isinstance(out, ModelOutput)
    assert out.logits.shape == (2, 10, 50)
    assert out.loss_sum.dtype == torch.float32 and out.loss_sum.dim() == 0
    assert out.num_targets.item() == 2 * 9  # shifted: the last position predicts nothing
    lean = model(ids, labels=labels, return_logits=False)
    assert lean.logits is None and torch.allclose(lean.loss_sum, out.loss_sum)
    assert model(ids).loss_sum is None
    explicit = model(ids, position_ids=torch.arange(10).expand(2, 10)).logits
    assert torch.equal(explicit, model(ids).logits)  # position_ids=None means 0..L-1


def test_output_head_is_tied_to_the_token_embedding():
    model = tiny()
    assert model.lm_head.weight is model.wte.weight


def test_rows_longer_than_max_seq_len_are_rejected():
    with pytest.raises(ValueError, match="max_seq_len"):
        tiny()(torch.zeros(1, 65, dtype=torch.long))


def test_packed_rows_need_max_seqlen():
    with pytest.raises(ValueError, match="max_seqlen"):
        tiny()(torch.zeros(1, 4, dtype=torch.long), cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))


def docs_batch(layout: str):
    rng = np.random.default_rng(0)
    rows = [[Document("a", rng.integers(1, 50, 5)), Document("b", rng.integers(1, 50, 7))],
            [Document("c", rng.integers(1, 50, 9))]]
    if layout != "packed":
        rows = [[d] for row in rows for d in row]
    return collate_rows(rows, 12, 0, layout)


def test_model_inputs_follow_the_layout():
    packed = model_inputs(docs_batch("packed"))
    assert packed["cu_seqlens"].tolist() == [0, 5, 12, 21, 24] and packed["max_seqlen"] == 9
    for layout in ("unpacked", "bucketed"):
        inputs = model_inputs(docs_batch(layout))
        assert inputs["cu_seqlens"] is None and inputs["max_seqlen"] is None
    assert model_inputs(docs_batch("packed"), packed=False)["cu_seqlens"] is None
    assert set(packed) == {"input_ids", "position_ids", "labels", "cu_seqlens", "max_seqlen"}


def test_without_isolation_packed_rows_get_one_causal_mask_per_row():
    batch = docs_batch("packed")
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=50, n_layer=2, n_head=4, n_embd=64, max_seq_len=64)
    concat = build_model(cfg, AttentionConfig(backend="sdpa_docs", isolate_documents=False))
    with torch.no_grad():
        ignoring_boundaries = concat(**model_inputs(batch)).logits
        row_causal = concat(**model_inputs(batch, packed=False)).logits
        isolated = tiny()(**model_inputs(batch)).logits
    assert torch.equal(ignoring_boundaries, row_causal)
    assert (ignoring_boundaries[0, 5:12] - isolated[0, 5:12]).abs().max() > 1e-5  # doc b sees doc a


def test_no_distributed_imports_under_the_model_package():
    package = Path(trainer.model.__file__).parent
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith(("torch.distributed", "deepspeed")), f"{path.name} imports {name}"
