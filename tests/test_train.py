"""`python -m trainer.train` end to end, as users launch it: real Hydra, shards, checkpoints, W&B files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.harness import free_port
from tests.helpers import ROOT, SMALL, metrics, run_train, sources_override
from trainer.checkpoint.safe_io import load_state
from trainer.reporting.runs import load_runs
from trainer.train import JOB_DIR_MAX, job_dir, strip_launcher_args

METRIC_KEYS = {
    "step", "loss", "lr", "grad_norm", "valid_tokens", "allocated_tokens", "token_utilization", "docs",
    "docs_per_row", "valid_tokens_per_s", "allocated_tokens_per_s", "step_time_s", "peak_mem_gb", "warmup",
}


@pytest.fixture(scope="module")
def layout_runs(demo_data, tmp_path_factory) -> dict[str, Path]:
    """The same seed in each layout, 20 steps, fp32 on CPU."""
    runs = {}
    for layout in ("packed", "unpacked", "bucketed"):
        run_dir = tmp_path_factory.mktemp(f"run_{layout}")
        run_train(run_dir, demo_data, f"packing={layout}", "train.max_steps=20", "train.checkpoint_every=10")
        runs[layout] = run_dir
    return runs


def test_layouts_see_the_same_documents_and_the_same_loss_curve(layout_runs):
    packed = metrics(layout_runs["packed"])
    assert len(packed) == 20
    for layout in ("unpacked", "bucketed"):
        other = metrics(layout_runs[layout])
        assert [m["valid_tokens"] for m in other] == [m["valid_tokens"] for m in packed]
        assert [m["docs"] for m in other] == [m["docs"] for m in packed]
        diff = np.abs(np.array([m["loss"] for m in other]) - np.array([m["loss"] for m in packed]))
        assert diff.max() <= 1e-4, f"{layout}: max loss difference {diff.max():.3g}"
        # ...while the padding differs: packing allocates fewer positions for the same targets.
        assert sum(m["allocated_tokens"] for m in other) > sum(m["allocated_tokens"] for m in packed)
        for a, b in zip(other, packed, strict=True):  # held-out loss at steps 10 and 20, equal too
            assert ("val_loss" in a) == ("val_loss" in b) == (a["step"] % 10 == 0)
            if "val_loss" in a:
                assert a["val_tokens"] == b["val_tokens"] and abs(a["val_loss"] - b["val_loss"]) <= 1e-4
    losses = [m["loss"] for m in packed]
    assert losses[-1] < losses[0] - 0.5  # and it learns


def test_metrics_lines_hold_every_documented_key(layout_runs):
    for line in metrics(layout_runs["packed"]):
        assert METRIC_KEYS <= set(line)
        assert 0 < line["token_utilization"] <= 1
        assert line["valid_tokens"] < line["allocated_tokens"]
    warm = [m["warmup"] for m in metrics(layout_runs["packed"])]
    assert warm[:2] == [True, True] and not any(warm[2:])
    summary = json.loads((layout_runs["packed"] / "summary.json").read_text())
    assert summary["final_step"] == 20 and summary["skipped_samples"] == {}
    last = metrics(layout_runs["packed"])[-1]
    assert summary["final_val_loss"] == last["val_loss"] and summary["val_tokens"] == last["val_tokens"] > 0
    assert abs(last["val_ppl"] - np.exp(last["val_loss"])) <= 1e-6 * last["val_ppl"]
    config = json.loads((layout_runs["packed"] / "config.json").read_text())
    assert config["packing"]["layout"] == "packed" and config["loss"]["normalization"] == "global_tokens"


def test_checkpoint_holds_weights_tokenizer_and_conventions(layout_runs, demo_data):
    ckpts = sorted((layout_runs["unpacked"] / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_000010", "step_000020"]
    last = ckpts[-1]
    conv = json.loads((last / "conventions.json").read_text())
    manifest = json.loads((demo_data / "manifest.json").read_text())
    assert conv["layout"] == "unpacked"
    assert conv["packing"]["row_length"] == 128
    assert conv["positions"]["reset_at_document_start"] is True
    assert conv["attention"]["isolate_documents"] is True
    assert conv["labels"]["ignore_index"] == -100
    assert conv["loss"]["normalization"] == "global_tokens" and conv["eval"]["split"] == "val"
    assert conv["tokenizer"]["sha256"] == manifest["tokenizer"]["sha256"]
    assert ((last / "tokenizer" / "tokenizer.json").read_bytes()
            == (demo_data / "tokenizer" / "tokenizer.json").read_bytes())
    engine = load_state(last / "engine.pt")
    assert "wte.weight" in "".join(engine["model"]) and engine["optimizer"]["state"]


def test_resume_continues_exactly(layout_runs, tmp_path, demo_data):
    """Interrupted after step 10 (its checkpoint), resumed: steps 11..20 repeat the uninterrupted run."""
    whole = layout_runs["packed"]
    resumed = tmp_path / "resumed"
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_000020")
    proc = run_train(resumed, demo_data, "packing=packed", "train.max_steps=20", "train.checkpoint_every=10",
                     "train.resume=true")
    assert "resumed from" in proc.stdout
    a, b = metrics(whole), metrics(resumed)
    # steps after the checkpoint were rewritten, not duplicated
    assert [m["step"] for m in b] == list(range(1, 21))
    for x, y in zip(a[10:], b[10:], strict=True):
        assert x["valid_tokens"] == y["valid_tokens"] and x["docs"] == y["docs"]
        # a few fp32 ulps (at a loss of ~6 one ulp is 4.8e-7): once, on 2 loaded cores, step 17 differed by
        # 1.0e-6; a resume that restored anything wrong (weights, optimizer, data position) differs by 1e-3
        # and more
        assert abs(x["loss"] - y["loss"]) <= 4e-6, (x["step"], x["loss"], y["loss"])
    assert b[-1]["val_tokens"] == a[-1]["val_tokens"] and abs(b[-1]["val_loss"] - a[-1]["val_loss"]) <= 4e-6


def test_torchrun_two_processes_and_deepspeed_style_local_rank(demo_data, tmp_path):
    run_dir = tmp_path / "ddp"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port",
                str(free_port()), "-m"]
    run_train(run_dir, demo_data, "train.max_steps=3", launcher=launcher)
    lines = metrics(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3]  # rank 0 alone writes
    assert lines[0]["valid_tokens"] > 0
    ckpt = run_dir / "checkpoints" / "step_000003"
    assert sorted(p.name for p in ckpt.glob("rank_*.pt")) == ["rank_00000.pt", "rank_00001.pt"]
    # A single process given the argument the deepspeed launcher appends.
    run_train(tmp_path / "single", demo_data, "train.max_steps=1", extra_args=("--local_rank=0",))


def test_wandb_offline_writes_a_real_run(demo_data, tmp_path):
    run_dir = tmp_path / "wb"
    run_train(run_dir, demo_data, "train.max_steps=2", "logging.wandb.mode=offline")
    runs = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert list(runs[0].glob("run-*.wandb"))  # the binary run log wandb sync would upload


def test_strip_launcher_args_keeps_hydra_overrides(monkeypatch):
    # recorded as it was (unset), so that it is restored: a LOCAL_RANK left behind tells lm-eval this process
    # is not rank 0 (tests/test_harness.py)
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.delenv("LOCAL_RANK")
    assert strip_launcher_args(["train", "model=tiny", "--local_rank=3"]) == ["train", "model=tiny"]
    assert os.environ["LOCAL_RANK"] == "3"
    monkeypatch.delenv("LOCAL_RANK")
    assert strip_launcher_args(["train", "--local_rank", "2", "seed=1"]) == ["train", "seed=1"]
    assert os.environ["LOCAL_RANK"] == "2"


def test_unknown_config_key_is_a_clear_error(demo_data, tmp_path):
    cmd = [sys.executable, "-m", "trainer.train", f"data.path={demo_data}", f"hydra.run.dir={tmp_path}",
           "+train.max_stepz=3", "logging.wandb.mode=disabled"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "unknown key(s) in config section 'train': ['max_stepz']" in proc.stderr


def test_eval_leaves_training_untouched_with_dropout(demo_data, tmp_path):
    """Evaluating every 2 steps draws no random number and reads no training document: with dropout on,
    the training losses equal those of a run without eval, step for step."""
    common = ("train.max_steps=6", "model.dropout=0.2", "train.checkpoint_every=0")
    run_train(tmp_path / "eval", demo_data, *common, "train.eval_every=2")
    run_train(tmp_path / "noeval", demo_data, *common, "train.eval_every=0")
    with_eval, without = metrics(tmp_path / "eval"), metrics(tmp_path / "noeval")
    assert [m["step"] for m in with_eval if "val_loss" in m] == [2, 4, 6]
    assert not any("val_loss" in m for m in without)
    assert [m["loss"] for m in with_eval] == [m["loss"] for m in without]


def test_multirun_sweep_preset(demo_data, tmp_path):
    """`-m experiment=packing_ablation`: one sweep dir, a run dir per layout named by it, one W&B group."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "trainer.train", "-m", "experiment=packing_ablation",
           f"data.path={demo_data}", f"hydra.sweep.dir={sweep}", *SMALL, "train.max_steps=3",
           "train.eval_every=0"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert runs == ["0_layout=packed", "1_layout=unpacked", "2_layout=bucketed"]
    docs = {tuple(m["docs"] for m in metrics(sweep / r)) for r in runs}
    assert len(docs) == 1  # the same documents per step in every run
    groups = {json.loads((sweep / r / "summary.json").read_text())["wandb_group"] for r in runs}
    assert groups == {"sweep"}  # the sweep directory's name


