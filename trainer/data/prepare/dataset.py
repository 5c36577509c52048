"""Prepare a dataset: documents -> tokenizer -> WebDataset shards -> manifest.json, streaming and in parallel
(`prepare`; `merge` after a run in parts). The command is trainer/prepare.py.

Steps: plan (the input cut into units of a few MB, trainer.data.prepare.plan); the tokenizer, trained on a
bounded sample spread over the units (--tokenizer-sample-mb) or copied (--tokenizer); each unit read, split
train/val by a hash of its key, counted and written to staged shards by --workers processes
(trainer.data.prepare.units); the merge moves them into place and writes the manifest last
(trainer.data.prepare.assemble). Memory does not grow with the corpus. Killed, it resumes: the same call again
keeps the finished units.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import os
import queue
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict
from pathlib import Path

from tokenizers import Tokenizer
from tqdm import tqdm

from trainer.data.chat import TEMPLATE_NAME, chat_template
from trainer.data.prepare.assemble import (
    SWAP_FILE,
    TOKENIZER_DIR,
    StageMerged,
    assemble,
    at_least_one_rule,
    check_out_dir,
    claiming_part,
    find_stage,
    holding,
    load_stage_plan,
    missing_message,
    part_file,
    remove_abandoned_stages,
    stage_dir,
    staged_plan,
    swap_into_place,
    unit_results,
    write_plan,
)
from trainer.data.prepare.corpus import ErrorPolicy, PrepareError, unique_keys, whole_modules
from trainer.data.prepare.plan import Piece, Plan, Unit, input_files, inputs_key, is_chat, make_plan
from trainer.data.prepare.units import Job, load_result, prepare_unit, unit_documents, unit_hash
from trainer.data.shards import (
    ASSISTANT_FIELD,
    ASSISTANT_SCHEMA,
    FORMAT_VERSION,
    IDS_CHECK,
    IDS_FIELD,
    IDS_SCHEMA,
    MANIFEST_FILE,
    SCHEMA,
    atomic_write_bytes,
    ids_dtype,
    load_manifest,
)
from trainer.data.tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    SPECIAL_TOKENS_MAP_FILE,
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    extend_tokenizer,
    hf_token_config,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    tokenizer_file,
    tokenizer_hash,
    tokenizer_ids,
    train_tokenizer,
    upgrade_chat_template,
    write_hf_configs,
)
from trainer.data.workers import die_with_parent

MB = 1 << 20
DEFAULT_SAMPLE_MB = 100
DEFAULT_MAX_DOC_MB = 8.0
"""One document's largest size (MB of UTF-8 text) by default: tokenizing one document whole takes ~200x its
size in memory (a 52 MB JSON line peaked at 10.6 GB), so 8 MB stays under ~2 GB per worker."""
DEMO_MODULES = "demo-modules"
"""The standard library's modules whole, one document each (trainer.data.prepare.corpus.whole_modules)."""


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
    max_doc_mb: float = DEFAULT_MAX_DOC_MB,
    add_tokens: Sequence[str] = (),
    workers: int = 1,
    part: int = 0,
    parts: int = 1,
    unit_mb: float | None = None,
    tokenizer_sample_mb: float = DEFAULT_SAMPLE_MB,
    resume: bool = False,
    text_only: bool = False,
) -> dict | None:
    """Build the dataset for `source` under `out` and return its manifest (also in out/manifest.json); with
    `parts` > 1, prepare part `part` and return None unless this part was the last to finish (then it merges).

    `tokenizer` reuses an existing tokenizer (a directory holding tokenizer.json, and tokenizer_config.json
    for a Hugging Face model's: its framing, trainer.data.tokenizer.special_ids) instead of training one;
    `add_tokens` appends special tokens to it (e.g. the tokenizer of a checkpoint to be fine-tuned with
    `train.init_from` and `tokenizer.add_tokens`): existing ids are unchanged. `max_docs` keeps only the first
    documents of the source (for quick, small datasets; read by one process). `workers` processes prepare
    units side by side; `resume` insists on finding earlier work of the same command (without it, it is used
    if there). `text_only`: shards without the documents' token ids (trainer.data.shards; the stream then
    tokenizes the text).
    """
    _check_options(val_fraction, docs_per_shard, max_docs, workers, part, parts, unit_mb, tokenizer_sample_mb)
    if not (isinstance(max_doc_mb, (int, float)) and math.isfinite(max_doc_mb) and max_doc_mb > 0):
        raise PrepareError(f"--max-doc-mb must be a finite number > 0, got {max_doc_mb}")
    if max_docs is not None and parts > 1:
        raise PrepareError("--max-docs reads the first documents in order: it cannot be split into --parts")
    if not all(isinstance(t, str) and t for t in add_tokens):
        raise PrepareError(f"--add-tokens {list(add_tokens)}: each token must be a non-empty string")
    chat = is_chat(source)
    # fail before the slow part
    reused = _load_reusable_tokenizer(tokenizer, chat, add_tokens) if tokenizer is not None else None
    if add_tokens and reused is None:
        raise PrepareError("--add-tokens extends an existing tokenizer: give it with --tokenizer (e.g. the "
                           "checkpoint's <run dir>/checkpoints/step_NNNNNN/tokenizer)")
    out = Path(out)
    check_out_dir(out)
    template = (chat_template(tokenizer) if tokenizer is not None else CHAT_TEMPLATE) if chat else None
    options = {
        "seed": seed, "val_fraction": val_fraction, "docs_per_shard": docs_per_shard,
        "max_shard_bytes": max_shard_bytes, "max_docs": max_docs, "text_key": text_key, "on_error": on_error,
        "max_doc_bytes": int(max_doc_mb * MB),
        "store_ids": not text_only,
        "ids_check": not text_only,
        "tokenizer": {"trained": reused is None, "vocab_size": vocab_size if reused is None else None,
                      "sample_bytes": int(tokenizer_sample_mb * MB) if reused is None else None,
                      "base_sha256": tokenizer_hash(tokenizer) if reused is not None else None,
                      "added_tokens": list(add_tokens)},
        "chat_template": template,
    }
    unit_bytes, single = (None if unit_mb is None else int(unit_mb * MB)), max_docs is not None
    files = source_files(source)
    check_not_prepared_data(files, out)
    plan = staged_plan(out, inputs_key(files, options, unit_bytes, single)) or \
        make_plan(source, options, unit_bytes, single, files=files)
    stage = stage_dir(out, plan.id)
    if resume and not (stage / "plan.json").is_file():
        raise PrepareError(f"--resume: nothing to resume in {out}: no earlier prepare of this source with "
                           "these options is staged there; run without --resume to start")
    if (stage / SWAP_FILE).is_file():  # a merge was interrupted midway: finish it
        return merge(out, stage)
    remove_abandoned_stages(out, keep=plan.id)  # before this stage exists: a refused prepare leaves nothing
    try:
        with holding(stage), claiming_part(stage, part, parts):
            remove_abandoned_stages(out, keep=plan.id)  # one started meanwhile
            write_plan(stage, plan)
            _stage_tokenizer(stage, plan, tokenizer, reused, add_tokens)
            job = job_of(plan, stage)
            mine = plan.part(part, parts)
            todo = [u for u in mine if load_result(stage, u.index) is None]
            label = f"part {part} of {parts}: " if parts > 1 else ""
            if len(todo) < len(mine):
                print(f"{label}resuming: {len(mine) - len(todo)} of {len(mine)} units already done in "
                      f"{stage}", file=sys.stderr)
            _run_units(todo, job, workers, label)
            results, _ = unit_results(stage, plan)
            _write_part_manifest(stage, plan, part, parts, results)
    except StageMerged:
        print(f"{out}: another prepare of this source with these options merged the dataset while this one "
              "waited for it: nothing left to do", file=sys.stderr)
        return load_manifest(out)
    done, missing = unit_results(stage, plan)
    if missing:
        print(f"part {part} of {parts} done; {missing_message(stage, missing, parts)}. The last part to "
              f"finish merges them, or run: python -m trainer.prepare --merge {out}", file=sys.stderr)
        return None
    return merge(out, stage)


