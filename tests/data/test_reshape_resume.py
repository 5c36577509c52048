"""A run interrupted on 2 ranks x 2 DataLoader workers resumes on 1 rank x 1 worker and on 3 x 1 (issue 21;
trainer.data.reshape through real runs).

Real torchrun runs with `logging.record_doc_keys` over 5 shards of short documents (shards of very different
token counts, more documents per shard than a DataLoader chunk: the readers stop inside shards). The 2 x 2 run
checkpoints every step through the end of epoch 0; the resumes start from a step in the middle of the epoch
and from a step in which one rank had finished the epoch and waited for the other (data.epoch_lockstep). Each
must:
  - train every chunk of the interrupted epoch exactly once, counted over both runs against the shards read
    with tarfile and the tokenizers library (nothing lost, nothing twice; the order differs from the
    uninterrupted run's);
  - then start the next epoch on every rank at one step, with the rows a run on the new shape would have had
    from the start (the new shape's own split, computed here in-process).
The model and optimizer half of such a resume is tests/distributed/test_reshape_engine.py; the deal itself,
case by case and in-process, tests/data/test_reshape.py.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    doc_keys,
    epoch_chunks,
    first_keys_of_epoch,
    metrics,
    run_train,
    short_docs_corpus,
    stream_rows,
    torchrun,
)
from trainer.distributed.groups import DistInfo
from trainer.run.inputs import rows_for_rank

pytestmark = pytest.mark.slow

SEQ_LEN, TOKENS_PER_STEP = 128, 2048
# What the ranks consume does not depend on the model: one block 16 wide (the tiny model's two 64 wide cost
# more).
COMMON = ("model.n_layer=1", "model.n_embd=16", "model.n_head=2", "data.shuffle_buffer=8",
          "packing.buffer_size=8", "train.eval_every=0", f"train.seq_len={SEQ_LEN}",
          f"train.tokens_per_step={TOKENS_PER_STEP}", "train.micro_batch_tokens=1024",
          "logging.record_doc_keys=true", "train.keep_last=1000")
MID_EPOCH = 15
RESUMES = [("mid", 1), ("mid", 3), ("wait", 3)]  # (where the 2 x 2 run is interrupted, ranks of the resume)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return short_docs_corpus(tmp_path_factory.mktemp("reshape_resume") / "short")


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> dict:
    tokens = json.loads((corpus / "manifest.json").read_text())["splits"]["train"]["tokens"]
    root = tmp_path_factory.mktemp("reshape_runs")
    whole = root / "whole"
    run_train(whole, corpus, *COMMON, "data.num_workers=2", "train.checkpoint_every=1",
              f"train.max_steps={math.ceil(1.2 * tokens / TOKENS_PER_STEP)}", launcher=torchrun(2))
    epoch_of = {m["step"]: m["epoch"] for m in metrics(whole)}
    next_epoch = min(step for step, epoch in epoch_of.items() if epoch == 1)
    # A step after which one rank had finished the epoch and the other had not: it trained nothing in the
    # next.
    waits = [step for steps in doc_keys(whole).values() for step, keys in steps.items()
             if not keys and step + 1 < next_epoch and not steps[step + 1]]
    assert waits, "the 2 x 2 run should wait at the end of epoch 0"
    at = {"mid": MID_EPOCH, "wait": min(waits)}
    out = {"whole": whole, "at": at, "next_epoch": next_epoch}
    resumes = []
    for where, ranks in RESUMES:
        run = root / f"{where}_{ranks}x1"
        shutil.copytree(whole, run)
        for ckpt in (run / "checkpoints").glob("step_*"):
            if int(ckpt.name[5:]) > at[where]:
                shutil.rmtree(ckpt)
        resumes.append((run, torchrun(ranks)))

    def resume(run: Path, launcher: list[str]) -> str:
        return run_train(run, corpus, *COMMON, "data.num_workers=1", "train.checkpoint_every=0",
                         "train.resume=true", f"train.max_steps={next_epoch + 8}", launcher=launcher).stdout

    # The resumes are independent runs in their own run dirs: side by side (a start is seconds of imports per
    # rank).
    with ThreadPoolExecutor(len(resumes)) as pool:
        stdouts = list(pool.map(lambda item: resume(*item), resumes))
    for (where, ranks), (run, _), stdout in zip(RESUMES, resumes, stdouts, strict=True):
        out[(where, ranks)] = (run, stdout)
    return out


@pytest.mark.parametrize("where, ranks", RESUMES, ids=[f"{w}-{r}x1" for w, r in RESUMES])
def test_the_interrupted_epoch_trains_every_chunk_once(runs, corpus, where, ranks):
    run, stdout = runs[(where, ranks)]
    assert ("resume on another shape: written by 2 rank(s) x 2 DataLoader worker(s), resumed on "
            f"{ranks} x 1: what was left of epoch 0 is dealt over the new readers") in stdout
    epoch_of = {m["step"]: m["epoch"] for m in metrics(run)}
    # the steps before the resume kept, once each
    assert sorted(epoch_of) == list(range(1, runs["next_epoch"] + 9))
    trained = Counter(key for steps in doc_keys(run).values() for step, keys in steps.items()
                      if epoch_of[step] == 0 for key in keys)
    epoch = epoch_chunks(corpus, SEQ_LEN)
    assert trained == epoch, ({k: n for k, n in trained.items() if n != epoch[k]},
                              sorted(set(epoch) - set(trained)))
    before = Counter(key for steps in doc_keys(runs["whole"]).values() for step, keys in steps.items()
                     if step <= runs["at"][where] for key in keys)
    assert 0 < sum(before.values()) < sum(epoch.values())  # the resume was inside the epoch


@pytest.mark.parametrize("where, ranks", RESUMES, ids=[f"{w}-{r}x1" for w, r in RESUMES])
def test_the_next_epoch_starts_on_every_rank_at_once_as_on_the_new_shape(runs, corpus, where, ranks):
    run, _ = runs[(where, ranks)]
    epoch_of = {m["step"]: m["epoch"] for m in metrics(run)}
    first = min(step for step, epoch in epoch_of.items() if epoch == 1)
    assert first < max(epoch_of)  # the resumed run went into epoch 1
    keys = doc_keys(run)
    # rank 1's file of the 2 x 2 run stays, cut at the resume
    assert sorted(keys) == list(range(max(ranks, 2)))
    for rank in range(ranks):
        assert all(keys[rank][step] for step in range(first, max(epoch_of) + 1))  # nobody waits in epoch 1
        info = DistInfo(rank=rank, world_size=ranks, local_rank=rank, device=torch.device("cpu"))
        rows = rows_for_rank(TOKENS_PER_STEP // SEQ_LEN, info)
        expected = first_keys_of_epoch(stream_rows(corpus, rank, ranks, 1, SEQ_LEN), 1, rows)
        assert keys[rank][first] == expected, rank

