"""What clusters do to a run, done for real: signals, kill -9, elastic restarts, NaN steps, a failing rank.

Every case runs `python -m trainer.train` (or torchrun) as a real subprocess and compares the losses of the
interrupted-and-resumed run with an uninterrupted run of the same config. Dropout is on and the data comes
through DataLoader workers, so a resume that restored the wrong random state, or read one document too many
or too few, would show in the losses.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.harness import run_distributed
from tests.helpers import ROOT, SMALL, metrics, run_train, torchrun
from trainer.checkpoint import store
from trainer.checkpoint.safe_io import load_state

pytestmark = pytest.mark.slow

STEPS = 16  # checkpoints at 4, 8, 12, 16; the signals arrive after step 5 or 6
CLUSTER = ("model.dropout=0.1", "data.num_workers=2", "train.eval_every=0", "train.checkpoint_every=4",
           f"train.max_steps={STEPS}", "train.keep_last=3")


def start(run_dir: Path, data: Path, *overrides: str, launcher: list[str] | None = None) -> subprocess.Popen:
    """The trainer in the background; stdout/stderr go to files in run_dir's parent."""
    cmd = (launcher or [sys.executable, "-m"]) + ["trainer.train", f"data.path={data}",
                                                  f"hydra.run.dir={run_dir}", *SMALL, *CLUSTER, *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    out = open(run_dir.parent / f"{run_dir.name}.out", "w")  # noqa: SIM115 (closed with the process)
    err = open(run_dir.parent / f"{run_dir.name}.err", "w")  # noqa: SIM115
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=err, start_new_session=True)


def output(run_dir: Path) -> tuple[str, str]:
    return ((run_dir.parent / f"{run_dir.name}.out").read_text(),
            (run_dir.parent / f"{run_dir.name}.err").read_text())