def source_files(source: str) -> list[Piece]:
    """The input files of `source` (trainer.data.prepare.plan.input_files), and those of `demo-modules`: each
    module a text piece, which the units read as one document (one file = one document, as `text:GLOB`), in
    the order and with the keys of `whole_modules`."""
    if source != DEMO_MODULES:
        return input_files(source)
    named = [(key, str(path)) for key, path in whole_modules()]
    # two modules can sanitize to one key: the second is `k-2`
    unique = (key for key, _ in unique_keys(named))
    return [Piece("text", path, key, os.path.getsize(path), renamed=key != original, number=number)
            for number, (key, (original, path)) in enumerate(zip(unique, named, strict=True), start=1)]


def check_not_prepared_data(files: Sequence[Piece], out: str | Path) -> None:
    """A PrepareError if the source matches a file inside `out` or inside any prepared dataset (a directory
    with manifest.json above the file): prepare would read its own output (its shards, manifest and tokenizer)
    or another dataset's as documents. Example: `text:notes/**/*` --out notes/prepared, run twice."""
    out = Path(out).resolve()
    is_dataset: dict[Path, bool] = {}  # each directory looked at once, however many files it holds
    for piece in files:
        if piece.kind == "module":
            continue
        path = Path(piece.path).resolve()
        for parent in path.parents:
            if parent not in is_dataset:
                is_dataset[parent] = parent == out or (parent / MANIFEST_FILE).is_file()
            if is_dataset[parent]:
                what = "--out" if parent == out else "a prepared dataset"
                raise PrepareError(f"the source matches {path}, inside {what} ({parent}): prepare would read "
                                   "a dataset's own files as documents; narrow the source's glob or write "
                                   "--out elsewhere")


