"""Checkpoints written by an older packtrain still resume, export and initialize a run (tests/fixtures/v0,
built by tests/fixtures/build_old_checkpoint.py with the code named in its expected.json)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.checkpoint import store

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "v0"
EXPECTED = json.loads((FIXTURE / "expected.json").read_text())


def _train(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "trainer.train", f"data.path={FIXTURE / 'data'}", f"hydra.run.dir={run_dir}",
         *EXPECTED["train_args"], *extra],
        capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_old_checkpoint_resumes_to_the_losses_of_the_uninterrupted_old_run(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(FIXTURE / "ddp" / store.step_name(2), store.checkpoint_dir(run_dir, 2))
    proc = _train(run_dir, "train.resume=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 2" in proc.stdout
    metrics = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert sorted(metrics) == [3, 4]
    for step, loss in EXPECTED["losses_after_resume"].items():
        assert metrics[int(step)]["loss"] == pytest.approx(loss, rel=1e-6, abs=0), step


def test_old_checkpoint_loads_as_weights(tmp_path):
    """The weights-only path (train.init_from, export, generate) reads the old checkpoint's safetensors."""
    import torch

    from trainer.export import main as export_main

    out = tmp_path / "hf"
    assert export_main([str(FIXTURE / "ddp" / store.step_name(2)), "--out", str(out)]) == 0
    from safetensors.torch import load_file

    from trainer.checkpoint import hf

    exported = load_file(out / hf.WEIGHTS_FILE)
    original = load_file(FIXTURE / "ddp" / store.step_name(2) / store.WEIGHTS_FILE)
    assert torch.equal(exported["transformer.wte.weight"], original["wte.weight"])
