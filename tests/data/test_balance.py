"""The readers' shards, balanced by tokens (trainer.data.stream.assign_shards): every shard once per epoch,
the same split on every rank, each rank's and reader's share close to the mean, and the tokens from the
manifest."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.helpers import make_trainer
from trainer.data.config import DataConfig
from trainer.data.loader import DocumentLoader
from trainer.data.reader import SlotState
from trainer.data.shards import load_manifest, shard_paths
from trainer.data.sources import resolve_source
from trainer.data.stream import DocumentStream, assign_shards, balance_shards, manifest_tokens
from trainer.data.tokenizer import load_tokenizer, special_ids


def deal(items: list[int], tokens: list[int], bins: int, at_least: int) -> list[list[int]]:
    """The rule recomputed the slow way: each item (largest first) to the open bin with the fewest tokens
    (then fewer items, then the lower index); a bin closes once the items left only just cover what the bins
    below `at_least` still need and it is not one of them."""
    members: list[list[int]] = [[] for _ in range(bins)]
    for k, item in enumerate(items):
        owed = sum(max(0, at_least - len(m)) for m in members)
        open_bins = [b for b in range(bins) if len(items) - k > owed or len(members[b]) < at_least]
        best = min(open_bins, key=lambda b: (sum(tokens[i] for i in members[b]), len(members[b]), b))
        members[best].append(item)
    return members


def reference(order: list[int], tokens: list[int], world_size: int, workers: int) -> list[list[int]]:
    by_size = sorted(order, key=lambda s: (-tokens[s], order.index(s)))
    return [sorted(worker, key=order.index)
            for rank in deal(by_size, tokens, world_size, workers)
            for worker in deal(rank, tokens, workers, 1)]


def test_the_docstring_example():
    assert balance_shards([3, 0, 4, 1, 2], [50, 10, 40, 30, 20], 2, 1) == [[0, 4, 1], [3, 2]]


def test_a_rank_holding_one_huge_shard_still_feeds_each_of_its_workers():
    # Greedy alone would leave rank 0 with the 100 and rank 1 with the three 1s; each rank needs 2 shards.
    assert balance_shards([0, 1, 2, 3], [100, 1, 1, 1], 2, 2) == [[0], [3], [1], [2]]


@given(tokens=st.lists(st.integers(0, 10_000), min_size=1, max_size=60), world_size=st.integers(1, 4),
       workers=st.integers(1, 3), seed=st.integers(0, 3), epoch=st.integers(0, 3))
def test_every_shard_once_in_permutation_order_and_as_recomputed(tokens, world_size, workers, seed, epoch):
    if len(tokens) < world_size * workers:
        return
    slots = assign_shards(tokens, world_size, workers, seed, epoch)
    order = [int(i) for i in np.random.default_rng([seed, epoch]).permutation(len(tokens))]
    assert len(slots) == world_size * workers and all(slots)
    assert sorted(i for slot in slots for i in slot) == list(range(len(tokens)))
    assert slots == reference(order, tokens, world_size, workers)


@pytest.mark.parametrize("world_size,workers", [(1, 4), (2, 2), (3, 2)])
def test_equal_sizes_deal_the_permutation_out_like_cards(world_size, workers):
    order = [int(i) for i in np.random.default_rng(1).permutation(23)]
    slots = balance_shards(order, [7] * 23, world_size, workers)
    assert slots == [order[rank::world_size][worker::workers]
                     for rank in range(world_size) for worker in range(workers)]


def test_log_normal_shards_are_shared_within_a_few_percent_of_the_mean():
    tokens = [int(t) for t in np.random.default_rng(0).lognormal(np.log(50_000), 1.0, size=512)]
    for epoch in range(3):
        slots = assign_shards(tokens, 8, 4, seed=0, epoch=epoch)
        per_slot = np.array([sum(tokens[i] for i in slot) for slot in slots])
        per_rank = per_slot.reshape(8, 4).sum(axis=1)
        assert per_rank.max() / per_rank.mean() < 1.01
        assert per_slot.max() / per_slot.mean() < 1.03


def test_every_rank_computes_the_same_split_alone(demo_data):
    shards = shard_paths(demo_data, "train")
    tokens = [9_000, 10, 4_000, 700, 2_500]
    streams = [DocumentStream(shards, demo_data / "tokenizer", 0, seed=4, rank=r, world_size=2,
                              shard_tokens=tokens)
               for r in range(2)]
    for epoch in range(2):
        split = [[shards[i] for i in slot] for slot in assign_shards(tokens, 2, 1, 4, epoch)]
        assert [[s.epoch_shards(epoch, slot, 2) for slot in range(2)] for s in streams] == [split, split]


def test_the_tokens_come_from_the_runs_manifest_wherever_the_shards_are(demo_data):
    """data.path, local data.urls beside a manifest, and data.urls by http or pipe: with data.path: the same
    counts, so the readers get the same shards as from the prepared directory itself."""
    listed = [s["tokens"] for s in load_manifest(demo_data)["splits"]["train"]["shards"]]
    assert len(set(listed)) > 1
    pipes = [f"pipe:cat {p}" for p in shard_paths(demo_data, "train")]
    for data in (DataConfig(path=str(demo_data)), DataConfig(urls=f"{demo_data}/train-*.tar"),
                 DataConfig(urls="http://host/train-{000000..000004}.tar", path=str(demo_data)),
                 DataConfig(urls=pipes, path=str(demo_data))):
        source = resolve_source(data)
        assert manifest_tokens(source.train_urls, source.manifest) == listed, data


def test_shards_without_a_manifest_or_not_in_it_weigh_the_same(demo_data):
    source = resolve_source(DataConfig(urls="http://host/train-{000000..000002}.tar",
                                       tokenizer=str(demo_data / "tokenizer")))
    assert source.manifest is None and manifest_tokens(source.train_urls, source.manifest) is None
    assert DocumentStream(source.train_urls, source.tokenizer_dir, 0).shard_tokens == [1, 1, 1]
    manifest = demo_data / "manifest.json"
    assert manifest_tokens([*shard_paths(demo_data, "train"), "http://host/extra.tar"], manifest) is None


def test_the_trainer_balances_its_readers_by_the_manifest(demo_data, tmp_path):
    trainer = make_trainer(demo_data, tmp_path / "run")
    try:
        listed = [s["tokens"] for s in load_manifest(demo_data)["splits"]["train"]["shards"]]
        # RowPrefetcher -> RowStream -> loader
        assert trainer.data.rows.rows.docs.stream.shard_tokens == listed
    finally:
        trainer.data.rows.close()


def test_a_checkpoint_from_before_the_balanced_split_ends_its_epoch_on_the_old_split(demo_data):
    """A slot state without `split` (written before the balanced split) reads the rest of its epoch from the
    old rule's shards (every 2nd of the permutation), then balances the next epoch: read 70 documents, save,
    resume, read to the end of two epochs; each epoch is exactly the documents of its shards, read alone."""
    shards = [str(s) for s in shard_paths(demo_data, "train")]
    tokens = [s["tokens"] for s in load_manifest(demo_data)["splits"]["train"]["shards"]]
    eos = special_ids(load_tokenizer(demo_data / "tokenizer")).eos

    def loader(state: dict) -> DocumentLoader:
        stream = DocumentStream(shards, demo_data / "tokenizer", eos, seed=4, rank=1, world_size=2, epochs=2,
                                shuffle_buffer=8, chunk_docs=16, shard_tokens=tokens)
        out = DocumentLoader(stream, num_workers=0)
        out.load_state_dict(state)
        return out

    def old(state: dict) -> dict:  # as a checkpoint of the earlier code has it: no "split" in the slot states
        return {**state, "slot_states": {k: {f: v for f, v in s.items() if f != "split"}
                                         for k, s in state["slot_states"].items()}}

    def keys_of(paths: list[str]) -> list[str]:
        stream = DocumentStream(paths, demo_data / "tokenizer", eos, epochs=1)
        return sorted(d.key for d in DocumentLoader(stream, num_workers=0))

    fresh = {"slot_states": {1: SlotState().to_dict()}, "chunks_consumed": 0, "num_workers": 0, "pending": []}
    first = loader(old(fresh))
    it = iter(first)
    read = [next(it).key for _ in range(70)]
    rest = [d.key for d in loader(old(first.state_dict()))]
    order = np.random.default_rng([4, 0]).permutation(len(shards))
    epoch0 = keys_of([shards[i] for i in order[1::2]])
    epoch1 = keys_of([shards[i] for i in assign_shards(tokens, 2, 1, 4, 1)[1]])
    assert sorted(read + rest[:len(epoch0) - 70]) == epoch0
    assert sorted(rest[len(epoch0) - 70:]) == epoch1
