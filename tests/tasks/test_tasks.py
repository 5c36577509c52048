"""trainer.tasks.tasks (task files, bad rows named by file and line) and trainer.tasks.builtins (held-out
tasks)."""

from __future__ import annotations

import json

import pytest

from trainer.data.tokenizer import load_tokenizer, special_ids
from trainer.tasks.builtins import cloze, continuation4, heldout_texts, pieces
from trainer.tasks.tasks import LANGUAGE_MODELING, MULTIPLE_CHOICE, Item, TaskFileError, load_task_file

MC = {"query": "2 + 2 =", "choices": [" 4", " 5"], "gold": 0}
LM = {"context": "The capital of France is", "continuation": " Paris"}


def write(path, *lines) -> str:
    path.write_bytes(b"\n".join(line if isinstance(line, bytes) else json.dumps(line).encode()
                                for line in lines))
    return str(path)


def test_both_forms_load_in_the_file_order(tmp_path):
    task = load_task_file(write(tmp_path / "arith.jsonl", MC, {**MC, "gold": 1}, b"", b"  "))
    assert (task.name, task.kind) == ("arith", MULTIPLE_CHOICE)
    assert task.items == (Item("2 + 2 =", (" 4", " 5"), 0, line=1), Item("2 + 2 =", (" 4", " 5"), 1, line=2))
    lm = load_task_file(write(tmp_path / "capitals.jsonl", LM))
    assert lm.kind == LANGUAGE_MODELING and lm.items == (Item(LM["context"], (" Paris",), 0, line=1),)


BAD_ROWS = {
    "gold past the choices": ({**MC, "gold": 2}, "gold must be an index into the 2 choices (0 to 1), got 2"),
    "gold negative": ({**MC, "gold": -1}, "got -1"),
    "gold a bool": ({**MC, "gold": True}, "got True"),
    "gold a string": ({**MC, "gold": "0"}, "got '0'"),
    "empty choice": ({**MC, "choices": [" 4", ""]}, "choice 1 must be a non-empty string, got ''"),
    "no choices": ({**MC, "choices": []}, "choices must be a non-empty list of strings"),
    "choice not a string": ({**MC, "choices": [4, 5]}, "choice 0 must be a non-empty string, got 4"),
    "empty query": ({**MC, "query": ""}, "query must be a non-empty string"),
    "empty continuation": ({**LM, "continuation": ""}, "continuation must be a non-empty string"),
    "missing key": ({"query": "q", "choices": ["a"]}, "missing key(s) ['gold']"),
    "no known key": ({"question": "q"}, "missing key(s)"),
    "not an object": (b"[1, 2]", "a JSON list, not an object"),
    "bad JSON": (b'{"query": "q",', "not JSON (Expecting"),
    "not UTF-8": (b'{"query": "caf\xe9"}', "not UTF-8 (byte 14: b'\\xe9')"),
    "mixed forms": (LM, "a language-modeling row in a multiple-choice file"),
    # issue 54: raw tracebacks, or silently one reading of the row
    "gold of 5000 digits": (b'{"query": "q", "choices": ["a", "b"], "gold": ' + b"9" * 5000 + b"}",
                            "Exceeds the limit (4300 digits) for integer string conversion"),
    "nested 200k deep": (b'{"query": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", "JSON nested too deeply"),
    "lone surrogate": (b'{"query": "q\\ud800", "choices": ["a", "b"], "gold": 0}',
                       "query holds a lone surrogate ('\\ud800' at character 1)"),
    "duplicate key": (b'{"query": "q", "choices": ["a", "b"], "gold": 0, "gold": 1}',
                      "key 'gold' appears twice in one object"),
    "both forms": ({**MC, **LM},
                   "holds keys of both forms (['query', 'choices', 'gold', 'context', 'continuation'])"),
    "gold's twin": ({**MC, "choices": [" 4", " 4"]}, "choice 1 is the gold choice 0's text again (' 4')"),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_row_is_one_error_naming_the_file_and_the_line(tmp_path, case):
    row, phrase = BAD_ROWS[case]
    first = LM if case == "empty continuation" else MC  # line 1 good, of the form line 2 has (or not)
    path = write(tmp_path / "task.jsonl", first, row)
    with pytest.raises(TaskFileError) as caught:
        load_task_file(path)
    message = str(caught.value)
    assert message.startswith(f"{path}:2: ") and phrase in message and "\n" not in message, message


def test_a_missing_or_empty_file_is_named(tmp_path):
    with pytest.raises(TaskFileError, match="no such task file"):
        load_task_file(tmp_path / "nope.jsonl")
    with pytest.raises(TaskFileError, match="holds no items"):
        load_task_file(write(tmp_path / "empty.jsonl", b""))


# ---------------------------------------------------------------------------------------------------
# Built-in tasks
# ---------------------------------------------------------------------------------------------------

WORDS = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho "
         "sigma").split()
TEXTS = [f"def f{i}(x):\n    return " + " ".join(WORDS[(5 * i + 3 * k) % len(WORDS)]
                                                 for k in range(8 + i % 7))
         for i in range(12)]


def test_pieces_keep_the_text_and_its_whitespace():
    assert pieces("def parse(s):\n    return s\n") == ["def", " parse(s):", "\n    return", " s"]
    assert "".join(pieces(TEXTS[3])) == TEXTS[3]


def test_continuation4_holds_the_true_continuation_among_4_of_similar_length():
    task = continuation4(TEXTS, seed=0)
    assert task.kind == MULTIPLE_CHOICE and len(task.items) == len(TEXTS)
    golds = set()
    for text, item in zip(TEXTS, task.items, strict=True):
        gold = item.choices[item.gold]
        assert text.startswith(item.query + gold)  # a prefix of the document as written
        assert gold[0].isspace() and not item.query[-1].isspace()  # the space starts the choice
        assert len(item.choices) == 4 == len(set(item.choices))
        assert max(abs(len(c) - len(gold)) for c in item.choices) <= 12
        golds.add(item.gold)
    assert golds == {0, 1, 2, 3}  # the gold's position is drawn, not fixed
    assert continuation4(TEXTS, seed=0) == task  # deterministic
    assert continuation4(TEXTS, seed=1) != task


def test_cloze_asks_for_the_last_word_of_the_opening():
    task = cloze(TEXTS)
    assert task.kind == LANGUAGE_MODELING and len(task.items) == len(TEXTS)
    for text, item in zip(TEXTS, task.items, strict=True):
        (word,) = item.choices
        assert text.startswith(item.query + word) and word[0] == " " and word.strip().isidentifier()


def test_heldout_texts_are_the_val_documents_decoded_exactly(demo_data):
    tok_dir = demo_data / "tokenizer"
    tok = load_tokenizer(tok_dir)
    texts = heldout_texts(demo_data, tok_dir, max_docs=20)
    assert len(texts) == 20
    from trainer.data.feed import load_eval_docs

    docs = load_eval_docs(demo_data, tok_dir, special_ids(tok).eos, 10**9, max_docs=20)
    assert [tok.encode(t, add_special_tokens=False).ids + [special_ids(tok).eos] for t in texts] == [
        d.tokens.tolist() for d in docs]
    assert len(continuation4(texts).items) >= 15 and len(cloze(texts).items) >= 15
