"""The output directory of a prepare: what may be in it, the staging area,
and the merge that makes it a dataset.

    <out>/manifest.json, tokenizer/, train-000000.tar ..., val-000000.tar ...   the dataset
                                                                               (trainer.data.shards)
    <out>/.prepare/<plan id>/                                                  staging, while a prepare runs:
        plan.json            the plan (trainer.data.prepare.plan): units, options
        tokenizer/           the tokenizer the units are counted with
        u000003/, u000003.json   a unit's shards and, written last, its result (trainer.data.prepare.units)
        part-000-of-002.json     a part's manifest: its units' shards and totals
        swap.json            the merge in progress: which staged file becomes which dataset file

Nothing outside `.prepare/` changes until the merge, so an existing dataset stays usable while a new one is
prepared over it (and is kept if the new one fails). The merge then swaps: it removes the old manifest, moves
the staged shards and tokenizer into place under their final names (train-000000.tar, ... in unit order),
writes the new manifest, deletes the old shards it no longer lists and the staging area. A merge interrupted
midway is finished by the next one (swap.json says what is left). The directory must hold nothing prepare did
not write: prepare never deletes or overwrites a file it does not own.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import socket
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from trainer.data.config import TRAIN_SPLIT, VAL_SPLIT
from trainer.data.prepare.plan import Plan
from trainer.data.prepare.units import SPLITS, load_result
from trainer.data.shards import MANIFEST_FILE, PrepareError, atomic_write_bytes, shard_name, write_manifest
from trainer.data.tokenizer import TOKENIZER_FILES

STATE_DIR = ".prepare"
TOKENIZER_DIR = "tokenizer"
LONG_THRESHOLDS = (512, 2048, 8192)
SHARD_RE = re.compile(r"^(train|val)-\d{6}\.tar$")
_OWN_TEMP_RE = re.compile(r"^\.(manifest\.json|(train|val)-\d{6}\.tar)\..*\.tmp$")
PLAN_FILE = "plan.json"
SWAP_FILE = "swap.json"


# ---------------------------------------------------------------------------------------------
# What the output directory may hold
# ---------------------------------------------------------------------------------------------


def check_out_dir(out: Path) -> None:
    """Refuse an output directory holding anything a prepare did not write (prepare deletes files it owns)."""
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out}: is a file, not a directory")
    if not out.exists():
        return
    foreign = [p.name + ("/" if p.is_dir() else "") for p in sorted(out.iterdir()) if not _ours(p)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        raise PrepareError(f"--out {out}: holds files prepare did not write ({shown}); prepare only writes "
                           "into an empty or new directory, or over a dataset an earlier prepare wrote")


def _ours(path: Path) -> bool:
    name = path.name
    if name == MANIFEST_FILE or SHARD_RE.match(name) or _OWN_TEMP_RE.match(name):
        return path.is_file()
    if name == STATE_DIR:
        return path.is_dir()
    if name == TOKENIZER_DIR:
        return path.is_dir() and all(p.name in TOKENIZER_FILES or p.name.endswith(".tmp")
                                     for p in path.iterdir())
    return False


def remove_own_temp_files(out: Path) -> None:
    """Temp files of atomic writes that a killed merge left in `out` (never another process's: only the merge,
    under its lock, writes there)."""
    for path in out.iterdir():
        if _OWN_TEMP_RE.match(path.name):
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# The staging area
# ---------------------------------------------------------------------------------------------


def stage_dir(out: Path, plan_id: str) -> Path:
    return out / STATE_DIR / plan_id


class StageMerged(Exception):
    """The stage a prepare waited for was merged into the dataset
    (and removed) by another prepare meanwhile."""


@contextlib.contextmanager
def holding(stage: Path, exclusive: bool = False) -> Iterator[None]:
    """Hold the stage's lock while working on it: shared for a running part, exclusive for the merge (two
    parts finishing at once merge one after the other) and for removing a stage no process uses."""
    stage.mkdir(parents=True, exist_ok=True)
    fd = os.open(stage / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        try:
            here = os.stat(stage / ".lock").st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            here = False
        if not here:  # waited on a merge, which removed the stage: this work is done
            raise StageMerged(stage)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def claiming_part(stage: Path, part: int, parts: int) -> Iterator[None]:
    """Be the one process preparing part `part` of `parts` of this stage, or a PrepareError naming the one
    that is (the same command started twice would write the same units side by side, and one would find the
    other's files moved away under it). The lock file says who holds it; a dead holder's lock is free
    (flock)."""
    fd = os.open(stage / f".part-{part:03d}-of-{parts:03d}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "a process"
            what = f"part {part} of {parts}" if parts > 1 else "this prepare"
            raise PrepareError(f"{stage.parent.parent}: {what} is already running there ({holder}); wait for "
                               "it to finish (it merges the dataset) or stop it first") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        os.close(fd)


def remove_abandoned_stages(out: Path, keep: str) -> None:
    """Delete the staging of other plans (an earlier prepare with other options or input) that no running
    prepare holds. A staging that holds a finished part of a prepare run in parts (--part I --parts N) is
    never deleted: this prepare is refused instead (its options or input differ from those parts')."""
    root = out / STATE_DIR
    if not root.is_dir():
        return
    for stage in root.iterdir():
        if stage.name == keep or not stage.is_dir():
            continue
        finished = sorted(p.name for p in stage.glob("part-*-of-*.json"))
        if finished:
            raise PrepareError(f"{out} holds finished parts of a prepare with other options or input "
                               f"({stage}: {', '.join(finished)}): every part of one dataset takes the same "
                               "--source and options; run this part with theirs, or delete that staging "
                               "directory to start over")
        fd = os.open(stage / ".lock", os.O_CREAT | os.O_RDWR, 0o644) if stage.is_dir() else None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a prepare of that plan is running: its merge would replace this one's
            raise PrepareError(f"{out}: another prepare with other options or input is running there "
                               f"({stage}); one --out takes one prepare at a time: "
                               "wait for it, or write elsewhere") from None
        finally:
            if fd is not None:
                os.close(fd)
        shutil.rmtree(stage, ignore_errors=True)


def write_plan(stage: Path, plan: Plan) -> None:
    path = stage / PLAN_FILE
    data = (json.dumps(plan.to_json(), sort_keys=True) + "\n").encode("utf-8")
    if not path.is_file() or path.read_bytes() != data:
        atomic_write_bytes(path, data)


def load_stage_plan(stage: Path) -> Plan:
    try:
        return Plan.from_json(json.loads((stage / PLAN_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise PrepareError(f"{stage / PLAN_FILE}: cannot read the plan of this prepare ({e})") from e


def staged_plan(out: Path, inputs: str) -> Plan | None:
    """The staged plan whose inputs key (trainer.data.prepare.plan.inputs_key) is `inputs`, if any."""
    root = out / STATE_DIR
    for path in sorted(root.glob(f"*/{PLAN_FILE}")) if root.is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if data.get("options", {}).get("inputs") == inputs:
            plan = Plan.from_json(data)
            if plan.id == path.parent.name:
                return plan
    return None


def find_stage(out: Path) -> Path | None:
    """The staging area of `out` to merge (the newest, if several); None if the dataset is complete and
    nothing is staged (a merge that already happened: merging again is not an error)."""
    root = out / STATE_DIR
    stages = sorted(p for p in root.iterdir() if (p / PLAN_FILE).is_file()) if root.is_dir() else []
    if not stages:
        if (out / MANIFEST_FILE).is_file():
            return None
        raise PrepareError(f"{out}: nothing to merge: no prepare staged there "
                           f"({STATE_DIR}/ is missing or empty)")
    if len(stages) > 1:
        newest = max(stages, key=lambda p: (p / PLAN_FILE).stat().st_mtime)
        return newest
    return stages[0]


def part_file(stage: Path, part: int, parts: int) -> Path:
    return stage / f"part-{part:03d}-of-{parts:03d}.json"


def unit_results(stage: Path, plan: Plan) -> tuple[dict[int, dict], list[int]]:
    """Results of the plan's finished units, and the indices of the others."""
    done, missing = {}, []
    for unit in plan.units:
        result = load_result(stage, unit.index)
        if result is None:
            missing.append(unit.index)
        else:
            done[unit.index] = result
    return done, missing


def missing_message(stage: Path, missing: Sequence[int], parts: int | None = None) -> str:
    """Which units, and with parts, which parts (those owning a unfinished unit), have not finished."""
    shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
    text = f"{len(missing)} unit(s) of this prepare are not done (units {shown})"
    if parts is None:  # --merge: the parts the part manifests were written for
        found = sorted({int(m.group(2)) for p in stage.glob("part-*-of-*.json")
                        if (m := re.match(r"part-(\d+)-of-(\d+)\.json", p.name))})
        parts = found[-1] if found else None
    if parts and parts > 1:
        text += f"; parts not finished: {sorted({u % parts for u in missing})} of --parts {parts}"
    return text


# ---------------------------------------------------------------------------------------------
# The manifest from the units' results
# ---------------------------------------------------------------------------------------------


def at_least_one_rule(results: Mapping[int, dict], val_fraction: float) -> tuple[int, str, str] | None:
    """The unit to redo, the key and the split it must go to, so that val has a document when val_fraction > 0
    and there are >= 2 documents (the lowest-scoring train key moves), and train always has one (the
    highest-scoring val key moves). None when the split already satisfies both."""
    docs = {split: sum(r["splits"][split]["docs"] for r in results.values()) for split in SPLITS}
    if val_fraction > 0 and docs[VAL_SPLIT] == 0 and docs[TRAIN_SPLIT] >= 2:
        score, key, unit = min((*r["extremes"]["train_min"], i) for i, r in results.items()
                               if "train_min" in r["extremes"])
        return unit, key, VAL_SPLIT
    if docs[TRAIN_SPLIT] == 0 and docs[VAL_SPLIT] >= 1:
        score, key, unit = max((*r["extremes"]["val_max"], i) for i, r in results.items()
                               if "val_max" in r["extremes"])
        return unit, key, TRAIN_SPLIT
    return None


def assemble(results: Mapping[int, dict]) -> tuple[dict, dict, list[tuple[str, str]]]:
    """(splits entry of the manifest, totals of skips/renames/chat, [(staged file, dataset file)]) for the
    units' results in unit order."""
    splits, moves = {}, []
    for split in SPLITS:
        shards, lengths = [], Counter()
        for index in sorted(results):
            entry = results[index]["splits"][split]
            for shard in entry["shards"]:
                name = shard_name(split, len(shards))
                shards.append({"name": name, "docs": shard["docs"], "tokens": shard["tokens"],
                               "bytes": shard["bytes"]})
                moves.append((shard["file"], name))
            lengths.update({int(k): v for k, v in entry["lengths"].items()})
        splits[split] = {"shards": shards, "docs": sum(s["docs"] for s in shards),
                         "tokens": sum(s["tokens"] for s in shards), "lengths": length_stats_of(lengths)}
    skipped: Counter[str] = Counter()
    for r in results.values():
        skipped.update(r["skipped"])
    totals = {"skipped": dict(sorted(skipped.items())),
              "renamed_duplicate_keys": sum(r["renamed"] for r in results.values())}
    chats = [r["chat"] for r in results.values() if "chat" in r]
    if chats:
        totals["chat"] = {key: sum(c[key] for c in chats) for key in ("conversations", "assistant_turns")}
    return splits, totals, moves


def length_stats(counts: Sequence[int]) -> dict:
    """Summary of document lengths in tokens (EOS included). All zeros for an empty split.

    Example: [2, 4, 600] -> min 2, max 600, mean 202.0, median 4.0, p90 480.8, p99 588.08,
    count_gt_512 1, count_gt_2048 0, count_gt_8192 0, histogram with power-of-two edges
    [1, 2, 4, ..., 1024] and counts [0, 1, 1, 0, 0, 0, 0, 0, 0, 1] (bins [lo, hi), the last one closed).
    """
    return length_stats_of(Counter(int(c) for c in counts))


def length_stats_of(distribution: Mapping[int, int]) -> dict:
    """`length_stats` from {length: number of documents}: exact (numpy's linear percentiles) in memory that
    grows with the number of distinct lengths, not of documents, so parts and units merge by adding counts."""
    values = np.array(sorted(k for k, v in distribution.items() if v > 0), dtype=np.int64)
    if values.size == 0:
        return {"min": 0, "max": 0, "mean": 0.0, "median": 0.0, "p90": 0.0, "p99": 0.0,
                **{f"count_gt_{t}": 0 for t in LONG_THRESHOLDS}, "histogram": {"edges": [1], "counts": []}}
    weights = np.array([distribution[int(v)] for v in values], dtype=np.int64)
    ends = np.cumsum(weights)  # the (sorted) documents values[i] covers end at ends[i]
    n = int(ends[-1])

    def nth(i: int) -> int:  # the i-th smallest length (0-based)
        return int(values[np.searchsorted(ends, i, side="right")])

    def percentile(p: float) -> float:  # numpy's default ("linear") method, its arithmetic included
        h = (n - 1) * (p / 100)
        lo = int(np.floor(h))
        a, b, t = float(nth(lo)), float(nth(min(lo + 1, n - 1))), h - lo
        return b - (b - a) * (1 - t) if t >= 0.5 else a + (b - a) * t

    edges = 2 ** np.arange(0, max(1, int(np.ceil(np.log2(max(2, int(values[-1])))))) + 1)
    return {
        "min": int(values[0]),
        "max": int(values[-1]),
        "mean": round(float((values * weights).sum()) / n, 2),
        "median": percentile(50),
        "p90": round(percentile(90), 2),
        "p99": round(percentile(99), 2),
        **{f"count_gt_{t}": int(weights[values > t].sum()) for t in LONG_THRESHOLDS},
        "histogram": {"edges": edges.tolist(),
                      "counts": np.histogram(values, bins=edges,
                                             weights=weights)[0].astype(np.int64).tolist()},
    }


# ---------------------------------------------------------------------------------------------
# The swap
# ---------------------------------------------------------------------------------------------


def swap_into_place(out: Path, stage: Path, manifest: dict | None = None,
                    moves: Sequence[tuple[str, str]] = ()) -> dict:
    """Make the staged dataset the dataset of `out` (see the module docstring); return its manifest. Without
    `manifest`, finish the swap swap.json describes."""
    swap_path = stage / SWAP_FILE
    if manifest is None:
        swap = json.loads(swap_path.read_text(encoding="utf-8"))
        manifest, moves = swap["manifest"], [tuple(m) for m in swap["moves"]]
    else:
        atomic_write_bytes(swap_path, json.dumps({"manifest": manifest, "moves": moves}).encode("utf-8"))
    (out / MANIFEST_FILE).unlink(missing_ok=True)  # a half-swapped directory must not look complete
    remove_own_temp_files(out)
    for staged, final in moves:
        src = stage / staged
        if src.is_file():
            os.replace(src, out / final)
        elif not (out / final).is_file():
            raise PrepareError(f"{stage}: staged shard {staged} is missing; prepare again "
                               "(the staged work is lost)")
    tok_dir = out / TOKENIZER_DIR
    tok_dir.mkdir(exist_ok=True)
    for name in TOKENIZER_FILES:
        if (stage / TOKENIZER_DIR / name).is_file():
            os.replace(stage / TOKENIZER_DIR / name, tok_dir / name)
    write_manifest(out, manifest)
    listed = {s["name"] for split in manifest["splits"].values() for s in split["shards"]}
    for path in out.iterdir():
        if SHARD_RE.match(path.name) and path.name not in listed:
            path.unlink()  # a shard of an earlier, larger dataset
    shutil.rmtree(stage, ignore_errors=True)
    with contextlib.suppress(OSError):
        (out / STATE_DIR).rmdir()  # empty unless another plan is staged
    return manifest
