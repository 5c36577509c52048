"""Session-wide fixtures shared by the test packages."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import settings

from tests import helpers
from trainer.checkpoint.store import latest_checkpoint

# CI replays the same examples every run (a landing never hinges on a lucky draw); locally they vary.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def built_once(tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], object]) -> Path:
    """A directory `build` fills once per test session, also under pytest-xdist (`make test` runs two workers,
    and files that read the same fixture often land on different ones): the workers share one directory beside
    their own temporary roots; the first to need it builds it under a lock, the others wait and read it. A
    build that fails leaves nothing behind: the next worker tries again from an empty directory."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        out = tmp_path_factory.mktemp(name)
        build(out)
        return out
    root = tmp_path_factory.getbasetemp().parent  # shared by the session's workers
    out, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            try:
                build(out)
            except BaseException:
                shutil.rmtree(out, ignore_errors=True)
                raise
            done.touch()
    return out


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small real dataset, prepared once per session (~2 s): the first 1000 documents of the demo
    corpus (standard-library functions and classes), a 512-token BPE, train shards of 200 documents
    (5 of them) and one val shard. Returns the directory holding manifest.json; treat it as read-only
    (the xdist workers share it).
    """
    from trainer.prepare import prepare

    return built_once(tmp_path_factory, "demo_data", lambda out: prepare(
        "demo", out, vocab_size=512, max_docs=1000, docs_per_shard=200, val_fraction=0.05, seed=0))


@pytest.fixture(scope="session")
def checkpoint(demo_data, tmp_path_factory) -> Path:
    """A tiny real checkpoint of demo_data (3 steps of `python -m trainer.train`), shared by the export and
    generate tests; read-only."""
    return latest_checkpoint(built_once(tmp_path_factory, "run",
                                        lambda run_dir: helpers.train_checkpoint(run_dir, demo_data)))


@pytest.fixture(scope="session")
def exported(checkpoint, tmp_path_factory) -> Path:
    """`checkpoint` exported by `python -m trainer.export` (a GPT-2 Hugging Face directory); read-only."""

    def export(out: Path) -> None:
        proc = helpers.run_export(checkpoint, out / "gpt2")
        assert proc.returncode == 0, proc.stderr

    return built_once(tmp_path_factory, "export", export) / "gpt2"


NEUTRAL_SWEEPS = {
    "prefetch": ("data.prefetch=true,false", "seed=0,1", "train.max_steps=3", "train.eval_every=3",
                 "train.eval_docs=8"),
    "compile": ("train.compile=true,false", "train.max_steps=3", "train.eval_every=0"),
}


@pytest.fixture(scope="session")
def neutral_sweeps(demo_data, tmp_path_factory) -> dict[str, Path]:
    """Two real sweeps over loss-preserving settings, run side by side (read by tests/test_registry.py and
    tests/reporting/test_report.py): data.prefetch on/off x seed 0/1 with a tiny eval, and train.compile
    on/off (inductor; no eval, so one compilation). 3 steps each."""

    def run(root: Path) -> None:
        with ThreadPoolExecutor(len(NEUTRAL_SWEEPS)) as pool:
            list(pool.map(lambda item: helpers.run_sweep(root / item[0], demo_data, *item[1]),
                          NEUTRAL_SWEEPS.items()))

    root = built_once(tmp_path_factory, "neutral_sweeps", run)
    return {name: root / name for name in NEUTRAL_SWEEPS}


# A headless chromium for tests that render pages (skips without one, fails under CI=true): see
# tests/browser.py.
from tests.browser import browser  # noqa: E402, F401
