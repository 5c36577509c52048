"""Downstream tasks in the loop (train.eval_tasks, trainer.run.evals.TaskScorer): scored at their cadence, the
same numbers as `python -m trainer.evaluate` gives for the run's checkpoint, and nothing else of the run
changed.

One real sweep of `python -m trainer.train` (two jobs in one process): the same 4 steps without tasks and with
a built-in and a task file, every 2 steps.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.helpers import metrics, run_sweep, run_train
from trainer.checkpoint.store import latest_checkpoint
from trainer.evaluate import main as evaluate_main

STEPS = 4
ITEMS = [  # a multiple-choice file in llm-foundry's form: code-like text as the demo corpus
    {"query": "def add(a, b):\n    return", "choices": [" a + b", " None", " 7", " print"], "gold": 0},
    {"query": "for i in range(10):\n   ", "choices": [" print(i)", " return", " class", " )"], "gold": 0},
    {"query": "import", "choices": [" os", " 12", " ]", " def"], "gold": 0},
]


@pytest.fixture(scope="module")
def sweep(demo_data, tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eval_tasks")
    task_file = root / "snippets.jsonl"
    task_file.write_text("".join(json.dumps(item) + "\n" for item in ITEMS))
    run_sweep(root / "sweep", demo_data, f"train.max_steps={STEPS}", "train.eval_every=2",
              "train.eval_docs=8", f"train.eval_tasks=choice([],[continuation4,{task_file}])")
    return root / "sweep", task_file


def test_tasks_are_scored_at_the_eval_cadence_and_change_nothing_else(sweep):
    """Steps 2 and 4 (train.eval_every=2, and the last) carry `tasks`; the run without tasks has none; and the
    losses and held-out losses of the two runs are equal, bit for bit: scoring draws no random number, reads
    no training document and leaves the model as it was (train.eval_tasks is SAME_OBJECTIVE)."""
    without, with_tasks = metrics(sweep[0] / "0"), metrics(sweep[0] / "1")
    assert [m["step"] for m in with_tasks if "tasks" in m] == [2, 4]
    assert not any("tasks" in m for m in without)
    for m in with_tasks:
        if "tasks" in m:
            assert sorted(m["tasks"]) == ["continuation4", "snippets"] and m["tasks_time_s"] > 0
            assert m["tasks"]["snippets"]["n"] == len(ITEMS) and 0 <= m["tasks"]["snippets"]["acc"] <= 1
    for a, b in zip(without, with_tasks, strict=True):
        assert (a["loss"], a.get("val_loss")) == (b["loss"], b.get("val_loss")), a["step"]


def test_the_loops_scores_are_trainer_evaluates_on_the_checkpoint(sweep, tmp_path):
    """The last step's scores equal those `python -m trainer.evaluate` computes from the run's final
    checkpoint (the weights read back from the checkpoint, the built-in remade from the held-out split): the
    loop scores what a user scoring the checkpoint would get."""
    run_dir, task_file = sweep[0] / "1", sweep[1]
    out = tmp_path / "scores.json"
    assert evaluate_main([str(latest_checkpoint(run_dir)), "--tasks", "continuation4", str(task_file),
                          "--batch-tokens", "512", "--attention", "sdpa_docs", "--out", str(out)]) == 0
    reference = json.loads(out.read_text())["tasks"]
    in_loop = metrics(run_dir)[-1]["tasks"]
    for name in ("continuation4", "snippets"):
        ours, theirs = in_loop[name], reference[name]["metrics"]
        assert ours.keys() == theirs.keys() and ours["n"] == theirs["n"] and ours["acc"] == theirs["acc"]
        for key, value in theirs.items():
            assert (value is None and ours[key] is None
                    or math.isclose(ours[key], value, rel_tol=0, abs_tol=1e-6)), key


def test_the_report_shows_each_arms_scores_with_an_interval_and_a_plot(sweep, tmp_path):
    """trainer.report on the sweep: a "Downstream tasks" table holding the run with tasks (the one without has
    no row), each accuracy with its 95 % interval, and the accuracy-over-steps plot."""
    from trainer.reporting.html import make_report

    written = make_report([sweep[0]], out=tmp_path / "report")
    text = (tmp_path / "report" / "report.md").read_text()
    section = text.split("## Downstream tasks\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| 1 |")]
    assert [row.split(" | ")[1] for row in rows] == ["continuation4", "snippets"]
    assert all(re.search(r"\| \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\] \|", row) for row in rows), rows
    assert not any(line.startswith("| 0 |") for line in section.splitlines())
    assert tmp_path / "report" / "task_accuracy.png" in written


def test_a_task_file_changed_before_a_resume_is_named(sweep, demo_data, tmp_path):
    """Issue 54: the run's checkpoint records each task's items (sha256); a resume whose task file holds other
    items under the same name says so in a warning line (before: silent, the scores after the resume of other
    items than those before it); the unchanged built-in is not named."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(sweep[0] / "1", run_dir)
    changed = tmp_path / "snippets.jsonl"
    changed.write_text("".join(json.dumps({**item, "gold": 1}) + "\n" for item in ITEMS))
    proc = run_train(run_dir, demo_data, f"train.max_steps={STEPS + 1}", "train.eval_every=0",
                     "train.eval_docs=8", f"train.eval_tasks=[continuation4,{changed}]", "train.resume=true")
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("resume: warning:")]
    assert (len(warnings) == 1
            and "train.eval_tasks: snippets's items changed since the checkpoint" in warnings[0]), proc.stdout
    assert metrics(run_dir)[-1]["step"] == STEPS + 1
