"""`python -m trainer.evaluate` on the session's real checkpoint, in process: built-in and file tasks, the
table, the JSON, packed == unpacked, and the log-likelihoods of `transformers`' GPT2LMHeadModel on the export
(1e-4)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.harness import require_module
from tests.helpers import CHECKPOINT_SEQ_LEN
from trainer.data.tokenizer import load_tokenizer
from trainer.evaluate import main
from trainer.tasks.builtins import heldout_texts
from trainer.tasks.suite import builtin_task

FILE_TASK = [{"query": "def parse(", "choices": ["self):", "x", "self, text):"], "gold": 0},
             {"query": "import", "choices": [" os", " sys"], "gold": 1}]


@pytest.fixture(scope="module")
def scored(checkpoint, tmp_path_factory) -> dict:
    """The checkpoint's scores, packed and unpacked, on the two built-ins and a task file; and the table."""
    tmp = tmp_path_factory.mktemp("evaluate")
    task_file = tmp / "mine.jsonl"
    task_file.write_text("".join(json.dumps(row) + "\n" for row in FILE_TASK))
    out = {}
    for layout in ("packed", "unpacked", "tree"):
        code = main([str(checkpoint), "--tasks", "continuation4", "cloze", str(task_file), "--packing",
                     layout, "--builtin-docs", "24", "--out", str(tmp / f"{layout}.json")])
        assert code == 0
        out[layout] = json.loads((tmp / f"{layout}.json").read_text())
    return out


def test_the_json_holds_each_tasks_metrics_and_one_loglikelihood_per_choice(scored):
    report = scored["packed"]
    assert report["packing"] == "packed" and list(report["tasks"]) == ["continuation4", "cloze", "mine"]
    mc, lm, mine = (report["tasks"][name] for name in ("continuation4", "cloze", "mine"))
    assert set(mc["metrics"]) == {"n", "acc", "acc_stderr", "acc_norm", "acc_norm_stderr", "bits_per_byte"}
    assert set(lm["metrics"]) == {"n", "acc", "acc_stderr", "loglikelihood", "loglikelihood_stderr",
                                  "bits_per_byte"}
    assert mc["metrics"]["n"] == len(mc["items"]) >= 10 and lm["metrics"]["n"] == len(lm["items"]) >= 10
    assert all(len(item["loglikelihoods"]) == 4 for item in mc["items"])
    assert [len(item["loglikelihoods"]) for item in mine["items"]] == [3, 2]
    assert [item["line"] for item in mine["items"]] == [1, 2]
    assert all(ll < 0 for item in mine["items"] + mc["items"] for ll in item["loglikelihoods"])
    assert 0 <= mc["metrics"]["acc"] <= 1 and mc["metrics"]["bits_per_byte"] > 0


def test_packed_and_unpacked_give_the_same_scores(scored):
    for name, task in scored["packed"]["tasks"].items():
        other = scored["unpacked"]["tasks"][name]
        for a, b in zip(task["items"], other["items"], strict=True):
            assert a["loglikelihoods"] == pytest.approx(b["loglikelihoods"], abs=1e-5)


def test_the_tree_layout_gives_the_packed_scores_on_the_builtins_and_a_task_file(scored):
    """Issue 57: each item's query once, its choices as branches: the packed layout's log-likelihoods to 4e-6
    and the same greedy matches, on continuation4, cloze (one choice an item: a one-branch tree) and the task
    file."""
    assert scored["tree"]["packing"] == "tree"
    for name, task in scored["packed"]["tasks"].items():
        other = scored["tree"]["tasks"][name]
        assert task["metrics"]["acc"] == other["metrics"]["acc"]
        for a, b in zip(task["items"], other["items"], strict=True):
            assert a["loglikelihoods"] == pytest.approx(b["loglikelihoods"], abs=4e-6)


def test_the_table_has_a_line_per_task(checkpoint, tmp_path, capsys):
    task_file = tmp_path / "mine.jsonl"
    task_file.write_text(json.dumps(FILE_TASK[1]) + "\n")
    assert main([str(checkpoint), "--tasks", str(task_file), "cloze", "--builtin-docs", "8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["task", "kind", "n", "acc", "acc_norm", "bits/byte"]
    assert lines[1].split()[:4] == ["mine", "multiple", "choice", "1"]
    assert lines[2].startswith("cloze") and "language modeling" in lines[2] and "±" in lines[2]


def test_loglikelihoods_equal_transformers_on_the_export(scored, demo_data, exported):
    """The checkpoint scored packed by packtrain == its export scored one sequence at a time by
    transformers."""
    transformers = require_module("transformers", "pip install transformers")
    model = transformers.GPT2LMHeadModel.from_pretrained(exported, attn_implementation="eager").float().eval()
    tok = load_tokenizer(exported)
    texts = heldout_texts(demo_data, demo_data / "tokenizer", 24)
    # as the command did
    builtin = builtin_task("continuation4", texts, 0, None, tok, CHECKPOINT_SEQ_LEN).items
    cases = [(row["query"], row["choices"], item) for row, item in
             zip(FILE_TASK, scored["packed"]["tasks"]["mine"]["items"], strict=True)]
    cases += [(i.query, i.choices, item) for i, item in
              zip(builtin[:5], scored["packed"]["tasks"]["continuation4"]["items"], strict=False)]
    worst = max(abs(ours - hf_loglikelihood(model, tok, query, choice)) for query, choices, item in cases
                for choice, ours in zip(choices, item["loglikelihoods"], strict=True))
    assert worst <= 1e-4


@torch.no_grad()
def hf_loglikelihood(model, tok, query: str, choice: str) -> float:
    """The choice's log-likelihood under transformers: query and choice tokenized apart, one forward alone."""
    q, c = (tok.encode(s, add_special_tokens=False).ids for s in (query, choice))
    logprobs = F.log_softmax(model(torch.tensor([q + c])).logits[0].float(), dim=-1)
    return float(sum(logprobs[len(q) - 1 + i, t] for i, t in enumerate(c)))
