"""Every training document is trained on once per epoch, counted from what the ranks actually consumed
(trainer.data.epochs: the readers, the loaders and the ranks in lockstep, through real runs).

2 ranks x 2 DataLoader workers (4 readers) over 8 shards for about 1.2 epochs, with `logging.record_doc_keys`:
each rank writes the keys of the documents (and chunks `key#k`) of every step it ran. A resume in the middle
of an epoch, and one inside a rank's wait at an epoch end (data.epoch_lockstep), must consume exactly the same
keys, step by step and rank by rank, as the uninterrupted run. The shards hold very different token counts;
balanced by them, the ranks wait for each other only a few steps per epoch, and no step trains documents of
two epochs.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.helpers import doc_keys as consumed
from tests.helpers import epoch_chunks, metrics, run_train, torchrun
from trainer.data.shards import shard_paths

pytestmark = pytest.mark.slow

SEQ_LEN, TOKENS_PER_STEP = 128, 2048
# What the ranks consume does not depend on the model: one block 16 wide (the tiny model's two 64 wide cost
# more).
COMMON = ("model.n_layer=1", "model.n_embd=16", "model.n_head=2", "data.num_workers=2",
          "data.shuffle_buffer=8", "packing.buffer_size=8", "train.eval_every=0", f"train.seq_len={SEQ_LEN}",
          f"train.tokens_per_step={TOKENS_PER_STEP}", "train.micro_batch_tokens=1024",
          "logging.record_doc_keys=true", "train.checkpoint_every=70", "train.keep_last=20")
# Checkpoints: step 210 falls in rank 1's wait at the end of epoch 0 (209-216). Step 70, unlike 140, is a step
# at which a resume that forgets which DataLoader worker's chunk comes next (loader epoch_chunks) trains other
# keys.
MID_EPOCH, IN_A_WAIT = 70, 210


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    from trainer.prepare import prepare

    out = tmp_path_factory.mktemp("accounting")
    # 8 shards of 30 documents, 9k to 131k tokens each: the readers' shares are balanced by tokens (the ranks'
    # within 3%; readers left unbalanced drift apart by whole shards per epoch: docs/data.md, "Epochs in
    # lockstep").
    prepare("demo", out, vocab_size=300, max_docs=240, docs_per_shard=30, val_fraction=0.0, seed=0)
    assert len(shard_paths(out, "train")) == 8
    return out


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict[str, Path]:
    epoch = epoch_chunks(corpus, SEQ_LEN)
    tokens = json.loads((corpus / "manifest.json").read_text())["splits"]["train"]["tokens"]
    steps = math.ceil(1.2 * tokens / TOKENS_PER_STEP)  # an epoch, its boundary, and a fifth of the next
    root = tmp_path_factory.mktemp("acc_runs")
    whole = root / "whole"
    run_train(whole, corpus, *COMMON, f"train.max_steps={steps}", launcher=torchrun())
    out = {"whole": whole, "epoch": epoch, "steps": steps}
    # Resume mid-epoch, and inside a wait: one rank has finished the epoch and waits for the other.
    resumes = []
    for at in (MID_EPOCH, IN_A_WAIT):
        resumed = root / f"resumed_{at}"
        shutil.copytree(whole, resumed)
        for ckpt in (resumed / "checkpoints").glob("step_*"):
            if int(ckpt.name[5:]) > at:
                shutil.rmtree(ckpt)
        resumes.append((resumed, torchrun()))
        out[f"resumed_{at}"] = resumed
    # Two independent runs in their own run dirs: side by side (a start is seconds of imports per rank).
    with ThreadPoolExecutor(len(resumes)) as pool:
        list(pool.map(lambda item: run_train(item[0], corpus, *COMMON, f"train.max_steps={steps}",
                                             "train.resume=true", launcher=item[1]), resumes))
    assert {IN_A_WAIT, IN_A_WAIT + 1} <= set(idle_steps(consumed(whole))), "the resume should fall in a wait"
    return out


def idle_steps(ranks: dict[int, dict[int, list[str]]]) -> list[int]:
    """Steps in which some rank trained nothing: it had finished the epoch and waited for the others."""
    return sorted({step for steps in ranks.values() for step, keys in steps.items() if not keys})


def epochs_of_steps(ranks: dict[int, dict[int, list[str]]]) -> dict[int, set[int]]:
    """{step: the epochs of the keys any rank trained in it}: a key's n-th appearance, in step order, is epoch
    n-1."""
    seen: Counter = Counter()
    out: dict[int, set[int]] = {}
    for step in sorted({s for steps in ranks.values() for s in steps}):
        out[step] = set()
        for rank in sorted(ranks):
            for key in ranks[rank].get(step, []):
                out[step].add(seen[key])
                seen[key] += 1
    return out


def test_every_chunk_is_consumed_once_per_epoch(runs):
    epoch = runs["epoch"]
    assert all(n == 1 for n in epoch.values())  # chunk keys are unique within an epoch
    counts = Counter(k for steps in consumed(runs["whole"]).values() for keys in steps.values() for k in keys)
    assert set(counts) == set(epoch)  # nothing unknown, nothing never seen
    # ~1.2 epochs went through: each chunk once or twice, never zero times (lost) or three times (repeated).
    assert set(counts.values()) == {1, 2}, Counter(counts.values())
    total = sum(counts.values())
    assert len(epoch) < total < 2 * len(epoch)


def test_counters_agree_with_the_consumed_keys(runs):
    for run in ("whole", f"resumed_{MID_EPOCH}", f"resumed_{IN_A_WAIT}"):
        per_step = Counter()
        for steps in consumed(runs[run]).values():
            for step, keys in steps.items():
                per_step[step] += len(keys)
        lines = metrics(runs[run])
        assert [m["step"] for m in lines] == list(range(1, runs["steps"] + 1))
        assert {m["step"]: m["docs"] for m in lines} == dict(per_step)
        summary = json.loads((runs[run] / "summary.json").read_text())
        assert summary["total_docs"] == sum(per_step.values())


@pytest.mark.parametrize("at", [MID_EPOCH, IN_A_WAIT])
def test_a_resume_consumes_exactly_the_same_keys(runs, at):
    whole, resumed = consumed(runs["whole"]), consumed(runs[f"resumed_{at}"])
    assert sorted(whole) == sorted(resumed) == [0, 1]
    for rank in whole:
        assert whole[rank] == resumed[rank]
    a, b = metrics(runs["whole"]), metrics(runs[f"resumed_{at}"])
    for x, y in zip(a[at:], b[at:], strict=True):
        assert abs(x["loss"] - y["loss"]) <= 1e-6, x["step"]
        assert (x["epoch"], x["lockstep_wait_steps"]) == (y["epoch"], y["lockstep_wait_steps"]), x["step"]
    summaries = [json.loads((runs[run] / "summary.json").read_text()) for run in ("whole", f"resumed_{at}")]
    assert summaries[0]["lockstep_wait_steps_by_epoch"] == summaries[1]["lockstep_wait_steps_by_epoch"]


def test_every_rank_trains_one_epoch_at_a_time(runs):
    """All ranks start the next epoch at the same step: no key of epoch e+1 on any rank before the last key of
    epoch e on every rank, and no step holds keys of two epochs; `epoch` in the metrics says which."""
    for run in ("whole", f"resumed_{IN_A_WAIT}"):
        epochs = epochs_of_steps(consumed(runs[run]))
        assert all(len(e) == 1 for e in epochs.values()), {s: e for s, e in epochs.items() if len(e) > 1}
        step_epoch = [(step, min(e)) for step, e in epochs.items()]
        assert [e for _, e in step_epoch] == sorted(e for _, e in step_epoch)
        assert {m["step"]: m["epoch"] for m in metrics(runs[run])} == dict(step_epoch)


def test_readers_balanced_by_tokens_wait_at_most_5_percent_of_an_epoch(runs):
    """Per complete epoch, the steps in which a rank trained nothing are at most 5% of the epoch's steps (with
    every 4th shard of the permutation to each reader: 70 of 247 steps in epoch 0); lockstep_wait_steps counts
    those and the step before them, in which the first rank to finish had fewer rows than its share."""
    ranks = consumed(runs["whole"])
    epochs = epochs_of_steps(ranks)
    idle = idle_steps(ranks)
    summary = json.loads((runs["whole"] / "summary.json").read_text())
    by_epoch = summary["lockstep_wait_steps_by_epoch"]
    assert summary["lockstep_wait_steps"] == sum(by_epoch) and len(by_epoch) == 2  # epoch 0 and a part of 1
    for epoch in (0,):
        steps = [s for s, e in epochs.items() if e == {epoch}]
        waited = [s for s in idle if s in steps]
        assert len(waited) <= 0.05 * len(steps), (epoch, len(waited), len(steps))
        assert len(waited) <= by_epoch[epoch] <= len(waited) + 1, (epoch, by_epoch, len(waited))
    last = metrics(runs["whole"])[-1]
    assert (last["lockstep_wait_steps"], last["epoch_lockstep_wait_steps"]) == (sum(by_epoch), by_epoch[1])
