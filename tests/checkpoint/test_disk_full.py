"""A disk that fills up during a checkpoint save: one error line naming the file system and the last complete
checkpoint, the partial directory removed (it would keep the disk full), the previous checkpoint intact and
resumable, every rank gone. On a real, small tmpfs (mounting needs root: CI runs as root; elsewhere the test
skips, under CI=true it fails); for the DDP engine and for DeepSpeed ZeRO-2 on one and two ranks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import require_module
from tests.helpers import ENV, ROOT, SMALL, assert_one_error_line, torchrun
from trainer.checkpoint.store import META_FILE, latest_checkpoint


def read_meta(checkpoint: Path) -> dict:
    return json.loads((checkpoint / META_FILE).read_text())


CHECKPOINT_MB = 2.5  # a tiny model's checkpoint at train.seq_len=128 (weights, AdamW state, tokenizer)
DEEPSPEED_CHECKPOINT_MB = 3.2  # the same under ZeRO-2 (+ DeepSpeed's copy of the module, its scripts)


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs: room for one checkpoint, not two (`resize` changes that)."""
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


def resize(small_disk: tuple[Path, list[str]], size: str) -> None:
    disk, prefix = small_disk
    subprocess.run([*prefix, "mount", "-o", f"remount,size={size}", str(disk)], check=True)


def train(run_dir: Path, data: Path, *overrides: str, launcher: list[str] | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess:
    """The trainer, and everything it started, ended after `timeout` seconds (a hung rank fails the test).
    DeepSpeed's ZeRO-2 on two ranks calls a deprecated torch collective: its FutureWarning is not the
    run's."""
    cmd = [*(launcher or [sys.executable, "-m"]), "trainer.train", f"data.path={data}",
           f"hydra.run.dir={run_dir}", *SMALL, "train.eval_every=0", "train.checkpoint_every=2",
           "logging.wandb.mode=disabled", *overrides]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**ENV, "PYTHONWARNINGS": "ignore::FutureWarning"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun's ranks too
        stdout, stderr = proc.communicate()
        pytest.fail(f"still running after {timeout} s (a rank hung?):\n{stderr[-5000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(small_disk, demo_data):
    disk = small_disk[0]
    run = disk / "run"
    proc = train(run, demo_data, "train.max_steps=4", "train.keep_last=2")
    line = assert_one_error_line(proc.returncode, proc.stderr, f"no space left on {disk}",
                                 "while writing the checkpoint of step 4",
                                 "the last complete checkpoint is step 2")
    assert "partial directory was removed" in line
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # no .tmp- leftover filling the disk
    assert read_meta(latest_checkpoint(run))["step"] == 2
    # The disk is as free as before the failed save: resuming from step 2 with room for one more checkpoint
    # works (keep_last=1 deletes step 2 only after step 4 is complete, so it needs room for two: give it
    # more).
    resize(small_disk, "8m")
    proc = train(run, demo_data, "train.max_steps=4", "train.resume=true")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_meta(latest_checkpoint(run))["step"] == 4


DEEPSPEED_TIMEOUT = 240
"""Seconds a failing DeepSpeed run may take (one takes 15-45 s here); a rank left in one of DeepSpeed's
collectives would wait for gloo's 30-minute timeout."""


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_full_disk_inside_a_deepspeed_save_is_one_line_on_every_rank_and_no_rank_waits(
        small_disk, demo_data, tmp_path, nproc):
    """5 MB: step 2's ZeRO-2 checkpoint (DEEPSPEED_CHECKPOINT_MB) fits, step 4's fails inside DeepSpeed's own
    writes (its module and optimizer-partition files, after the rank files). On two ranks either rank, or
    both, may be the one that fails (here it is mostly rank 0 alone), while the other goes on into DeepSpeed's
    closing barrier: before the fix rank 0 raised from torch.save and rank 1 was left in that barrier."""
    require_module("deepspeed", "pip install -e '.[deepspeed]'")
    disk = small_disk[0]
    resize(small_disk, "5m")
    run, logs = disk / "run", tmp_path / "logs"
    # Each rank's stderr in its own file (torchrun adds its own report of the failed ranks to the console).
    launcher = None if nproc == 1 else torchrun(nproc, "--log-dir", str(logs), "--redirects", "2")
    args = ("distributed=deepspeed_zero2", "train.max_steps=4")
    proc = train(run, demo_data, *args, "train.keep_last=2", launcher=launcher, timeout=DEEPSPEED_TIMEOUT)
    phrases = (f"no space left on {disk}", "while writing the checkpoint of step 4",
               "the last complete checkpoint is step 2", "partial directory was removed")
    if nproc == 1:
        assert_one_error_line(proc.returncode, proc.stderr, *phrases)
    else:
        assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-5000:]
        ranks = sorted(logs.glob("*/attempt_0/*/stderr.log"))
        assert len(ranks) == nproc, ranks
        lines = {assert_one_error_line(2, path.read_text(), *phrases) for path in ranks}
        assert len(lines) == 1, lines  # every rank says the same
    root = run / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step_000002"]  # no .tmp- leftover
    assert read_meta(latest_checkpoint(run))["step"] == 2
    # step 2's checkpoint resumes (once there is room): DeepSpeed loads its shards, step 4 is saved
    if nproc == 2:
        resize(small_disk, "12m")
        launcher = torchrun(nproc)
        proc = train(run, demo_data, *args, "train.resume=true", launcher=launcher, timeout=DEEPSPEED_TIMEOUT)
        assert proc.returncode == 0, proc.stderr[-5000:]
        assert "resumed from" in proc.stdout
        assert read_meta(latest_checkpoint(run))["step"] == 4


@pytest.mark.slow
def test_a_full_disk_inside_an_fsdp2_save_is_one_line_on_every_rank_and_no_rank_waits(
        small_disk, demo_data, tmp_path):
    """FSDP2 on two ranks: each rank writes its DCP shard file in parallel; the disk fills during step 4's
    save (step 2's fits in the 4 MB, as DDP's). DCP gathers every rank's outcome before it raises, so the rank
    whose write failed raises after DCP's collectives and the store agrees on the failure: one line on every
    rank, the partial directory removed, step 2 intact."""
    disk = small_disk[0]
    run, logs = disk / "run", tmp_path / "logs"
    args = ("distributed=fsdp2", "train.max_steps=4")
    proc = train(run, demo_data, *args, "train.keep_last=2", launcher=torchrun(2, "--log-dir", str(logs),
                                                                              "--redirects", "2"))
    phrases = (f"no space left on {disk}", "while writing the checkpoint of step 4",
               "the last complete checkpoint is step 2", "partial directory was removed")
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-5000:]
    ranks = sorted(logs.glob("*/attempt_0/*/stderr.log"))
    assert len(ranks) == 2, ranks
    lines = {assert_one_error_line(2, path.read_text(), *phrases) for path in ranks}
    assert len(lines) == 1, lines
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002"]
    # intact (resuming after a full disk: the tests above)
    assert read_meta(latest_checkpoint(run))["step"] == 2
