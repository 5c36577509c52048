"""A Hugging Face model's tokenizer directory in trainer.data.tokenizer, trainer.prepare and the stream:
documents framed as that tokenizer frames them ([BOS] + text + [EOS] where it starts every text with BOS,
text + [EOS] otherwise), with transformers as the reference for the ids. Tiny tokenizers are trained here
(tests.helpers)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.harness import require_module
from tests.helpers import HF_TEXTS, LLAMA3, hf_tokenizer_dir
from trainer.data.config import DataConfig, PackingConfig
from trainer.data.feed import IGNORE_INDEX, FramedTokenizer, build_data, load_eval_docs, micro_batches
from trainer.data.tokenizer import (
    PAD_FROM_EOS,
    PAD_FROM_TOKEN,
    SpecialIds,
    count_tokens,
    tokenizer_hash,
    tokenizer_ids,
)
from trainer.prepare import prepare

KINDS = {  # name: (special tokens, hf_tokenizer_dir keywords, the SpecialIds expected)
    "llama3": (LLAMA3, {"eos": LLAMA3[1], "bos": LLAMA3[0], "post_processor": f"{LLAMA3[0]} $A"},
               SpecialIds(eos=1, pad=1, bos=0, add_bos=True, pad_from=PAD_FROM_EOS)),
    "gpt2": (("<|endoftext|>",), {"eos": "<|endoftext|>", "bos": "<|endoftext|>", "add_bos_token": False},
             SpecialIds(eos=0, pad=0, pad_from=PAD_FROM_EOS)),
    "qwen2": (("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
              {"eos": "<|endoftext|>", "pad": "<|endoftext|>"},
              SpecialIds(eos=0, pad=0, im_start=1, im_end=2)),
    "add_bos_token": (("<s>", "</s>", "<pad>"),
                      {"eos": "</s>", "bos": "<s>", "pad": "<pad>", "add_bos_token": True},
                      SpecialIds(eos=1, pad=2, bos=0, add_bos=True, pad_from=PAD_FROM_TOKEN)),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, Path]:
    require_module("transformers", "pip install -e '.[dev]'")
    root = tmp_path_factory.mktemp("hf_tokenizers")
    return {name: hf_tokenizer_dir(root / name, specials, **kw) for name, (specials, kw, _) in KINDS.items()}


@pytest.mark.parametrize("kind", KINDS)
def test_the_special_ids_and_framing_are_read_from_the_directory(hf_dirs, kind):
    assert tokenizer_ids(hf_dirs[kind]) == KINDS[kind][2]


@pytest.mark.parametrize("kind", ["llama3", "gpt2", "qwen2"])
def test_a_framed_document_is_transformers_encoding_then_eos(hf_dirs, kind):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_dirs[kind])
    tok = FramedTokenizer.load(hf_dirs[kind])
    framed = [tok.ids.frame(tok.encode(text)) for text in HF_TEXTS]
    assert framed == [hf(text)["input_ids"] + [tok.ids.eos] for text in HF_TEXTS]
    assert count_tokens(tok.tok, HF_TEXTS, desc=None, added=tok.ids.added) == [len(f) for f in framed]
    assert all(f[0] == tok.ids.bos for f in framed) == (kind == "llama3")


def test_add_bos_token_without_a_post_processor_frames_with_bos_too(hf_dirs):
    """An older Llama/Mistral directory: the config says each sequence starts with BOS, tokenizer.json adds
    nothing itself (transformers 4's LlamaTokenizerFast built the post-processor from add_bos_token)."""
    tok = FramedTokenizer.load(hf_dirs["add_bos_token"])
    text_ids = tok.tok.encode(HF_TEXTS[0]).ids
    assert tok.ids.frame(tok.encode(HF_TEXTS[0])) == [0, *text_ids, 1] and tok.ids.added == 2


def test_packtrains_own_tokenizer_keeps_its_ids_and_no_bos(demo_data):
    ids = tokenizer_ids(demo_data / "tokenizer")
    assert ids == SpecialIds(eos=0, pad=1, im_start=2, im_end=3, bos=None, add_bos=False,
                             pad_from=PAD_FROM_TOKEN)
    assert ids.head == () and ids.frame([7, 8]) == [7, 8, 0]


# ---------------------------------------------------------------------------------------------------
# trainer.prepare --tokenizer DIR, then the stream
# ---------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_data(hf_dirs, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("llama_data")
    words = " ".join(HF_TEXTS).split()
    lines = [json.dumps({"text": " ".join(words[i % 7: i % 7 + 3 + i % 5])}) for i in range(60)]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare(f"jsonl:{root / 'docs.jsonl'}", root / "out", tokenizer=hf_dirs["llama3"], docs_per_shard=15,
            val_fraction=0.2)
    return root / "out"


def test_prepare_copies_the_directory_and_records_its_framing(hf_dirs, llama_data):
    src, copied = hf_dirs["llama3"], llama_data / "tokenizer"
    assert tokenizer_hash(copied) == tokenizer_hash(src)  # the identity stays tokenizer.json's bytes
    assert (copied / "tokenizer_config.json").read_bytes() == (src / "tokenizer_config.json").read_bytes()
    assert (not (src / "special_tokens_map.json").exists()
            and not (copied / "special_tokens_map.json").exists())
    manifest = json.loads((llama_data / "manifest.json").read_text())
    assert manifest["tokenizer"]["special_ids"] == {"eos": 1, "pad": 1, "pad_from": "eos", "bos": 0,
                                                    "add_bos": True, "im_start": None, "im_end": None}
    assert manifest["tokenizer"]["chat_template"] is False


def test_the_stream_frames_documents_with_bos_and_the_loss_starts_after_it(hf_dirs, llama_data):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(hf_dirs["llama3"])
    manifest = json.loads((llama_data / "manifest.json").read_text())
    data = build_data(DataConfig(path=str(llama_data), num_workers=0, prefetch=False), PackingConfig(),
                      64, 0, 0, 1)
    try:
        rows = data.rows.take(1000)  # the epoch: the stored ids, framed by the stream
    finally:
        data.rows.close()
    docs = [doc for row in rows for doc in row]
    assert sum(len(d) for d in docs) == manifest["splits"]["train"]["tokens"]  # prepare counted the BOS too
    for doc in docs:
        text = hf.decode(doc.tokens[1:-1].tolist())
        assert doc.tokens.tolist() == hf(text)["input_ids"] + [1]  # BOS, the text, EOS
    held_out = load_eval_docs(llama_data, llama_data / "tokenizer", 1, 64, None)
    assert held_out and all(d.tokens[0] == 0 and d.tokens[-1] == 1 for d in held_out)

    (batch,) = micro_batches(rows[:1], PackingConfig(), 64, 64, data.pad_id)
    starts = batch.cu_seqlens[:-1].long()[np.array(batch.segment_sources) >= 0]
    ids, labels = batch.input_ids.reshape(-1), batch.labels.reshape(-1)
    # Labels are unshifted (the loss predicts labels[t + 1] from position t): at each document's BOS the label
    # is -100, and the first target is the first text token, predicted from the BOS.
    assert (ids[starts] == 0).all() and (labels[starts] == IGNORE_INDEX).all()
    assert (labels[starts + 1] == ids[starts + 1]).all() and (ids[starts + 1] != 0).all()
