"""lm-evaluation-harness on a packtrain checkpoint: `python -m trainer.harness CHECKPOINT_OR_EXPORT --tasks T...`.

    python -m trainer.harness runs/.../checkpoints/step_000100 --tasks arc_easy hellaswag --out harness.json
    python -m trainer.harness CHECKPOINT --tasks my_task --include-path my_tasks/     # task YAMLs of your own

`PacktrainLM` is lm-eval's model interface (lm_eval.api.model.LM, registered as "packtrain") over the
project's own scoring (trainer.tasks.scoring), so a harness task scores the way
`python -m trainer.evaluate` does:

    loglikelihood          (context, continuation): tokenized apart and concatenated, nothing before the
                           context but what a training document's framing puts there (the BOS of a tokenizer
                           that adds one), every pair a document of packed rows; greedy match from the same
                           forward
    loglikelihood_rolling  a text's tokens in lm-eval's disjoint windows of max_seq_len - 1 (the first after
                           lm-eval's prefix token: the BOS of such a tokenizer, else EOS), each window a
                           document whose targets are its tokens
    generate_until         greedy decoding with the KV cache (trainer.generate), cut at the first `until`
                           string

Tasks come from lm-eval's own registry (they download their datasets: run it where that works, or with
HF_DATASETS_OFFLINE=1 and a filled cache) or from YAML files under --include-path, whose dataset may be a
local JSON file (`dataset_path: json`, `dataset_kwargs: {data_files: {test: items.jsonl}}`). With lm-eval's
default `target_delimiter: " "` a space is put between context and choice; packtrain's own task files use none
(the choice carries its whitespace): set `target_delimiter: ""` to score them alike. Needs the `harness` extra
(`pip install -e '.[harness]'`: lm-eval 0.4).
"""  # noqa: E501 (line 1 is the --help description: __doc__.split("\n")[0])

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from trainer.data.tokenizer import load_tokenizer, special_ids
from trainer.errors import UserError, command
from trainer.generate import check_device, generate, load
from trainer.model.attention import resolve_backend
from trainer.outputs import check_out_file, write_json_output, written_by
from trainer.tasks.scoring import LAYOUTS, Candidate, score


class HarnessError(UserError):
    """lm-eval missing, or a task it cannot find."""


def _lm_base():
    try:
        from lm_eval.api.model import LM
    except ImportError as e:
        raise HarnessError(f"lm-evaluation-harness is not installed ({e}): "
                           "pip install -e '.[harness]'") from None
    return LM


def packtrain_lm_class():
    """PacktrainLM, defined on lm-eval's LM once lm-eval is importable (it is an optional extra)."""
    global _PACKTRAIN_LM
    if _PACKTRAIN_LM is None:
        _PACKTRAIN_LM = _define(_lm_base())
    return _PACKTRAIN_LM


_PACKTRAIN_LM = None


