"""`train.init_from` (weights only; fresh optimizer, schedule, step and data) and the tokenizer that must go
with the weights: a mismatch is refused naming both hashes, `tokenizer.add_tokens` is the supported
extension."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import free_port, require_module
from tests.helpers import ROOT, SMALL, metrics, run_train
from trainer.checkpoint import store
from trainer.checkpoint.safe_io import load_state
from trainer.checkpoint.weights import grow_rows
from trainer.data.shards import PrepareError
from trainer.data.tokenizer import extend_tokenizer, extension_problem, load_tokenizer, train_tokenizer
from trainer.model import AttentionConfig, GPTConfig, build_model
from trainer.prepare import prepare

TEXTS = ["def add(a, b):\n    return a + b\n", "hello world, hello tokens",
         "<|tool|> is not special yet"] * 20


# --------------------------------------------------------------------------------------------------
# The extension itself
# --------------------------------------------------------------------------------------------------


def test_extension_appends_ids_and_changes_no_existing_token():
    base = train_tokenizer(TEXTS, vocab_size=300)
    ext = extend_tokenizer(base, ["<|tool|>", "<|call|>"])
    size = base.get_vocab_size()
    old = base.get_vocab(with_added_tokens=True)
    new = ext.get_vocab(with_added_tokens=True)
    assert all(new[t] == i for t, i in old.items())  # every existing id keeps its token
    assert new["<|tool|>"] == size and new["<|call|>"] == size + 1 and len(new) == size + 2
    for text in TEXTS[:2]:  # texts without the new tokens encode exactly as before
        assert ext.encode(text).ids == base.encode(text).ids
    assert ext.encode("x<|tool|>y").ids == base.encode("x").ids + [size] + base.encode("y").ids
    assert extension_problem(base, ext, ["<|tool|>", "<|call|>"]) is None


def test_extension_problem_names_what_is_not_an_extension():
    base = train_tokenizer(TEXTS, vocab_size=300)
    ext = extend_tokenizer(base, ["<|tool|>", "<|call|>"])
    assert "not ['<|call|>', '<|tool|>']" in extension_problem(base, ext, ["<|call|>", "<|tool|>"])  # order
    assert "adds [] " in extension_problem(base, base, ["<|tool|>"])  # nothing added
    other = train_tokenizer(TEXTS[:1] * 30, vocab_size=280)  # another BPE altogether
    assert "model differs" in extension_problem(base, extend_tokenizer(other, ["<|tool|>"]), ["<|tool|>"])
    with pytest.raises(PrepareError, match="already has them"):
        extend_tokenizer(base, ["<|im_end|>"])


def test_grown_embedding_leaves_every_old_tokens_logits_unchanged():
    """The old model and the grown one (2 new rows = mean of the old) give the same logits for every old
    token, on inputs made of old tokens; the new tokens' logits are those of the mean row."""
    torch.manual_seed(0)
    cfg, attention = (GPTConfig(n_layer=2, n_head=2, n_embd=32, max_seq_len=64),
                      AttentionConfig(backend="sdpa_docs"))
    old = build_model(cfg, attention, vocab_size=300).eval()
    new = build_model(cfg, attention, vocab_size=302).eval()
    weights = {k: v for k, v in old.state_dict().items() if k != store.TIED_KEY}
    weights["wte.weight"] = grow_rows(weights["wte.weight"], 302, base_vocab=300, added=2)
    new.load_state_dict(weights, strict=False)
    # the head is still tied, so it grew too
    assert new.lm_head.weight.data_ptr() == new.wte.weight.data_ptr()
    ids = torch.randint(0, 300, (3, 40))
    with torch.no_grad():
        a, b = old(ids).logits, new(ids).logits
    assert b.shape[-1] == 302
    torch.testing.assert_close(b[..., :300], a, rtol=0, atol=1e-6)
    mean = old.wte.weight[:300].mean(0)
    torch.testing.assert_close(new.wte.weight[300], mean)
    torch.testing.assert_close(new.wte.weight[301], mean)


# --------------------------------------------------------------------------------------------------
# End to end: a pretrained checkpoint, then runs started from it
# --------------------------------------------------------------------------------------------------


