"""Fine-tuning on chat data with data.loss_on=assistant, end to end through `python -m trainer.train`.

A small demo-chat set (300 conversations about the standard library) is prepared once; the same seed runs
packed and unpacked. The targets of step 1 are counted independently here (the rendered texts read back from
the shards, tokenized by `transformers`, assistant turns found by a regular expression) and must equal the
step's valid_tokens; packed and unpacked runs must give the same losses.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from tests.harness import require_module
from tests.helpers import ENV, ROOT, SMALL, assert_one_error_line, metrics, run_train
from trainer.data.shards import TEXT_FIELD, load_manifest, shard_paths
from trainer.prepare import prepare

pytestmark = pytest.mark.slow

SEQ_LEN = 128  # a dozen of the 300 conversations are longer: split in chunks, some in the first steps
SFT = [
    "data.loss_on=assistant",
    f"train.seq_len={SEQ_LEN}",
    "train.tokens_per_step=2048",
    "train.micro_batch_tokens=1024",
    "train.max_steps=4",
    "train.checkpoint_every=2",
    "train.eval_every=2",
    "logging.record_doc_keys=true",
]
# Independent of trainer.data.chat: an assistant turn's content and its closing <|im_end|>.
ASSISTANT_TURN = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("demo_chat")
    manifest = prepare("demo-chat", out, vocab_size=512, max_docs=300, docs_per_shard=60, val_fraction=0.05)
    assert manifest["chat"]["conversations"] == 300
    # a few are over SEQ_LEN: split in chunks
    assert manifest["splits"]["train"]["lengths"]["count_gt_512"] == 0
    return out


@pytest.fixture(scope="module")
def sft_runs(chat_data, tmp_path_factory) -> dict[str, Path]:
    runs = {}
    for layout in ("packed", "unpacked"):
        runs[layout] = tmp_path_factory.mktemp(f"sft_{layout}")
        run_train(runs[layout], chat_data, f"packing={layout}", *SFT)
    return runs


def assistant_targets(text: str, hf, chunk: int | None = None) -> int:
    """Targets of `text` (or of its chunk number `chunk` of SEQ_LEN tokens): tokens whose characters overlap
    an assistant turn (transformers' rule), via transformers' offsets; the EOS and each chunk's first token
    are not."""
    spans = [m.span(1) for m in ASSISTANT_TURN.finditer(text)]
    offsets = hf(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
    # + the EOS the stream appends
    mask = [any(s < b and e > a for a, b in spans) for s, e in offsets] + [False]
    if chunk is not None:
        mask = mask[chunk * SEQ_LEN : (chunk + 1) * SEQ_LEN]
    return sum(mask[1:])


def step_targets(keys: list[str], texts: dict[str, str], hf) -> int:
    """Targets of the documents and chunks ("key#k") of one step."""
    total = 0
    for key in keys:
        name, _, chunk = key.partition("#")
        total += assistant_targets(texts[name], hf, int(chunk) if chunk else None)
    return total


def test_step_targets_are_the_assistant_tokens_only(sft_runs, chat_data):
    transformers = require_module("transformers", "pip install -e '.[dev]'")
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_data / "tokenizer"))
    texts = {s["__key__"]: s[TEXT_FIELD].decode() for s in wds.WebDataset(shard_paths(chat_data, "train"),
                                                                          shardshuffle=False)}
    lines = metrics(sft_runs["packed"])
    steps = [json.loads(line)
             for line in (sft_runs["packed"] / "doc_keys" / "rank_00000.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    # split conversations are counted chunk by chunk
    assert any("#" in key for s in steps for key in s["keys"])
    assert [m["valid_tokens"] for m in lines] == [step_targets(s["keys"], texts, hf) for s in steps]
    # prompts are inputs only: far fewer targets than loss_on=all's (about 2/3 of them here)
    for line in lines:
        targets_if_all = round(line["token_utilization"] * line["allocated_tokens"]) - line["docs"]
        assert 0 < line["valid_tokens"] < 0.8 * targets_if_all
    conv = json.loads((sft_runs["packed"] / "checkpoints" / "step_000004" / "conventions.json").read_text())
    assert conv["labels"]["loss_on"] == "assistant" and "assistant turns only" in conv["labels"]["targets"]


def test_packed_and_unpacked_sft_give_the_same_losses(sft_runs):
    packed, unpacked = metrics(sft_runs["packed"]), metrics(sft_runs["unpacked"])
    assert [m["valid_tokens"] for m in packed] == [m["valid_tokens"] for m in unpacked]
    assert [m["docs"] for m in packed] == [m["docs"] for m in unpacked]
    diff = np.abs(np.array([m["loss"] for m in packed]) - np.array([m["loss"] for m in unpacked]))
    assert diff.max() <= 1e-4, diff
    evals = [(a, b) for a, b in zip(packed, unpacked, strict=True) if "val_loss" in a]
    assert [a["step"] for a, _ in evals] == [2, 4]
    for a, b in evals:  # the held-out loss scores the same assistant targets in both
        assert a["val_tokens"] == b["val_tokens"] and abs(a["val_loss"] - b["val_loss"]) <= 1e-4
    assert sum(m["allocated_tokens"] for m in packed) < sum(m["allocated_tokens"] for m in unpacked)


def test_resume_continues_exactly_with_the_masks_of_buffered_documents(sft_runs, chat_data, tmp_path):
    """Resumed at step 2: documents waiting in the packer and the loader carry their loss masks in the
    state."""
    resumed = tmp_path / "resumed"
    shutil.copytree(sft_runs["packed"], resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000004")
    proc = run_train(resumed, chat_data, "packing=packed", *SFT, "train.resume=true")
    assert "resumed from" in proc.stdout
    whole, again = metrics(sft_runs["packed"]), metrics(resumed)
    for a, b in zip(whole[2:], again[2:], strict=True):
        assert (a["valid_tokens"] == b["valid_tokens"]
                and abs(a["loss"] - b["loss"]) <= 1e-6), (a["step"], a, b)


def test_eval_counts_only_assistant_targets(sft_runs, chat_data):
    """val_tokens with loss_on=assistant is the count of assistant targets of the val split."""
    transformers = require_module("transformers", "pip install -e '.[dev]'")
    hf = transformers.AutoTokenizer.from_pretrained(str(chat_data / "tokenizer"))
    val = [s[TEXT_FIELD].decode() for s in wds.WebDataset(shard_paths(chat_data, "val"), shardshuffle=False)]
    assert metrics(sft_runs["packed"])[-1]["val_tokens"] == sum(assistant_targets(t, hf) for t in val)


def test_loss_on_assistant_with_plain_text_data_fails_at_startup(demo_data, tmp_path):
    assert "chat" not in load_manifest(demo_data)
    cmd = [sys.executable, "-m", "trainer.train", f"data.path={demo_data}", f"hydra.run.dir={tmp_path}",
           *SMALL, "data.loss_on=assistant"]
    proc = subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert_one_error_line(proc.returncode, proc.stderr, "data.loss_on=assistant needs chat data prepared "
                          "with --source chat:PATH or demo-chat", f"{demo_data} holds plain text")
