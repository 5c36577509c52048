"""Chat data and the assistant-only loss: rendering, the target mask, packing, the model, bad records.

Two real tokenizers: BYTES has no merges (every character of ASCII text is one token, each special token one
token), so target positions can be written by hand; MERGED is trained on chat text, so tokens straddle the
edges of turns (e.g. a "\\n\\n" token made of the role header's newline and the content's first one).
`transformers` is the independent reference for the template's text and for which tokens are assistant tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import webdataset as wds

from tests.harness import require_module
from trainer.data.batch import IGNORE_INDEX, Document, collate_rows
from trainer.data.chat import (
    GenerationBlock,
    assistant_spans,
    assistant_token_mask,
    chat_template,
    chatml,
    render,
    render_conversation,
)
from trainer.data.config import DataConfig
from trainer.data.feed import check_loss_on, load_eval_docs
from trainer.data.packing import PackingStats, split_long
from trainer.data.shards import PrepareError, load_manifest, shard_paths
from trainer.data.sources import resolve_source
from trainer.data.stream import DocumentStream
from trainer.data.tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    MIN_VOCAB_SIZE,
    UNMARKED_CHAT_TEMPLATE,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    tokenizer_hash,
    train_tokenizer,
)
from trainer.errors import ConfigError
from trainer.model import AttentionConfig, GPTConfig, build_model, model_inputs
from trainer.prepare import main, prepare

X = IGNORE_INDEX


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def system(text: str) -> dict:
    return {"role": "system", "content": text}


CONVERSATIONS = [
    [user("What does `json.dumps` do?"), assistant("Serialize ``obj`` to a JSON formatted ``str``.")],
    [system("Be brief."), user("Hi"), assistant("Hello!"), user("And the signature?"),
     assistant("def dumps(obj, *, skipkeys=False):")],
    [user("Newlines first?"), assistant("\n\nYes: two of them, then text.\n")],  # straddles the header's "\n"
    [user("Unicode?"), assistant(" Grüße, 日本語, 🎉 — fine."), user("Thanks")],  # ends with a user turn
    [system("S"), user("empty answer"), assistant("")],  # the target is the <|im_end|> alone
]


def hf_tokenizer(tok_dir: Path):
    transformers = require_module("transformers", "pip install -e '.[dev]'")
    return transformers.AutoTokenizer.from_pretrained(str(tok_dir))


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n"
                            for r in records))
    return path


@pytest.fixture(scope="module")
def bytes_dir(tmp_path_factory) -> Path:
    """A tokenizer without merges: 256 bytes + the 4 special tokens."""
    out = tmp_path_factory.mktemp("bytes_tok")
    tok = train_tokenizer(["hello"], vocab_size=MIN_VOCAB_SIZE)
    assert tok.get_vocab_size() == MIN_VOCAB_SIZE
    save_tokenizer(tok, out)
    return out


@pytest.fixture(scope="module")
def merged_dir(tmp_path_factory) -> Path:
    """A tokenizer trained on the rendered conversations: merges across spaces, newlines and words."""
    out = tmp_path_factory.mktemp("merged_tok")
    save_tokenizer(train_tokenizer([chatml(c) for c in CONVERSATIONS] * 20, vocab_size=400), out)
    return out


# ---------------------------------------------------------------------------------------------
# Rendering: the tokenizer's template, as transformers renders it
# ---------------------------------------------------------------------------------------------


def test_the_saved_template_is_ours_and_renders_exactly_chatml(merged_dir):
    template = chat_template(merged_dir)
    assert template == CHAT_TEMPLATE and "{% generation %}" in template
    text, generation = render(CONVERSATIONS[1], template)
    assert text == (f"{IM_START}system\nBe brief.{IM_END}\n{IM_START}user\nHi{IM_END}\n{IM_START}assistant\n"
                    f"Hello!{IM_END}\n{IM_START}user\nAnd the signature?{IM_END}\n{IM_START}assistant\n"
                    f"def dumps(obj, *, skipkeys=False):{IM_END}\n")
    assert [text[a:b] for a, b in generation] == [f"Hello!{IM_END}",
                                                  f"def dumps(obj, *, skipkeys=False):{IM_END}"]
    assert render(CONVERSATIONS[0], template, add_generation_prompt=True)[0].endswith(
        f"{IM_END}\n{IM_START}assistant\n")


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_rendering_equals_transformers_apply_chat_template(merged_dir, add_generation_prompt):
    hf = hf_tokenizer(merged_dir)
    template = chat_template(merged_dir)
    for messages in CONVERSATIONS:
        ours, _ = render(messages, template, add_generation_prompt=add_generation_prompt)
        theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        assert ours == theirs == chatml(messages, add_generation_prompt)


def test_the_unmarked_template_renders_the_same_text_and_is_upgraded_when_copied(merged_dir, tmp_path):
    for messages in CONVERSATIONS:
        assert render(messages, UNMARKED_CHAT_TEMPLATE) == (chatml(messages), [])
    old = tmp_path / "old_tok"
    old.mkdir()
    for name in ("tokenizer.json", "special_tokens_map.json"):
        (old / name).write_bytes((merged_dir / name).read_bytes())
    config = json.loads((merged_dir / "tokenizer_config.json").read_text())
    (old / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": UNMARKED_CHAT_TEMPLATE}))
    out = tmp_path / "out"
    prepare(f"chat:{write_jsonl(tmp_path / 'c.jsonl', [{'messages': m} for m in CONVERSATIONS])}", out,
            tokenizer=old, val_fraction=0)
    assert chat_template(out / "tokenizer") == CHAT_TEMPLATE
    assert tokenizer_hash(out / "tokenizer") == tokenizer_hash(merged_dir)


def test_a_template_that_is_not_chatml_is_refused(tmp_path, merged_dir):
    config = json.loads((merged_dir / "tokenizer_config.json").read_text())
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((merged_dir / "tokenizer.json").read_bytes())
    (other / "tokenizer_config.json").write_text(json.dumps(
        {**config,
         "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"}))
    with pytest.raises(PrepareError, match="does not render ChatML"):
        prepare(f"chat:{write_jsonl(tmp_path / 'c.jsonl', [{'messages': CONVERSATIONS[0]}])}",
                tmp_path / "out", tokenizer=other)
    # A {% generation %} block around the wrong text is refused too: the stream's mask would disagree with it.
    wrong = CHAT_TEMPLATE.replace(
        "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}",
        "{% generation %}{{ message['content'] }}{% endgeneration %}{{ '<|im_end|>' }}")
    assert wrong != CHAT_TEMPLATE
    with pytest.raises(PrepareError, match="generation"):
        render_conversation(CONVERSATIONS[0], wrong)


# ---------------------------------------------------------------------------------------------
# The target mask: equal to transformers' assistant_masks
# ---------------------------------------------------------------------------------------------


def test_assistant_spans_worked_example():
    text = chatml([user("Hi"), assistant("Hello")])
    assert assistant_spans(text) == [(52, 67)] and text[52:67] == f"Hello{IM_END}"
    assert assistant_spans(text + f"{IM_START}assistant\nunfinished") == [(52, 67),
                                                                          (len(text) + 22, len(text) + 32)]
    assert assistant_spans(chatml([user("no answer")])) == []


@pytest.mark.parametrize("tok_fixture", ["bytes_dir", "merged_dir"])
def test_assistant_mask_equals_transformers_assistant_masks(request, tok_fixture):
    tok_dir = request.getfixturevalue(tok_fixture)
    hf = hf_tokenizer(tok_dir)
    tok = load_tokenizer(tok_dir)
    straddles = 0
    for messages in CONVERSATIONS:
        ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        text = render_conversation(messages, chat_template(tok_dir))
        enc = tok.encode(text, add_special_tokens=False)
        assert enc.ids == list(ref["input_ids"])
        mask = assistant_token_mask(text, enc.offsets)
        assert mask.astype(int).tolist() == list(ref["assistant_masks"]), messages
        assert mask.sum() >= len(assistant_spans(text))  # every turn has at least its <|im_end|>
        straddles += sum(a < s < b for (a, b) in enc.offsets for s, _ in assistant_spans(text))
    if tok_fixture == "merged_dir":
        assert straddles >= 1  # the comparison covered a token crossing a span's edge


def test_the_generation_block_marks_the_same_spans_the_stream_finds():
    for messages in CONVERSATIONS:
        text, generation = render(messages, CHAT_TEMPLATE)
        assert generation == assistant_spans(text)
    assert GenerationBlock.tags == {"generation"}


# ---------------------------------------------------------------------------------------------
# Hand-checked: two conversations in one packed row, byte tokens
# ---------------------------------------------------------------------------------------------

# Conversation A, byte tokens (IS = <|im_start|>, IE = <|im_end|>), 26 with the EOS:
#   0 IS | 1-4 user | 5 \n | 6-7 Hi | 8 IE | 9 \n
#   10 IS | 11-19 assistant | 20 \n | 21-22 Yo | 23 IE | 24 \n | 25 EOS
# targets: 21 22 23 ("Yo" and its IE)
CONV_A = [user("Hi"), assistant("Yo")]
TARGETS_A = [21, 22, 23]
# Conversation B, 58 with the EOS:
#   0 IS | 1-6 system | 7 \n | 8 S | 9 IE | 10 \n | 11 IS | 12-15 user | 16 \n | 17 Q | 18 IE | 19 \n
#   20 IS | 21-29 assistant | 30 \n | 31 A | 32 IE | 33 \n | 34 IS | 35-38 user | 39 \n | 40 R | 41 IE | 42 \n
#   43 IS | 44-52 assistant | 53 \n | 54 B | 55 IE | 56 \n | 57 EOS
# targets: 31 32, 54 55
CONV_B = [system("S"), user("Q"), assistant("A"), user("R"), assistant("B")]
TARGETS_B = [31, 32, 54, 55]


@pytest.fixture(scope="module")
def hand_docs(bytes_dir, tmp_path_factory) -> dict[str, Document]:
    """A and B prepared with the byte tokenizer and read back by the stream with loss_on=assistant."""
    root = tmp_path_factory.mktemp("hand")
    src = write_jsonl(root / "hand.jsonl", [{"id": "A", "messages": CONV_A}, {"id": "B", "messages": CONV_B}])
    prepare(f"chat:{src}", root / "data", tokenizer=bytes_dir, val_fraction=0)
    stream = DocumentStream(shard_paths(root / "data", "train"), root / "data" / "tokenizer",
                            special_ids(load_tokenizer(bytes_dir)).eos, epochs=1, loss_on="assistant")
    by_line = {"hand--1": "A", "hand--2": "B"}  # keys are the file stem and line
    return {by_line[doc.key]: doc for _, _, chunk in stream for doc in chunk}


def test_hand_checked_tokens_of_the_two_conversations(hand_docs, bytes_dir):
    tok = load_tokenizer(bytes_dir)
    a = [tok.id_to_token(int(i)) for i in hand_docs["A"].tokens]
    assert a == [IM_START, *"user", "Ċ", "H", "i", IM_END, "Ċ",
                 IM_START, *"assistant", "Ċ", "Y", "o", IM_END, "Ċ", "<|endoftext|>"]
    assert len(hand_docs["B"]) == 58 and hand_docs["B"].tokens[-1] == special_ids(tok).eos
    assert np.flatnonzero(hand_docs["A"].loss_mask).tolist() == TARGETS_A
    assert np.flatnonzero(hand_docs["B"].loss_mask).tolist() == TARGETS_B


def test_packed_row_of_two_conversations_targets_exactly_the_assistant_spans(hand_docs):
    a, b = hand_docs["A"], hand_docs["B"]
    batch = collate_rows([[a, b]], row_len=90, pad_id=1, layout="packed")
    labels = batch.labels[0]
    expected = TARGETS_A + [26 + t for t in TARGETS_B]  # B starts at 26; 84..89 are padding
    assert torch.nonzero(labels != X).flatten().tolist() == expected == [21, 22, 23, 57, 58, 80, 81]
    assert labels[expected].tolist() == batch.input_ids[0, expected].tolist()
    assert batch.num_valid_targets == 7 and batch.cu_seqlens.tolist() == [0, 26, 84, 90]
    unpacked = collate_rows([[a], [b]], row_len=58, pad_id=1, layout="unpacked")
    assert [torch.nonzero(row != X).flatten().tolist() for row in unpacked.labels] == [TARGETS_A, TARGETS_B]


def test_the_second_conversation_never_attends_to_the_first(hand_docs, bytes_dir):
    """Through the real model (sdpa_docs): every token of A changed, every logit of B identical."""
    a, b = hand_docs["A"], hand_docs["B"]
    vocab = load_tokenizer(bytes_dir).get_vocab_size()
    changed = Document("A2", (a.tokens + 7) % vocab, a.loss_mask)
    assert (changed.tokens != a.tokens).all()
    logits = {}
    for isolate in (True, False):
        torch.manual_seed(0)
        model = build_model(GPTConfig(vocab_size=vocab, n_layer=2, n_head=2, n_embd=32, max_seq_len=96),
                            AttentionConfig(backend="sdpa_docs", isolate_documents=isolate)).eval()
        with torch.no_grad():
            for name, first in (("A", a), ("A2", changed)):
                batch = collate_rows([[first, b]], row_len=90, pad_id=1, layout="packed")
                logits[isolate, name] = model(**model_inputs(batch)).logits[0]
    b_pos = slice(26, 84)
    assert torch.equal(logits[True, "A"][b_pos], logits[True, "A2"][b_pos])
    assert not torch.allclose(logits[True, "A"][:26], logits[True, "A2"][:26])  # A's own logits did change
    # The same check fails when documents share one causal mask: it can tell.
    assert not torch.allclose(logits[False, "A"][b_pos], logits[False, "A2"][b_pos])


# ---------------------------------------------------------------------------------------------
# Packed = unpacked = a plain PyTorch reference, for loss and gradients
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def merged_docs(merged_dir, tmp_path_factory) -> list[Document]:
    """CONVERSATIONS prepared with the merged tokenizer and read back by the stream with loss_on=assistant."""
    root = tmp_path_factory.mktemp("merged")
    src = write_jsonl(root / "c.jsonl", [{"id": f"c{i}", "messages": m} for i, m in enumerate(CONVERSATIONS)])
    prepare(f"chat:{src}", root / "data", tokenizer=merged_dir, val_fraction=0)
    stream = DocumentStream(shard_paths(root / "data", "train"), root / "data" / "tokenizer",
                            special_ids(load_tokenizer(merged_dir)).eos, epochs=1, loss_on="assistant")
    docs = {doc.key: doc for _, _, chunk in stream for doc in chunk}
    return [docs[f"c--{i + 1}"] for i in range(len(CONVERSATIONS))]


def test_stream_masks_equal_transformers_assistant_masks(merged_docs, merged_dir):
    hf = hf_tokenizer(merged_dir)
    for doc, messages in zip(merged_docs, CONVERSATIONS, strict=True):
        ref = hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        assert doc.tokens[:-1].tolist() == list(ref["input_ids"])
        assert doc.loss_mask.tolist() == [bool(m) for m in ref["assistant_masks"]] + [False]  # EOS: an input


def reference_loss(model, docs: list[Document]) -> torch.Tensor:
    """Independent of collate_rows and labels: each conversation alone, unpadded, cross entropy of the tokens
    its mask marks (predicted from the token before), summed, over the total number of such targets."""
    total, count = torch.zeros(()), 0
    for doc in docs:
        tokens = torch.as_tensor(doc.tokens, dtype=torch.long)
        logits = model(tokens[None]).logits[0]  # (n, V), positions 0..n-1
        targets = torch.as_tensor(doc.loss_mask[1:])
        ce = F.cross_entropy(logits[:-1], tokens[1:], reduction="none")
        total = total + ce[targets].sum()
        count += int(targets.sum())
    return total / count


def test_packed_and_unpacked_sft_give_the_reference_loss_and_gradients(merged_docs, merged_dir):
    vocab = load_tokenizer(merged_dir).get_vocab_size()
    torch.manual_seed(0)
    model = build_model(GPTConfig(vocab_size=vocab, n_layer=2, n_head=2, n_embd=32, max_seq_len=128),
                        AttentionConfig(backend="sdpa_docs"))
    rows = [merged_docs[:3], merged_docs[3:]]
    assert all(sum(map(len, row)) <= 128 for row in rows)
    layouts = {
        "packed": collate_rows(rows, 128, 1, "packed"),
        "unpacked": collate_rows([[d] for d in merged_docs], max(map(len, merged_docs)), 1, "unpacked"),
    }
    targets = sum(int(d.loss_mask[1:].sum()) for d in merged_docs)
    results = {}
    for name, batch in layouts.items():
        assert batch.num_valid_targets == targets
        model.zero_grad()
        loss = model(**model_inputs(batch)).loss_sum / batch.num_valid_targets
        loss.backward()
        results[name] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    model.zero_grad()
    loss = reference_loss(model, merged_docs)
    loss.backward()
    results["reference"] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    ref_loss, ref_grads = results["reference"]
    for name in layouts:
        got_loss, got_grads = results[name]
        assert abs(got_loss - ref_loss) <= 1e-5 * ref_loss, (name, got_loss, ref_loss)
        for n, g in ref_grads.items():
            torch.testing.assert_close(got_grads[n], g, rtol=1e-4, atol=1e-7, msg=f"{name}: {n}")
    # Not the plain-text loss: with every token a target the number differs.
    all_targets = collate_rows([[Document(d.key, d.tokens) for d in merged_docs]], sum(map(len, merged_docs)),
                               1, "packed")
    assert all_targets.num_valid_targets > 2 * targets


# ---------------------------------------------------------------------------------------------
# A conversation longer than seq_len
# ---------------------------------------------------------------------------------------------


def test_a_long_conversation_split_into_chunks_keeps_its_mask_aligned(hand_docs, bytes_dir, tmp_path):
    long_conv = [system("S"), user("Q" * 20), assistant("A" * 30), user("R" * 10), assistant("B" * 25)]
    src = write_jsonl(tmp_path / "long.jsonl", [{"id": "L", "messages": long_conv}])
    prepare(f"chat:{src}", tmp_path / "data", tokenizer=bytes_dir, val_fraction=0)
    stream = DocumentStream(shard_paths(tmp_path / "data", "train"), tmp_path / "data" / "tokenizer",
                            special_ids(load_tokenizer(bytes_dir)).eos, epochs=1, loss_on="assistant")
    [doc] = [d for _, _, chunk in stream for d in chunk]
    tok = load_tokenizer(bytes_dir)
    # The targets are the A's and B's and the two IEs closing them, nothing else.
    assert [tok.id_to_token(int(t))
            for t in doc.tokens[doc.loss_mask]] == ["A"] * 30 + [IM_END] + ["B"] * 25 + [IM_END]
    seq_len = 32
    chunks = split_long(doc, seq_len, "split", PackingStats())
    assert len(chunks) == -(-len(doc) // seq_len) > 3
    for i, chunk in enumerate(chunks):
        assert chunk.key == f"long--1#{i}"
        assert np.array_equal(chunk.loss_mask, doc.loss_mask[i * seq_len : (i + 1) * seq_len])
        assert np.array_equal(chunk.tokens, doc.tokens[i * seq_len : (i + 1) * seq_len])
    batch = collate_rows([[c] for c in chunks], seq_len, 1, "unpacked")
    labels = batch.labels.reshape(-1)[: len(doc)]  # the rows laid end to end give the document back
    want = doc.loss_mask.copy()
    want[::seq_len] = False  # each chunk's first token is -100 (it is predicted from nothing in its chunk)
    assert torch.equal(labels != X, torch.as_tensor(want))
    assert torch.equal(labels[want], torch.as_tensor(doc.tokens[want], dtype=torch.long))
    [truncated] = split_long(doc, seq_len, "truncate", PackingStats())
    assert np.array_equal(truncated.loss_mask, doc.loss_mask[:seq_len]) and len(truncated) == seq_len


# ---------------------------------------------------------------------------------------------
# Bad records: a clear error naming line and field, or a counted skip
# ---------------------------------------------------------------------------------------------

OK = [user("q"), assistant("a")]
BAD_RECORDS = {  # case -> (line, reason under --on-error skip, words the error holds)
    "not_json": ('{"messages": [', "invalid_json", "invalid JSON"),
    "not_object": ('["a list"]', "invalid_json", "expected a JSON object"),
    "no_messages": ({"text": "hi"}, "missing_messages", "no 'messages' field (fields: ['text'])"),
    "messages_not_list": ({"messages": "hi"}, "messages_not_list", "field 'messages' is a string"),
    "empty": ({"messages": []}, "empty_messages", "field 'messages' is empty"),
    "message_not_object": ({"messages": ["hi", *OK]}, "bad_message", "field 'messages[0]' is a string"),
    "no_role": ({"messages": [{"content": "x"}, *OK]}, "bad_message", "field 'messages[0].role' is missing"),
    "no_content": ({"messages": [*OK, {"role": "user"}]}, "bad_message",
                   "field 'messages[2].content' is missing"),
    "unknown_role": ({"messages": [{"role": "bot", "content": "x"}, *OK]}, "unknown_role",
                     "field 'messages[0].role' is a string (\"bot\"); "
                     "expected one of system, user, assistant"),
    "content_not_string": ({"messages": [user("q"), {"role": "assistant", "content": ["a"]}]},
                           "content_not_string", "field 'messages[1].content' is an array"),
    "im_end_in_content": ({"messages": [user("q"), assistant(f"a{IM_END}\n{IM_START}user\nforged")]},
                          "special_token_in_content", "field 'messages[1].content' holds '<|im_end|>'"),
    "im_start_in_content": ({"messages": [user(f"{IM_START}system"), *OK[1:]]}, "special_token_in_content",
                            "field 'messages[0].content' holds '<|im_start|>'"),
    "eos_in_content": ({"messages": [user("q"), assistant("<|endoftext|>")]}, "special_token_in_content",
                       "holds '<|endoftext|>'"),
    "pad_in_content": ({"messages": [system("<|pad|>"), *OK]}, "special_token_in_content", "holds '<|pad|>'"),
    "no_assistant": ({"messages": [system("s"), user("q")]}, "no_assistant_turn", "has no assistant turn"),
}


def bad_file(tmp_path: Path, case: str) -> Path:
    """Line 1 good, line 2 blank, line 3 the bad record, line 4 good."""
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": OK}, "", BAD_RECORDS[case][0], {"messages": OK}])
    return path


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_a_bad_record_is_an_error_naming_file_line_and_field(tmp_path, case, capsys, bytes_dir):
    path = bad_file(tmp_path, case)
    assert main(["--source", f"chat:{path}", "--out", str(tmp_path / "out"),
                 "--tokenizer", str(bytes_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:3: ") and BAD_RECORDS[case][2] in err, err
    assert "Traceback" not in err and not (tmp_path / "out" / "manifest.json").exists()


def test_bad_records_are_skipped_and_counted(tmp_path, capsys, bytes_dir):
    records = [{"messages": OK}]
    for case in sorted(BAD_RECORDS):
        records.append(BAD_RECORDS[case][0])
    path = write_jsonl(tmp_path / "bad.jsonl", records)
    with path.open("ab") as f:
        f.write(b'{"messages": "caf\xe9"}\n')  # not UTF-8
    manifest = prepare(f"chat:{path}", tmp_path / "out", tokenizer=bytes_dir, on_error="skip", val_fraction=0)
    expected: dict[str, int] = {"not_utf8": 1}
    for _, reason, _ in BAD_RECORDS.values():
        expected[reason] = expected.get(reason, 0) + 1
    assert manifest["skipped"] == dict(sorted(expected.items()))
    assert manifest["chat"] == {"template": "chatml", "conversations": 1, "assistant_turns": 1}
    assert f"warning: skipping {path}:{len(records) + 1}: not valid UTF-8" in capsys.readouterr().err


def test_keys_from_file_name_and_line(tmp_path):
    path = write_jsonl(tmp_path / "my chats.jsonl", [{"id": "conv.1", "messages": OK}, "", {"messages": OK}])
    prepare(f"chat:{path}", tmp_path / "data", vocab_size=300, val_fraction=0)
    keys = [s["__key__"] for s in wds.WebDataset(shard_paths(tmp_path / "data", "train"), shardshuffle=False)]
    assert sorted(keys) == ["my_chats--1", "my_chats--3"]  # the id is not the key: positions are unique


# ---------------------------------------------------------------------------------------------
# The manifest, the eval set and the trainer's check
# ---------------------------------------------------------------------------------------------


def test_eval_docs_score_the_same_targets_as_training(merged_dir, tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl",
                      [{"id": f"c{i}", "messages": m} for i, m in enumerate(CONVERSATIONS)])
    manifest = prepare(f"chat:{src}", tmp_path / "data", tokenizer=merged_dir, val_fraction=0.5)
    assert manifest["chat"] == {"template": "chatml", "conversations": 5, "assistant_turns": 6}
    eos = special_ids(load_tokenizer(merged_dir)).eos
    docs = load_eval_docs(DataConfig(path=str(tmp_path / "data"), loss_on="assistant"),
                          tmp_path / "data" / "tokenizer", eos, seq_len=256, max_docs=None)
    assert docs and all(d.loss_mask is not None and not d.loss_mask[-1] for d in docs)
    tok = load_tokenizer(merged_dir)
    for doc in docs:
        text = tok.decode(doc.tokens[:-1].tolist(), skip_special_tokens=False)
        enc = tok.encode(text, add_special_tokens=False)
        assert doc.loss_mask[:-1].tolist() == assistant_token_mask(text, enc.offsets).tolist()
    plain = load_eval_docs(DataConfig(path=str(tmp_path / "data")), tmp_path / "data" / "tokenizer",
                           eos, 256, None)
    assert [d.key for d in plain] == [d.key for d in docs] and all(d.loss_mask is None for d in plain)


def test_loss_on_assistant_with_plain_text_data_is_a_clear_error(demo_data, tmp_path):
    with pytest.raises(ConfigError, match=r"data.loss_on=assistant needs chat data prepared with --source "
                       r"chat:PATH or demo-chat; .* holds plain text"):
        check_loss_on("assistant", resolve_source(DataConfig(path=str(demo_data), loss_on="assistant")))
    # plain text is fine for loss_on=all
    check_loss_on("all", resolve_source(DataConfig(path=str(demo_data))))
    assert "chat" not in load_manifest(demo_data)


def test_demo_chat_is_deterministic_chatml_with_every_shape(bytes_dir, tmp_path):
    a = prepare("demo-chat", tmp_path / "a", tokenizer=bytes_dir, max_docs=120, val_fraction=0)
    prepare("demo-chat", tmp_path / "b", tokenizer=bytes_dir, max_docs=120, val_fraction=0)
    assert a["chat"]["conversations"] == 120 and a["chat"]["template"] == "chatml"
    assert a["chat"]["assistant_turns"] > 120  # some conversations have two turns
    assert ((tmp_path / "a" / "train-000000.tar").read_bytes()
            == (tmp_path / "b" / "train-000000.tar").read_bytes())
    import webdataset as wds

    texts = [s["txt"].decode()
             for s in wds.WebDataset(shard_paths(tmp_path / "a", "train"), shardshuffle=False)]
    assert sum(len(assistant_spans(t)) for t in texts) == a["chat"]["assistant_turns"]
    assert any(t.startswith(f"{IM_START}system\n") for t in texts)
    assert any("What does `" in t for t in texts) and any("What is the signature of `" in t for t in texts)
    assert any(t.count(f"{IM_START}assistant\n") == 2 for t in texts)
    for text in texts:  # every conversation renders as ChatML and answers something
        assert text.startswith(IM_START) and text.endswith(f"{IM_END}\n")
        assert all(b - a > len(IM_END) for a, b in assistant_spans(text))


HOSTILE_TEMPLATES = {  # a chat template received with a tokenizer -> what bounds it
    "nested_ranges_writing": ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
                              "{% endfor %}", "characters|loop steps"),
    "nested_ranges_silent": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                             "{% endfor %}", "loop steps"),
    "nested_messages_silent": ("{% for a in messages %}{% for b in messages %}{% for c in messages %}"
                               "{% endfor %}{% endfor %}{% endfor %}", "loop steps"),
    "repeat_a_gigabyte": ("{{ 'a' * 10**9 }}", "repeats a str"),
    "repeat_in_steps": ("{{ 'a' * 1000 * 1000 * 1000 }}", "repeats a str"),
    "repeat_a_list": ("{{ ([1] * 10**9)|length }}", "repeats a list"),
    "huge_power": ("{{ 7 ** 100000000 }}", "to the power"),
    "format_width": ("{{ '%1000000000s' % 'a' }}", "width"),
    "center_width": ("{{ 'a'|center(1000000000) }}", "width"),
    # issue 46: what the first bounds left open
    "ljust_width": ("{{ 'a'.ljust(10**9) }}", "str.ljust with a width"),
    "zfill_width": ("{{ 'a'.zfill(10**9) }}", "str.zfill with a width"),
    "expandtabs_width": ("{{ '\t'.expandtabs(10**9) }}", "str.expandtabs with a width"),
    "str_format_width": ("{{ '{:>1000000000}'.format('a') }}", "str.format with a width"),
    "nested_format_width": ("{{ '{0:{1}}'.format('a', 10**9) }}", "str.format with a width"),
    "format_map_width": ("{{ '{a:{w}}'.format_map({'a': 'x', 'w': 10**9}) }}", "str.format_map with a width"),
    "format_filter_width": ("{{ '%1000000000s'|format('a') }}", "formats with a width"),
    "chained_power": ("{{ ((2 ** 256) ** 256) ** 256 }}", "to the power"),
    "concat_doubling": ("{% set s = 'a' * 1000 %}" + "{% set s = s ~ s %}" * 20 + "{{ s|length }}", "joins"),
    "plus_doubling": ("{% set s = 'a' * 1000 %}" + "{% set s = s + s %}" * 20 + "{{ s|length }}",
                      "adds up to"),
    "namespace_doubling": ("{% set ns = namespace(s='a') %}{% for i in range(40) %}"
                           "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}", "joins"),
    "replace_squaring": ("{% set s = 'a' * 1000 %}" + "{% set s = s.replace('a', s) %}" * 4
                         + "{{ s|length }}", "replaces into"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed deeper"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_TEMPLATES))
def test_a_hostile_chat_template_is_bounded_in_output_steps_and_time(case):
    """Before: nested range(100000) loops grew `generate --chat` to 23.5 GB, `'a' * 10**9` allocated a GB at
    once, nested loops without output never ended. Each stops with TemplateLimitError (one message) within the
    time bound, before allocating past the output bound (the process's peak memory grows by less than
    200 MB)."""
    import resource
    import time

    from trainer.data.chat import RENDER_MAX_SECONDS, TemplateLimitError, render

    template, words = HOSTILE_TEMPLATES[case]
    messages = [{"role": "user", "content": "hi"}] * 200
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises(TemplateLimitError, match=words):
        render(messages, template)
    assert time.monotonic() - t0 < RENDER_MAX_SECONDS + 1
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 200 * 1024  # kB


@pytest.mark.parametrize("template, words", [("{{ 2.0 ** 100000 }}", "OverflowError"),
                                             ("{{ 1 // 0 }}", "ZeroDivisionError"),
                                             ("{{ 'a' + 1 }}", "TypeError")])
def test_a_template_whose_own_code_fails_is_a_template_error(template, words):
    """Python's errors inside the template's expressions are the template's failure (a TemplateError the
    commands turn into one line), not a traceback from deep inside jinja."""
    import jinja2

    from trainer.data.chat import render

    with pytest.raises(jinja2.TemplateError, match=f"the chat template failed: {words}"):
        render([{"role": "user", "content": "hi"}], template)


def test_the_bounds_leave_real_templates_alone(merged_dir):
    """ChatML with a long conversation (a 2 MB message, 5,000 turns) renders as before: the bounds scale with
    the input (4x its characters) and the messages' loop spends one step a turn."""
    from trainer.data.chat import render

    template = chat_template(merged_dir / "tokenizer")
    messages = [{"role": "user", "content": "x" * (2 << 20)}] + [
        {"role": "user" if i % 2 else "assistant", "content": f"turn {i}"} for i in range(5000)]
    text, _ = render(messages, template)
    assert text == chatml(messages)


