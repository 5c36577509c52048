"""Score a checkpoint on downstream tasks: `python -m trainer.evaluate CHECKPOINT_OR_EXPORT --tasks TASK...`.

    python -m trainer.evaluate runs/demo/<time>/0_layout=packed/checkpoints/step_000100 \\
        --tasks continuation4 cloze my_task.jsonl --out scores.json
    python -m trainer.evaluate exports/demo --tasks my_task.jsonl --packing unpacked
    torchrun --nproc_per_node=2 -m trainer.evaluate CHECKPOINT --tasks continuation4
        # items split over ranks

A task is a jsonl file in llm-foundry's forms (trainer.tasks.tasks: multiple choice {"query", "choices",
"gold"}, language modeling {"context", "continuation"}) or a built-in made from the held-out split
(trainer.tasks.builtins: continuation4, cloze), read from --data (default: the checkpoint's run's data.path /
data.val_urls). Every query + choice is scored as a document of the training layouts' rows (--packing packed:
several a row, documents isolated; unpacked: one a row, padded), its choice's log-likelihood summed from the
model's token losses (trainer.tasks.scoring). Prints a table; --out writes JSON: per task its metrics
(trainer.tasks.metrics) and per item `loglikelihoods`, one per choice in the file's order. A user mistake ends
as trainer/errors.py says.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from trainer.checkpoint.store import META_FILE
from trainer.checkpoint.weights import checkpoint_meta
from trainer.data.config import DataConfig
from trainer.data.tokenizer import FramedTokenizer
from trainer.distributed.config import DistributedConfig
from trainer.distributed.groups import init_distributed, shutdown_distributed
from trainer.errors import UserError, command
from trainer.generate import check_device, load
from trainer.model.attention import BACKENDS, resolve_backend
from trainer.outputs import check_out_file, write_json_output, written_by
from trainer.tasks.builtins import BUILTINS
from trainer.tasks.scoring import LAYOUTS
from trainer.tasks.suite import BuiltinOptions, load_tasks, score_tasks
from trainer.tasks.tasks import Task


class EvaluateError(UserError):
    """Built-in tasks without held-out data to make them from (an export, a checkpoint that names no data)."""


def builtin_data(path: Path, data: Path | None) -> DataConfig:
    """Where the built-ins' held-out documents come from: --data, else the checkpoint's run's data config."""
    if data is not None:
        return DataConfig(path=str(data))
    if not (path / META_FILE).is_file():
        raise EvaluateError(f"{path} is an export: built-in tasks need the held-out data, give --data DIR "
                            "(the prepared directory the run trained on)")
    section = checkpoint_meta(path).get("config", {}).get("data", {})
    if not (section.get("path") or section.get("val_urls")):
        raise EvaluateError(f"{path / META_FILE} names no data.path or data.val_urls: give --data DIR")
    return DataConfig(path=section.get("path"), val_urls=section.get("val_urls"),
                      tokenizer=section.get("tokenizer"))


def tasks_of(args: argparse.Namespace, tok: Tokenizer, tok_dir: Path, max_tokens: int) -> list[Task]:
    """The tasks of --tasks (trainer.tasks.suite),
    the built-ins from --data or the checkpoint's held-out data."""
    return load_tasks(args.tasks, "--tasks", lambda: builtin_data(args.path, args.data), tok, tok_dir,
                      max_tokens,
                      BuiltinOptions(docs=args.builtin_docs, items=args.builtin_items, seed=args.seed))


def table(results: dict) -> str:
    """One line per task: n, acc ± standard error, acc_norm, bits per byte."""
    def cell(value, stderr=None, digits=3) -> str:
        if value is None:
            return "-"
        return f"{value:.{digits}f}" + (f" ± {stderr:.{digits}f}" if stderr is not None else "")

    rows = [("task", "kind", "n", "acc", "acc_norm", "bits/byte")]
    for name, result in results.items():
        m = result["metrics"]
        rows.append((name, result["kind"].replace("_", " "), str(m["n"]), cell(m["acc"], m["acc_stderr"]),
                     cell(m.get("acc_norm"), m.get("acc_norm_stderr")), cell(m["bits_per_byte"])))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows)


COMMAND = "trainer.evaluate"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.evaluate", description=__doc__.split("\n")[0])
    p.add_argument("path", type=Path, metavar="CHECKPOINT_OR_EXPORT",
                   help="<run dir>/checkpoints/step_NNNNNN, or a directory written by "
                        "python -m trainer.export")
    p.add_argument("--tasks", nargs="+", required=True, metavar="TASK",
                   help=f"task files (.jsonl) or built-ins ({', '.join(BUILTINS)})")
    p.add_argument("--packing", choices=LAYOUTS, default="tree",
                   help="row layout of the scored sequences "
                        "(default tree: an item's query once; the same scores)")
    p.add_argument("--out", type=Path, default=None,
                   help="write the metrics and per-item log-likelihoods here")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing --out file this command did not write")
    p.add_argument("--data", type=Path, default=None,
                   help="prepared data directory whose val split the built-ins use "
                        "(default: the checkpoint's)")
    p.add_argument("--builtin-docs", type=int, default=500, help="held-out documents read for the built-ins")
    p.add_argument("--builtin-items", type=int, default=None,
                   help="most items of each built-in (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-ins' choice order (default 0)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="positions per forward (default 8192)")
    p.add_argument("--attention", choices=BACKENDS, default="auto", help="attention backend of packed rows")
    p.add_argument("--device", default="cpu",
                   help="torch device (default cpu; under torchrun cuda = the local GPU)")
    return p.parse_args(argv)


@command(extra_user_errors=(OSError,))  # OSError: --out cannot be written
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (args.batch_tokens < 1 or args.builtin_docs < 1
            or (args.builtin_items is not None and args.builtin_items < 1)):
        raise EvaluateError(f"--batch-tokens, --builtin-docs and --builtin-items must be >= 1, got "
                            f"{args.batch_tokens}, {args.builtin_docs} and {args.builtin_items}")
    check_device(args.device)
    if args.out is not None:
        check_out_file(args.out, COMMAND, written_by(COMMAND), args.overwrite)
    info = init_distributed(DistributedConfig(device=torch.device(args.device).type))
    try:
        model, tok_dir = load(args.path, info.device)
        model.attention.backend = resolve_backend(args.attention, info.device, torch.float32,
                                                  requires_grad=False)
        tok = FramedTokenizer.load(tok_dir)
        tasks = tasks_of(args, tok.tok, tok_dir, model.cfg.max_seq_len)
        results = score_tasks(model, tasks, tok, tok.ids.pad, args.packing, args.batch_tokens, info.device,
                              info)
    finally:
        shutdown_distributed()
    if info.is_main:
        print(table(results))
        if args.out is not None:
            report = {"checkpoint": str(args.path), "packing": args.packing, "tasks": results}
            write_json_output(args.out, report, COMMAND)
    return 0


if __name__ == "__main__":
    sys.exit(main())
