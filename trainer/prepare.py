"""Prepare a dataset: documents -> tokenizer -> WebDataset shards -> manifest.json.

    python -m trainer.prepare --source demo --out data/demo
    python -m trainer.prepare --source 'text:notes/**/*.md' --out data/notes --tokenizer data/demo/tokenizer
    python -m trainer.prepare --source jsonl:corpus.jsonl --out data/c --text-key body --on-error skip
    python -m trainer.prepare --source demo-chat --out data/demo-chat --tokenizer data/demo/tokenizer

Sources: `demo` (the standard library, split into functions/classes), `text:GLOB` (one file = one
document), `jsonl:PATH` (one line = one document), `chat:PATH` (one line = one conversation,
{"messages": [{"role": ..., "content": ...}, ...]}, rendered by the tokenizer's chat template; see
trainer.data.chat) and `demo-chat` (questions about the standard library answered from its docstrings).
The whole corpus is held in memory.

Steps: read and deduplicate keys; split train/val by a hash of each key (stable when documents are
added); shuffle each split with --seed; train the tokenizer on the train split (or copy --tokenizer);
count tokens; write shards; write the manifest last. A user mistake ends as trainer/errors.py says (`error: ...`).
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import random
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from trainer.data.chat import chat_summary, chat_template, is_chat_source, read_chat_source
from trainer.data.config import ON_ERROR, TRAIN_SPLIT, VAL_SPLIT
from trainer.data.corpus import ErrorPolicy, PrepareError, read_source, unique_keys
from trainer.data.shards import (
    FORMAT_VERSION,
    MANIFEST_FILE,
    SCHEMA,
    atomic_write_bytes,
    write_manifest,
    write_shards,
)
from trainer.data.tokenizer import (
    CHAT_TEMPLATE,
    TOKENIZER_FILE,
    check_no_added_tokens,
    count_tokens,
    extend_tokenizer,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    tokenizer_file,
    tokenizer_hash,
    train_tokenizer,
    upgrade_chat_template,
    write_hf_configs,
)
from trainer.errors import command

Doc = tuple[str, str]  # (key, text)
TOKENIZER_DIR = "tokenizer"
LONG_THRESHOLDS = (512, 2048, 8192)
_SHARD_RE = re.compile(r"^(train|val)-\d{6}\.tar$")
_TEMP_RE = re.compile(r"^\.(manifest\.json|(train|val)-\d{6}\.tar)\..*\.tmp$")


def prepare(
    source: str,
    out: str | Path,
    *,
    vocab_size: int = 8192,
    tokenizer: str | Path | None = None,
    val_fraction: float = 0.01,
    docs_per_shard: int = 2000,
    max_shard_bytes: int | None = None,
    seed: int = 0,
    text_key: str = "text",
    on_error: str = "raise",
    max_docs: int | None = None,
    add_tokens: Sequence[str] = (),
) -> dict:
    """Build the dataset for `source` under `out` and return its manifest (also in out/manifest.json).

    `tokenizer` reuses an existing tokenizer (a directory holding tokenizer.json) instead of training
    one; `max_docs` keeps only the first documents of the source (for quick, small datasets).
    `add_tokens` appends special tokens to that reused tokenizer (e.g. the tokenizer of a checkpoint to be
    fine-tuned with `train.init_from` and `tokenizer.add_tokens`): existing ids are unchanged.
    """
    _check_options(val_fraction, docs_per_shard, max_docs)
    reused = _load_reusable_tokenizer(tokenizer) if tokenizer is not None else None  # fail before the slow part
    if add_tokens and reused is None:
        raise PrepareError("--add-tokens extends an existing tokenizer: give it with --tokenizer (e.g. the "
                           "checkpoint's <run dir>/checkpoints/step_NNNNNN/tokenizer)")
    extended = extend_tokenizer(reused, add_tokens) if add_tokens else None
    out = Path(out)
    _clear_leftovers(out)
    policy = ErrorPolicy(on_error)
    renamed: Counter[str] = Counter()
    chat = is_chat_source(source)
    if chat:  # rendered by the template the dataset's tokenizer/ will hold
        raw = read_chat_source(source, policy, chat_template(tokenizer) if tokenizer is not None else CHAT_TEMPLATE)
    else:
        raw = read_source(source, policy, text_key)
    docs = list(itertools.islice(unique_keys(raw, renamed), max_docs))
    if not docs:
        raise PrepareError(f"no documents in {source!r} (skipped: {dict(policy.skipped) or 'none'})")

    train, val = split_train_val(docs, val_fraction, seed)
    if reused is None:
        tok = train_tokenizer([text for _, text in train], vocab_size)
        save_tokenizer(tok, out / TOKENIZER_DIR)
    elif extended is not None:
        tok = extended
        save_tokenizer(tok, out / TOKENIZER_DIR)
    else:
        tok = reused
        _copy_tokenizer(tokenizer, out / TOKENIZER_DIR)
    manifest = {
        "format": FORMAT_VERSION,
        "schema": SCHEMA,
        "source": source,
        "options": {
            "seed": seed, "val_fraction": val_fraction, "docs_per_shard": docs_per_shard,
            "max_shard_bytes": max_shard_bytes, "max_docs": max_docs, "text_key": text_key, "on_error": on_error,
        },
        "tokenizer": {
            "path": TOKENIZER_DIR,
            "vocab_size": tok.get_vocab_size(),
            "special_ids": asdict(special_ids(tok)),
            "sha256": tokenizer_hash(out / TOKENIZER_DIR),
            "trained": tokenizer is None,
            **({"added_tokens": list(add_tokens), "base_sha256": tokenizer_hash(tokenizer)} if add_tokens else {}),
        },
        "splits": {
            name: _write_split(out, name, split, tok, docs_per_shard, max_shard_bytes)
            for name, split in ((TRAIN_SPLIT, train), (VAL_SPLIT, val))
        },
        "skipped": dict(sorted(policy.skipped.items())),
        "renamed_duplicate_keys": renamed["duplicate_key"],
    }
    if chat:  # the trainer's data.loss_on=assistant requires it
        manifest["chat"] = chat_summary([text for _, text in docs])
    write_manifest(out, manifest)
    _remove_stale_shards(out, manifest)
    return manifest


def _check_options(val_fraction: float, docs_per_shard: int, max_docs: int | None) -> None:
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"val fraction must be in [0, 1), got {val_fraction}")
    if docs_per_shard < 1:
        raise PrepareError(f"docs per shard must be >= 1, got {docs_per_shard}")
    if max_docs is not None and max_docs < 1:
        raise PrepareError(f"max docs must be >= 1, got {max_docs}")


def _clear_leftovers(out: Path) -> None:
    """Remove the old manifest first, so an interrupted run never looks finished, and temp files
    that a killed run left behind."""
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST_FILE).unlink(missing_ok=True)
    for path in out.iterdir():
        if _TEMP_RE.match(path.name):
            path.unlink(missing_ok=True)


def split_train_val(docs: Sequence[Doc], val_fraction: float, seed: int) -> tuple[list[Doc], list[Doc]]:
    """Val gets the documents whose key hashes (with the seed) below `val_fraction`; then each split
    is shuffled with `seed`.

    A key's side never depends on the other documents, so adding documents does not move old ones
    between splits. With >= 2 documents and val_fraction > 0, val gets at least one (the lowest
    hash) and train keeps at least one. The shuffle matters because sources come grouped (all of
    asyncio, then all of email, ...): shuffled shards each look like the whole corpus.
    """
    scores = [_unit_hash(key, seed) for key, _ in docs]
    is_val = [score < val_fraction for score in scores]
    if val_fraction > 0 and len(docs) >= 2 and not any(is_val):
        is_val[int(np.argmin(scores))] = True
    if all(is_val):
        is_val[int(np.argmax(scores))] = False
    train = [doc for doc, v in zip(docs, is_val, strict=True) if not v]
    val = [doc for doc, v in zip(docs, is_val, strict=True) if v]
    rng = random.Random(seed)
    rng.shuffle(train)
    rng.shuffle(val)
    return train, val


def _unit_hash(key: str, seed: int) -> float:
    """A uniform number in [0, 1) from the key and seed; the same on every machine and Python."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def _load_reusable_tokenizer(path: str | Path) -> Tokenizer:
    """An existing tokenizer, checked: it has the special tokens and adds no tokens of its own."""
    tok = load_tokenizer(path)
    special_ids(tok, path)
    check_no_added_tokens(tok)
    return tok