def _define(LM):  # noqa: N803 (lm-eval's class)
    from lm_eval.api.registry import register_model
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    @register_model("packtrain")
    class PacktrainLM(LM):
        """A packtrain checkpoint (or export) as an lm-eval model; `batch_tokens` positions a forward."""

        def __init__(self, checkpoint: str, device: str = "cpu", batch_tokens: int = 8192,
                     layout: str = "tree", attention: str = "auto") -> None:
            super().__init__()
            self.model, tok_dir = load(checkpoint, device)
            self.model.attention.backend = resolve_backend(attention, torch.device(device), torch.float32,
                                                           requires_grad=False)
            self.tok = load_tokenizer(tok_dir)
            ids = special_ids(self.tok, tok_dir)
            self.pad_id, self.eos_id, self.head = ids.pad, ids.eos, ids.head
            # lm-eval's rolling windows start after this token (its HF backend's prefix: BOS when there is
            # one)
            self.prefix_id = ids.head[0] if ids.head else ids.eos
            self._device, self.batch_tokens, self.layout = torch.device(device), int(batch_tokens), layout

        @classmethod
        def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None):
            args = dict(kv.split("=", 1) for kv in arg_string.split(",") if kv)
            return cls(**args)

        def encode(self, text: str) -> tuple[int, ...]:
            return tuple(self.tok.encode(text, add_special_tokens=False).ids)

        def _score(self, pairs: list[Candidate]):
            longest = max((len(p.query) + len(p.choice) for p in pairs), default=0)
            if longest > self.model.cfg.max_seq_len:
                raise HarnessError(f"a request is {longest} tokens, more than the model's context "
                                   f"({self.model.cfg.max_seq_len})")
            return score(self.model, pairs, self.layout, self.pad_id, self.batch_tokens, self._device)

        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            pairs = [Candidate((*self.head, *self.encode(context)), self.encode(continuation))
                     for context, continuation in (r.args for r in requests)]
            scores = self._score(pairs)
            return list(zip(scores.loglikelihoods, scores.greedy, strict=True))

        def loglikelihood_rolling(self, requests) -> list[float]:
            windows, owner = [], []
            for n, request in enumerate(requests):
                tokens = list(self.encode(request.args[0]))
                for context, predicted in map(make_disjoint_window, get_rolling_token_windows(
                        tokens, self.prefix_id, self.model.cfg.max_seq_len - 1, 1)):
                    windows.append(Candidate(tuple(context), tuple(predicted)))
                    owner.append(n)
            totals = [0.0] * len(requests)
            for n, ll in zip(owner, self._score(windows).loglikelihoods, strict=True):
                totals[n] += ll
            return totals

        def generate_until(self, requests) -> list[str]:
            out = []
            for context, kwargs in (r.args for r in requests):
                until = kwargs.get("until") or []
                until = [until] if isinstance(until, str) else list(until)
                prompt = ([*self.head, *self.encode(context)][-(self.model.cfg.max_seq_len - 1):]
                          or [self.eos_id])
                new = generate(self.model, prompt, int(kwargs.get("max_gen_toks", 256)),
                               stop_ids=(self.eos_id,))
                text = self.tok.decode([t for t in new if t != self.eos_id])
                cut = min((i for i in (text.find(u) for u in until) if i >= 0), default=len(text))
                out.append(text[:cut])
            return out

    return PacktrainLM


TASK_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {items}
test_split: test
output_type: multiple_choice
doc_to_text: query
doc_to_choice: choices
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
  - metric: acc_norm
