"""trainer.run.flops: model and hardware FLOPs by hand on tiny rows, layouts compared, and a real run's
metrics.

The tiny FLOP model throughout: N = 100 matmul parameters, 2 layers, width 4, so 6 N = 600 per position and
6 n_layer d = 48 per L^2 of attention (12 n_layer d = 96 per (query, key) pair).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import make_trainer, metrics
from trainer.data.batch import Document, collate_rows
from trainer.data.config import PackingConfig
from trainer.data.pipeline import micro_batches
from trainer.run.flops import FlopModel, attention_pairs, flex_tiles, flop_metrics

TINY = FlopModel(matmul_params=100, n_layer=2, n_embd=4, kernel="flash")


def doc(n: int, key: str = "d") -> Document:
    return Document(key, np.arange(1, n + 1, dtype=np.int64))


def packed_row():
    """Documents [3, 2] and 3 positions of padding in one packed row of 8: segments [3, 2, 3]."""
    return collate_rows([[doc(3, "a"), doc(2, "b")]], row_len=8, pad_id=0, layout="packed")


def test_a_packed_row_by_hand():
    batch = packed_row()
    assert batch.cu_seqlens.tolist() == [0, 3, 5, 8]
    # model: 600 * 5 real tokens + 48 * (9 + 4)
    assert TINY.model_flops([3, 2]) == 3000 + 624
    # flash / torch_varlen / sdpa_docs run the padding segment too: 600 * 8 + 48 * (9 + 4 + 9)
    for kernel in ("flash", "torch_varlen", "sdpa_docs"):
        assert dataclasses.replace(TINY, kernel=kernel).hardware_flops(batch) == 4800 + 1056
    # isolation off: one causal row of 8, 600 * 8 + 48 * 64
    assert dataclasses.replace(TINY, isolate_documents=False).hardware_flops(batch) == 4800 + 3072
    # dense: the whole 8 x 8 mask, 64 pairs of 96
    assert dataclasses.replace(TINY, kernel="dense").hardware_flops(batch) == 4800 + 6144
    # flex: one 128 x 128 tile, computed whole
    assert dataclasses.replace(TINY, kernel="flex").hardware_flops(batch) == 4800 + 96 * 128 * 128


def test_packed_and_unpacked_same_documents_same_model_flops_other_hardware_flops():
    rows = [[doc(3, "a"), doc(2, "b")]]
    packed = micro_batches(rows, PackingConfig(layout="packed"), 8, 64, pad_id=0)
    to_seq_len = micro_batches(rows, PackingConfig(layout="unpacked", pad_to="seq_len"), 8, 64, pad_id=0)
    to_longest = micro_batches(rows, PackingConfig(layout="unpacked", pad_to="longest"), 8, 64, pad_id=0)
    assert [mb.shape for mb in (*packed, *to_seq_len, *to_longest)] == [(1, 8), (2, 8), (2, 3)]
    hardware = [sum(TINY.hardware_flops(mb) for mb in mbs) for mbs in (packed, to_seq_len, to_longest)]
    assert hardware == [
        4800 + 1056,  # packed: 8 positions, segments 3, 2, 3
        9600 + 48 * (64 + 64),  # two rows of 8: 16 positions, 8^2 per row
        3600 + 48 * (9 + 9),  # two rows of 3 (the longest): 6 positions, 3^2 per row
    ]
    # the same documents in each: the same useful work, 3624, below every layout's hardware count
    assert all(h > TINY.model_flops([3, 2]) == 3624 for h in hardware)


def test_flex_counts_the_block_masks_tiles():
    # tiles of 128 over segments [100, 100, 56]: (0, 0) and (1, 1) on the diagonal, (1, 0) shares the second
    # document
    batch = collate_rows([[doc(100), doc(100), doc(56)]], row_len=256, pad_id=0, layout="packed")
    assert flex_tiles(batch.cu_seqlens, 256) == 3
    assert attention_pairs(batch, "flex") == 3 * 128 * 128
    assert attention_pairs(batch, "flash") == (100**2 + 100**2 + 56**2) / 2


def test_at_long_context_attention_dominates_and_the_layouts_part():
    # gpt2-124m, tied head
    gpt2 = FlopModel(matmul_params=123_689_472, n_layer=12, n_embd=768, kernel="flash")
    # attention / 6N for one document of L: 6 * 12 * 768 * L^2 / (6 * 123_689_472 * L) = 9216 L / 123_689_472
    for length, ratio in ((2048, 0.1526), (32768, 2.4415)):
        attention = gpt2.model_flops([length]) - 6 * 123_689_472 * length
        assert attention == 6 * 12 * 768 * length**2
        assert attention / (6 * 123_689_472 * length) == pytest.approx(ratio, abs=1e-4)
    # 16 documents of 2048 in one row of 32768: isolated kernels do what the documents need plus nothing; one
    # causal row (isolation off) or a row per document padded to 32768 does far more
    rows = [[doc(2048, f"d{i}") for i in range(16)]]
    model = gpt2.model_flops([2048] * 16)
    assert model == 24_318_339_710_976 + 3_710_851_743_744  # 6 N * 32768 + 6 * 12 * 768 * 16 * 2048^2
    packed = micro_batches(rows, PackingConfig(layout="packed"), 32768, 32768, pad_id=0)
    unpacked = micro_batches(rows, PackingConfig(layout="unpacked", pad_to="seq_len"), 32768, 32768, pad_id=0)
    assert gpt2.hardware_flops(packed[0]) == model  # no padding: the row is exactly its documents
    no_isolation = dataclasses.replace(gpt2, isolate_documents=False).hardware_flops(packed[0])
    assert no_isolation == 24_318_339_710_976 + 59_373_627_899_904  # 6 N * 32768 + 6 * 12 * 768 * 32768^2
    assert no_isolation / model == pytest.approx(2.986, abs=1e-3)  # 6 N alone would say 1.0
    padded = sum(gpt2.hardware_flops(mb) for mb in unpacked)
    assert padded == 16 * no_isolation  # 16 rows of 32768, each one document and its padding
    assert padded / model == pytest.approx(47.77, abs=0.01)  # 6 N alone would say 16


def test_utilization_only_with_a_known_peak():
    assert flop_metrics(3e14, 4e14, 2.0, None) == {"model_flops": 3e14, "hardware_flops": 4e14}
    assert flop_metrics(3e14, 4e14, 2.0, 1e15) == pytest.approx(
        {"model_flops": 3e14, "hardware_flops": 4e14, "mfu": 0.15, "hfu": 0.2})


@settings(max_examples=40, deadline=None)
@given(rows=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=4), min_size=1, max_size=4),
       layout=st.sampled_from(["packed", "unpacked", "bucketed"]),
       kernel=st.sampled_from(["flash", "flex", "dense"]), isolate=st.booleans())
def test_hardware_flops_never_below_model_flops(rows, layout, kernel, isolate):
    seq_len = max(sum(row) for row in rows)
    docs = [[doc(n, f"{r}.{i}") for i, n in enumerate(row)] for r, row in enumerate(rows)]
    mbs = micro_batches(docs, PackingConfig(layout=layout), seq_len, 2 * seq_len, pad_id=0)
    flops = dataclasses.replace(TINY, kernel=kernel, isolate_documents=isolate)
    model = flops.model_flops(n for row in rows for n in row)
    hardware = sum(flops.hardware_flops(mb) for mb in mbs)
    padding = sum(mb.num_allocated - mb.num_tokens for mb in mbs)
    assert hardware >= model + 600 * padding  # every allocated position pays 6 N, and attention never less


TINY_MODEL_N = 512 * 64 + 2 * (2 * 128 + 64 * 192 + 192 + 64 * 64 + 64 + 64 * 256 + 256 + 256 * 64 + 64) + 128
"""model=tiny on the demo tokenizer: the tied 512 x 64 embedding, two blocks (two LayerNorms, qkv, proj, MLP),
the final LayerNorm; the 128 x 64 position table left out."""


def test_a_real_run_logs_both_counts_per_step(demo_data, tmp_path):
    runs = {}
    for layout in ("packed", "unpacked"):
        trainer = make_trainer(demo_data, tmp_path / layout, "train.max_steps=3", f"packing={layout}")
        assert trainer.flops == FlopModel(TINY_MODEL_N, n_layer=2, n_embd=64, kernel="sdpa_docs")
        summary = trainer.fit()
        runs[layout] = metrics(tmp_path / layout)
        assert summary["mean_model_flops_per_s"] > 0 and summary["mean_mfu"] is None  # CPU: no peak, no mfu
    packed, unpacked = runs["packed"], runs["unpacked"]
    assert len(packed) == len(unpacked) == 3
    for p, u in zip(packed, unpacked, strict=True):
        assert "mfu" not in p and "hfu" not in p
        assert p["docs"] == u["docs"] and p["model_flops"] == u["model_flops"]  # same documents, same work
        # the useful work is 6 N per real token + 6 * 2 * 64 per squared document length, each length <= 128
        real_tokens = p["valid_tokens"] + p["docs"]  # every document's first token is no target (loss_on=all)
        squares = (p["model_flops"] - 6 * TINY_MODEL_N * real_tokens) / (6 * 2 * 64)
        assert squares == int(squares) and real_tokens**2 / p["docs"] <= squares <= 128 * real_tokens
        # the packed rows' kernel (sdpa_docs) runs every segment, padding too: 6 N per allocated position
        segment_squares = (p["hardware_flops"] - 6 * TINY_MODEL_N * p["allocated_tokens"]) / (6 * 2 * 64)
        assert squares <= segment_squares <= 128 * p["allocated_tokens"]
        # unpacked rows compute their padding
        assert u["hardware_flops"] >= p["hardware_flops"] >= p["model_flops"]
    # (a step of eight 128-token chunks has no padding in either layout; over the run, unpacking costs more)
    assert sum(u["hardware_flops"] for u in unpacked) > sum(p["hardware_flops"] for p in packed)
