"""A disk that fills up during a checkpoint save: one error line naming the file system and the last complete
checkpoint, the partial directory removed (it would keep the disk full), the previous checkpoint intact and
resumable. On a real, small tmpfs (mounting needs root: CI runs as root; elsewhere the test skips, under
CI=true it fails)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ENV, ROOT, SMALL, assert_one_error_line
from trainer.checkpoint.store import META_FILE, latest_checkpoint


def read_meta(checkpoint: Path) -> dict:
    return json.loads((checkpoint / META_FILE).read_text())


CHECKPOINT_MB = 2.5  # a tiny model's checkpoint at train.seq_len=128 (weights, AdamW state, tokenizer)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs: room for one checkpoint, not two."""
    disk = tmp_path / "disk"
    disk.mkdir()
    # As root (CI), or through a password-less sudo (.ci/run installs the browser the same way).
    prefix = [] if os.geteuid() == 0 or shutil.which("sudo") is None else ["sudo", "-n"]
    proc = subprocess.run([*prefix, "mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)],
                          capture_output=True, text=True)
    if proc.returncode == 0 and prefix:  # the run (this user) must be able to write there
        subprocess.run([*prefix, "chmod", "1777", str(disk)], check=True)
    if proc.returncode != 0:
        message = f"cannot mount a tmpfs (needs root): {proc.stderr.strip()}"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield disk, prefix
    finally:
        subprocess.run([*prefix, "umount", "-l", str(disk)], check=False)


def train(run_dir: Path, data: Path, *overrides: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer.train", f"data.path={data}", f"hydra.run.dir={run_dir}", *SMALL,
           "train.eval_every=0", "train.checkpoint_every=2", "logging.wandb.mode=disabled", *overrides]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(small_disk, demo_data):
    small_disk, prefix = small_disk
    run = small_disk / "run"
    proc = train(run, demo_data, "train.max_steps=4", "train.keep_last=2")
    line = assert_one_error_line(proc.returncode, proc.stderr, f"no space left on {small_disk}",
                                 "while writing the checkpoint of step 4", "the last complete checkpoint is step 2")
    assert "partial directory was removed" in line
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # no .tmp- leftover filling the disk
    assert read_meta(latest_checkpoint(run))["step"] == 2
    # The disk is as free as before the failed save: resuming from step 2 with room for one more checkpoint
    # works (keep_last=1 deletes step 2 only after step 4 is complete, so it needs room for two: give it more).
    subprocess.run([*prefix, "mount", "-o", "remount,size=8m", str(small_disk)], check=True)
    proc = train(run, demo_data, "train.max_steps=4", "train.resume=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_meta(latest_checkpoint(run))["step"] == 4
