"""python -m trainer.certify (trainer.run.certify, issue 56): the user's own config certified cell by cell
against the unpacked one-process fp32 reference. It passes on the tiny model and the demo data, under torchrun
with every parallel cell; and it FAILS, naming the cells, on the three ways a packed run can silently change
the objective: documents not isolated, positions continuing across documents with learned embeddings, a
denominator that depends on the micro-batches. Kernels this CPU lacks are listed as skipped, never as
passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.helpers import ROOT, torchrun
from trainer.certify import main as certify_main
from trainer.run.certify import Cell, Measured, Tolerance, judge

TINY = ["train.seq_len=128", "train.micro_batch_tokens=256", "--steps", "2", "--rows", "4"]


def certificate(out) -> dict:
    return json.loads((out / "certificate.json").read_text())


def test_under_torchrun_every_cell_passes_and_the_missing_kernels_are_skipped(demo_data, tmp_path):
    out = tmp_path / "cert"
    cmd = [*torchrun(2), "trainer.certify", f"data.path={demo_data}", *TINY, "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    cert = certificate(out)
    status = {c["name"]: c["status"] for c in cert["cells"]}
    assert cert["passed"] and cert["ranks"] == 2 and cert["torch"] == torch.__version__
    ran = [c for c in cert["cells"] if c["status"] == "pass"]
    assert {c["parallel"] for c in ran} >= {"one process", "ddp", "ddp, rows dealt by work", "fsdp2", "tp 2",
                                           "cp 2 (balanced)", "cp 2 (zigzag)", "cp 2 (documents)"}, status
    assert {c["layout"] for c in ran} == {"packed", "unpacked", "bucketed"}
    assert {c["accumulation"] for c in ran if c["parallel"] == "one process"} >= {1, 2}
    for c in ran:  # measured, not assumed: the figures are there and small
        assert c["loss_rdiff"] <= 1e-5 and c["grad_rdiff"] <= 1e-5, c
    probes = [c["probe"] for c in ran if c["probe"]]
    assert probes and all(p["moved"] == 0 and p["checked"] > 0 for p in probes)
    skipped = {c["backend"]: c["skipped"] for c in cert["cells"] if c["status"] == "skipped"}
    assert "flash-attn needs a CUDA device" in skipped["flash"] and "torch_varlen" in skipped
    markdown = (out / "certificate.md").read_text()
    assert markdown.startswith("# packtrain certificate: PASSED") and "## Not checked here" in markdown
    assert "| packed, sdpa_docs, fp32, accumulation 1, fsdp2 | pass |" in markdown


BROKEN = {  # override: (cells that must fail, cells that must pass, a phrase of the failure)
    "attention.isolate_documents=false": ({"packed"}, {"unpacked", "bucketed"}, "moved"),
    "packing.reset_positions=false": ({"packed"}, {"unpacked", "bucketed"}, "the loss differs"),
    "loss.normalization=micro_batch_mean": ({"accumulated"}, {"whole step"}, "differs"),
}


@pytest.mark.parametrize("override", list(BROKEN))
def test_a_broken_configuration_fails_naming_its_cells(demo_data, tmp_path, override, capsys):
    """Exit status 1 and each failing cell named with what differs; the cells the breakage cannot touch
    pass."""
    out = tmp_path / "cert"
    code = certify_main([f"data.path={demo_data}", *TINY, "--out", str(out), override])
    assert code == 1
    cert = certificate(out)
    failing, passing, phrase = BROKEN[override]
    groups = {"packed": lambda c: c["layout"] == "packed", "unpacked": lambda c: c["layout"] == "unpacked",
              "bucketed": lambda c: c["layout"] == "bucketed", "accumulated": lambda c: c["accumulation"] > 1,
              "whole step": lambda c: c["accumulation"] == 1}
    ran = [c for c in cert["cells"] if c["status"] != "skipped"]
    for group in failing:
        cells = [c for c in ran if groups[group](c)]
        assert cells and all(c["status"] == "FAIL" and phrase in " ".join(c["problems"])
                             for c in cells), cells
    for group in passing:
        assert all(c["status"] == "pass" for c in ran if groups[group](c)), [c["name"] for c in ran]
    printed = capsys.readouterr().out
    assert "certificate FAILED: " in printed and (out / "certificate.md").read_text().count("**") >= 2


def test_bf16_cells_are_held_to_the_measured_noise_and_a_leak_fails_whatever_the_losses():
    """The bf16 tolerance is 3x the unpacked bf16 run's own distance from fp32, the loss and the gradients
    each by their own (a gradient noise of 1e-3 must not excuse a loss off by 2e-3)."""
    reference = Measured([1.0, 1.0], [1.0, 1.0], {"w": torch.tensor([1.0, -2.0])})
    near = Measured([1.0 + 2e-3, 1.0], [1.0, 1.0], {"w": torch.tensor([1.0, -2.002])})
    cell = Cell("packed", "flash", "bf16", 1024, 1)
    assert Tolerance.from_noise(1e-3, 1e-3) == Tolerance(3e-3, 3e-3)
    assert Tolerance.from_noise(1e-9, 1e-3) == Tolerance(1e-5, 3e-3)  # never below fp32's
    assert judge(cell, near, reference, Tolerance.from_noise(1e-3, 1e-3)).status == "pass"
    loss_only = judge(cell, near, reference, Tolerance.from_noise(1e-6, 1e-3))
    assert (loss_only.status == "FAIL" and len(loss_only.problems) == 1
            and "the loss differs" in loss_only.problems[0])
    failed = judge(cell, near, reference)
    assert failed.status == "FAIL" and "step 1 at lr 0" in failed.problems[0] and "w differs by 0.001" in \
        failed.problems[1]
    leaky = Measured(reference.losses, reference.grad_norms, reference.grads,
                     probe={"moved": 3, "checked": 40, "noise": 0.0, "document": 1})
    verdict = judge(cell, leaky, reference)
    assert verdict.status == "FAIL" and verdict.problems == [
        "document 2 of a packed row moved 3 logit positions of the row's other documents (of 40 checked; "
        "kernel noise 0)"]


def test_bad_arguments_are_one_line(demo_data, tmp_path, capsys):
    assert certify_main([f"data.path={demo_data}", "--steps", "0", "--out", str(tmp_path / "c")]) == 2
    assert "--steps and --rows must be >= 1" in capsys.readouterr().err
    assert certify_main([f"data.path={demo_data}", "model.n_layr=2", "--out", str(tmp_path / "c")]) == 2
    assert "unknown config key 'model.n_layr'" in capsys.readouterr().err
    assert sys.modules["trainer.certify"]
