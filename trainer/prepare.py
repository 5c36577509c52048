"""Prepare a dataset: documents -> tokenizer -> WebDataset shards -> manifest.json, streaming and in parallel.

    python -m trainer.prepare --source demo --out data/demo
    python -m trainer.prepare --source 'jsonl:dolma/*.json.gz' --out data/dolma --workers 16
    python -m trainer.prepare --source 'parquet:fineweb/*.parquet' --text-key text --out data/fw \\
        --tokenizer data/demo/tokenizer
    python -m trainer.prepare --source 'text:notes/**/*.md' --out data/notes --tokenizer data/demo/tokenizer
    python -m trainer.prepare --source chat:chats.jsonl --out data/chat --tokenizer data/demo/tokenizer
    sbatch --array=0-7 launch/prepare.sbatch --source ... --out /shared/data/x     # --part I --parts 8, then a merge

Sources: `demo` (the standard library, split into functions/classes), `demo-modules` (the same modules whole:
long documents, for a mixture with `demo`), `demo-chat` (questions about it answered from its docstrings),
`text:GLOB` (one file = one document), `jsonl:GLOB` (one line = one document; .jsonl, .json, .gz, .zst),
`parquet:GLOB` (one row = one document), `hf:DIR_OR_NAME` (a Hugging Face dataset saved with save_to_disk or
in the local cache; needs the `hf` extra) and `chat:GLOB` (one line = one conversation,
{"messages": [{"role": ..., "content": ...}, ...]}, rendered by the tokenizer's chat template;
trainer.data.chat).

The work is trainer.data.prepare (plan, units, the merge; `prepare`, `merge`); this command parses the flags,
calls it and prints the report. Memory does not grow with the corpus. Killed, it resumes: the same command
again keeps the finished units. A user mistake ends as trainer/errors.py says (`error: ...`).
"""  # noqa: E501

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from trainer.data.config import ON_ERROR
from trainer.data.prepare.assemble import (  # noqa: F401  (length_stats: re-exported)
    LONG_THRESHOLDS,
    length_stats,
)
from trainer.data.prepare.dataset import DEFAULT_MAX_DOC_MB, DEFAULT_SAMPLE_MB, merge, prepare, usable_cores
from trainer.data.shards import PrepareError
from trainer.errors import command
from trainer.outputs import check_not_inside_input

__all__ = ["main", "merge", "prepare"]


