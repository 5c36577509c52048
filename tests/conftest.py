"""Session-wide fixtures shared by the test packages."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import settings

from tests import helpers

# CI replays the same examples every run (a landing never hinges on a lucky draw); locally they vary.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real dataset, prepared once per session (~5 s): the first 1000 documents of the demo
    corpus (standard-library functions and classes), a 512-token BPE, train shards of 200 documents
    (5 of them) and one val shard. Returns the directory holding manifest.json; treat it as read-only.
    """
    from trainer.prepare import prepare

    out = tmp_path_factory.mktemp("demo_data")
    prepare("demo", out, vocab_size=512, max_docs=1000, docs_per_shard=200, val_fraction=0.05, seed=0)
    return out


@pytest.fixture(scope="session")
def checkpoint(demo_data, tmp_path_factory) -> Path:
    """A tiny real checkpoint of demo_data (3 steps of `python -m trainer.train`), shared by the export and
    generate tests; read-only."""
    return helpers.train_checkpoint(tmp_path_factory.mktemp("run"), demo_data)


@pytest.fixture(scope="session")
def exported(checkpoint, tmp_path_factory) -> Path:
    """`checkpoint` exported by `python -m trainer.export` (a GPT-2 Hugging Face directory); read-only."""
    out = tmp_path_factory.mktemp("export") / "gpt2"
    proc = helpers.run_export(checkpoint, out)
    assert proc.returncode == 0, proc.stderr
    return out


@pytest.fixture(scope="session")
def neutral_sweeps(demo_data, tmp_path_factory) -> dict[str, Path]:
    """Two real sweeps over loss-preserving settings, run side by side (also read by tests/test_registry.py):
    data.prefetch on/off x seed 0/1 with a tiny eval, and train.compile on/off (inductor; no eval, so one
    compilation). 3 steps each."""
    root = tmp_path_factory.mktemp("neutral_sweeps")
    sweeps = {
        "prefetch": ("data.prefetch=true,false", "seed=0,1", "train.max_steps=3", "train.eval_every=3",
                     "train.eval_docs=8"),
        "compile": ("train.compile=true,false", "train.max_steps=3", "train.eval_every=0"),
    }
    with ThreadPoolExecutor(len(sweeps)) as pool:
        list(pool.map(lambda item: helpers.run_sweep(root / item[0], demo_data, *item[1]), sweeps.items()))
    return {name: root / name for name in sweeps}


# A headless chromium for tests that render pages (skips without one, fails under CI=true): see tests/browser.py.
from tests.browser import browser  # noqa: E402, F401