def merge(out: str | Path, stage: Path | None = None) -> dict:
    """Write the dataset of the prepare staged in `out` (every unit done) and return its manifest."""
    out = Path(out)
    stage = stage if stage is not None else find_stage(out)
    if stage is None:
        print(f"{out}: already merged (manifest.json, nothing staged)", file=sys.stderr)
        return load_manifest(out)
    try:
        with holding(stage, exclusive=True):
            return _merge_held(out, stage)
    except StageMerged:  # another part merged while this one waited for the lock
        return load_manifest(out)


def _merge_held(out: Path, stage: Path) -> dict:
    if not (stage / "plan.json").is_file():  # another part merged while this one waited for the lock
        return load_manifest(out)
    if (stage / SWAP_FILE).is_file():
        return swap_into_place(out, stage)
    plan = load_stage_plan(stage)
    results, missing = unit_results(stage, plan)
    if missing:
        raise PrepareError(f"{out}: cannot merge yet: {missing_message(stage, missing)}; run the missing "
                           "parts (the same command with --part I --parts N for each)")
    rule = at_least_one_rule(results, plan.options["val_fraction"])
    if rule is not None:  # e.g. 40 documents at val_fraction 0.01: the lowest-scoring one goes to val
        index, key, split = rule
        job = job_of(plan, stage)
        results[index] = prepare_unit(plan.units[index], job, load_tokenizer(job.tokenizer),
                                      force={**results[index]["force"], key: split})
    splits, totals, moves = assemble(results)
    skipped = Counter(totals["skipped"]) + Counter(plan.options.get("plan_skipped", {}))
    totals["skipped"] = dict(sorted(skipped.items()))
    if not sum(split["docs"] for split in splits.values()):  # e.g. a parquet of 0 rows, an empty .gz
        raise PrepareError(f"no documents in {plan.source!r}: its files hold none, or every one was skipped "
                           f"({dict(skipped) or 'none skipped'}); nothing was written to {out}")
    return swap_into_place(out, stage, _manifest(plan, stage, splits, totals), moves)


def job_of(plan: Plan, stage: Path, ids: bool = True) -> Job:
    """The plan's options for its units. `ids=False`: without the ids' dtype (reading only: before the
    tokenizer is staged)."""
    o = plan.options
    # a plan staged before ids were stored: as its other units, none
    store_ids = ids and o.get("store_ids", False)
    dtype = ids_dtype(load_tokenizer(stage / TOKENIZER_DIR).get_vocab_size()) if store_ids else None
    framing = tokenizer_ids(stage / TOKENIZER_DIR).added if ids else 1
    return Job(stage=str(stage), tokenizer=str(stage / TOKENIZER_DIR), seed=o["seed"],
               val_fraction=o["val_fraction"], docs_per_shard=o["docs_per_shard"],
               max_shard_bytes=o["max_shard_bytes"], text_key=o["text_key"], on_error=o["on_error"],
               chat_template=o["chat_template"], max_docs=o["max_docs"], max_doc_bytes=o.get("max_doc_bytes"),
               ids_dtype=dtype, ids_check=store_ids and o.get("ids_check", False), framing=framing)