def _copy_tokenizer(src_dir: str | Path, tok_dir: Path) -> None:
    """Copy tokenizer.json byte for byte (so its hash is unchanged), and its two HF config files
    (written fresh if the source lacks them)."""
    src = tokenizer_file(src_dir)
    if src.resolve() == (tok_dir / TOKENIZER_FILE).resolve():
        return  # --tokenizer points at this dataset's own tokenizer
    atomic_write_bytes(tok_dir / TOKENIZER_FILE, src.read_bytes())
    configs = [src.parent / name for name in ("tokenizer_config.json", "special_tokens_map.json")]
    if all(path.is_file() for path in configs):
        for path in configs:
            atomic_write_bytes(tok_dir / path.name, path.read_bytes())
        upgrade_chat_template(tok_dir)  # a config written before the template marked assistant turns
    else:
        write_hf_configs(tok_dir)


def _write_split(
    out: Path, name: str, docs: list[Doc], tok: Tokenizer, docs_per_shard: int, max_shard_bytes: int | None
) -> dict:
    """Count tokens, write the shards; the split's entry in the manifest."""
    counts = count_tokens(tok, [text for _, text in docs], desc=f"tokenizing {name}")
    shards = write_shards(docs, out, name, docs_per_shard, max_shard_bytes)
    # Shards hold consecutive runs of `docs`, so their token counts are sums over consecutive runs.
    ends = np.cumsum([0] + [s.docs for s in shards])
    return {
        "shards": [
            {"name": s.name, "docs": s.docs, "tokens": int(sum(counts[ends[i] : ends[i + 1]])), "bytes": s.bytes}
            for i, s in enumerate(shards)
        ],
        "docs": len(docs),
        "tokens": int(sum(counts)),
        "lengths": length_stats(counts),
    }