"""
"""lm-eval's task YAML for a multiple-choice task file of llm-foundry's form ({"query", "choices", "gold"} a
line), scored as packtrain scores it: the choice right after the query (no delimiter added)."""


def write_task_yaml(name: str, items: str | Path, directory: str | Path) -> Path:
    """`directory`/`name`.yaml: task `name` over the task file `items` (an --include-path for run_harness)."""
    path = Path(directory) / f"{name}.yaml"
    path.write_text(TASK_YAML.format(name=name, items=Path(items).resolve()))
    return path


STANDARD_TAG = "tag:yaml.org,2002:"
"""The prefix of YAML's own tags (str, int, map, ...): every other tag is an application's, e.g. lm-eval's
`!function module.name`, which imports and runs a Python file beside the YAML."""


def code_in_task_yamls(directory: Path) -> tuple[Path, int, str, str] | None:
    """(file, line, tag, its value) of the first YAML tag under `directory` (or in a file a YAML there
    `include`s) that is not one of YAML's own: lm-eval's `!function` imports and runs Python from the
    directory. Composed with PyYAML's safe composer: nothing is constructed, nothing imported. A YAML that
    does not parse: HarnessError.

    Example: DIR/t.yaml with `process_docs: !function utils.process_docs` on line 4
        -> (DIR/t.yaml, 4, '!function', 'utils.process_docs')."""
    import yaml

    pending = sorted([*directory.rglob("*.yaml"), *directory.rglob("*.yml")])
    seen: set[Path] = set()
    while pending:
        file = pending.pop(0).resolve()
        if file in seen or not file.is_file():
            continue
        seen.add(file)
        try:
            roots = list(yaml.compose_all(file.read_text(encoding="utf-8"), Loader=yaml.SafeLoader))
        except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError) as e:
            raise HarnessError(f"{file}: not a readable task YAML "
                               f"({str(e).splitlines()[0] if str(e) else e})") from e
        for node in _nodes(roots):
            if not node.tag.startswith(STANDARD_TAG):
                return file, node.start_mark.line + 1, node.tag, str(getattr(node, "value", ""))
            if isinstance(node, yaml.MappingNode):
                pending += [file.parent / v.value for k, v in node.value
                            if k.value == "include" and isinstance(v, yaml.ScalarNode)]
    return None


def _nodes(roots):
    import yaml

    stack = [r for r in roots if r is not None]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, yaml.SequenceNode):
            stack += node.value
        elif isinstance(node, yaml.MappingNode):
            stack += [part for pair in node.value for part in pair]


def check_include_path(directory: Path, trusted: bool) -> None:
    """Refuse --include-path `directory` if a task YAML in it would run Python (`code_in_task_yamls`), unless
    the user said they trust it (--trust-include-path): a task pack with `!function` is code, and runs as the
    user."""
    if not directory.is_dir():
        raise HarnessError(f"--include-path {directory} is not a directory")
    found = code_in_task_yamls(directory)
    if found is not None and not trusted:
        file, line, tag, value = found
        raise HarnessError(f"{file}:{line}: {tag} {value} would import and run Python code from {directory} "
                           "(a task pack with such tags is code): pass --trust-include-path if you trust "
                           "that directory as you would a script, else remove the tag")


def run_harness(checkpoint: str | Path, tasks: list[str], include_path: str | Path | None = None,
                device: str = "cpu", batch_tokens: int = 8192, layout: str = "tree", limit: int | None = None,
                attention: str = "auto", trust_include_path: bool = False) -> dict:
    """lm_eval.simple_evaluate on `checkpoint` through PacktrainLM: {task: its metrics} (lm-eval's 'results').
    Task YAMLs under `include_path` that would run Python are refused unless `trust_include_path`."""
    if include_path:
        check_include_path(Path(include_path), trust_include_path)
    lm = packtrain_lm_class()(str(checkpoint), device=device, batch_tokens=batch_tokens, layout=layout,
                              attention=attention)
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    manager = None
    if include_path:  # indexing lm-eval's own thousands of task files takes tens of seconds: only if needed
        manager = TaskManager(include_path=str(include_path), include_defaults=False)
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        where = f" nor under --include-path {include_path}" if include_path else ""
        raise HarnessError(f"--tasks {unknown}: not tasks lm-eval knows{where}")
    try:
        results = simple_evaluate(model=lm, tasks=tasks, task_manager=manager, limit=limit, log_samples=False)
    except ValueError as e:
        if "Sample larger than population" not in str(e):
            raise
        raise HarnessError(f"--tasks {tasks}: a task's num_fewshot asks for more few-shot examples than its "
                           f"documents hold ({e}): lower num_fewshot in its YAML") from None
    return results["results"] if results is not None else {}  # None: lm-eval reports on LOCAL_RANK 0 only


COMMAND = "trainer.harness"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.harness", description=__doc__.split("\n")[0])
    p.add_argument("path", type=Path, metavar="CHECKPOINT_OR_EXPORT")
    p.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names")
    p.add_argument("--include-path", type=Path, default=None, help="a directory of task YAMLs of your own")
    p.add_argument("--trust-include-path", action="store_true",
                   help="let --include-path's YAMLs run Python "
                        "(lm-eval's !function tags import files from it)")
    p.add_argument("--limit", type=int, default=None, help="at most this many items per task")
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--packing", choices=LAYOUTS, default="tree",
                   help="scoring layout (the same scores in each)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", type=Path, default=None, help="write lm-eval's results as JSON here")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out file this command did not write")
    return p.parse_args(argv)


@command(extra_user_errors=(OSError,))
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (args.limit is not None and args.limit < 1) or args.batch_tokens < 1:
        raise HarnessError("--limit and --batch-tokens must be >= 1, "
                           f"got {args.limit} and {args.batch_tokens}")
    check_device(args.device)
    if args.out is not None:
        check_out_file(args.out, COMMAND, written_by(COMMAND), args.overwrite)
    results = run_harness(args.path, args.tasks, args.include_path, args.device, args.batch_tokens,
                          args.packing, args.limit, trust_include_path=args.trust_include_path)
    print(json.dumps(results, indent=1, default=str))
    if args.out is not None:
        write_json_output(args.out, results, COMMAND)
    return 0


if __name__ == "__main__":
    sys.exit(main())