def run_fails(run_dir: Path, data: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer.train", f"data.path={data}", f"hydra.run.dir={run_dir}", *SMALL,
           *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, f"expected a refusal (exit 2)\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


@pytest.fixture(scope="module")
def pretrained(demo_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("pretrain")
    run_train(run_dir, demo_data, "train.max_steps=4", "train.checkpoint_every=4",
              "logging.record_doc_keys=true")
    return run_dir


ckpt = store.checkpoint_dir
WEIGHTS, CONVENTIONS = store.WEIGHTS_FILE, store.CONVENTIONS_FILE


def doc_keys(run_dir: Path) -> list[list[str]]:
    lines = (run_dir / "doc_keys" / "rank_00000.jsonl").read_text().splitlines()
    return [json.loads(line)["keys"] for line in lines]


@pytest.mark.slow
def test_init_from_loads_weights_only(pretrained, demo_data, tmp_path):
    """lr = 0 keeps the weights as loaded: the saved weights equal the checkpoint's bit for bit. The step
    count, optimizer state, schedule and data stream all start fresh (the first step's documents are those of
    a fresh run's first step)."""
    source = ckpt(pretrained, 4)
    run_dir = tmp_path / "ft"
    proc = run_train(run_dir, demo_data, f"train.init_from={source}", "optim.lr=0", "train.max_steps=2",
                     "train.checkpoint_every=2", "logging.record_doc_keys=true")
    assert "init_from: weights of" in proc.stdout
    loaded, original = load_file(ckpt(run_dir, 2) / WEIGHTS), load_file(source / WEIGHTS)
    assert loaded.keys() == original.keys()
    for k in original:
        assert torch.equal(loaded[k], original[k]), k
    assert [m["step"] for m in metrics(run_dir)] == [1, 2]
    engine = load_state(ckpt(run_dir, 2) / store.ENGINE_FILE)
    assert {int(s["step"]) for s in engine["optimizer"]["state"].values()} == {2}  # AdamW's own step count
    assert engine["scheduler"]["last_epoch"] == 2
    assert doc_keys(run_dir)[:2] == doc_keys(pretrained)[:2]
    conv = json.loads((ckpt(run_dir, 2) / CONVENTIONS).read_text())
    assert conv["init_from"]["checkpoint"] == str(source.resolve()) and conv["init_from"]["step"] == 4


@pytest.mark.slow
def test_init_from_reads_a_checkpoint_from_before_model_safetensors(pretrained, demo_data, tmp_path):
    """Older DDP checkpoints hold the weights only in engine.pt: read with weights_only=True, the same
    weights."""
    old = tmp_path / "old_ckpt"
    shutil.copytree(ckpt(pretrained, 4), old)
    (old / WEIGHTS).unlink()
    run_dir = tmp_path / "ft"
    run_train(run_dir, demo_data, f"train.init_from={old}", "optim.lr=0", "train.max_steps=1",
              "train.checkpoint_every=1")
    loaded, original = load_file(ckpt(run_dir, 1) / WEIGHTS), load_file(ckpt(pretrained, 4) / WEIGHTS)
    assert all(torch.equal(loaded[k], original[k]) for k in original)


@pytest.mark.slow
def test_init_from_starts_lower_than_scratch(pretrained, demo_data, tmp_path):
    """With learning on, the first step from the checkpoint sees the same documents as a fresh run's first
    step and scores them better than the random initialization did."""
    run_dir = tmp_path / "ft"
    run_train(run_dir, demo_data, f"train.init_from={ckpt(pretrained, 4)}", "train.max_steps=1")
    first, scratch = metrics(run_dir)[0], metrics(pretrained)[0]
    assert first["docs"] == scratch["docs"] and first["lr"] == scratch["lr"]
    assert first["loss"] < scratch["loss"] - 0.1, (first["loss"], scratch["loss"])


@pytest.fixture(scope="module")
def other_data(tmp_path_factory) -> Path:
    """The same documents under another tokenizer (vocab 300)."""
    out = tmp_path_factory.mktemp("other_tok")
    prepare("demo", out, vocab_size=300, max_docs=300, docs_per_shard=100, val_fraction=0.05, seed=0)
    return out


@pytest.mark.slow
def test_mismatched_tokenizer_is_refused_for_init_from_and_resume(pretrained, other_data, tmp_path):
    source = ckpt(pretrained, 4)
    ours = json.loads((source / CONVENTIONS).read_text())["tokenizer"]["sha256"]
    theirs = json.loads((other_data / "manifest.json").read_text())["tokenizer"]["sha256"]
    for override in (f"train.init_from={source}", f"train.resume={source}"):
        err = run_fails(tmp_path / "x", other_data, override).stderr
        assert ours in err and theirs in err, err
        assert "tokenizer.add_tokens" in err and "--tokenizer" in err, err
    err = run_fails(tmp_path / "y", other_data, 'tokenizer.add_tokens=["<|tool|>"]').stderr
    assert "set train.init_from" in err


@pytest.mark.slow
def test_add_tokens_grows_the_model_from_the_checkpoint(pretrained, demo_data, tmp_path):
    """Data prepared with the checkpoint's tokenizer + one token; init_from with tokenizer.add_tokens: old
    rows as they were, the new row the mean of the old ones (lr = 0), the extension recorded in
    conventions.json. Naming another token is refused."""
    source = ckpt(pretrained, 4)
    data = tmp_path / "extended"
    prepare("demo", data, tokenizer=source / store.TOKENIZER_DIR, add_tokens=["<|tool|>"], max_docs=300,
            docs_per_shard=100, val_fraction=0.05)
    manifest = json.loads((data / "manifest.json").read_text())
    base = load_tokenizer(source / store.TOKENIZER_DIR)
    assert manifest["tokenizer"]["added_tokens"] == ["<|tool|>"]
    assert load_tokenizer(data / "tokenizer").token_to_id("<|tool|>") == base.get_vocab_size()

    err = run_fails(tmp_path / "wrong", data, f"train.init_from={source}",
                    'tokenizer.add_tokens=["<|other|>"]').stderr
    assert "not the checkpoint's" in err and "<|other|>" in err, err
    err = run_fails(tmp_path / "none", data, f"train.init_from={source}").stderr  # forgot add_tokens
    assert "tokenizer.add_tokens" in err, err

    run_dir = tmp_path / "ft"
    run_train(run_dir, data, f"train.init_from={source}", 'tokenizer.add_tokens=["<|tool|>"]', "optim.lr=0",
              "train.max_steps=1", "train.checkpoint_every=1")
    old, new = load_file(source / WEIGHTS), load_file(ckpt(run_dir, 1) / WEIGHTS)
    V = base.get_vocab_size()
    assert new["wte.weight"].shape[0] == V + 1
    assert torch.equal(new["wte.weight"][:V], old["wte.weight"])
    torch.testing.assert_close(new["wte.weight"][V], old["wte.weight"].mean(0))
    ext = json.loads((ckpt(run_dir, 1) / CONVENTIONS).read_text())["init_from"]["extension"]
    assert ext["added_tokens"] == ["<|tool|>"] and ext["new_ids"] == [V]
    assert ext["base_sha256"] == json.loads((source / CONVENTIONS).read_text())["tokenizer"]["sha256"]


@pytest.mark.slow
def test_init_from_under_zero3_on_two_ranks_loads_before_partitioning(pretrained, demo_data, tmp_path):
    """DeepSpeed ZeRO-3 partitions the weights as it wraps the model: init_from loads them before that, so
    with lr = 0 the weights gathered from both ranks' partitions equal the (DDP) checkpoint's; an FSDP2 run
    started from the ZeRO-3 run's checkpoint holds them too."""
    require_module("deepspeed", "pip install deepspeed (the `deepspeed` extra)")
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                str(free_port()), "-m"]
    run_dir = tmp_path / "zero3"
    run_train(run_dir, demo_data, "distributed=deepspeed_zero3", f"train.init_from={ckpt(pretrained, 4)}",
              "optim.lr=0", "train.max_steps=1", "train.checkpoint_every=1", launcher=launcher)
    loaded, original = load_file(ckpt(run_dir, 1) / WEIGHTS), load_file(ckpt(pretrained, 4) / WEIGHTS)
    assert loaded.keys() == original.keys()
    for k in original:
        assert torch.equal(loaded[k], original[k]), k
    # That DeepSpeed-written checkpoint starts an FSDP2 run (its weights loaded before fully_shard): equal
    # again.
    fsdp = tmp_path / "fsdp2"
    launcher[-2] = str(free_port())
    run_train(fsdp, demo_data, "distributed=fsdp2", f"train.init_from={ckpt(run_dir, 1)}", "optim.lr=0",
              "train.max_steps=1", "train.checkpoint_every=1", launcher=launcher)
    again = load_file(ckpt(fsdp, 1) / WEIGHTS)
    assert again.keys() == original.keys()
    for k in original:
        assert torch.equal(again[k], original[k]), k