def test_a_sweep_over_paths_keeps_each_job_one_level_below_the_sweep_dir(demo_data, tmp_path):
    """Overrides holding paths (a data.sources entry's path) used to nest each job's run dir along the path
    (`0_data.sources=[{name:a,path:` / `tmp/...`), and the report then found no runs:
    trainer.train.job_dir."""
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, "-m", "trainer.train", "-m", sources_override(("a", demo_data, 1.0)),
           f"hydra.sweep.dir={sweep}", *SMALL, "train.max_steps=1", "train.eval_every=0",
           "train.checkpoint_every=0", "seed=0,1"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 2 and all((job / "metrics.jsonl").is_file() for job in jobs), [str(p) for p in jobs]
    assert all("_tmp_" in job.name or "path:_" in job.name for job in jobs)
    assert sorted(run.name for run in load_runs([sweep])) == sorted(job.name for job in jobs)


def test_job_dir_names_are_one_path_component():
    assert job_dir("seed=1,packing=unpacked") == "seed=1,packing=unpacked"
    assert job_dir("data.sources=[{name:a,path:/d/x}]") == "data.sources=[{name:a,path:_d_x}]"
    long = job_dir("data.urls=" + "/very/long/path" * 20)
    assert (len(long) == JOB_DIR_MAX and "/" not in long
            and long != job_dir("data.urls=" + "/very/long/path" * 21))
