"""data.path (a prepared dataset: its manifest and tokenizer) with data.urls (shards named as the manifest's)
that belong to another dataset. Local shards are compared with the manifest at the start
(tests/data/test_mixture.py: one line naming both); a remote source (http, gs, pipe:) cannot be, so each of
its shards is compared with its manifest entry when it has been read through: one line naming the shard, not
"truncated", not silence."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from trainer.data.config import DataConfig, PackingConfig
from trainer.data.feed import build_data
from trainer.data.reader import DataStreamError
from trainer.data.shards import shard_paths
from trainer.data.tars import tar_samples


def _other_dataset_shard(shard: str, out: Path) -> Path:
    """A shard of another dataset under the same name: as many samples, other texts (each twice),
    no stored ids."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(shard, "rb") as f, tarfile.open(out, "w") as tar:
        for sample in tar_samples(f, shard):
            text = sample["txt"] * 2
            info = tarfile.TarInfo(f"{sample['__key__']}.txt")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    return out


def test_a_remote_shard_of_another_dataset_beside_data_path_is_one_line_naming_it(demo_data, tmp_path):
    """As many samples as the manifest lists, so the count alone passed it: it trained on another dataset's
    text without a word. Now the shard read through is compared with its manifest entry (the stream gets the
    manifest)."""
    first = shard_paths(demo_data, "train")[0]
    other = _other_dataset_shard(first, tmp_path / "other" / Path(first).name)
    data = DataConfig(path=str(demo_data), urls=f"pipe:cat {other}", num_workers=0, prefetch=False,
                      shuffle_buffer=50)
    source = build_data(data, PackingConfig(), 256, seed=0, rank=0, world_size=1)
    with pytest.raises(DataStreamError,
                       match=r"^pipe:cat \S+/other/train-000000\.tar: not the shard the manifest "
                             r"lists: it is [\d,]+ bytes, the manifest lists [\d,]+ \(a shard of "
                             r"another dataset or tokenizer copied in, or damaged\)"):
        while source.rows.take(8):
            pass