def format_report(manifest: dict, out: str | Path) -> str:
    """A few lines for the terminal: docs, tokens, shards, lengths, skips, tokenizer."""
    lines = [f"prepared {manifest['source']} -> {out}"]
    for name, split in manifest["splits"].items():
        lines.append(f"  {name:5s}: {split['docs']:,} docs, {split['tokens']:,} tokens, "
                     f"{len(split['shards'])} shards")
    for name, split in manifest["splits"].items():
        s = split["lengths"]
        over = ", ".join(f">{t}: {s[f'count_gt_{t}']}" for t in LONG_THRESHOLDS)
        lines.append(f"  {name:5s} lengths (tokens incl. EOS): min {s['min']}, mean {s['mean']}, "
                     f"median {s['median']}, p90 {s['p90']}, p99 {s['p99']}, max {s['max']}; {over}")
    skipped = ", ".join(f"{reason}={n}" for reason, n in manifest["skipped"].items()) or "none"
    lines.append(f"  skipped: {skipped}; renamed duplicate keys: {manifest['renamed_duplicate_keys']}")
    if "chat" in manifest:
        chat = manifest["chat"]
        lines.append(f"  chat: {chat['conversations']:,} conversations, {chat['assistant_turns']:,} "
                     f"assistant turns ({chat['template']}); train on the assistant's tokens only with "
                     "data.loss_on=assistant")
    tok = manifest["tokenizer"]
    lines.append(f"  tokenizer: {Path(out) / tok['path']} (vocab {tok['vocab_size']}, "
                 f"{'trained' if tok['trained'] else 'copied'}, sha256 {tok['sha256'][:16]}...)")
    ids = manifest.get("ids")
    lines.append(f"  token ids: stored beside the text ({'uint16' if ids['dtype'] == '<u2' else 'uint32'}; "
                 "read instead of tokenizing by runs with this tokenizer)" if ids
                 else "  token ids: not stored (--text-only)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--source", help="demo | demo-modules | demo-chat | text:GLOB | jsonl:GLOB | "
                   "parquet:GLOB | hf:DIR_OR_NAME | chat:GLOB")
    p.add_argument("--out", help="output directory (shards, tokenizer/, manifest.json)")
    p.add_argument("--merge", metavar="DIR", default=None,
                   help="only merge the parts staged in DIR into its dataset (after every --part finished)")
    p.add_argument("--vocab-size", type=int, default=8192,
                   help="BPE vocabulary size when training (default 8192)")
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer directory instead of training one")
    p.add_argument("--tokenizer-sample-mb", type=float, default=DEFAULT_SAMPLE_MB,
                   help="train the tokenizer on this much text, spread over the corpus "
                        f"(default {DEFAULT_SAMPLE_MB})")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of documents for val (default 0.01)")
    p.add_argument("--docs-per-shard", type=int, default=2000, help="documents per tar shard (default 2000)")
    p.add_argument("--shard-bytes", type=int, default=None, help="also close a shard before this much text")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split (a hash of seed and key)")
    p.add_argument("--text-key", default="text",
                   help="jsonl/parquet/hf: the field holding the text, a.b for a nested one (default 'text')")
    p.add_argument("--on-error", choices=ON_ERROR, default="raise",
                   help="stop at, or skip (warn and count), bad items")
    p.add_argument("--max-docs", type=int, default=None, help="keep only the first N documents")
    p.add_argument("--max-doc-mb", type=float, default=DEFAULT_MAX_DOC_MB,
                   help="one document's largest size in MB of UTF-8 text (tokenizing one document takes "
                        "~200x its size in memory); a larger one is an error naming it, or with --on-error "
                        f"skip a counted skip (too_large); default {DEFAULT_MAX_DOC_MB:g}")
    p.add_argument("--add-tokens", nargs="+", default=[], metavar="TOKEN",
                   help="append these special tokens to the --tokenizer "
                        "(train with tokenizer.add_tokens=[...])")
    p.add_argument("--workers", type=int, default=None,
                   help="processes preparing units side by side (default and most: the cores this process "
                   "may use, and no more than there are units)")
    p.add_argument("--part", type=int, default=0,
                   help="prepare the part I (0-based) of --parts (several machines)")
    p.add_argument("--parts", type=int, default=1,
                   help="the number of parts the input is split into (default 1)")
    p.add_argument("--unit-mb", type=float, default=None,
                   help="input per unit, the piece one worker prepares (default: the corpus / 64, "
                        "1 to 64 MB)")
    p.add_argument("--text-only", action="store_true",
                   help="write only each document's text, not its token ids beside it (the trainer then "
                        "tokenizes the text as it reads; it always does for a run with another tokenizer)")
    p.add_argument("--resume", action="store_true",
                   help="insist on continuing an interrupted prepare (the same command resumes anyway)")
    args = p.parse_args(argv)
    if args.merge is None and (args.source is None or args.out is None):
        p.error("--source and --out are required (or --merge DIR alone)")
    return args


@command(extra_user_errors=(OSError,))  # OSError: the output cannot be written (permissions, disk full)
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if args.merge is not None:
        if args.source is not None or args.out is not None:
            raise PrepareError(f"--merge {args.merge} merges the parts staged for that dataset and takes no "
                               "--source or --out: drop them (or drop --merge to prepare)")
        print(format_report(merge(args.merge), args.merge))
        return 0
    # `out` itself may be an earlier dataset (prepared again)
    check_not_inside_input(Path(args.out), itself=False)
    manifest = prepare(
        args.source, args.out, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
        val_fraction=args.val_fraction, docs_per_shard=args.docs_per_shard, max_shard_bytes=args.shard_bytes,
        seed=args.seed, text_key=args.text_key, on_error=args.on_error, max_docs=args.max_docs,
        max_doc_mb=args.max_doc_mb,
        add_tokens=args.add_tokens, workers=usable_cores() if args.workers is None else args.workers,
        part=args.part, parts=args.parts,
        unit_mb=args.unit_mb, tokenizer_sample_mb=args.tokenizer_sample_mb, resume=args.resume,
        text_only=args.text_only,
    )
    if manifest is not None:
        print(format_report(manifest, args.out))
        print(f"  in {time.monotonic() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
