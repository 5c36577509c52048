"""Shards where clusters keep them: data.urls over a real local HTTP server, pipe: commands, retries, bad
URLs.

The server is the standard library's ThreadingHTTPServer in a thread of this process, serving the prepared
demo dataset; it can cut a response mid-way (Content-Length sent, half the bytes, connection closed) for
the first N requests of a file. Reads go through webdataset's own handlers (curl for http, a shell for pipe:).
"""

from __future__ import annotations

import collections
import functools
import http.server
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import free_port
from tests.helpers import ROOT, SMALL, ShardHandler, metrics, serve_shards
from trainer.data.config import DataConfig
from trainer.data.feed import load_eval_docs
from trainer.data.loader import DocumentLoader
from trainer.data.reader import DataStreamError
from trainer.data.sources import ShardSourceError, resolve_source
from trainer.data.stream import DocumentStream
from trainer.data.tokenizer import load_tokenizer, special_ids

TRAIN = "train-{000000..000004}.tar"  # the demo_data fixture's five train shards


@pytest.fixture(scope="module")
def server(demo_data):
    with serve_shards(demo_data, ShardHandler) as srv:
        yield srv


@pytest.fixture
def http(server):
    server.cuts, server.requests = {}, collections.defaultdict(list)
    return server


def read(data: DataConfig, demo_data: Path,
         num_workers: int = 0) -> tuple[list[tuple[str, list[int]]], DocumentLoader]:
    """(key, token ids) of every training document of one epoch, through the real stream and loader."""
    source = resolve_source(data)
    eos = special_ids(load_tokenizer(source.tokenizer_dir)).eos
    stream = DocumentStream(source.train_urls, source.tokenizer_dir, eos, seed=3, shuffle_buffer=64,
                            chunk_docs=16, epochs=1, on_error=data.on_error,
                            expected_docs=source.expected_docs, retries=data.retries, retry_backoff_s=0.05)
    loader = DocumentLoader(stream, num_workers=num_workers)
    return [(d.key, d.tokens.tolist()) for d in loader], loader


@pytest.fixture(scope="module")
def from_disk(demo_data):
    """from_disk(num_workers): what `read` gives over data.path (the order depends on the worker count)."""

    @functools.cache
    def docs(num_workers: int = 0) -> list[tuple[str, list[int]]]:
        result, _ = read(DataConfig(path=str(demo_data)), demo_data, num_workers)
        assert len(result) > 900
        return result

    return docs


def remote(demo_data: Path, urls, **kw) -> DataConfig:
    return DataConfig(urls=urls, tokenizer=str(demo_data / "tokenizer"), **kw)


# -- the same documents, wherever the shards are ---------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_http_brace_pattern_gives_the_documents_of_the_prepared_dir(http, demo_data, from_disk, num_workers):
    docs, _ = read(remote(demo_data, f"{http.base}/{TRAIN}"), demo_data, num_workers)
    assert docs == from_disk(num_workers)
    assert all(http.curl_gets(f"train-{i:06d}.tar") == 1 for i in range(5))


def test_pipe_command_gives_the_same_documents_and_counts_are_checked(demo_data, from_disk):
    data = DataConfig(urls=f"pipe:cat {demo_data}/{TRAIN}", path=str(demo_data))  # tokenizer from data.path
    assert resolve_source(data).expected_docs["train-000003.tar"] == 200
    docs, _ = read(data, demo_data)
    assert docs == from_disk()


def test_urls_with_a_manifest_take_its_counts_tokenizer_and_val_split(http, demo_data):
    source = resolve_source(DataConfig(urls=f"{http.base}/{TRAIN}", path=str(demo_data)))
    assert source.train_urls == [f"{http.base}/train-{i:06d}.tar" for i in range(5)]
    assert source.tokenizer_dir == demo_data / "tokenizer"
    assert source.expected_docs["train-000000.tar"] == 200 and source.val_urls[0].endswith("val-000000.tar")
    beside = resolve_source(DataConfig(urls=f"{demo_data}/train-*.tar"))  # a glob; the manifest sits beside
    assert beside.train_urls == [str(demo_data / f"train-{i:06d}.tar") for i in range(5)]
    assert beside.tokenizer_dir == demo_data / "tokenizer" and beside.expected_docs == source.expected_docs


def test_eval_reads_val_urls(http, demo_data):
    over_http = load_eval_docs(remote(demo_data, f"{http.base}/{TRAIN}",
                                      val_urls=f"{http.base}/val-000000.tar"),
                               demo_data / "tokenizer", 0, 64, max_docs=None)
    from_disk = load_eval_docs(demo_data, demo_data / "tokenizer", 0, 64, max_docs=None)
    assert [(d.key, d.tokens.tolist()) for d in over_http] == [(d.key, d.tokens.tolist()) for d in from_disk]


def test_eval_without_val_urls_or_a_manifest_is_a_clear_error(http, demo_data):
    with pytest.raises(ShardSourceError, match=r"set data\.val_urls=SHARDS .* or train\.eval_every=0"):
        load_eval_docs(remote(demo_data, f"{http.base}/{TRAIN}"), demo_data / "tokenizer", 0, 64,
                       max_docs=None)


