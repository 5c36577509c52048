"""`python -m trainer.prepare` at scale: units, worker processes, parts and their merge, resuming after
kill -9, the formats corpora ship in, and the output directory (never a file prepare did not write; the old
dataset kept until the new one is complete). Every comparison is with an uninterrupted one-process run on the
same input."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import psutil
import pytest
import webdataset as wds

from tests.helpers import ENV, ROOT
from trainer.data.prepare.assemble import STATE_DIR, length_stats, length_stats_of
from trainer.data.shards import TEXT_FIELD, PrepareError, load_manifest, shard_paths
from trainer.prepare import main, merge, prepare

VOCAB = 300
UNIT_MB = 0.02  # ~20 kB units: the small corpus below is cut into a dozen, as a large one would be


def corpus_records(n: int = 1500, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    words = ["packing", "attention", "tokens", "Grüße", "日本語", "naïve", "loss", "batch", "🎉", "document"]
    return [{"text": " ".join(rng.choice(words, size=int(rng.integers(3, 60)))) + f" #{i}", "meta": {"n": i}}
            for i in range(n)]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Three JSONL files of ~40 kB (one gzipped), so units come from byte ranges and whole files."""
    root = tmp_path_factory.mktemp("corpus")
    records = corpus_records()
    write_jsonl(root / "a.jsonl", records[:700])
    write_jsonl(root / "b.jsonl", records[700:1200])
    with gzip.open(root / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r, ensure_ascii=False) + "\n" for r in records[1200:])
    return root


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> Path:
    """The corpus prepared in one process, uninterrupted: what every other way must reproduce exactly."""
    out = tmp_path_factory.mktemp("reference")
    prepare(f"jsonl:{corpus}/*", out, vocab_size=VOCAB, docs_per_shard=100, val_fraction=0.05,
            unit_mb=UNIT_MB)
    return out


