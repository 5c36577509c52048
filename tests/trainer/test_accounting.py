"""Every training document is trained on once per epoch, counted from what the ranks actually consumed.

2 ranks x 2 DataLoader workers (4 readers) over 8 shards for about 2.5 epochs, with `logging.record_doc_keys`:
each rank writes the keys of the documents (and chunks `key#k`) of every step it ran. A resume in the middle
of an epoch, and one inside a rank's wait at an epoch end (data.epoch_lockstep), must consume exactly the same
keys, step by step and rank by rank, as the uninterrupted run.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import metrics, run_train, torchrun
from trainer.data.packing import PackingStats, split_long
from trainer.data.shards import shard_paths
from trainer.data.stream import DocumentStream
from trainer.data.tokenizer import load_tokenizer, special_ids

pytestmark = pytest.mark.slow

SEQ_LEN, TOKENS_PER_STEP = 128, 2048
COMMON = ("data.num_workers=2", "data.shuffle_buffer=8", "packing.buffer_size=8", "train.eval_every=0",
          f"train.seq_len={SEQ_LEN}", f"train.tokens_per_step={TOKENS_PER_STEP}", "train.micro_batch_tokens=1024",
          "logging.record_doc_keys=true", "train.checkpoint_every=50", "train.keep_last=20")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from trainer.prepare import prepare

    out = tmp_path_factory.mktemp("accounting")
    # 8 shards of 30 documents: each of the 4 readers holds 2 shards, the same number of documents (readers with
    # unequal documents drift apart by whole shards per epoch; see docs/data.md, "Epochs in lockstep").
    prepare("demo", out, vocab_size=300, max_docs=240, docs_per_shard=30, val_fraction=0.0, seed=0)
    assert len(shard_paths(out, "train")) == 8
    return out


def epoch_chunks(data: Path) -> Counter:
    """The chunks of one epoch (documents split at SEQ_LEN, as the trainer does), read once, in one process."""
    tok_dir = data / "tokenizer"
    stream = DocumentStream(shard_paths(data, "train"), tok_dir, special_ids(load_tokenizer(tok_dir)).eos, epochs=1)
    stats = PackingStats()
    return Counter(piece.key for _, _, docs in stream for doc in docs for piece in split_long(doc, SEQ_LEN, "split",
                                                                                          stats))


def consumed(run_dir: Path) -> dict[int, dict[int, list[str]]]:
    """{rank: {step: keys}} from the doc_keys files."""
    out = {}
    for path in sorted((run_dir / "doc_keys").glob("rank_*.jsonl")):
        rank = int(path.stem.split("_")[1])
        out[rank] = {r["step"]: r["keys"] for r in map(json.loads, path.read_text().splitlines())}
    return out


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict[str, Path]:
    epoch = epoch_chunks(corpus)
    tokens = json.loads((corpus / "manifest.json").read_text())["splits"]["train"]["tokens"]
    steps = math.ceil(2.5 * tokens / TOKENS_PER_STEP)
    root = tmp_path_factory.mktemp("acc_runs")
    whole = root / "whole"
    run_train(whole, corpus, *COMMON, f"train.max_steps={steps}", launcher=torchrun())
    out = {"whole": whole, "epoch": epoch, "steps": steps}
    # Resume mid-epoch (step 50), and at step 200, where one rank has finished the epoch and waits for the other.
    for at in (50, 200):
        resumed = root / f"resumed_{at}"
        shutil.copytree(whole, resumed)
        for ckpt in (resumed / "checkpoints").glob("step_*"):
            if int(ckpt.name[5:]) > at:
                shutil.rmtree(ckpt)
        run_train(resumed, corpus, *COMMON, f"train.max_steps={steps}", "train.resume=true", launcher=torchrun())
        out[f"resumed_{at}"] = resumed
    waiting = [s for s, keys in consumed(whole)[0].items() if not keys] + [s for s, keys in consumed(whole)[1].items()
                                                                           if not keys]
    assert {200, 201} <= set(waiting), "step 200 should fall in a rank's wait at an epoch end"
    return out


def test_every_chunk_is_consumed_once_per_epoch(runs):
    epoch = runs["epoch"]
    assert all(n == 1 for n in epoch.values())  # chunk keys are unique within an epoch
    counts = Counter(k for steps in consumed(runs["whole"]).values() for keys in steps.values() for k in keys)
    assert set(counts) == set(epoch)  # nothing unknown, nothing never seen
    # ~2.5 epochs went through: each chunk twice or three times, never once (lost) or four times (repeated).
    assert set(counts.values()) == {2, 3}, Counter(counts.values())
    total = sum(counts.values())
    assert 2 * len(epoch) < total < 3 * len(epoch)


def test_counters_agree_with_the_consumed_keys(runs):
    for run in ("whole", "resumed_50", "resumed_200"):
        per_step = Counter()
        for steps in consumed(runs[run]).values():
            for step, keys in steps.items():
                per_step[step] += len(keys)
        lines = metrics(runs[run])
        assert [m["step"] for m in lines] == list(range(1, runs["steps"] + 1))
        assert {m["step"]: m["docs"] for m in lines} == dict(per_step)
        summary = json.loads((runs[run] / "summary.json").read_text())
        assert summary["total_docs"] == sum(per_step.values())


@pytest.mark.parametrize("at", [50, 200])
def test_a_resume_consumes_exactly_the_same_keys(runs, at):
    whole, resumed = consumed(runs["whole"]), consumed(runs[f"resumed_{at}"])
    assert sorted(whole) == sorted(resumed) == [0, 1]
    for rank in whole:
        assert whole[rank] == resumed[rank]
    a, b = metrics(runs["whole"]), metrics(runs[f"resumed_{at}"])
    for x, y in zip(a[at:], b[at:], strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-6, x["step"]