def length_stats(counts: Sequence[int]) -> dict:
    """Summary of document lengths in tokens (EOS included). All zeros for an empty split.

    Example: [2, 4, 600] -> min 2, max 600, mean 202.0, median 4.0, p90 480.8, p99 588.08,
    count_gt_512 1, count_gt_2048 0, count_gt_8192 0, histogram with power-of-two edges
    [1, 2, 4, ..., 1024] and counts [0, 1, 1, 0, 0, 0, 0, 0, 0, 1] (bins [lo, hi), the last one closed).
    """
    a = np.asarray(counts, dtype=np.int64)
    if a.size == 0:
        return {"min": 0, "max": 0, "mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0,
                **{f"count_gt_{t}": 0 for t in LONG_THRESHOLDS}, "histogram": {"edges": [1], "counts": []}}
    edges = 2 ** np.arange(0, max(1, int(np.ceil(np.log2(max(2, a.max()))))) + 1)
    return {
        "min": int(a.min()),
        "max": int(a.max()),
        "mean": round(float(a.mean()), 2),
        "median": float(np.median(a)),
        "p90": round(float(np.percentile(a, 90)), 2),
        "p99": round(float(np.percentile(a, 99)), 2),
        **{f"count_gt_{t}": int((a > t).sum()) for t in LONG_THRESHOLDS},
        "histogram": {"edges": edges.tolist(), "counts": np.histogram(a, bins=edges)[0].tolist()},
    }


