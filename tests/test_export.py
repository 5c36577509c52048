"""`python -m trainer.export`: a real checkpoint as a Hugging Face GPT-2, checked against `transformers`
itself.

`transformers` is the independent reference: its GPT2LMHeadModel, loss and autograd know nothing of packtrain.
One row per held-out document (right-padded, attention_mask) gives its mean loss over the valid targets; the
same documents packed several per row through packtrain's GPT and its real training step must give the same
loss and the same gradient. A wrong denominator (tokens instead of targets, a per-row or per-micro-batch mean)
would not: see test_step_gradient_equals_the_gradient_of_transformers_mean_loss.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from tests.harness import require_module
from tests.helpers import ROOT, GradientRecorder, run_export, train_checkpoint
from trainer.checkpoint import hf
from trainer.checkpoint.weights import load_model
from trainer.data.batch import IGNORE_INDEX, Document, collate_rows
from trainer.data.chat import chat_template, render
from trainer.data.feed import load_eval_docs
from trainer.data.tokenizer import IM_END, IM_START, load_tokenizer, special_ids
from trainer.distributed.groups import DistInfo
from trainer.export import write_hf
from trainer.model import GPT, AttentionConfig, GPTConfig, model_inputs
from trainer.run.step import train_step

SEQ_LEN = 128
LOSS_TOL = 1e-5
GRAD_REL_TOL = 1e-5


@pytest.fixture(scope="module")
def transformers():
    return require_module("transformers", "pip install transformers")


@pytest.fixture(scope="module")
def hf_model(transformers, exported):
    model = transformers.GPT2LMHeadModel.from_pretrained(exported, attn_implementation="eager")
    return model.float()


@pytest.fixture(scope="module")
def held_out(demo_data) -> list[Document]:
    """The val split of demo_data (chunks of <= 128 tokens, EOS last), in the eval's fixed order."""
    eos = special_ids(load_tokenizer(demo_data / "tokenizer")).eos
    docs = load_eval_docs(demo_data, demo_data / "tokenizer", eos, SEQ_LEN, max_docs=None)
    assert len(docs) >= 40
    return docs


def pack_greedily(docs: list[Document], row_len: int) -> list[list[Document]]:
    """Documents in order, a new row whenever the next one does not fit: several documents per row."""
    rows: list[list[Document]] = [[]]
    for doc in docs:
        if sum(map(len, rows[-1])) + len(doc) > row_len:
            rows.append([])
        rows[-1].append(doc)
    return rows