# -- failures -------------------------------------------------------------------------------------


def test_404_is_a_clear_error_naming_the_url_and_status_without_retries(http, demo_data):
    url = f"{http.base}/train-999999.tar"
    with pytest.raises(DataStreamError, match=rf"^{re.escape(url)}: cannot read shard .*HTTP 404 Not Found"):
        read(remote(demo_data, [f"{http.base}/{TRAIN}", url], retries=2), demo_data)
    assert http.curl_gets("train-999999.tar") == 1  # a client error is not retried


def test_404_under_skip_is_counted_and_the_other_shards_arrive(http, demo_data, from_disk):
    docs, loader = read(remote(demo_data, [f"{http.base}/{TRAIN}", f"{http.base}/nothing.tar"],
                               on_error="skip"), demo_data)
    assert sorted(docs) == sorted(from_disk())
    assert loader.skipped() == {"unreadable_shard": 1}


def test_transfer_cut_midway_without_retries_is_a_clear_error(http, demo_data):
    http.cuts["train-000002.tar"] = 1
    url = f"{http.base}/train-000002.tar"
    with pytest.raises(DataStreamError,
                       match=rf"^{re.escape(url)}: cannot read shard \(after sample '.*curl exit 18"):
        read(remote(demo_data, f"{http.base}/{TRAIN}", retries=0), demo_data)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_retries_after_cut_transfers_give_the_exact_sequence(http, demo_data, from_disk, num_workers, caplog):
    """Every shard's first transfer is cut after about half its samples were passed on: each is read again
    from its start, the samples already given are not passed on twice, and none is missing."""
    http.cuts = {f"train-{i:06d}.tar": 1 for i in range(5)}
    with caplog.at_level(logging.WARNING, logger="trainer.data.reader"):
        docs, _ = read(remote(demo_data, f"{http.base}/{TRAIN}", retries=2), demo_data, num_workers)
    assert docs == from_disk(num_workers)
    assert all(http.curl_gets(f"train-{i:06d}.tar") == 2 for i in range(5))
    if num_workers == 0:  # the workers' log records stay in their processes
        assert "retry 1 of 2" in caplog.text and "samples already passed on" in caplog.text


def test_connection_refused_is_retried_then_named(demo_data):
    url = f"http://127.0.0.1:{free_port()}/train-000000.tar"  # nothing listens there
    with pytest.raises(DataStreamError,
                       match=rf"^{re.escape(url)}: .*; 2 attempts\): curl exit 7: could not connect"):
        read(remote(demo_data, url, retries=1), demo_data)


@pytest.mark.parametrize(
    "urls,message",
    [
        ("{root}/nowhere-*.tar", r"data\.urls='.*/nowhere-\*\.tar' matches no file"),
        ("{root}/shard-{{000000..000004}}.tar", r"matches no shard: none of its 5 paths exists "
                                                r"\(first: .*/shard-000000\.tar\)"),
        ("{root}/train-{{000000..000009}}.tar", r"5 of its 10 shards do not exist "
                                                r"\(first: .*/train-000005\.tar\)"),
        ("{root}/train-000000.tar::{root}/no.tar", r"1 of its 2 shards do not exist \(first: .*/no\.tar\)"),
    ],
)
def test_patterns_matching_nothing_fail_at_startup_naming_the_pattern(demo_data, urls, message):
    with pytest.raises(ShardSourceError, match=message):
        resolve_source(remote(demo_data, urls.format(root=demo_data)))


def test_urls_without_a_tokenizer_is_a_clear_error(http):
    with pytest.raises(ShardSourceError, match=r"needs a tokenizer: set data\.tokenizer=DIR"):
        resolve_source(DataConfig(urls=f"{http.base}/{TRAIN}"))


# -- end to end -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_train_over_http_equals_train_from_disk(http, demo_data, tmp_path):
    """`python -m trainer.train` reading shards and val shards over HTTP (served from this process) logs the
    same documents, targets and losses per step, and the same val_loss, as a run over data.path."""
    common = [*SMALL, "train.max_steps=3", "train.checkpoint_every=0"]
    over_http = [f"data.urls='{http.base}/{TRAIN}'", f"data.val_urls='{http.base}/val-000000.tar'",
                 f"data.tokenizer={demo_data / 'tokenizer'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    runs = {}
    for name, data in {"disk": [f"data.path={demo_data}"], "http": over_http}.items():
        cmd = [sys.executable, "-m", "trainer.train", f"hydra.run.dir={tmp_path / name}", *data, *common]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        runs[name] = metrics(tmp_path / name)
    keys = ("step", "docs", "valid_tokens", "loss")
    assert [[m[k] for k in keys] for m in runs["http"]] == [[m[k] for k in keys] for m in runs["disk"]]
    assert runs["http"][-1]["val_loss"] == runs["disk"][-1]["val_loss"]
    assert http.curl_gets("val-000000.tar") >= 1
    config = json.loads((tmp_path / "http" / "config.json").read_text())
    assert config["data"]["urls"] == f"{http.base}/{TRAIN}"
