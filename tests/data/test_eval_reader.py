"""The held-out reader (trainer.data.feed.load_eval_docs) is bounded and gives way to a preemption signal, as
the training stream does (issue 42: a crafted held-out tar hung the start for good, RSS growing, SIGTERM and
SIGINT ignored). The subprocesses run load_eval_docs as the trainer's start does: the real PreemptionHandler
installed, the command's one-line errors (trainer.errors.run_command)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import tracemalloc

import pytest

from tests.shards import NEGATIVE, at_most, sparse_shard
from trainer.data.config import DataConfig
from trainer.data.feed import load_eval_docs
from trainer.data.reader import DataStreamError
from trainer.data.workers import ReadInterrupted, allow_reads, interrupt_reads

EVAL_START = """
import sys
from pathlib import Path
from trainer.data.config import DataConfig
from trainer.data.feed import ReadInterrupted, load_eval_docs
from trainer.errors import run_command
from trainer.run.preemption import PreemptionHandler

handler = PreemptionHandler()  # as the trainer's start: SIGTERM recorded, every shard read interrupted

def start():
    print("reading", flush=True)
    try:
        docs = load_eval_docs(DataConfig(path=sys.argv[1], val_urls=sys.argv[2]), Path(sys.argv[1]) / "tokenizer",
                              0, 64, None)
    except ReadInterrupted:  # the trainer then stops before training (PreemptedAtStart), exit status 0
        print(f"interrupted by {handler.signal_name}", flush=True)
        return 0
    print(f"read {len(docs)} documents", flush=True)

sys.exit(run_command(start))
"""  # noqa: E501


def _start(demo_data, val_urls: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", EVAL_START, str(demo_data), val_urls],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "reading\n"
    return proc


def _end(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running after {timeout_s} s (a hang): {err[-2000:]}")
    return proc.returncode, out, err


def test_a_crafted_held_out_shard_ends_the_start_in_one_line(demo_data, tmp_path):
    """The issue's tar (a pax header with a negative size) as the held-out shard: the old reader looped over
    its first members for good (RSS growing, the recorded SIGTERM never looked at); now one line naming the
    member, exit status 2, by itself."""
    shard = tmp_path / "neg.tar"
    shard.write_bytes(NEGATIVE["pax header"])
    status, _, err = _end(_start(demo_data, str(shard)), timeout_s=30)
    assert status == 2, err
    assert err.count("\n") == 1, err
    assert re.fullmatch(r"error: \S*/neg\.tar: cannot read shard \(after sample 'a'\): TarFormatError: "
                        r"\./\./@PaxHeader: a negative size \(-3584\) in its header: "
                        r"a damaged or crafted shard\n", err)


@pytest.mark.parametrize("sig, status, line", [(signal.SIGTERM, 0, "interrupted by SIGTERM\n"),
                                               (signal.SIGINT, 130, "error: interrupted (SIGINT)\n")])
def test_a_stalled_held_out_source_gives_way_to_a_signal(demo_data, sig, status, line):
    """A held-out source that sends its shard and then nothing (a stalled server or command): the signal ends
    the start within a fraction of a second, with the trainer's status for it."""
    proc = _start(demo_data, f"pipe:cat {demo_data / 'val-000000.tar'}; sleep 120")
    time.sleep(1.0)  # the shard sent, the read waiting for more
    assert proc.poll() is None
    sent = time.monotonic()
    proc.send_signal(sig)
    code, out, err = _end(proc, timeout_s=20)
    assert time.monotonic() - sent < 5
    assert code == status, err
    assert line in (out if status == 0 else err)


def test_the_held_out_reader_gives_way_to_a_preemption_signal_on_local_shards(demo_data):
    """A local file never blocks, so only the reads' own check can stop it: a signal that arrives while the
    held-out shards are read (the handler's interrupt_reads) ends the read, where it used to read them all."""
    interrupt_reads()
    try:
        with pytest.raises(ReadInterrupted):
            load_eval_docs(DataConfig(path=str(demo_data)), demo_data / "tokenizer", 0, 64, None)
    finally:
        allow_reads()
    # and reads after
    assert load_eval_docs(DataConfig(path=str(demo_data)), demo_data / "tokenizer", 0, 64, 3)


def test_a_held_out_member_over_the_document_bound_is_refused_unread(demo_data, tmp_path):
    """The held-out reader has the training stream's document bound (data.max_doc_mb), judged from the tar
    header: a 300 MB member is refused by name and size without being read (memory stays far below it)."""
    shard = sparse_shard(tmp_path / "big.tar")
    tracemalloc.start()
    try:
        with pytest.raises(DataStreamError, match=r"big\.tar: sample 'big' is 314,572,800 bytes of text, "
                                                  r"over data\.max_doc_mb=8"):
            load_eval_docs(DataConfig(path=str(demo_data), val_urls=str(shard)), demo_data / "tokenizer",
                           0, 64, None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 << 20, f"peak {peak:,} bytes"


def test_under_on_error_skip_a_crafted_held_out_shard_is_one_counted_skip(demo_data, tmp_path, caplog):
    """data.on_error=skip over the issue's tar: it was the same endless loop with thousands of warnings (its
    first samples read again and again); now the samples before the bad header are read once (b, whose sample
    the header would have continued, is not whole), the shard is skipped once (unreadable_shard)."""
    shard = tmp_path / "neg.tar"
    shard.write_bytes(NEGATIVE["pax header"])
    data = DataConfig(path=str(demo_data), val_urls=str(shard), on_error="skip")
    with at_most(30):
        docs = load_eval_docs(data, demo_data / "tokenizer", 0, 2**20, None, "skip")
    assert [d.key for d in docs] == ["a"]
    skips = [r.getMessage() for r in caplog.records if "skipped (" in r.getMessage()]
    assert (len(skips) == 1 and "skipped (unreadable_shard)" in skips[0]
            and "a negative size" in skips[0]), skips