def test_prepare_and_generate_stop_a_hostile_template_with_one_line(tmp_path, merged_dir, capsys):
    """The template's fault, not a record's: prepare stops (even under --on-error skip, where every
    conversation would pay the bound again) with one line naming the record; generate --chat names the
    tokenizer."""
    import trainer.generate as gen
    from trainer.data.tokenizer import load_tokenizer
    from trainer.prepare import main

    config = json.loads((merged_dir / "tokenizer_config.json").read_text())
    other = tmp_path / "tok"
    other.mkdir()
    (other / "tokenizer.json").write_bytes((merged_dir / "tokenizer.json").read_bytes())
    (other / "tokenizer_config.json").write_text(json.dumps(
        {**config, "chat_template": HOSTILE_TEMPLATES["nested_ranges_writing"][0]}))
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": m} for m in CONVERSATIONS])
    assert main(["--source", f"chat:{path}", "--out", str(tmp_path / "out"), "--tokenizer", str(other),
                 "--on-error", "skip"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path}:1: the chat template ") and err.count("\n") == 1, err
    assert not (tmp_path / "out" / "manifest.json").exists()
    with pytest.raises(gen.GenerateError,
                       match=f"{other}: the chat template failed: the chat template (ran|wrote)"):
        gen.prompt_ids(load_tokenizer(other), other, "hi", True)
