"""The GPU window's scripts, checked on CPU: it gets one short try on a GPU machine, so what it runs is tested
here.

- scripts/gpu_check.sh stops at once without CUDA, saying so on stderr.
- scripts/gpu_report.py: the verdict from fabricated results and from a real pytest JUnit report (a skipped
  kernel never counts as a pass).
- scripts/fetch_wheels.sh prints the pip commands it would run (binary wheels for the target, torch left out).
- The whole window rehearsed on CPU: wheels fetched for this Python, then gpu_check.sh installs them offline
  into an environment that has only what the GPU machine has, keeps its torch, runs the tests into the table
  and the benchmark.
- bench/gpu_train.py runs end to end with tiny settings and writes every key.
- The model-level checks of tests/test_gpu.py run on CPU (sdpa_docs under bf16 autocast): they pass on
  isolated documents and fail on a planted leak.
- attention=auto logs its choice and why; the peak-FLOPs table behind MFU.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import test_gpu
from trainer.model import attention as attention_module
from trainer.model.attention import resolve_backend
from trainer.run.metrics import peak_flops_for_name

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "scripts"
CPU = torch.device("cpu")


def load_script_module(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_report = load_script_module("gpu_report")
R = gpu_report.TestResult
FWD, BWD = gpu_report.FORWARD_TESTS[0], gpu_report.BACKWARD_TESTS[0]


def run(cmd: list[str], timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)


# ---------------------------------------------------------------------------------------------------
# gpu_check.sh without CUDA
# ---------------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="this machine has CUDA: the script would run the whole check")
def test_gpu_check_stops_at_once_without_cuda(tmp_path):
    start = time.monotonic()
    proc = run(["bash", str(SCRIPTS / "gpu_check.sh")], env={**os.environ, "PY": sys.executable,
                                                            "OUT": str(tmp_path / "out")})
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("gpu_check.sh needs CUDA: torch ") and "no CUDA device" in proc.stderr
    assert proc.stdout == ""
    assert not (tmp_path / "out").exists()  # nothing done, nothing written
    assert time.monotonic() - start < 30


# ---------------------------------------------------------------------------------------------------
# The verdict
# ---------------------------------------------------------------------------------------------------


def rows_by_kernel(rows) -> dict:
    return {r.kernel: r for r in rows}


def test_every_kernel_skipped_fails_and_says_why():
    results = [R(f"{FWD}[flash-torch.bfloat16]", "skipped", "the flash-attn package does not import"),
               R(f"{BWD}[flash-torch.bfloat16]", "skipped", "the flash-attn package does not import"),
               R(f"{FWD}[torch_varlen-torch.bfloat16]", "skipped",
                 "this torch has no torch.nn.attention.varlen"),
               R(f"{BWD}[torch_varlen-torch.bfloat16]", "skipped",
                 "this torch has no torch.nn.attention.varlen"),
               R("test_varlen_kernels_refuse_fp32_with_a_clear_error", "passed")]
    ok, rows, problems = gpu_report.verdict(results)
    assert not ok
    by = rows_by_kernel(rows)
    assert by["flash"].verdict == by["torch_varlen"].verdict == "SKIPPED"
    assert by["flash"].available == "the flash-attn package does not import"
    assert (by["torch_varlen"].run, by["torch_varlen"].skipped,
            by["torch_varlen"].forward) == (0, 2, "not run")
    assert "no varlen kernel ran its forward and backward tests" in problems[0]
    assert "flash: skipped (the flash-attn package does not import)" in problems[0]


def test_torch_varlen_forward_and_backward_passing_passes_with_flash_listed_as_skipped():
    results = [R(f"{FWD}[torch_varlen-torch.bfloat16]", "passed"),
               R(f"{BWD}[torch_varlen-torch.bfloat16]", "passed"),
               R("test_changing_one_document_leaves_every_other_logit_unchanged[torch_varlen]", "passed"),
               R(f"{FWD}[flash-torch.bfloat16]", "skipped", "flash-attn does not import"),
               R(f"{FWD}[flex-torch.bfloat16]", "passed")]
    ok, rows, problems = gpu_report.verdict(results)
    assert ok and problems == []
    by = rows_by_kernel(rows)
    assert (by["torch_varlen"].run, by["torch_varlen"].passed, by["torch_varlen"].verdict) == (3, 3, "PASS")
    assert by["flash"].verdict == "SKIPPED" and by["flash"].available == "flash-attn does not import"
    assert by["flex"].verdict == "INCOMPLETE"  # listed, but flex is not what the check needs
    table = gpu_report.markdown_table(rows)
    assert "| torch_varlen | yes | 3 | 3 | 0 | 0 | passed | passed | PASS |" in table
    assert "| flash | flash-attn does not import | 0 | 0 | 0 | 1 | not run | not run | SKIPPED |" in table


def test_flash_skipped_and_torch_varlen_failing_fails():
    results = [R(f"{FWD}[torch_varlen-torch.bfloat16]", "passed"),
               R(f"{BWD}[torch_varlen-torch.bfloat16]", "failed", "dk: relative error 0.5 > 0.02"),
               R(f"{FWD}[flash-torch.bfloat16]", "skipped", "flash-attn does not import"),
               R(f"{BWD}[flash-torch.bfloat16]", "skipped", "flash-attn does not import")]
    ok, rows, problems = gpu_report.verdict(results)
    assert not ok
    by = rows_by_kernel(rows)
    assert (by["torch_varlen"].verdict, by["torch_varlen"].backward) == ("FAIL", "FAILED")
    assert any("1 test(s) failed" in p for p in problems)


@pytest.mark.parametrize("results, why", [
    ([R(f"{FWD}[torch_varlen-torch.bfloat16]", "passed"),
      R(f"{BWD}[torch_varlen-torch.bfloat16]", "skipped", "?")], "backward never ran"),
    ([R(f"{FWD}[torch_varlen-torch.bfloat16]", "passed"), R(f"{BWD}[torch_varlen-torch.bfloat16]", "passed"),
      R("test_auto_picks_the_documented_kernel_and_says_why[torch.bfloat16]", "failed")],
     "another test failed"),
    ([R(f"{FWD}[flex-torch.bfloat16]", "passed"), R(f"{BWD}[flex-torch.bfloat16]", "passed")],
     "flex is no varlen kernel"),
    ([], "nothing ran"),
])
def test_the_check_fails_whenever_it_could_pass_vacuously(results, why):
    ok, _, problems = gpu_report.verdict(results)
    assert not ok and problems, why


def test_kernel_of_reads_the_parameter_ids():
    assert gpu_report.kernel_of(f"{FWD}[torch_varlen-torch.float16]") == "torch_varlen"
    assert (gpu_report.kernel_of("test_reference_check_catches_a_planted_leak[flash-one_mask_per_row]")
            == "flash")
    assert gpu_report.kernel_of("test_auto_picks_the_documented_kernel_and_says_why[torch.bfloat16]") is None
    assert gpu_report.kernel_of("test_varlen_kernels_refuse_fp32_with_a_clear_error") is None


FAKE_GPU_TESTS = '''
import pytest

@pytest.mark.parametrize("dtype", ["torch.bfloat16"])
@pytest.mark.parametrize("backend", ["torch_varlen", "flash"])
def test_kernel_forward_matches_fp32_reference(backend, dtype):
    if backend == "flash":
        pytest.skip("the flash-attn package does not import (ImportError: No module named 'flash_attn')")

@pytest.mark.parametrize("dtype", ["torch.bfloat16"])
@pytest.mark.parametrize("backend", ["torch_varlen", "flash"])
def test_kernel_backward_matches_fp32_reference(backend, dtype):
    if backend == "flash":
        pytest.skip("the flash-attn package does not import (ImportError: No module named 'flash_attn')")
    assert BACKWARD_OK, "dq: relative error 0.3 > 0.02"
'''


@pytest.mark.parametrize("backward_ok", [True, False])
def test_the_report_reads_a_real_junit_file(tmp_path, backward_ok):
    (tmp_path / "test_fake_gpu.py").write_text(FAKE_GPU_TESTS.replace("BACKWARD_OK", str(backward_ok)))
    xml = tmp_path / "gpu_tests.xml"
    pytest_run = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}",
                      str(tmp_path / "test_fake_gpu.py")], cwd=tmp_path)
    assert pytest_run.returncode == (0 if backward_ok else 1), pytest_run.stdout
    proc = run([sys.executable, str(SCRIPTS / "gpu_report.py"), str(xml), "--markdown",
                str(tmp_path / "t.md"), "--json", str(tmp_path / "t.json")])
    assert proc.returncode == (0 if backward_ok else 1), proc.stdout
    table = (tmp_path / "t.md").read_text()
    assert ("| flash | the flash-attn package does not import (ImportError: No module named 'flash_attn') "
            "| 0 | 0 | 0 | 2 " in table)
    if backward_ok:
        assert "| torch_varlen | yes | 2 | 2 | 0 | 0 | passed | passed | PASS |" in table
        assert "GPU CHECK: PASS" in proc.stdout
    else:
        assert "| torch_varlen | yes | 2 | 1 | 1 | 0 | passed | FAILED | FAIL |" in table
        assert "GPU CHECK: FAIL" in proc.stdout
    report = json.loads((tmp_path / "t.json").read_text())
    assert report["ok"] is backward_ok and len(report["tests"]) == 4


def test_the_report_fails_without_a_junit_file(tmp_path):
    proc = run([sys.executable, str(SCRIPTS / "gpu_report.py"), str(tmp_path / "missing.xml")])
    assert proc.returncode == 1 and "no JUnit report" in proc.stderr


# ---------------------------------------------------------------------------------------------------
# Wheels: the download's command line, and the offline install for real
# ---------------------------------------------------------------------------------------------------


def fetch_wheels(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return run(["bash", str(SCRIPTS / "fetch_wheels.sh"), str(tmp_path / "wheels")],
               env={**os.environ, "PY": sys.executable, **env})


def printed_commands(stdout: str) -> list[list[str]]:
    return [shlex.split(line[2:]) for line in stdout.splitlines()
            if line.startswith("+ ") and "prune" not in line]


def test_fetch_wheels_dry_run_asks_for_binary_wheels_for_the_target_and_never_torch(tmp_path):
    proc = fetch_wheels(tmp_path, DRY_RUN="1")
    assert proc.returncode == 0, proc.stderr
    build, download = printed_commands(proc.stdout)
    assert (build[1:4] == ["-m", "pip", "wheel"] and "--no-deps" in build
            and build[-1] == "antlr4-python3-runtime==4.9.3")
    assert download[1:4] == ["-m", "pip", "download"]
    assert "--only-binary=:all:" in download and "--no-deps" not in download  # pip resolves the dependencies
    assert download[download.index("--python-version") + 1] == "3.12"
    assert download[download.index("--implementation") + 1] == "cp"
    platforms = [download[i + 1] for i, arg in enumerate(download) if arg == "--platform"]
    assert platforms == ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                         "manylinux2014_x86_64", "manylinux1_x86_64"]
    requirements = download[download.index("--dest") + 2:]
    # what the GPU machine lacks
    assert requirements == ["webdataset>=0.2.86", "hydra-core>=1.3", "zstandard>=0.22"]
    assert not any(re.match(r"(torch|nvidia|triton|wandb)\b", arg) for arg in download)
    assert not (tmp_path / "wheels").exists()  # a dry run creates nothing


def test_fetch_wheels_takes_the_target_from_the_environment(tmp_path):
    proc = fetch_wheels(tmp_path, DRY_RUN="1", PYTHON_VERSION="3.10", PLATFORMS="manylinux_2_17_aarch64",
                        TARGET_HAS="", EXCLUDE="torch")
    assert proc.returncode == 0, proc.stderr
    download = printed_commands(proc.stdout)[1]
    assert download[download.index("--python-version") + 1] == "3.10"
    assert ([download[i + 1] for i, a in enumerate(download) if a == "--platform"]
            == ["manylinux_2_17_aarch64"])
    requirements = download[download.index("--dest") + 2:]
    assert "wandb>=0.17" in requirements and "numpy>=1.24" in requirements and "pytest>=8" in requirements
    assert not any(r.startswith("torch") for r in requirements)
    assert fetch_wheels(tmp_path, DRY_RUN="1", PYTHON_VERSION="312").returncode != 0


def device_like_environment(root: Path) -> Path:
    """A Python that has only what the GPU machine has (scripts/device_packages.txt), taken from this
    environment: a venv without packages whose site-packages points at symlinks to those distributions.
    torch is this machine's CPU build, standing in for the GPU machine's."""
    names = {re.sub(r"[-_.]+", "-", line.strip()).lower()
             for line in (SCRIPTS / "device_packages.txt").read_text().splitlines()
             if line.strip() and not line.startswith("#")}
    device_site = root / "device_site"
    device_site.mkdir(parents=True)
    for dist in importlib.metadata.distributions():
        if re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower() not in names or not dist.files:
            continue
        for top in {f.parts[0] for f in dist.files if f.parts[0] != ".."}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (device_site / top).exists():
                (device_site / top).symlink_to(source)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True)
    site_packages = next((root / "venv" / "lib").glob("python3*/site-packages"))
    (site_packages / "device.pth").write_text(f"{device_site}\n")
    return root / "venv" / "bin" / "python"


PROBE = """
import importlib, json, sys
found = {}
for name in sys.argv[1:]:
    try:
        found[name] = importlib.import_module(name).__file__
    except ImportError:
        found[name] = None