def _manifest(plan: Plan, stage: Path, splits: dict, totals: dict) -> dict:
    o = plan.options
    tok_dir = stage / TOKENIZER_DIR
    tok = load_tokenizer(tok_dir)
    config, _ = hf_token_config(tok_dir)
    tokenizer = {
        "path": TOKENIZER_DIR,
        "vocab_size": tok.get_vocab_size(),
        # eos, pad (and pad_from), bos, add_bos: the framing
        "special_ids": asdict(special_ids(tok, tok_dir)),
        "chat_template": isinstance((config or {}).get("chat_template"), str),
        "sha256": tokenizer_hash(tok_dir),
        "trained": o["tokenizer"]["trained"],
    }
    if o["tokenizer"]["added_tokens"]:
        tokenizer |= {"added_tokens": o["tokenizer"]["added_tokens"],
                      "base_sha256": o["tokenizer"]["base_sha256"]}
    chat = "chat" in totals
    schema = SCHEMA | (IDS_SCHEMA | (ASSISTANT_SCHEMA if chat else {}) if o.get("store_ids") else {})
    manifest = {
        "format": FORMAT_VERSION,
        "schema": schema,
        "source": plan.source,
        "options": {k: o[k] for k in ("seed", "val_fraction", "docs_per_shard", "max_shard_bytes", "max_docs",
                                      "text_key", "on_error", "unit_bytes", "max_doc_bytes")}
                   | {"tokenizer_sample_bytes": o["tokenizer"]["sample_bytes"],
                      "store_ids": bool(o.get("store_ids"))},
        "tokenizer": tokenizer,
        "splits": splits,
        "skipped": totals["skipped"],
        "renamed_duplicate_keys": totals["renamed_duplicate_keys"],
    }
    if o.get("store_ids"):  # the stream reads them when the run's tokenizer is this one (trainer.data.shards)
        manifest["ids"] = {"field": IDS_FIELD, "dtype": ids_dtype(tok.get_vocab_size()),
                           "tokenizer_sha256": tokenizer["sha256"],
                           **({"assistant_field": ASSISTANT_FIELD} if chat else {}),
                           **({"check": IDS_CHECK} if o.get("ids_check") else {})}
    if chat:  # the trainer's data.loss_on=assistant requires it
        manifest["chat"] = {"template": TEMPLATE_NAME, **totals["chat"]}
    return manifest