def hf_batch(docs: list[Document], pad_id: int) -> dict[str, torch.Tensor]:
    """One right-padded row per document; labels are the ids with -100 on padding (transformers shifts
    them)."""
    width = max(map(len, docs))
    ids = torch.full((len(docs), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for r, doc in enumerate(docs):
        ids[r, : len(doc)] = torch.from_numpy(doc.tokens)
        mask[r, : len(doc)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE_INDEX)}


def relative_errors(ours: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Per parameter: |ours - ref| / |ref| (Frobenius norms)."""
    assert set(ours) == set(ref)
    return {k: float((ours[k] - ref[k]).norm() / ref[k].norm()) for k in ref}


# ---------------------------------------------------------------------------------------------------
# The directory
# ---------------------------------------------------------------------------------------------------


def test_export_writes_a_gpt2_directory_that_transformers_loads(transformers, checkpoint, exported):
    model, info = transformers.GPT2LMHeadModel.from_pretrained(exported, attn_implementation="eager",
                                                               output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    config = json.loads((exported / "config.json").read_text())
    ids = special_ids(load_tokenizer(exported))
    assert config["architectures"] == ["GPT2LMHeadModel"] and config["model_type"] == "gpt2"
    assert ((config["n_embd"], config["n_layer"], config["n_head"], config["n_positions"])
            == (64, 2, 4, SEQ_LEN))
    assert config["vocab_size"] == 512 and config["activation_function"] == "gelu_new"
    assert (config["tie_word_embeddings"]
            and model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr())
    assert ((config["bos_token_id"], config["eos_token_id"], config["pad_token_id"])
            == (ids.eos, ids.eos, ids.pad))
    gen = json.loads((exported / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [ids.eos, ids.im_end] and gen["pad_token_id"] == ids.pad
    assert model.generation_config.eos_token_id == [ids.eos, ids.im_end]
    assert (exported / "conventions.json").read_bytes() == (checkpoint / "conventions.json").read_bytes()
    assert ((exported / "tokenizer.json").read_bytes()
            == (checkpoint / "tokenizer" / "tokenizer.json").read_bytes())
    assert json.loads((exported / "tokenizer_config.json").read_text())["model_max_length"] == SEQ_LEN
    # The weights are the checkpoint's, under GPT-2 names: packtrain's GPT read back from the export is
    # identical.
    ours, back = load_model(checkpoint), hf.load_hf(exported)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(tensor, back.state_dict()[name]), name


def test_export_and_generate_never_import_transformers():
    code = "import sys, trainer.export, trainer.generate; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_mapping_transposes_conv1d_weights_and_leaves_the_tied_head_out():
    model = GPT(GPTConfig(vocab_size=40, n_layer=2, n_head=2, n_embd=16, max_seq_len=8))
    state = model.state_dict()
    gpt2 = hf.hf_state_dict(model)
    assert gpt2["transformer.h.1.attn.c_attn.weight"].shape == (16, 48)  # Conv1D: (in, out)
    assert torch.equal(gpt2["transformer.h.0.mlp.c_fc.weight"], state["blocks.0.mlp.c_fc.weight"].t())
    assert torch.equal(gpt2["transformer.wpe.weight"], state["wpe.weight"])
    assert "lm_head.weight" not in gpt2 and len(gpt2) == len(state) - 1


def test_hf_tokenizer_encodes_like_ours_and_renders_chatml(transformers, exported, held_out):
    hf_tok = transformers.AutoTokenizer.from_pretrained(exported)
    ours = load_tokenizer(exported)
    texts = [ours.decode(doc.tokens[:-1].tolist()) for doc in held_out[:20]]
    texts += ["héllo wörld ✓ 日本語", f"{IM_START}user\nhi{IM_END}\n", "x<|endoftext|>y",
              "  two  spaces\n\ttab"]
    for text in texts:
        want = ours.encode(text, add_special_tokens=False).ids
        assert hf_tok.encode(text, add_special_tokens=False) == want
        assert hf_tok(text)["input_ids"] == want  # and it adds no BOS/EOS of its own
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                {"role": "user", "content": "again"}]
    rendered = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
                        "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n")
    # trainer.generate renders --chat prompts with trainer.data.chat: the same text from the exported template
    assert render(messages, chat_template(exported), add_generation_prompt=True)[0] == rendered


# ---------------------------------------------------------------------------------------------------
# Loss and gradient against transformers
# ---------------------------------------------------------------------------------------------------


def test_packed_loss_equals_transformers_loss_on_held_out_docs(hf_model, checkpoint, held_out):
    pad = special_ids(load_tokenizer(checkpoint / "tokenizer")).pad
    rows = pack_greedily(held_out, SEQ_LEN)
    assert len(rows) < len(held_out)  # several documents per row
    packed = collate_rows(rows, SEQ_LEN, pad, "packed")
    model = load_model(checkpoint)  # attention sdpa_docs: each document attends only to itself
    with torch.no_grad():
        out = model(**model_inputs(packed))
        ref_batch = hf_batch(held_out, pad)
        ref = hf_model(**ref_batch)
    # The same targets: every token of every document but its first.
    assert (int(out.num_targets) == packed.num_valid_targets
            == int((ref_batch["labels"][:, 1:] != IGNORE_INDEX).sum()))
    ours = float(out.loss_sum) / packed.num_valid_targets
    diff = abs(ours - float(ref.loss))
    print(f"held-out loss: packtrain {ours:.7f}, transformers {float(ref.loss):.7f}, |diff| {diff:.2e}")
    assert diff <= LOSS_TOL


def test_step_gradient_equals_the_gradient_of_transformers_mean_loss(hf_model, checkpoint, held_out):
    """The real train_step (packed rows, 3+ micro-batches, global valid-target normalization) against
    d(transformers' mean loss over the valid targets of the whole batch). Its denominator is all-reduced
    once before the micro-batches: a per-micro-batch mean, or dividing by tokens instead of targets, scales
    the gradient by another factor and fails here (see the check at the end)."""
    pad = special_ids(load_tokenizer(checkpoint / "tokenizer")).pad
    rows = pack_greedily(held_out, SEQ_LEN)
    micro_batches = [collate_rows(rows[i : i + 2], SEQ_LEN, pad, "packed") for i in range(0, len(rows), 2)]
    assert len(micro_batches) >= 3

    model = load_model(checkpoint, AttentionConfig(backend="sdpa_docs")).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    info = DistInfo(0, 1, 0, torch.device("cpu"))
    engine = GradientRecorder(model, optimizer, scheduler, info, grad_clip=0.0, dtype="fp32")
    stats = train_step(engine, micro_batches, info, pad)
    ours = hf.to_hf(engine.grads, model.cfg)

    hf_model.train().zero_grad(set_to_none=True)
    ref_loss = hf_model(**hf_batch(held_out, pad)).loss
    ref_loss.backward()
    # lm_head is tied: wte's grad holds both uses
    ref = {name: p.grad for name, p in hf_model.named_parameters()}
    hf_model.zero_grad(set_to_none=True)
    hf_model.eval()

    assert abs(stats.loss - float(ref_loss.detach())) <= LOSS_TOL
    errors = relative_errors(ours, ref)
    worst = max(errors, key=errors.get)
    print(f"max relative gradient error {errors[worst]:.2e} ({worst}) over {len(errors)} parameters, "
          f"{len(micro_batches)} micro-batches")
    assert errors[worst] <= GRAD_REL_TOL, errors

    # The check is absolute: had the step divided by the tokens (padding excluded) instead of the valid
    # targets, every gradient would be off by valid / tokens (here one target fewer per document), far beyond
    # the tolerance.
    tokens = sum(mb.num_tokens for mb in micro_batches)
    wrong = {k: v * stats.valid_tokens / tokens for k, v in ours.items()}
    assert min(relative_errors(wrong, ref).values()) > 100 * GRAD_REL_TOL


# ---------------------------------------------------------------------------------------------------
# What does not export, and bias-free models
# ---------------------------------------------------------------------------------------------------


def test_rope_models_are_refused_with_one_line(demo_data, tmp_path):
    ids = special_ids(load_tokenizer(demo_data / "tokenizer"))
    with pytest.raises(hf.ExportError, match="no Hugging Face class computes this model"):
        hf.hf_config(GPTConfig(vocab_size=512, n_layer=1, n_head=2, n_embd=16, pos_emb="rope"), ids)
    rope = train_checkpoint(tmp_path / "run", demo_data, "model.pos_emb=rope", "train.max_steps=1",
                            "train.eval_every=0")
    proc = run_export(rope, tmp_path / "out")
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "no Hugging Face class computes this model" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_bias_free_model_exports_zero_biases(transformers, demo_data, tmp_path):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=512, n_layer=2, n_head=2, n_embd=32, max_seq_len=32, bias=False)
    model = GPT(cfg).eval()
    write_hf(model, demo_data / "tokenizer", tmp_path)
    ref = transformers.GPT2LMHeadModel.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert not ref.transformer.h[1].mlp.c_fc.bias.detach().any()
    ids = torch.randint(0, 512, (2, 32))
    with torch.no_grad():
        diff = (model(ids).logits - ref(ids).logits).abs().max()
    assert diff <= 1e-5


def test_export_writes_only_into_a_new_or_empty_dir_or_over_an_earlier_export(checkpoint, exported, tmp_path,
                                                                              capsys):
    """A run directory, a checkpoint's tokenizer/ and a directory of one's own files are refused, untouched;
    an earlier export is replaced (tests/fixtures are not needed: the refusals come before any weight is
    read). The command's main in this process (its one line and status; tests/test_errors.py runs it as a
    process)."""
    from trainer.export import main
    run_dir = checkpoint.parent.parent
    before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    cases = {
        run_dir: "is not empty and not an earlier export",
        checkpoint / "tokenizer": f"is inside the checkpoint {checkpoint.resolve()}",
        checkpoint: f"is inside the checkpoint {checkpoint.resolve()}",
        mine: "(notes.txt)",
        # a new directory beside the run's checkpoints: train.resume=true would take it for one (and break)
        checkpoint.parent / "step_000099": "is inside the run's checkpoint directory "
                                           f"{checkpoint.parent.resolve()}",
    }
    for out, words in cases.items():
        status, err = main([str(checkpoint), "--out", str(out)]), capsys.readouterr().err
        assert (status == 2 and err.startswith(f"error: --out {out} ") and words in err
                and err.count("\n") == 1), err
    assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before
    assert not (checkpoint.parent / "step_000099").exists()
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    again = tmp_path / "again"
    again.mkdir()
    for p in exported.iterdir():
        (again / p.name).write_bytes(p.read_bytes())
    (again / hf.WEIGHTS_FILE).write_bytes(b"stale")
    assert main([str(checkpoint), "--out", str(again)]) == 0  # over an earlier export
    assert (again / hf.WEIGHTS_FILE).read_bytes() == (exported / hf.WEIGHTS_FILE).read_bytes()
