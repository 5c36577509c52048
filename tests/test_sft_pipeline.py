"""The whole fine-tuning path as docs/checkpoints.md gives it, each step through its CLI: pretrain -> chat
prepare with the checkpoint's tokenizer -> packed SFT from the checkpoint with assistant-only loss -> export
-> load in transformers -> generate. transformers is the reference at both ends: its loss on the held-out
conversations (assistant targets only) equals the run's final val_loss, and its greedy decoding equals
`trainer.generate`'s."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.harness import require_module
from tests.helpers import ROOT, metrics, run_train
from trainer.data.config import DataConfig
from trainer.data.feed import load_eval_docs
from trainer.data.tokenizer import load_tokenizer, special_ids

pytestmark = pytest.mark.slow


def cli(*args: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_chat_prepare_sft_export_transformers_generate(demo_data, tmp_path):
    transformers = require_module("transformers", "pip install transformers")

    pretrain = tmp_path / "pretrain"
    run_train(pretrain, demo_data, "train.max_steps=3", "train.checkpoint_every=3")
    base = pretrain / "checkpoints" / "step_000003"

    chat = tmp_path / "chat"
    cli("trainer.prepare", "--source", "demo-chat", "--out", str(chat),
        "--tokenizer", str(base / "tokenizer"), "--max-docs", "240", "--docs-per-shard", "60",
        "--val-fraction", "0.1")

    sft = tmp_path / "sft"
    run_train(sft, chat, f"train.init_from={base}", "data.loss_on=assistant", "train.max_steps=3",
              "train.checkpoint_every=3", "train.eval_every=3")
    final = metrics(sft)[-1]
    assert (final["step"] == 3
            and final["valid_tokens"] < 0.9 * final["allocated_tokens"] * final["token_utilization"])

    export = tmp_path / "hf"
    cli("trainer.export", str(sft / "checkpoints" / "step_000003"), "--out", str(export))
    model = transformers.GPT2LMHeadModel.from_pretrained(export, attn_implementation="eager").eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(export)

    # Held-out conversations as the run evaluated them (chunks of seq_len, assistant masks), one padded row
    # each.
    tok_dir = chat / "tokenizer"
    ids = special_ids(load_tokenizer(tok_dir))
    docs = load_eval_docs(DataConfig(path=str(chat), loss_on="assistant"), tok_dir, ids.eos, 128, None,
                          "raise")
    assert len(docs) >= 10 and all(d.loss_mask is not None for d in docs)
    L = max(len(d) for d in docs)
    input_ids = torch.full((len(docs), L), ids.pad)
    labels = torch.full((len(docs), L), -100)
    attention = torch.zeros((len(docs), L), dtype=torch.long)
    for i, d in enumerate(docs):
        tokens = torch.as_tensor(d.tokens)
        input_ids[i, : len(d)] = tokens
        labels[i, : len(d)] = torch.where(torch.as_tensor(d.loss_mask), tokens, -100)
        attention[i, : len(d)] = 1
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention, labels=labels)
    assert int((labels[:, 1:] != -100).sum()) == final["val_tokens"]
    assert abs(out.loss.item() - final["val_loss"]) <= 1e-5, (out.loss.item(), final["val_loss"])

    # Greedy chat decoding: trainer.generate on the export == transformers.generate on the export.
    question = "What does json.dumps do?"
    ours = cli("trainer.generate", str(export), "--chat", "--prompt", question, "--temperature", "0",
               "--max-new-tokens", "12").stdout.rstrip("\n")
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        return_tensors="pt", return_dict=True)
    with torch.no_grad():
        theirs = model.generate(**prompt, do_sample=False, max_new_tokens=12,
                                eos_token_id=[ids.eos, ids.im_end], pad_token_id=ids.pad)
    new = theirs[0, prompt["input_ids"].shape[1]:].tolist()
    if new and new[-1] in (ids.eos, ids.im_end):
        new = new[:-1]
    assert ours == hf_tok.decode(new, skip_special_tokens=True)
