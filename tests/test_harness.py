"""lm-evaluation-harness on a packtrain checkpoint (trainer.harness): a task YAML whose dataset is a local
JSON file scores what `python -m trainer.evaluate` scores on the same items, and the rolling log-likelihood is
the model's own, computed here in plain PyTorch."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from tests.harness import require_module
from trainer.evaluate import main as evaluate_main
from trainer.generate import load
from trainer.harness import write_task_yaml

ROLLING_YAML = """task: packtrain_rolling
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: text
metric_list:
  - metric: word_perplexity
"""


@pytest.fixture(scope="module")
def tasks(checkpoint, tmp_path_factory):
    """A multiple-choice file of up to 40 items cut from the checkpoint's held-out split (the built-in
    continuation4, written out as llm-foundry jsonl), and a rolling file of 3 texts; a YAML for each."""
    require_module("lm_eval", "pip install -e '.[harness]'")
    from trainer.data.tokenizer import load_tokenizer
    from trainer.evaluate import builtin_data
    from trainer.tasks.builtins import heldout_texts
    from trainer.tasks.suite import builtin_task

    root = tmp_path_factory.mktemp("harness")
    model, tok_dir = load(checkpoint)
    texts = heldout_texts(builtin_data(checkpoint, None), tok_dir, 200)
    task = builtin_task("continuation4", texts, 0, 40, load_tokenizer(tok_dir), model.cfg.max_seq_len)
    items = root / "mc.jsonl"
    items.write_text("".join(json.dumps({"query": i.query, "choices": list(i.choices), "gold": i.gold}) + "\n"
                             for i in task.items))
    rolling = root / "rolling.jsonl"
    rolling.write_text("".join(json.dumps({"text": t[:200]}) + "\n" for t in texts[:3]))
    write_task_yaml("packtrain_mc", items, root)
    (root / "rolling.yaml").write_text(ROLLING_YAML.format(items=rolling))
    return root


def test_a_local_multiple_choice_task_scores_as_trainer_evaluate(checkpoint, tasks, tmp_path):
    from trainer.harness import run_harness

    results = run_harness(checkpoint, ["packtrain_mc"], include_path=tasks)["packtrain_mc"]
    out = tmp_path / "scores.json"
    assert evaluate_main([str(checkpoint), "--tasks", str(tasks / "mc.jsonl"), "--out", str(out)]) == 0
    ours = json.loads(out.read_text())["tasks"]["mc"]["metrics"]
    assert results["sample_len"] == ours["n"] == len((tasks / "mc.jsonl").read_text().splitlines()) >= 20
    assert results["acc,none"] == pytest.approx(ours["acc"], abs=1e-12)
    assert results["acc_norm,none"] == pytest.approx(ours["acc_norm"], abs=1e-12)
    # items the model neither always gets nor always misses: the equality says something
    assert 0 < ours["acc"] < 1
    # --out replaces its own earlier output; someone else's file only with --overwrite (issue 54)
    assert evaluate_main([str(checkpoint), "--tasks", str(tasks / "mc.jsonl"), "--out", str(out)]) == 0
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    assert evaluate_main([str(checkpoint), "--tasks", str(tasks / "mc.jsonl"), "--out", str(notes)]) == 2
    assert notes.read_text() == '{"mine": 1}'
    assert evaluate_main([str(checkpoint), "--tasks", str(tasks / "mc.jsonl"), "--out", str(notes),
                          "--overwrite"]) == 0
    assert json.loads(notes.read_text())["tasks"]["mc"]["metrics"] == ours


def test_the_rolling_log_likelihood_is_the_models_own(checkpoint, tasks):
    """lm-eval's word_perplexity = exp(-sum of log-likelihoods / words); each text here fits one window: its
    tokens after the EOS token, scored by the model's logits in plain PyTorch."""
    from trainer.data.tokenizer import load_tokenizer, special_ids
    from trainer.harness import run_harness

    results = run_harness(checkpoint, ["packtrain_rolling"], include_path=tasks)["packtrain_rolling"]
    model, tok_dir = load(checkpoint)
    tok = load_tokenizer(tok_dir)
    eos = special_ids(tok, tok_dir).eos
    total, words = 0.0, 0
    for line in (tasks / "rolling.jsonl").read_text().splitlines():
        text = json.loads(line)["text"]
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) < model.cfg.max_seq_len
        with torch.no_grad():
            logits = model(torch.tensor([[eos, *ids[:-1]]])).logits[0].double()
        total += logits.log_softmax(-1)[torch.arange(len(ids)), torch.tensor(ids)].sum().item()
        words += len(re.split(r"\s+", text))  # lm-eval's count_words
    assert results["word_perplexity,none"] == pytest.approx(math.exp(-total / words), rel=1e-4)


