"""Checkpoints written by an older packtrain still resume, export and initialize a run
(tests/fixtures/<version>, built by tests/fixtures/build_old_checkpoint.py with the code named in each
expected.json): v0 a single source, v1 (the data stream's state before issue 31's typed states) a single
source and a two-source mixture."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.checkpoint import store

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VERSIONS = ("v0", "v1")
CASES = [("v0", "ddp"), ("v1", "ddp"), ("v1", "mixture")]


def expected(version: str) -> dict:
    return json.loads((FIXTURES / version / "expected.json").read_text())


def _train(version: str, run_dir: Path, data_args: list[str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.train", *data_args, f"hydra.run.dir={run_dir}",
         *expected(version)["train_args"], *extra],
        capture_output=True, text=True, timeout=300)


def test_every_fixture_is_tested():
    assert sorted(p.name for p in FIXTURES.iterdir() if (p / "expected.json").is_file()) == list(VERSIONS)
    assert sorted({(v, kind) for v in VERSIONS for kind in ("ddp", "mixture")
                   if (FIXTURES / v / kind).is_dir()}) == sorted(CASES)


@pytest.mark.slow
@pytest.mark.parametrize(("version", "kind"), CASES)
def test_old_checkpoint_resumes_to_the_losses_of_the_uninterrupted_old_run(tmp_path, version, kind):
    data = FIXTURES / version / "data"
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURES / version / kind / store.step_name(2), store.checkpoint_dir(run_dir, 2))
    if kind == "mixture":  # the data arguments it was written with, the corpus where this checkout holds it
        data_args = [arg.replace(expected(version)["data"], str(data))
                     for arg in expected(version)["mixture_data_args"]]
    else:
        data_args = [f"data.path={data}"]
    proc = _train(version, run_dir, data_args, "train.resume=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    metrics = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == [3, 4]
    want = expected(version)["mixture_losses_after_resume" if kind == "mixture" else "losses_after_resume"]
    for step, loss in want.items():
        assert metrics[int(step)]["loss"] == pytest.approx(loss, rel=1e-6, abs=0), step


@pytest.mark.parametrize("version", VERSIONS)
def test_old_checkpoint_loads_as_weights(tmp_path, version):
    """The weights-only path (train.init_from, export, generate) reads the old checkpoint's safetensors."""
    import torch

    from trainer.export import main as export_main

    checkpoint = FIXTURES / version / "ddp" / store.step_name(2)
    out = tmp_path / "hf"
    assert export_main([str(checkpoint), "--out", str(out)]) == 0
    from safetensors.torch import load_file

    from trainer.checkpoint import hf

    exported = load_file(out / hf.WEIGHTS_FILE)
    original = load_file(checkpoint / store.WEIGHTS_FILE)
    assert torch.equal(exported["transformer.wte.weight"], original["wte.weight"])