def _remove_stale_shards(out: Path, manifest: dict) -> None:
    """Delete shards of an earlier, larger run that this manifest does not list."""
    listed = {s["name"] for split in manifest["splits"].values() for s in split["shards"]}
    for path in out.iterdir():
        if _SHARD_RE.match(path.name) and path.name not in listed:
            path.unlink()


def format_report(manifest: dict, out: str | Path) -> str:
    """A few lines for the terminal: docs, tokens, shards, lengths, skips, tokenizer."""
    lines = [f"prepared {manifest['source']} -> {out}"]
    for name, split in manifest["splits"].items():
        lines.append(f"  {name:5s}: {split['docs']:,} docs, {split['tokens']:,} tokens, {len(split['shards'])} shards")
    for name, split in manifest["splits"].items():
        s = split["lengths"]
        over = ", ".join(f">{t}: {s[f'count_gt_{t}']}" for t in LONG_THRESHOLDS)
        lines.append(f"  {name:5s} lengths (tokens incl. EOS): min {s['min']}, mean {s['mean']}, median {s['median']}, "
                     f"p90 {s['p90']}, p99 {s['p99']}, max {s['max']}; {over}")
    skipped = ", ".join(f"{reason}={n}" for reason, n in manifest["skipped"].items()) or "none"
    lines.append(f"  skipped: {skipped}; renamed duplicate keys: {manifest['renamed_duplicate_keys']}")
    if "chat" in manifest:
        chat = manifest["chat"]
        lines.append(f"  chat: {chat['conversations']:,} conversations, {chat['assistant_turns']:,} assistant turns "
                     f"({chat['template']}); train on the assistant's tokens only with data.loss_on=assistant")
    tok = manifest["tokenizer"]
    lines.append(f"  tokenizer: {Path(out) / tok['path']} (vocab {tok['vocab_size']}, "
                 f"{'trained' if tok['trained'] else 'copied'}, sha256 {tok['sha256'][:16]}...)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.prepare", description=__doc__.split("\n")[0])
    p.add_argument("--source", required=True, help="demo | demo-chat | text:GLOB | jsonl:PATH | chat:PATH")
    p.add_argument("--out", required=True, help="output directory (shards, tokenizer/, manifest.json)")
    p.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size when training (default 8192)")
    p.add_argument("--tokenizer", default=None, help="reuse this tokenizer directory instead of training one")
    p.add_argument("--val-fraction", type=float, default=0.01, help="share of documents for val (default 0.01)")
    p.add_argument("--docs-per-shard", type=int, default=2000, help="documents per tar shard (default 2000)")
    p.add_argument("--shard-bytes", type=int, default=None, help="also close a shard before this much text")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/val split and the shuffle")
    p.add_argument("--text-key", default="text", help="jsonl: the field holding the text (default 'text')")
    p.add_argument("--on-error", choices=ON_ERROR, default="raise",
                   help="text/jsonl/chat: stop at, or skip (warn and count), bad items")
    p.add_argument("--max-docs", type=int, default=None, help="keep only the first N documents")
    p.add_argument("--add-tokens", nargs="+", default=[], metavar="TOKEN",
                   help="append these special tokens to the --tokenizer (train with tokenizer.add_tokens=[...])")
    return p.parse_args(argv)


@command(extra_user_errors=(OSError,))  # OSError: the output cannot be written (permissions, disk full)
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    manifest = prepare(
        args.source, args.out, vocab_size=args.vocab_size, tokenizer=args.tokenizer,
        val_fraction=args.val_fraction, docs_per_shard=args.docs_per_shard, max_shard_bytes=args.shard_bytes,
        seed=args.seed, text_key=args.text_key, on_error=args.on_error, max_docs=args.max_docs,
        add_tokens=args.add_tokens,
    )
    print(format_report(manifest, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
