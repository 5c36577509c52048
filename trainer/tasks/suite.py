"""Tasks named by the user, loaded and scored together: what `python -m trainer.evaluate --tasks` and the
training loop's `train.eval_tasks` share.

A name is a built-in (BUILTINS: made once from the held-out split's texts, read only if a built-in is named)
or a task file's path. Two tasks of one name (a task is named by its file's stem) are refused: their scores
would share one key. `score_tasks` scores every task in a layout and returns, per task, its kind, source,
metrics and items.

Example: ["continuation4", "qa/arc.jsonl"] -> [Task continuation4 (from the held-out texts),
Task arc (the file)].
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from trainer.data.config import DataConfig
from trainer.data.tokenizer import FramedTokenizer, special_ids
from trainer.distributed.groups import DistInfo
from trainer.errors import UserError
from trainer.model import GPT
from trainer.tasks.builtins import BUILTINS, fitting, heldout_texts
from trainer.tasks.metrics import item_records, task_metrics
from trainer.tasks.scoring import score, task_sequences
from trainer.tasks.tasks import Task, load_task_file


class TaskSuiteError(UserError):
    """Tasks that cannot be scored as named: no such file or built-in, a built-in with no item,
    a name twice."""


@dataclass(frozen=True)
class BuiltinOptions:
    """How the built-ins are made: from the first `docs` held-out documents, at most `items` items each (None:
    all), choices ordered by `seed`."""

    docs: int = 500
    items: int | None = None
    seed: int = 0


def builtin_task(name: str, texts: list[str], seed: int, max_items: int | None, tok: Tokenizer,
                 max_tokens: int, head: int = 0) -> Task:
    """Built-in task `name` of the held-out `texts`, without the items that do not fit the model's context
    (`head`: the tokens the framing puts before each query, SpecialIds.head)."""
    task = BUILTINS[name](texts, seed, max_items)
    task = fitting(task, lambda s: len(tok.encode(s, add_special_tokens=False).ids), max_tokens - head)
    if not task.items:
        raise TaskSuiteError(f"built-in task {name}: the held-out split gave no item (too few or too short "
                             "documents); evaluate with more held-out documents")
    return task


def load_tasks(names: Sequence[str], setting: str, heldout: Callable[[], DataConfig | str | Path],
               tok: Tokenizer, tok_dir: Path, max_tokens: int,
               options: BuiltinOptions = BuiltinOptions()) -> list[Task]:
    """The tasks of `names` in order. `setting` names where they were given (--tasks, train.eval_tasks) in
    errors; `heldout()` says where the built-ins' held-out documents are
    (called once, if a built-in is named)."""
    texts = None
    tasks = []
    head = len(special_ids(tok, tok_dir).head)
    for name in names:
        if name in BUILTINS:
            if texts is None:
                texts = heldout_texts(heldout(), tok_dir, options.docs)
            task = builtin_task(name, texts, options.seed, options.items, tok, max_tokens, head)
        elif not Path(name).is_file():
            raise TaskSuiteError(f"{setting} {name}: no such task file, nor a built-in task "
                                 f"({', '.join(BUILTINS)})")
        else:
            task = load_task_file(name)
        tasks.append(task)
    seen = [t.name for t in tasks]
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise TaskSuiteError(f"{setting} names the task(s) {twice} twice (a task is named by its file's "
                             "stem): rename one of the files")
    return tasks


def load_suite(names: Sequence[str], setting: str, heldout: Callable[[], DataConfig | str | Path],
               tok_dir: Path, max_tokens: int,
               options: BuiltinOptions = BuiltinOptions()) -> tuple[list[Task], FramedTokenizer]:
    """(`load_tasks`, the tokenizer of `tok_dir` they are scored with): for callers that hold no tokenizer."""
    framed = FramedTokenizer.load(tok_dir)
    return load_tasks(names, setting, heldout, framed.tok, tok_dir, max_tokens, options), framed


def score_tasks(model: GPT, tasks: Sequence[Task], tok: FramedTokenizer, pad_id: int, layout: str,
                batch_tokens: int, device: torch.device, info: DistInfo | None = None) -> dict:
    """{task name: {kind, source, metrics, items}} for every task, scored in `layout` (collective over
    `info`'s loss group: trainer.tasks.scoring.score); each query preceded by what the tokenizer's framing
    puts before a training document (its BOS, if any)."""
    out = {}
    for task in tasks:
        sequences = task_sequences(task, tok.encode, model.cfg.max_seq_len, tok.ids.head)
        scores = score(model, sequences, layout, pad_id, batch_tokens, device, info)
        records = item_records(task, scores.loglikelihoods, scores.greedy)
        out[task.name] = {"kind": task.kind, "source": task.source, "metrics": task_metrics(task, records),
                          "items": records}
    return out