def assert_same_dataset(a: Path, b: Path) -> None:
    """Same manifest (but the source string) and byte-identical shards and tokenizer files."""
    ma, mb = load_manifest(a), load_manifest(b)
    ma.pop("source"), mb.pop("source")
    assert ma == mb
    names = [s["name"] for split in ma["splits"].values() for s in split["shards"]]
    for name in [*names, "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert sorted(p.name for p in b.glob("*.tar")) == sorted(names)
    assert not (b / STATE_DIR).exists()


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainer.prepare", *args], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=300, **kwargs)


def test_the_corpus_is_cut_into_units_and_every_document_is_there_once(corpus, reference):
    manifest = load_manifest(reference)
    assert len(manifest["splits"]["train"]["shards"]) >= 10  # units each end a shard: there were many
    keys = Counter(s["__key__"] for split in ("train", "val")
                   for s in wds.WebDataset(shard_paths(reference, split), shardshuffle=False))
    expected = ({f"a--{i}" for i in range(1, 701)} | {f"b--{i}" for i in range(1, 501)}
                | {f"c--{i}" for i in range(1, 301)})
    assert set(keys) == expected and set(keys.values()) == {1}
    texts = {s["__key__"]: s[TEXT_FIELD].decode() for split in ("train", "val")
             for s in wds.WebDataset(shard_paths(reference, split), shardshuffle=False)}
    records = corpus_records()
    offset = {"a": 0, "b": 700, "c": 1200}
    for key, text in texts.items():
        stem, line = key.split("--")
        assert text == records[offset[stem] + int(line) - 1]["text"], key


def test_two_workers_give_the_same_bytes_as_one(corpus, reference, tmp_path):
    out = tmp_path / "w2"
    prepare(f"jsonl:{corpus}/*", out, vocab_size=VOCAB, docs_per_shard=100, val_fraction=0.05,
            unit_mb=UNIT_MB, workers=2)
    assert_same_dataset(reference, out)


def test_parts_merged_equal_one_run_and_a_missing_part_is_named(corpus, reference, tmp_path, monkeypatch):
    out = tmp_path / "parts"
    args = dict(vocab_size=VOCAB, docs_per_shard=100, val_fraction=0.05, unit_mb=UNIT_MB, parts=3)
    assert prepare(f"jsonl:{corpus}/*", out, part=2, **args) is None
    assert not (out / "manifest.json").exists()
    assert main(["--merge", str(out)]) == 2  # parts 0 and 1 have not run
    import trainer.data.prepare.formats as formats

    def plan_again(*_args, **_kwargs):
        raise AssertionError("planned again: the staged plan of the same input and options must be reused")

    monkeypatch.setattr(formats, "plan_spans", plan_again)  # planning a JSONL reads it all: once is enough
    assert prepare(f"jsonl:{corpus}/*", out, part=0, **args) is None
    [stage] = (out / STATE_DIR).iterdir()
    part = json.loads((stage / "part-002-of-003.json").read_text())
    assert part["units"] and all(u % 3 == 2 for u in part["units"])
    with pytest.raises(Exception, match=r"parts not finished: \[1\] of --parts 3"):
        merge(out)
    manifest = prepare(f"jsonl:{corpus}/*", out, part=1, **args)  # the last part merges by itself
    assert manifest == load_manifest(out)
    assert_same_dataset(reference, out)


def test_a_part_with_other_options_is_refused_and_the_finished_parts_are_kept(corpus, tmp_path):
    """--part 1 --parts 3 with options other than part 0's used to delete part 0's finished staging."""
    out = tmp_path / "parts"
    args = dict(vocab_size=VOCAB, val_fraction=0.05, unit_mb=UNIT_MB, parts=3)
    assert prepare(f"jsonl:{corpus}/*", out, part=0, docs_per_shard=100, **args) is None
    [stage] = (out / STATE_DIR).iterdir()
    before = {p.relative_to(stage): p.read_bytes() for p in stage.rglob("*")
              if p.is_file() and p.name != ".lock"}
    assert (stage / "part-000-of-003.json").is_file()
    with pytest.raises(PrepareError, match=r"holds finished parts of a prepare with other options or input .*"
                                           r"part-000-of-003.json"):
        prepare(f"jsonl:{corpus}/*", out, part=1, docs_per_shard=60, **args)
    assert {p.relative_to(stage): p.read_bytes() for p in stage.rglob("*")
            if p.is_file() and p.name != ".lock"} == before


def test_merge_is_idempotent_and_an_empty_dir_has_nothing_to_merge(reference, tmp_path, capsys):
    before = {p.name: p.stat().st_mtime_ns for p in reference.iterdir()}
    assert main(["--merge", str(reference)]) == 0  # a dependent merge job after the last part merged
    captured = capsys.readouterr()
    assert "already merged" in captured.err and "train:" in captured.out
    assert {p.name: p.stat().st_mtime_ns for p in reference.iterdir()} == before
    assert main(["--merge", str(tmp_path)]) == 2
    assert "nothing to merge: no prepare staged there" in capsys.readouterr().err


def staged_results(out: Path) -> list[Path]:
    return list((out / STATE_DIR).glob("*/u*.json")) if (out / STATE_DIR).is_dir() else []


def test_killed_with_sigkill_and_started_again_equals_an_uninterrupted_run(corpus, reference, tmp_path):
    """kill -9 once some units are done: the old dataset in --out is untouched, the restart keeps the finished
    units (their staged shards become the final ones: same inode) and ends byte-identical to the reference."""
    out = tmp_path / "killed"
    old = prepare(f"jsonl:{corpus}/a.jsonl", out, vocab_size=VOCAB, docs_per_shard=100)  # a dataset to keep
    old_bytes = {p.name: p.read_bytes() for p in out.glob("*.tar")}
    args = ["--source", f"jsonl:{corpus}/*", "--out", str(out), "--vocab-size", str(VOCAB),
            "--docs-per-shard", "100", "--val-fraction", "0.05", "--unit-mb", str(UNIT_MB), "--workers", "1"]
    proc = subprocess.Popen([sys.executable, "-m", "trainer.prepare", *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while len(staged_results(out)) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = staged_results(out)
    total = len(json.loads(next((out / STATE_DIR).glob("*/plan.json")).read_text())["units"])
    assert 3 <= len(done) < total, "the kill must land halfway"
    assert load_manifest(out) == old and {p.name: p.read_bytes() for p in out.glob("*.tar")} == old_bytes
    kept = {}
    for result in done:
        for split in json.loads(result.read_text())["splits"].values():
            for shard in split["shards"]:
                kept[shard["file"]] = (result.parent / shard["file"]).stat().st_ino
    proc = cli(*args, "--resume")
    assert proc.returncode == 0, proc.stderr
    assert f"resuming: {len(done)} of {total} units already done" in proc.stderr  # no terminal: status lines
    assert f"preparing: {total - len(done)}/{total - len(done)} units" in proc.stderr
    assert_same_dataset(reference, out)
    inodes = {p.stat().st_ino for p in out.glob("*.tar")}
    assert set(kept.values()) <= inodes  # finished units were not redone


def test_a_merge_interrupted_midway_is_finished_by_the_next_run(corpus, reference, tmp_path, monkeypatch):
    """The swap moves staged shards one by one; killed after a few, the old manifest is already gone (a
    half-swapped directory must not look complete) and the same command again finishes the swap."""
    import trainer.data.prepare.assemble as assemble

    out = tmp_path / "swap"
    args = dict(vocab_size=VOCAB, docs_per_shard=100, val_fraction=0.05, unit_mb=UNIT_MB)
    prepare(f"jsonl:{corpus}/a.jsonl", out, vocab_size=VOCAB)  # an old dataset being replaced
    real_replace, moved = os.replace, []

    def dying_replace(src, dst):  # os.replace is os.replace everywhere: count only the swap's moves
        if Path(dst).parent == out and Path(src).parent.parent.parent.name == STATE_DIR:
            if len(moved) == 5:
                raise KeyboardInterrupt  # as good as kill -9 here: nothing after it runs
            moved.append(dst)
        real_replace(src, dst)

    monkeypatch.setattr(assemble.os, "replace", dying_replace)
    with pytest.raises(KeyboardInterrupt):
        prepare(f"jsonl:{corpus}/*", out, **args)
    monkeypatch.setattr(assemble.os, "replace", real_replace)
    assert len(moved) == 5 and not (out / "manifest.json").exists()
    assert list((out / STATE_DIR).glob("*/swap.json"))
    prepare(f"jsonl:{corpus}/*", out, **args)
    assert_same_dataset(reference, out)


def test_the_same_prepare_started_twice_is_refused_naming_the_first(corpus, reference, tmp_path):
    """Two identical prepares into one --out used to work the same units side by side until one found the
    other's files moved away ("[Errno 2] No such file or directory"). The second is refused with one line
    naming the first (pid and host); the first, held stopped meanwhile, then finishes the dataset undisturbed.
    A prepare with other options started beside it is refused too (its merge would replace the first's
    dataset)."""
    out = tmp_path / "twice"
    args = ["--source", f"jsonl:{corpus}/*", "--out", str(out), "--vocab-size", str(VOCAB),
            "--docs-per-shard", "100", "--val-fraction", "0.05", "--unit-mb", str(UNIT_MB), "--workers", "1"]
    first = subprocess.Popen([sys.executable, "-m", "trainer.prepare", *args], cwd=ROOT, env=ENV,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob(f"{STATE_DIR}/*/.part-000-of-001.lock")) and time.monotonic() < deadline:
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.005)
        lock = next(out.glob(f"{STATE_DIR}/*/.part-000-of-001.lock"))
        while not lock.read_text() and time.monotonic() < deadline:
            time.sleep(0.005)
        os.kill(first.pid, signal.SIGSTOP)
        second = cli(*args)
        assert second.returncode == 2
        assert second.stderr == (f"error: {out}: this prepare is already running there (pid {first.pid} on "
                                 f"{os.uname().nodename}); wait for it to finish (it merges the dataset) or "
                                 "stop it first\n")
        other = cli(*args[:-2], "--seed", "7")
        assert other.returncode == 2 and "another prepare with other options or input is running there" in \
            other.stderr and other.stderr.count("\n") == 1
    finally:
        os.kill(first.pid, signal.SIGCONT)
    assert first.wait(timeout=120) == 0, first.stderr.read()
    assert_same_dataset(reference, out)


def test_a_prepare_that_waited_on_a_merge_of_its_stage_ends_cleanly(tmp_path):
    """A prepare that waits for the stage's lock while another merges it finds the stage gone when it gets the
    lock: it is told so (StageMerged), instead of working in a deleted directory."""
    import threading

    from trainer.data.prepare.assemble import StageMerged, holding

    stage = tmp_path / "out" / STATE_DIR / "plan"
    merged, outcome = threading.Event(), []

    def waiter():
        try:
            with holding(stage):
                outcome.append("held")
        except StageMerged:
            outcome.append("merged")

    with holding(stage, exclusive=True):
        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(0.2)  # the waiter is blocked on the lock
        assert not outcome
        import shutil

        shutil.rmtree(stage)  # what the merge does last
    thread.join(timeout=10)
    assert outcome == ["merged"]
    merged.set()


def test_resume_without_earlier_work_is_refused(corpus, tmp_path, capsys):
    assert main(["--source", f"jsonl:{corpus}/a.jsonl", "--out", str(tmp_path / "o"), "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err


def test_workers_die_with_a_killed_prepare(corpus, tmp_path):
    args = ["--source", f"jsonl:{corpus}/*", "--out", str(tmp_path / "o"), "--vocab-size", str(VOCAB),
            "--unit-mb", "0.005", "--workers", "2"]
    proc = subprocess.Popen([sys.executable, "-m", "trainer.prepare", *args], cwd=ROOT, env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    parent = psutil.Process(proc.pid)
    deadline = time.monotonic() + 60
    children: list[psutil.Process] = []
    while len(children) < 2 and time.monotonic() < deadline and proc.poll() is None:
        children = [c for c in parent.children(recursive=True) if "spawn_main" in " ".join(c.cmdline())]
        time.sleep(0.01)
    assert len(children) == 2, "the workers must have started"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"orphaned workers: {[p.pid for p in alive]}"


def test_a_bad_line_in_a_worker_is_one_error_line_naming_it(corpus, tmp_path):
    src = tmp_path / "src"
    for name in ("a.jsonl", "b.jsonl"):
        (src / name).parent.mkdir(exist_ok=True)
        (src / name).write_bytes((corpus / name).read_bytes())
    with open(src / "b.jsonl", "ab") as f:
        f.write(b'{"text": "unterminated\n')
    proc = cli("--source", f"jsonl:{src}/*", "--out", str(tmp_path / "o"), "--vocab-size", str(VOCAB),
               "--unit-mb", str(UNIT_MB), "--workers", "2")
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert lines == [f"error: {src / 'b.jsonl'}:501: invalid JSON: Unterminated string starting at "
                     "(column 10)"] \
        or (len(lines) == 1
            and lines[0].startswith(f"error: {src / 'b.jsonl'}:501: invalid JSON")), proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# The output directory
# ---------------------------------------------------------------------------------------------


def test_an_out_dir_with_foreign_files_is_refused_and_left_alone(corpus, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("my notes")
    (out / "train-000000.tar").write_bytes(b"not ours? it has our name: allowed")
    assert main(["--source", f"jsonl:{corpus}/a.jsonl", "--out", str(out), "--vocab-size", str(VOCAB)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {out}: holds files prepare did not write (notes.txt)")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "train-000000.tar"]


def test_a_failed_reprepare_keeps_the_old_dataset(corpus, reference, tmp_path, capsys):
    out = tmp_path / "keep"
    prepare(f"jsonl:{corpus}/a.jsonl", out, vocab_size=VOCAB, docs_per_shard=100)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["--source", f"jsonl:{corpus}/mistyped*.jsonl", "--out", str(out)]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "wrong field"}\n')
    assert main(["--source", f"jsonl:{bad}", "--out", str(out), "--vocab-size", str(VOCAB)]) == 2
    capsys.readouterr()
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*")
             if p.is_file() and STATE_DIR not in p.parts}
    assert after == before
    # ... and a prepare that succeeds replaces it, leaving none of the old shards
    prepare(f"jsonl:{corpus}/*", out, vocab_size=VOCAB, docs_per_shard=100, val_fraction=0.05,
            unit_mb=UNIT_MB)
    assert_same_dataset(reference, out)


# ---------------------------------------------------------------------------------------------
# Formats: the same records as .jsonl, .jsonl.zst, parquet and a saved Hugging Face dataset
# ---------------------------------------------------------------------------------------------


def test_every_format_gives_the_same_dataset(tmp_path):
    """The same records as .jsonl (cut into many byte-range units), .jsonl.zst (one unit: not seekable),
    parquet (units of row groups) and a saved HF dataset (row ranges): byte-identical shards and the same
    manifest, because shards end at blocks of records, whatever the units."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    records = corpus_records(1500, seed=1)
    src = tmp_path / "src"
    write_jsonl(src / "jsonl" / "corpus.jsonl", records)
    (src / "zst").mkdir()
    (src / "zst" / "corpus.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress((src / "jsonl" / "corpus.jsonl").read_bytes()))
    (src / "parquet").mkdir()
    pq.write_table(pa.Table.from_pylist(records), src / "parquet" / "corpus.parquet", row_group_size=100)
    datasets.Dataset.from_list(records).save_to_disk(str(src / "hf" / "corpus"))
    common = dict(vocab_size=VOCAB, docs_per_shard=50, val_fraction=0.05, unit_mb=UNIT_MB)
    ref = tmp_path / "out-jsonl"
    prepare(f"jsonl:{src}/jsonl/*.jsonl", ref, workers=2, **common)
    tok = ref / "tokenizer"
    for name, source in [("zst", f"jsonl:{src}/zst/*"), ("parquet", f"parquet:{src}/parquet/*.parquet"),
                         ("hf", f"hf:{src}/hf/corpus")]:
        out = tmp_path / f"out-{name}"
        prepare(source, out, tokenizer=tok, workers=2 if name == "parquet" else 1, **common)
        units = len(json.loads((out / "manifest.json").read_text())["splits"]["train"]["shards"])
        a, b = load_manifest(ref), load_manifest(out)
        assert a["splits"] == b["splits"], name
        for split in a["splits"].values():
            for shard in split["shards"]:
                assert (ref / shard["name"]).read_bytes() == (out / shard["name"]).read_bytes(), \
                    (name, shard["name"])
    assert units == 30  # 1500 records in blocks of 50: one train shard per block
    from trainer.data.prepare.plan import make_plan

    cut = {name: len(make_plan(source, {"docs_per_shard": 50}, int(UNIT_MB * 2**20)).units)
           for name, source in [("jsonl", f"jsonl:{src}/jsonl/*.jsonl"), ("zst", f"jsonl:{src}/zst/*"),
                                ("parquet", f"parquet:{src}/parquet/*.parquet")]}
    assert cut["zst"] == 1 and cut["jsonl"] > 3 and cut["parquet"] > 3, cut  # the inputs were cut differently


# ---------------------------------------------------------------------------------------------
# Length statistics merge exactly
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_length_stats_from_counts_equal_numpy_on_the_lengths(seed):
    rng = np.random.default_rng(seed)
    lengths = (rng.lognormal(4, 1.5, size=int(rng.integers(1, 3000))) + 1).astype(int)
    stats = length_stats_of(Counter(lengths.tolist()))
    assert stats["median"] == float(np.median(lengths))
    assert stats["p90"] == round(float(np.percentile(lengths, 90)), 2)
    assert stats["p99"] == round(float(np.percentile(lengths, 99)), 2)
    assert stats["mean"] == round(float(lengths.mean()), 2)
    assert (stats["min"], stats["max"]) == (lengths.min(), lengths.max())
    edges = stats["histogram"]["edges"]
    assert stats["histogram"]["counts"] == np.histogram(lengths, bins=edges)[0].tolist()
    assert stats["count_gt_512"] == int((lengths > 512).sum())
    halves = Counter(lengths[: len(lengths) // 2].tolist()) + Counter(lengths[len(lengths) // 2 :].tolist())
    assert length_stats_of(halves) == stats == length_stats(lengths.tolist())


def test_a_file_that_is_not_parquet_is_an_error_or_a_counted_skip(tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    src = tmp_path / "src"
    src.mkdir()
    pq.write_table(pa.Table.from_pylist(corpus_records(50)), src / "good.parquet")
    (src / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    assert main(["--source", f"parquet:{src}/*.parquet", "--out", str(tmp_path / "a"), "--vocab-size",
                 str(VOCAB)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {src / 'broken.parquet'}: not a parquet file"), err
    manifest = prepare(f"parquet:{src}/*.parquet", tmp_path / "b", vocab_size=VOCAB, on_error="skip")
    assert manifest["skipped"] == {"corrupt_file": 1}
    assert manifest["splits"]["train"]["docs"] + manifest["splits"]["val"]["docs"] == 50


def test_a_fifo_matched_by_a_glob_is_refused_or_skipped_never_opened(tmp_path, capsys):
    """Opening a FIFO blocks until someone writes to it: prepare must not hang on one a glob matched."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("a document")
    os.mkfifo(src / "pipe.txt")
    write_jsonl(src / "r.jsonl", corpus_records(5))
    os.mkfifo(src / "q.jsonl")
    for argv, where in ([f"text:{src}/*.txt"], src / "pipe.txt"), ([f"jsonl:{src}/*.jsonl"], src / "q.jsonl"):
        proc = cli("--source", argv[0], "--out", str(tmp_path / "o"), "--vocab-size", str(VOCAB))
        assert proc.returncode == 2 and proc.stderr.startswith(
            f"error: {where}: not a regular file (a FIFO)"), proc.stderr
    manifest = prepare(f"text:{src}/*.txt", tmp_path / "skip", vocab_size=VOCAB, on_error="skip")
    assert manifest["skipped"] == {"not_a_file": 1} and manifest["splits"]["train"]["docs"] == 1