def wait_for_step(run_dir: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    path, deadline = run_dir / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"trainer exited early ({proc.returncode}): {output(run_dir)[1][-3000:]}"
        if path.exists() and len(path.read_text().splitlines()) >= step:
            return
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (children, their children, ...)."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def trainer_ranks(torchrun_pid: int) -> dict[int, int]:
    """{rank: pid} of the trainer processes torchrun started (its direct children; their DataLoader workers
    carry the same command line one level further down)."""
    ranks = {}
    for pid in descendants(torchrun_pid):
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        if int(stat[1]) == torchrun_pid:
            env = dict(item.split(b"=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                       if b"=" in item)
            ranks[int(env[b"RANK"])] = pid
    return ranks


def alive(pids: list[int]) -> list[int]:
    living = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":  # a zombie has exited; only its parent's wait() is missing
            living.append(pid)
    return living


def assert_no_survivors(children: list[int], timeout: float = 10) -> None:
    deadline = time.time() + timeout
    while alive(children) and time.time() < deadline:
        time.sleep(0.1)
    assert not alive(children), f"processes outlived the trainer: {alive(children)}"


def assert_same_losses_from(resumed: Path, whole: Path, first_step: int) -> None:
    a = {m["step"]: m for m in metrics(whole)}
    b = {m["step"]: m for m in metrics(resumed)}
    assert sorted(b) == list(range(1, STEPS + 1))  # every step once, none repeated after the resume
    for step in range(first_step, STEPS + 1):
        assert a[step]["docs"] == b[step]["docs"] and a[step]["valid_tokens"] == b[step]["valid_tokens"], step
        assert abs(a[step]["loss"] - b[step]["loss"]) <= 1e-6, (step, a[step]["loss"], b[step]["loss"])


@pytest.fixture(scope="module")
def uninterrupted(demo_data, tmp_path_factory) -> dict[int, Path]:
    """The reference runs: 1 process and 2 ranks under torchrun, never interrupted."""
    root = tmp_path_factory.mktemp("whole")
    run_train(root / "one", demo_data, *CLUSTER)
    run_train(root / "two", demo_data, *CLUSTER, launcher=torchrun())
    return {1: root / "one", 2: root / "two"}


def test_reference_runs_log_every_step_and_learn(uninterrupted):
    """The references the resume tests compare against are complete runs (1 and 2 ranks) that train."""
    for run in uninterrupted.values():
        losses = [m["loss"] for m in metrics(run)]
        assert len(losses) == STEPS and losses[-1] < losses[0]


def test_sigterm_checkpoints_the_current_step_and_exits_zero(demo_data, tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    proc = start(run_dir, demo_data)
    wait_for_step(run_dir, 5, proc)
    children = descendants(proc.pid)
    assert children, "expected DataLoader worker processes"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, output(run_dir)[1][-3000:]
    out = output(run_dir)[0]
    assert "preempted (SIGTERM) after step" in out
    step = json.loads((run_dir / "summary.json").read_text())["final_step"]
    assert step < STEPS and (run_dir / "checkpoints" / f"step_{step:06d}").is_dir()
    assert f"checkpoint: {run_dir / 'checkpoints' / f'step_{step:06d}'}" in out
    assert_no_survivors(children)
    run_train(run_dir, demo_data, *CLUSTER, "train.resume=true")
    assert_same_losses_from(run_dir, uninterrupted[1], step + 1)


def test_sigusr1_on_one_rank_stops_both_ranks_at_the_same_step(demo_data, tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    proc = start(run_dir, demo_data, launcher=torchrun())
    wait_for_step(run_dir, 5, proc)
    os.kill(trainer_ranks(proc.pid)[1], signal.SIGUSR1)  # rank 1 alone gets the signal
    assert proc.wait(timeout=120) == 0, output(run_dir)[1][-3000:]
    assert "preempted (a signal on another rank) after step" in output(run_dir)[0]  # rank 0 prints
    step = json.loads((run_dir / "summary.json").read_text())["final_step"]
    ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
    assert sorted(p.name for p in ckpt.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
    run_train(run_dir, demo_data, *CLUSTER, "train.resume=true", launcher=torchrun())
    assert_same_losses_from(run_dir, uninterrupted[2], step + 1)


def test_fsdp2_under_torchrun_trains_as_ddp_and_resumes_exactly_after_a_sigterm(demo_data, tmp_path,
                                                                                uninterrupted):
    """distributed=fsdp2 on 2 ranks, SIGTERM to rank 0 mid-run: both ranks stop at one step and write a DCP
    checkpoint; resumed, every step's loss (dropout on, before and after the preemption) equals the
    uninterrupted DDP run's. The last checkpoint exports to the Hugging Face format without a GPU (its weights
    are the whole model's). Only the last checkpoint holds model.safetensors (train.save_weights=end); the
    preempted one's weights are read from its DCP shards, and the last one's shards read whole equal its
    model.safetensors exactly."""
    from safetensors.torch import load_file

    from tests.helpers import run_export
    from trainer.checkpoint.weights import _dcp_weights, load_weights

    run_dir = tmp_path / "fsdp2"
    proc = start(run_dir, demo_data, "distributed=fsdp2", launcher=torchrun())
    wait_for_step(run_dir, 5, proc)
    os.kill(trainer_ranks(proc.pid)[0], signal.SIGTERM)
    assert proc.wait(timeout=120) == 0, output(run_dir)[1][-3000:]
    assert "preempted (SIGTERM) after step" in output(run_dir)[0]
    step = json.loads((run_dir / "summary.json").read_text())["final_step"]
    ckpt = store.checkpoint_dir(run_dir, step)
    assert sorted(p.name for p in (ckpt / store.DCP_DIR).iterdir()) == [".metadata", "__0_0.distcp",
                                                                        "__1_0.distcp"]
    assert json.loads((ckpt / store.META_FILE).read_text())["engine"] == "fsdp2"
    # train.save_weights=end: a save before the last gathers nothing
    assert not (ckpt / store.WEIGHTS_FILE).exists()
    preempted_weights = load_weights(ckpt)  # read from its DCP shards instead, on one process
    run_train(run_dir, demo_data, *CLUSTER, "distributed=fsdp2", "train.resume=true", launcher=torchrun())
    assert_same_losses_from(run_dir, uninterrupted[2], 1)
    last = store.latest_checkpoint(run_dir)
    out = tmp_path / "hf"
    proc = run_export(last, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = load_file(out / "model.safetensors")
    assert torch.equal(exported["transformer.wte.weight"], load_file(last / store.WEIGHTS_FILE)["wte.weight"])
    # The last checkpoint holds both: its DCP shards read whole are its model.safetensors, bit for bit.
    whole, from_dcp = load_file(last / store.WEIGHTS_FILE), _dcp_weights(last)
    assert whole.keys() == from_dcp.keys() == preempted_weights.keys()
    assert all(torch.equal(whole[k], from_dcp[k]) for k in whole)


def test_kill_9_of_the_torchrun_agent_preempts_its_ranks_instead_of_orphaning_them(demo_data, tmp_path):
    """The agent killed with SIGKILL: each rank gets SIGTERM from the kernel (PR_SET_PDEATHSIG, set at its
    start), so the ranks checkpoint the step they reached together and exit, their DataLoader workers with
    them (without it they train on as orphans: max_steps is far away); the run then resumes from that
    checkpoint."""
    run_dir = tmp_path / "run"
    proc = start(run_dir, demo_data, "train.max_steps=100000", launcher=torchrun())
    wait_for_step(run_dir, 5, proc)
    ranks = trainer_ranks(proc.pid)
    assert sorted(ranks) == [0, 1]
    below = descendants(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)  # the agent only: its ranks are in the same session, not signalled
    proc.wait()
    assert_no_survivors(below, timeout=60)
    ckpt = store.latest_checkpoint(run_dir)
    step = store.read_meta(ckpt)["step"]
    assert step >= 5 and f"preempted (SIGTERM) after step {step}" in output(run_dir)[0], output(run_dir)
    assert sorted(p.name for p in ckpt.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
    run_train(run_dir, demo_data, *CLUSTER, "train.resume=true", f"train.max_steps={step + 2}",
              launcher=torchrun())
    assert [m["step"] for m in metrics(run_dir)][-2:] == [step + 1, step + 2]


@pytest.mark.parametrize("engine", ["ddp", "fsdp2"])
def test_kill_9_during_a_checkpoint_write_resumes_from_the_last_complete_one(demo_data, tmp_path,
                                                                             uninterrupted, engine):
    """FSDP2 (DCP's files, written by the engine into the save's .tmp- directory) as DDP; on one process both
    train the same losses, so the uninterrupted DDP run is the reference for both."""
    run_dir = tmp_path / "run"
    engine_args = (f"distributed={engine}",)
    proc = start(run_dir, demo_data, *engine_args)
    wait_for_step(run_dir, 6, proc)
    children = descendants(proc.pid)
    deadline = time.time() + 60
    while not list((run_dir / "checkpoints").glob(".tmp-step_*")) and time.time() < deadline:
        time.sleep(0.001)  # a save in progress (every 4 steps)
    proc.kill()
    proc.wait()
    assert_no_survivors(children)
    # Whether or not the kill landed inside the write, leave a half-written save behind for certain.
    partial = run_dir / "checkpoints" / ".tmp-step_999999"
    partial.mkdir(parents=True, exist_ok=True)
    (partial / "rank_00000.pt").write_bytes(b"\x80half a pickle")
    done = sorted(int(p.name[5:]) for p in (run_dir / "checkpoints").glob("step_*"))
    proc = run_train(run_dir, demo_data, *CLUSTER, *engine_args, "train.resume=true")
    assert f"ignoring incomplete checkpoint {partial}" in proc.stdout
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{done[-1]:06d}'}" in proc.stdout
    assert_same_losses_from(run_dir, uninterrupted[1], done[-1] + 1)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))  # the next save cleared the leftovers


def test_torchrun_elastic_restart_resumes_from_the_last_checkpoint(demo_data, tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    # A c10d rendezvous, as launch/torchrun.sh (--standalone) and launch/slurm.sbatch use: each restart gets a
    # fresh round. (The static rendezvous of a bare --master_port can hand the restarted ranks stale
    # addresses.)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                "--max-restarts=1", "-m"]
    proc = start(run_dir, demo_data, "train.resume=true", launcher=launcher)
    wait_for_step(run_dir, 6, proc)
    os.kill(trainer_ranks(proc.pid)[1], signal.SIGKILL)
    assert proc.wait(timeout=300) == 0, output(run_dir)[1][-3000:]
    out = output(run_dir)[0]
    assert "resume: no checkpoint" in out and "resumed from" in out  # fresh start, then the restart resumed
    assert_same_losses_from(run_dir, uninterrupted[2], 1)


def test_a_failing_rank_takes_the_job_down_within_seconds(demo_data, tmp_path):
    """Rank 1's first shard is cut short: it raises, and rank 0 (waiting in a collective) does not hang."""
    data = tmp_path / "data"
    import shutil

    shutil.copytree(demo_data, data)
    manifest = json.loads((data / "manifest.json").read_text())
    shards = [s["name"] for s in manifest["splits"]["train"]["shards"]]
    tokens = [s["tokens"] for s in manifest["splits"]["train"]["shards"]]
    # the stream's epoch-0 order for seed 0
    order = list(np.random.default_rng([0, 0]).permutation(len(shards)))
    held, loads = [[], []], [0, 0]  # its split by tokens: largest shard first, to the rank holding fewer
    for i in sorted(order, key=lambda i: -tokens[i]):
        rank = min((0, 1), key=lambda r: (loads[r], len(held[r]), r))
        held[rank].append(i)
        loads[rank] += tokens[i]
    victim = data / shards[min(held[1], key=order.index)]  # rank 1 (one worker) reads this one first
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])
    run_dir = tmp_path / "run"
    t0 = time.time()
    proc = start(run_dir, data, "data.num_workers=1", launcher=torchrun())
    code = proc.wait(timeout=300)
    assert code != 0
    assert time.time() - t0 < 60
    assert victim.name in output(run_dir)[1]


def test_sigterm_and_crash_leave_no_process_behind(demo_data, tmp_path):
    """A crash (a non-finite step with on_nonfinite=stop) ends the run with its workers."""
    run_dir = tmp_path / "nan"
    proc = start(run_dir, demo_data, "optim.lr=1e20", "optim.warmup_steps=1", "train.checkpoint_every=1")
    deadline = time.time() + 60
    children: list[int] = []
    while proc.poll() is None and time.time() < deadline:
        children = sorted(set(children) | set(descendants(proc.pid)))
        time.sleep(0.05)
    assert proc.wait(timeout=60) != 0
    err = output(run_dir)[1]
    assert "non-finite loss" in err and "step 2" in err
    assert children
    assert_no_survivors(children)
    # The last checkpoint is the good step 1: nothing non-finite was written over it.
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").glob("step_*"))
    assert ckpts == ["step_000001"]
    state = load_state(run_dir / "checkpoints" / "step_000001" / "engine.pt")
    assert all(torch.isfinite(t).all() for t in state["model"].values())


# ---------------------------------------------------------------------------------------------------
# Non-finite steps on real gloo ranks
# ---------------------------------------------------------------------------------------------------


def nan_on_rank1_step2(rank: int, world_size: int, policy_skip: bool) -> dict:
    """Three steps; rank 1's forward of step 2 returns NaN logits. Returns what each rank ended with."""
    from tests.helpers import MODEL, PAD, SEQ_LEN, make_steps
    from trainer.data.config import PackingConfig
    from trainer.data.packing import OnlinePacker
    from trainer.data.pipeline import micro_batches
    from trainer.distributed.config import DistributedConfig
    from trainer.distributed.engine import parallelize
    from trainer.distributed.groups import init_distributed
    from trainer.model import AttentionConfig, build_model
    from trainer.run.step import train_step

    torch.manual_seed(0)
    info = init_distributed(DistributedConfig(device="cpu"))
    model = build_model(MODEL, AttentionConfig(backend="sdpa_docs"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    engine = parallelize(model, opt, sched, info, DistributedConfig(device="cpu"), grad_clip=1.0,
                         dtype="fp32")
    poison = {"on": False}
    model.lm_head.register_forward_hook(lambda _m, _i, out: out * float("nan") if poison["on"] else out)
    history = []
    for i, docs in enumerate(make_steps(num_steps=3, docs_per_step=8, seed=1)):
        poison["on"] = i == 1 and rank == 1
        rows = list(OnlinePacker(SEQ_LEN, 8).pack(docs[rank::world_size]))
        stats = train_step(engine, micro_batches(rows, PackingConfig(), SEQ_LEN, 2 * SEQ_LEN, PAD), info, PAD)
        history.append({"finite": stats.finite, "lr": engine.lr(),
                        "adam_steps": int(opt.state[next(iter(model.parameters()))]["step"]),
                        "params": torch.cat([p.detach().flatten() for p in model.parameters()])})
    return history


def test_a_nonfinite_step_is_dropped_on_every_rank(demo_data):
    ranks = run_distributed(nan_on_rank1_step2, 2, args=(True,))
    for history in ranks:
        assert [h["finite"] for h in history] == [True, False, True]  # rank 0 saw finite numbers, yet agrees
        assert [h["adam_steps"] for h in history] == [1, 1, 2]  # optimizer untouched by step 2
        assert history[1]["lr"] == history[0]["lr"]  # schedule untouched
        assert torch.equal(history[1]["params"], history[0]["params"])  # no update
        assert torch.isfinite(history[2]["params"]).all()
    assert torch.equal(ranks[0][2]["params"], ranks[1][2]["params"])


def test_skip_policy_counts_skipped_steps(demo_data, tmp_path):
    run_dir = tmp_path / "skip"
    run_train(run_dir, demo_data, "train.max_steps=4", "optim.lr=1e20", "optim.warmup_steps=1",
              "train.on_nonfinite=skip", "train.eval_every=0")
    lines = metrics(run_dir)
    assert [m["nonfinite"] for m in lines] == [False, True, True, True]
    assert [m["skipped_steps"] for m in lines] == [0, 1, 2, 3]
    assert json.loads((run_dir / "summary.json").read_text())["skipped_steps"] == 3
    state = load_state(run_dir / "checkpoints" / "step_000004" / "engine.pt")
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert state["scheduler"]["last_epoch"] == 1  # only step 1 advanced the schedule


def test_sigterm_while_a_resume_restores_the_readers_ends_the_start_within_seconds(demo_data, tmp_path):
    """A resume replays each reader's shards to its position before training; over a slow source that takes
    long (here: the shards' command stalls once FLAG exists). SIGTERM then ends the start within seconds, with
    one line and exit 0, writing nothing (before: the default action killed it without a word, or a launcher's
    handler left it replaying to the end). The next start resumes from the same checkpoint."""
    flag, slow = tmp_path / "FLAG", tmp_path / "slow_cat.sh"
    slow.write_text(f'#!/bin/sh\n[ -e {flag} ] && sleep 600\nexec cat "$1"\n')
    urls = f"data.urls='pipe:sh {slow} {demo_data}/train-{{000000..000004}}.tar'"
    run_dir = tmp_path / "run"
    run_train(run_dir, demo_data, *CLUSTER, urls, "train.max_steps=8")
    before = sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*"))
    flag.touch()
    proc = start(run_dir, demo_data, urls, "train.resume=true")
    time.sleep(8)  # loading, then stalled in the replay
    assert proc.poll() is None, output(run_dir)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    took = time.monotonic() - t0
    out, err = output(run_dir)
    assert code == 0 and took < 15, (code, took, err[-3000:])
    assert "preempted (SIGTERM) while restoring the data readers' positions of " in out, out
    assert "nothing was trained or written" in out
    assert "Traceback" not in err, err[-3000:]
    assert sorted(p.relative_to(run_dir).as_posix() for p in run_dir.rglob("*")) == before
    flag.unlink()
    run_train(run_dir, demo_data, *CLUSTER, urls, "train.resume=true", "train.max_steps=10")
    assert [m["step"] for m in metrics(run_dir)] == list(range(1, 11))
