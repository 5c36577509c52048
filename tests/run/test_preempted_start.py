"""trainer.run.loop: a preemption signal while the trainer reads its held-out documents at the start (a
stalled held-out source) ends the start on every rank as a preemption: exit status 0, one line saying so,
nothing trained or written. Before: load_eval_docs gave way (ReadInterrupted) but the Trainer let it out as a
traceback, exit status 1."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from tests.helpers import ENV, ROOT, SMALL


def test_sigterm_while_reading_the_held_out_documents_stops_the_start_cleanly(demo_data, tmp_path):
    run_dir = tmp_path / "run"
    stalled = f"pipe:cat {demo_data / 'val-000000.tar'}; sleep 120"  # the shard sent, then nothing
    cmd = [sys.executable, "-m", "trainer.train", f"data.path={demo_data}", f"hydra.run.dir={run_dir}",
           *SMALL, "train.max_steps=2", "train.eval_every=1", f"data.val_urls='{stalled}'",
           "data.read_timeout_s=300"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    # claimed: the handler is installed
    while not (run_dir / ".lock").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(3.0)  # building the data and the model, then the held-out read waiting for more
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert "preempted (SIGTERM) while reading the held-out documents, before training" in out, out[-2000:]
    assert "Traceback" not in err
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "checkpoints").exists()