def usable_cores() -> int:
    """The cores this process may run on: prepare's default --workers, and the most it starts (more processes
    than cores only share them, each holding its own tokenizer and buffers)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _check_options(val_fraction: float, docs_per_shard: int, max_docs: int | None, workers: int, part: int,
                   parts: int, unit_mb: float | None, sample_mb: float) -> None:
    if not 0 <= val_fraction < 1:
        raise PrepareError(f"val fraction must be in [0, 1), got {val_fraction}")
    if docs_per_shard < 1:
        raise PrepareError(f"docs per shard must be >= 1, got {docs_per_shard}")
    if max_docs is not None and max_docs < 1:
        raise PrepareError(f"max docs must be >= 1, got {max_docs}")
    if workers < 1:
        raise PrepareError(f"--workers must be >= 1, got {workers}")
    if parts < 1 or not 0 <= part < parts:
        raise PrepareError("--part must be in [0, --parts) and --parts >= 1, got "
                           f"--part {part} --parts {parts}")
    if unit_mb is not None and not (math.isfinite(unit_mb) and unit_mb > 0):
        raise PrepareError(f"--unit-mb must be a finite number > 0, got {unit_mb}")
    if not (math.isfinite(sample_mb) and sample_mb > 0):
        raise PrepareError(f"--tokenizer-sample-mb must be a finite number > 0, got {sample_mb}")


# ---------------------------------------------------------------------------------------------
# The tokenizer
# ---------------------------------------------------------------------------------------------


def _stage_tokenizer(stage: Path, plan: Plan, tokenizer: str | Path | None, reused: Tokenizer | None,
                     add_tokens: Sequence[str]) -> None:
    """The tokenizer the units count with, in <stage>/tokenizer: copied, extended, or trained on the sample.
    Kept across a restart (and, trained, the same in every part: the sample is a function of the plan)."""
    tok_dir = stage / TOKENIZER_DIR
    if all((tok_dir / name).is_file() for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE)):
        return
    if reused is not None:
        _copy_tokenizer(tokenizer, tok_dir, extend_tokenizer(reused, add_tokens) if add_tokens else None)
    else:
        o = plan.options
        texts = sample_texts(plan, job_of(plan, stage, ids=False), o["tokenizer"]["sample_bytes"])
        save_tokenizer(train_tokenizer(texts, o["tokenizer"]["vocab_size"]), tok_dir)


def sample_texts(plan: Plan, job: Job, sample_bytes: int) -> Iterator[str]:
    """The tokenizer's training sample: from each unit in turn, its first train documents up to an equal share
    of `sample_bytes`. Deterministic, spread over the whole corpus, streamed (never held in memory)."""
    quota = max(1, sample_bytes // len(plan.units))
    quiet = ErrorPolicy(job.on_error, warn=lambda _msg: None)  # the units' pass warns and counts
    for unit in tqdm(plan.units, desc="tokenizer sample", unit="unit", disable=None):
        taken = 0
        for key, text, _ in unit_documents(unit, job, quiet):
            if unit_hash(key, job.seed) < job.val_fraction:
                continue
            yield text
            taken += len(text)
            if taken >= quota:
                break


# ---------------------------------------------------------------------------------------------
# Running the units: in this process, or in worker processes
# ---------------------------------------------------------------------------------------------


def _run_units(units: Sequence[Unit], job: Job, workers: int, label: str = "") -> None:
    """Prepare `units`, `workers` at a time, with one progress bar (input MB/s, docs/s, ETA); without a
    terminal (a Slurm log), a status line every STATUS_EVERY_S seconds instead."""
    if not units:
        return
    total = sum(u.bytes for u in units)
    with tqdm(total=total, desc="preparing", unit="B", unit_scale=True, unit_divisor=1024,
              disable=None) as bar:
        status = _Status(bar, total, len(units), label)
        if workers == 1 or len(units) == 1:
            with _single_threaded_tokenizer():
                tok = load_tokenizer(job.tokenizer)
                for unit in units:
                    prepare_unit(unit, job, tok, status.progress)
                    status.unit_done()
        else:
            _run_in_workers(units, job, min(workers, len(units), usable_cores()), status)
        bar.update(max(0, total - bar.n))  # sizes on disk are estimates for compressed input and datasets
        status.line(final=True)


STATUS_EVERY_S = 30.0


class _Status:
    """Progress of the units: the bar's numbers, and the same as a line every STATUS_EVERY_S without a bar."""

    def __init__(self, bar: tqdm, total: int, units: int, label: str) -> None:
        self.bar, self.total, self.units, self.label = bar, total, units, label
        self.started = self.last = time.monotonic()
        self.docs = self.done = self.nbytes = 0

    def progress(self, nbytes: int, ndocs: int) -> None:
        self.docs += ndocs
        self.nbytes += nbytes
        self.bar.update(nbytes)
        if ndocs:
            self.bar.set_postfix_str(f"{self.docs / self.elapsed:,.0f} docs/s", refresh=False)
        if self.bar.disable and time.monotonic() - self.last >= STATUS_EVERY_S:
            self.line()

    def unit_done(self) -> None:
        self.done += 1

    @property
    def elapsed(self) -> float:
        return max(time.monotonic() - self.started, 1e-9)

    def line(self, final: bool = False) -> None:
        if not self.bar.disable:
            return
        self.last = time.monotonic()
        rate = self.nbytes / MB / self.elapsed
        left = max(self.total - self.nbytes, 0) / MB / rate if rate > 0 and not final else 0.0
        print(f"{self.label}preparing: {self.done}/{self.units} units, "
              f"{self.nbytes / MB:,.1f}/{self.total / MB:,.1f} MB, "
              f"{rate:.2f} MB/s, {self.docs:,} docs ({self.docs / self.elapsed:,.0f}/s)"
              + ("" if final else f", ETA {left:,.0f} s"), file=sys.stderr, flush=True)


def _run_in_workers(units: Sequence[Unit], job: Job, workers: int, status: _Status) -> None:
    # no fork of a process that already ran the Rust thread pool
    context = multiprocessing.get_context("spawn")
    updates = context.Queue()
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker,
                               initargs=(os.getpid(), updates, job))
    futures = {pool.submit(_work, unit): unit for unit in units}
    try:
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, timeout=0.2, return_when=FIRST_EXCEPTION)
            _drain(updates, status.progress)
            for future in finished:
                try:
                    future.result()
                    status.unit_done()
                except BrokenProcessPool as e:
                    raise PrepareError("a prepare worker died (killed, or out of memory?) while preparing "
                                       f"unit {futures[future].index} ({_where(futures[future])}); run the "
                                       "same command again: finished units are kept") from e
        _drain(updates, status.progress)
    finally:
        for future in futures:
            future.cancel()
        for process in list(getattr(pool, "_processes", {}).values()):  # stop the others at once on an error
            if process.is_alive() and any(not f.done() for f in futures):
                process.kill()
        pool.shutdown(wait=True, cancel_futures=True)