import torch
found["torch_version"] = torch.__version__
print(json.dumps(found))
"""


def probe(python: Path, *modules: str, env: dict | None = None) -> dict:
    """Where `modules` and torch import from in `python` (None: not importable), run outside the working
    tree."""
    proc = run([str(python), "-c", PROBE, *modules], cwd="/", env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="the default wheel platforms are manylinux x86_64")
def test_the_gpu_window_rehearsed_on_cpu_from_fetched_wheels(tmp_path):
    """fetch_wheels.sh for this Python (the registry is reachable here); then gpu_check.sh with WHEELS, in its
    CPU rehearsal, under a Python that has only the GPU machine's packages: the offline install keeps torch,
    trainer and its dependencies import from the installed site, the GPU tests run (skipping: no CUDA) into
    the table, the benchmark writes its files, the certificate passes its CPU cells but certifies no varlen
    kernel, and the verdict is FAIL because no varlen kernel ran."""
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    fetched = fetch_wheels(tmp_path, PYTHON_VERSION=version)
    assert fetched.returncode == 0, fetched.stderr
    wheels = sorted(p.name for p in (tmp_path / "wheels").iterdir())
    assert (any(w.startswith("webdataset-") for w in wheels)
            and any(w.startswith("hydra_core-") for w in wheels))
    assert not any(re.match(r"(torch|nvidia|triton|numpy|pyyaml|packaging)[-_]", w.lower())
                   for w in wheels), wheels
    assert re.search(r"# total: \d+ bytes", fetched.stdout)

    python = device_like_environment(tmp_path / "env")
    modules = ("torch", "webdataset", "hydra", "omegaconf", "trainer", "pytest", "hypothesis")
    before = probe(python, *modules)
    assert before["torch"] and before["pytest"] and before["hypothesis"]
    assert before["webdataset"] is None and before["hydra"] is None and before["trainer"] is None

    site, out = tmp_path / "site", tmp_path / "out"
    proc = run(["bash", str(SCRIPTS / "gpu_check.sh")], timeout=300, env={
        **os.environ, "PY": str(python), "WHEELS": str(tmp_path / "wheels"), "SITE": str(site),
        "OUT": str(out), "DATA": str(tmp_path / "data"), "GPU_CHECK_REHEARSAL": "1"})
    log = (out / "gpu_check.log").read_text()
    assert proc.returncode == 1, log  # the rehearsal's verdict: no varlen kernel ran
    assert f"torch untouched: {before['torch_version']} {before['torch']}" in log
    after = probe(python, *modules, env={"PYTHONPATH": str(site)})
    assert (after["torch"], after["torch_version"]) == (before["torch"], before["torch_version"])
    for name in ("webdataset", "hydra", "omegaconf", "trainer"):
        assert after[name].startswith(str(site)), (name, after[name])
    assert not any(p.name.lower().startswith(("torch", "nvidia", "triton")) for p in site.iterdir())

    table = (out / "gpu_tests.md").read_text()
    for kernel in ("flash", "torch_varlen"):
        # 10 tests each
        assert f"| {kernel} | needs a CUDA device | 0 | 0 | 0 | 10 | not run | not run | SKIPPED |" in table
    assert "GPU CHECK: FAIL" in table
    assert json.loads((out / "gpu_train.json").read_text())["measured_steps"] == 2
    # the CPU cells passed, but none varlen
    certificate = json.loads((out / "certificate" / "certificate.json").read_text())
    assert certificate["passed"] and "certificate: no varlen kernel (flash, torch_varlen) ran" in log
    assert "certificate FAILED (exit 1)" in log
    assert sorted(p.name for p in out.iterdir()) == [
        "certificate", "gpu_check.log", "gpu_tests.json", "gpu_tests.md", "gpu_tests.xml", "gpu_train.json",
        "gpu_train.md"]


def test_install_wheels_refuses_a_torch_wheel(tmp_path):
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch-2.11.0-cp312-cp312-manylinux_2_28_x86_64.whl").write_bytes(b"")
    proc = run(["bash", str(SCRIPTS / "install_wheels.sh"), str(tmp_path / "wheels"), str(tmp_path / "site")],
               env={**os.environ, "PY": sys.executable})
    assert proc.returncode != 0 and "refusing torch-2.11.0" in proc.stderr
    assert not (tmp_path / "site").exists()


# ---------------------------------------------------------------------------------------------------
# The benchmark, end to end on CPU
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gpu_train_benchmark_runs_on_cpu_and_writes_every_key(demo_data, tmp_path):
    out = tmp_path / "out"
    proc = run([sys.executable, str(REPO / "bench" / "gpu_train.py"), "--data", str(demo_data),
                "--out", str(out), "--device", "cpu", "--model", "tiny", "--seq-len", "128",
                "--tokens-per-step", "1024", "--micro-batch-tokens", "512", "--steps", "2", "--warmup", "1",
                "--threads", "1"], timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "attention=auto picked sdpa_docs on cpu bfloat16" in proc.stderr  # the choice and why, logged once
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import gpu_train
    finally:
        sys.path.remove(str(REPO / "bench"))
    result = json.loads((out / "gpu_train.json").read_text())
    assert set(gpu_train.RESULT_KEYS) <= set(result)
    assert result["measured_steps"] == 2 and result["attention"] == "sdpa_docs" and result["dtype"] == "bf16"
    packed, unpacked = result["layouts"]["packed"], result["layouts"]["unpacked"]
    for layout in (packed, unpacked):
        assert set(gpu_train.LAYOUT_KEYS) <= set(layout)
        # CPU: no peak FLOP/s, no CUDA allocator
        assert layout["mfu"] is None and layout["peak_mem_gib"] is None
        assert 0 < layout["token_utilization"] <= 1
    # same documents
    assert packed["valid_tokens"] == unpacked["valid_tokens"] and packed["docs"] == unpacked["docs"]
    assert packed["token_utilization"] >= unpacked["token_utilization"]
    assert abs(packed["loss_first"] - unpacked["loss_first"]) < 1e-2  # same init, same documents
    text = (out / "gpu_train.md").read_text()
    assert "| packed |" in text and "| unpacked |" in text and "packed / unpacked valid tokens/s" in text


# ---------------------------------------------------------------------------------------------------
# The model-level GPU checks, on CPU: they pass on isolated documents and catch planted leaks
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_gpu_isolation_check_separates_noise_from_a_leak_on_cpu():
    model = test_gpu.small_model(CPU, "sdpa_docs").eval()
    noise, change = test_gpu.isolation_diffs(model, CPU, torch.bfloat16)
    assert change <= noise
    leaky = test_gpu.small_model(CPU, "sdpa_docs", isolate_documents=False).eval()
    leaky.load_state_dict(model.state_dict())
    assert test_gpu.isolation_diffs(leaky, CPU, torch.bfloat16)[1] > noise


@pytest.mark.slow
def test_the_gpu_reference_check_passes_isolated_documents_and_catches_leaks_on_cpu():
    problems, got, yardstick = test_gpu.reference_check(CPU, "sdpa_docs")
    assert problems == [], (got, yardstick)
    for leak in ("one_mask_per_row", "boundary_off_by_one"):
        problems, got, _ = test_gpu.reference_check(CPU, "sdpa_docs", leak)
        assert any(p.startswith("logits") for p in problems), (leak, got)
        assert got.logits > 30 * yardstick.logits  # far outside the tolerance, not at its edge


def test_the_gpu_kernel_check_passes_an_isolating_kernel_on_cpu():
    for backward in (False, True):
        assert test_gpu.compare_kernel("dense", torch.bfloat16, backward, CPU) == []


# ---------------------------------------------------------------------------------------------------
# attention=auto says what it picked and why; the peak FLOP/s behind MFU
# ---------------------------------------------------------------------------------------------------


def test_auto_on_cpu_picks_sdpa_docs_and_logs_why_once(caplog, monkeypatch):
    monkeypatch.setattr(attention_module, "_AUTO_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="trainer.model.attention"):
        assert resolve_backend("auto", CPU, torch.float32) == "sdpa_docs"
        assert resolve_backend("auto", CPU, torch.float32, requires_grad=False) == "sdpa_docs"
    lines = [r.getMessage() for r in caplog.records if r.name == "trainer.model.attention"]
    assert len(lines) == 1, lines
    assert lines[0].startswith("attention=auto picked sdpa_docs on cpu float32 "
                               "(order flash > torch_varlen > flex")
    assert "flash: flash-attn needs a CUDA device" in lines[0]
    assert "torch_varlen: torch.nn.attention.varlen.varlen_attn runs on CUDA only" in lines[0]
    assert "flex: not picked off CUDA" in lines[0]


def test_an_explicit_backend_logs_nothing(caplog, monkeypatch):
    monkeypatch.setattr(attention_module, "_AUTO_LOGGED", set())
    with caplog.at_level(logging.INFO, logger="trainer.model.attention"):
        assert resolve_backend("dense", CPU, torch.float32) == "dense"
    assert not [r for r in caplog.records if r.name == "trainer.model.attention"]


@pytest.mark.parametrize("name, tflops", [
    ("NVIDIA H200", 989), ("NVIDIA H200 NVL", 835), ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756),
    ("NVIDIA H100 NVL", 835), ("NVIDIA A100-SXM4-80GB", 312), ("NVIDIA A100 80GB PCIe", 312),
    ("NVIDIA L40S", 362), ("NVIDIA L4", 121), ("NVIDIA A10", 125), ("NVIDIA A10G", None), ("Tesla T4", None),
])
def test_peak_flops_table_matches_whole_names(name, tflops):
    got = peak_flops_for_name(name)
    assert (got / 1e12 if got else None) == tflops
