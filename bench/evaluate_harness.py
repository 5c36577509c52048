"""Items/s of one multiple-choice task through lm-evaluation-harness: packtrain's model (trainer.harness, tree,
packed and unpacked rows) against lm-eval's own Hugging Face backend (`hf`, batches padded) on the exported
model.

Not a test. The task is written as an llm-foundry jsonl file and a task YAML (`target_delimiter: ""`, as
packtrain's task files), so all three score the same (query, choice) pairs; their accuracies are printed
beside the rates. The items are a built-in (continuation4 or cloze's multiple-choice sibling: continuation4)
made from the checkpoint's held-out split, or a task file. After one warm-up round, rounds rotate the order of
the three backends; medians of each are reported.

    python -m trainer.export CKPT --out EXPORT
    python bench/evaluate_harness.py --checkpoint CKPT --export EXPORT [--items 200] [--rounds 3]
"""  # noqa: E501 (line 1 is the --help description: __doc__.split("\n")[0])

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

def write_task(args: argparse.Namespace, root: Path) -> int:
    """The items as jsonl + YAML under `root`; returns their number."""
    from trainer.data.tokenizer import load_tokenizer
    from trainer.evaluate import builtin_data
    from trainer.generate import load
    from trainer.harness import write_task_yaml
    from trainer.tasks.builtins import heldout_texts
    from trainer.tasks.suite import builtin_task
    from trainer.tasks.tasks import load_task_file

    model, tok_dir = load(args.checkpoint)
    if args.task_file:
        task = load_task_file(args.task_file)
    else:
        texts = heldout_texts(builtin_data(args.checkpoint, args.data), tok_dir, args.builtin_docs)
        task = builtin_task("continuation4", texts, 0, args.items, load_tokenizer(tok_dir),
                            model.cfg.max_seq_len)
    (root / "items.jsonl").write_text("".join(json.dumps({"query": i.query, "choices": list(i.choices),
                                                           "gold": i.gold}) + "\n" for i in task.items))
    write_task_yaml("bench_mc", root / "items.jsonl", root)
    return len(task.items)


def run(backend: str, args: argparse.Namespace, root: Path) -> tuple[float, float]:
    """(seconds, acc) of scoring the task once with `backend`."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from trainer.harness import packtrain_lm_class

    manager = TaskManager(include_path=str(root), include_defaults=False)
    if backend == "hf":
        import lm_eval.models.huggingface  # noqa: F401 (registers "hf")

        model, model_args = "hf", f"pretrained={args.export},dtype=float32,device=cpu"
    else:
        model = packtrain_lm_class()(str(args.checkpoint), batch_tokens=args.batch_tokens, layout=backend)
        model_args = None
    t0 = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["bench_mc"],
                                  task_manager=manager, batch_size=args.hf_batch_size, log_samples=False)
    return time.perf_counter() - t0, out["results"]["bench_mc"]["acc,none"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--export", type=Path, required=True,
                   help="the checkpoint's python -m trainer.export directory")
    p.add_argument("--task-file", type=Path, default=None, help="a task jsonl (default: continuation4)")
    p.add_argument("--data", type=Path, default=None)
    p.add_argument("--builtin-docs", type=int, default=1000)
    p.add_argument("--items", type=int, default=200)
    p.add_argument("--batch-tokens", type=int, default=8192, help="packtrain: positions per forward")
    p.add_argument("--hf-batch-size", type=int, default=16, help="lm-eval hf: sequences per forward")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    import torch

    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        n = write_task(args, root)
        times: dict[str, list[float]] = {"tree": [], "packed": [], "unpacked": [], "hf": []}
        accs: dict[str, float] = {}
        names = list(times)
        for backend in names:  # warm-up: imports, the dataset's cache, first-call allocations
            run(backend, args, root)
        for r in range(args.rounds):
            for backend in names[r % 4:] + names[:r % 4]:  # rotated: no backend always first
                seconds, accs[backend] = run(backend, args, root)
                times[backend].append(seconds)
    print(f"# {n} items x 4 choices, {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads; median of {args.rounds} rounds "
          "(each includes lm-eval's task setup)")
    print("| backend | s (median) | items/s | vs hf | acc |\n|---|---:|---:|---:|---:|")
    hf = statistics.median(times["hf"])
    for backend, ts in times.items():
        median = statistics.median(ts)
        print(f"| {backend} | {median:.2f} | {n / median:.1f} | {hf / median:.2f}x | {accs[backend]:.3f} |")


if __name__ == "__main__":
    main()