def _where(unit: Unit) -> str:
    first = unit.pieces[0].path
    return first if len(unit.pieces) == 1 else f"{first} and {len(unit.pieces) - 1} more"


def _drain(updates, progress) -> None:
    while True:
        try:
            nbytes, ndocs = updates.get_nowait()
        except queue.Empty:
            return
        progress(nbytes, ndocs)


_WORKER: dict = {}


def _init_worker(parent_pid: int, updates, job: Job) -> None:
    die_with_parent(parent_pid)  # never outlive a prepare killed with kill -9
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --workers says how many
    _WORKER.update(updates=updates, job=job, tok=load_tokenizer(job.tokenizer), pending=[0, 0], last=0.0)


def _work(unit: Unit) -> None:
    w = _WORKER
    pending = w["pending"]

    def progress(nbytes: int, ndocs: int) -> None:  # batched: a queue message every 0.2 s at most
        pending[0] += nbytes
        pending[1] += ndocs
        now = time.monotonic()
        if now - w["last"] > 0.2:
            w["updates"].put((pending[0], pending[1]))
            pending[0] = pending[1] = 0
            w["last"] = now

    prepare_unit(unit, w["job"], w["tok"], progress)
    w["updates"].put((pending[0], pending[1]))
    pending[0] = pending[1] = 0


@contextlib.contextmanager
def _single_threaded_tokenizer():
    """The tokenizer's own thread pool off while units are counted here: --workers 1 means one core."""
    old = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = old


def _write_part_manifest(stage: Path, plan: Plan, part: int, parts: int, results: dict[int, dict]) -> None:
    """What this part prepared: its units, their shards (staged names) and totals."""
    mine = {u.index: results[u.index] for u in plan.part(part, parts) if u.index in results}
    splits, totals, _ = assemble(mine)
    summary = {"part": part, "parts": parts, "plan": plan.id, "units": sorted(mine),
               "splits": {name: {k: v for k, v in split.items() if k != "shards"} | {
                   "shards": [r["file"] for i in sorted(mine) for r in mine[i]["splits"][name]["shards"]]}
                   for name, split in splits.items()}, **totals}
    atomic_write_bytes(part_file(stage, part, parts), (json.dumps(summary, indent=2) + "\n").encode("utf-8"))


def _load_reusable_tokenizer(path: str | Path, chat: bool, add_tokens: Sequence[str]) -> Tokenizer:
    """An existing tokenizer, checked: its special ids and framing are readable (special_ids) and, for chat
    data, it has the ChatML tokens (or --add-tokens adds them)."""
    tok = load_tokenizer(path)
    ids = special_ids(tok, path)
    missing = [t for t, i in ((IM_START, ids.im_start), (IM_END, ids.im_end))
               if i is None and t not in add_tokens]
    if chat and missing:
        raise PrepareError(f"{tokenizer_file(path)}: chat data needs the ChatML tokens {missing}, which this "
                           f"tokenizer lacks: add them (--add-tokens {' '.join(missing)}) or use a tokenizer "
                           "that has them")
    return tok


def _copy_tokenizer(src_dir: str | Path, tok_dir: Path, extended: Tokenizer | None = None) -> None:
    """Copy tokenizer.json byte for byte (so its hash is unchanged; `extended`: write that one, the tokenizer
    with --add-tokens), and the Hugging Face files beside it: tokenizer_config.json (its framing travels with
    it) and special_tokens_map.json if there. Without tokenizer_config.json (a bare tokenizer.json),
    packtrain's are written."""
    src = tokenizer_file(src_dir)
    if extended is None and src.resolve() == (tok_dir / TOKENIZER_FILE).resolve():
        return  # --tokenizer points at this dataset's own tokenizer
    atomic_write_bytes(tok_dir / TOKENIZER_FILE,
                       extended.to_str().encode("utf-8") if extended else src.read_bytes())
    if not (src.parent / TOKENIZER_CONFIG_FILE).is_file():
        write_hf_configs(tok_dir)
        return
    for name in (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE):
        if (src.parent / name).is_file():
            atomic_write_bytes(tok_dir / name, (src.parent / name).read_bytes())
    upgrade_chat_template(tok_dir)  # a config written before the template marked assistant turns