def test_a_task_pack_that_would_run_python_is_refused_unless_trusted(checkpoint, tasks, tmp_path, capsys):
    """A YAML holding `!function utils.process_docs` (here in a file another YAML `include`s): refused in one
    line naming file:line before lm-eval imports utils.py (before: utils.py ran, its marker file appeared,
    exit 0); with --trust-include-path it runs, and scores as the same task without the tag."""
    from trainer.harness import main

    pack = tmp_path / "pack"
    pack.mkdir()
    marker = tmp_path / "ran"
    (pack / "utils.py").write_text("import pathlib\n\ndef process_docs(ds):\n"
                                   f"    pathlib.Path({str(marker)!r}).write_text('ran')\n    return ds\n")
    base = (tasks / "packtrain_mc.yaml").read_text().replace("task: packtrain_mc", "task: coded")
    (pack / "base.yaml").write_text(base.replace("test_split: test\n",
                                                 "test_split: test\n"
                                                 "process_docs: !function utils.process_docs\n"))
    (pack / "coded.yaml").write_text("include: base.yaml\n")
    (pack / "base.yaml").rename(pack / "base.inc")  # an included file of another suffix is read too
    (pack / "coded.yaml").write_text("include: base.inc\n")
    out = tmp_path / "scores.json"
    capsys.readouterr()
    assert main([str(checkpoint), "--tasks", "coded", "--include-path", str(pack), "--limit", "4", "--out",
                 str(out)]) == 2
    line = capsys.readouterr().err.strip()
    assert re.fullmatch(rf"error: {re.escape(str(pack / 'base.inc'))}:7: !function utils\.process_docs "
                        r"would import and run Python code from .*pack \(a task pack with such tags is "
                        r"code\): pass --trust-include-path if you trust that directory as you would a "
                        r"script, else remove the tag", line), line
    assert not marker.exists() and not out.exists()
    assert main([str(checkpoint), "--tasks", "coded", "--include-path", str(pack), "--limit", "4", "--out",
                 str(out), "--trust-include-path"]) == 0
    assert marker.read_text() == "ran" and json.loads(out.read_text())["coded"]["acc,none"] >= 0


def test_a_num_fewshot_larger_than_the_task_is_one_line(checkpoint, tasks, tmp_path, capsys):
    """Issue 54: lm-eval's "Sample larger than population" traceback."""
    from trainer.harness import main

    pack = tmp_path / "pack"
    pack.mkdir()
    text = (tasks / "packtrain_mc.yaml").read_text().replace("task: packtrain_mc", "task: greedy_shots")
    (pack / "greedy_shots.yaml").write_text(text + "num_fewshot: 100000\nfewshot_split: test\n")
    capsys.readouterr()
    assert main([str(checkpoint), "--tasks", "greedy_shots", "--include-path", str(pack), "--limit",
                 "2"]) == 2
    err = capsys.readouterr().err  # beside datasets' progress bars
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("error: --tasks ['greedy_shots']: a task's num_fewshot asks for more "
                               "few-shot examples") \
        and "lower num_fewshot" in lines[0], err
