"""The verdict of scripts/gpu_check.sh: which varlen kernels really ran, from the GPU tests' JUnit XML.

    python scripts/gpu_report.py OUT/gpu_tests.xml [--markdown OUT/gpu_tests.md] [--json OUT/gpu_tests.json]

Prints one row per kernel (available or why not, tests run, passed, failed, skipped, forward, backward) and
exits 0 only if at least one real varlen kernel (flash = flash-attn, torch_varlen = PyTorch's varlen_attn)
ran its forward AND its backward tests and they passed, and no test failed anywhere. A kernel whose tests all
skipped is listed with the reason, never counted as a pass: the GPU window must not pass vacuously.

Tests are attributed to a kernel by their parameter id (`test_x[torch_varlen-torch.bfloat16]` ->
torch_varlen); a kernel's forward and backward tests are the ones named in FORWARD_TESTS / BACKWARD_TESTS
(tests/test_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

VARLEN_KERNELS = ("flash", "torch_varlen")
"""The kernels the check is about: at least one of them must pass forward and backward."""
OTHER_KERNELS = ("flex", "sdpa_docs", "dense")
FORWARD_TESTS = ("test_kernel_forward_matches_fp32_reference",)
BACKWARD_TESTS = ("test_kernel_backward_matches_fp32_reference",)
OUTCOMES = ("passed", "failed", "error", "skipped")


@dataclass
class TestResult:
    name: str
    """pytest's test name with its parameter id, e.g.
    "test_kernel_forward_matches_fp32_reference[flash-torch.bfloat16]"."""
    outcome: str
    """passed | failed | error | skipped"""
    message: str = ""
    """The skip reason or the failure message (first line)."""

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {self.outcome!r}")


@dataclass
class KernelRow:
    kernel: str
    available: str
    """"yes" if any of its tests ran, else why not (the first skip reason) or "no test of it ran"."""
    run: int
    passed: int
    failed: int
    skipped: int
    forward: str
    """passed | FAILED | not run"""
    backward: str
    verdict: str
    """PASS (forward and backward passed, nothing failed) | FAIL | SKIPPED (nothing ran) | INCOMPLETE"""


def kernel_of(name: str) -> str | None:
    """The kernel a test is about, from its parameter id. Example: "test_x[flash-torch.float16]" ->
    "flash"."""
    if "[" not in name:
        return None
    params = name[name.index("[") + 1 : name.rindex("]")].split("-")
    return next((p for p in params if p in VARLEN_KERNELS + OTHER_KERNELS), None)


def _base(name: str) -> str:
    return name.split("[", 1)[0]


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def read_junit(path: str | Path) -> list[TestResult]:
    """The test cases of a pytest --junitxml file (a test whose setup and call both report counts once, worst
    first)."""
    results: dict[str, TestResult] = {}
    rank = {"error": 3, "failed": 2, "passed": 1, "skipped": 0}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name")
        if name is None:  # the test pytest was in when interrupted: it did not finish
            continue
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = _first_line(child.get("message") or child.text or "")
                break
        key = f"{case.get('classname', '')}::{name}"
        previous = results.get(key)
        if previous is None or rank[outcome] > rank[previous.outcome]:
            results[key] = TestResult(name, outcome, message)
    return list(results.values())


def _stage(tests: list[TestResult], names: tuple[str, ...]) -> str:
    ran = [t for t in tests if _base(t.name) in names and t.outcome != "skipped"]
    if not ran:
        return "not run"
    return "passed" if all(t.outcome == "passed" for t in ran) else "FAILED"


def kernel_rows(results: list[TestResult]) -> list[KernelRow]:
    """One row per varlen kernel (always) and per other kernel that has tests."""
    rows = []
    for kernel in VARLEN_KERNELS + OTHER_KERNELS:
        tests = [t for t in results if kernel_of(t.name) == kernel]
        if not tests and kernel not in VARLEN_KERNELS:
            continue
        count = {o: sum(t.outcome == o for t in tests) for o in OUTCOMES}
        run = count["passed"] + count["failed"] + count["error"]
        skip_reasons = [t.message for t in tests if t.outcome == "skipped" and t.message]
        available = "yes" if run else (skip_reasons[0] if skip_reasons else "no test of it ran")
        forward, backward = _stage(tests, FORWARD_TESTS), _stage(tests, BACKWARD_TESTS)
        if count["failed"] or count["error"]:
            verdict = "FAIL"
        elif not run:
            verdict = "SKIPPED"
        elif forward == backward == "passed":
            verdict = "PASS"
        else:
            verdict = "INCOMPLETE"
        rows.append(KernelRow(kernel, available, run, count["passed"], count["failed"] + count["error"],
                              count["skipped"], forward, backward, verdict))
    return rows


def verdict(results: list[TestResult]) -> tuple[bool, list[KernelRow], list[str]]:
    """(ok, the kernel rows, the reasons it is not ok). ok: a varlen kernel passed forward and backward,
    nothing failed.

    Examples: every test skipped -> not ok; torch_varlen's forward and backward passed, flash skipped -> ok;
    flash skipped and a torch_varlen test failed -> not ok.
    """
    rows = kernel_rows(results)
    problems = []
    if not results:
        problems.append("no test ran at all (the JUnit report is empty)")
    failed = [t for t in results if t.outcome in ("failed", "error")]
    if failed:
        problems.append(f"{len(failed)} test(s) failed: " + ", ".join(t.name for t in failed[:8])
                        + (" ..." if len(failed) > 8 else ""))
    passing = [r.kernel for r in rows if r.kernel in VARLEN_KERNELS and r.verdict == "PASS"]
    if not passing:
        states = "; ".join(f"{r.kernel}: {r.verdict.lower()} ({_state(r)})" for r in rows
                           if r.kernel in VARLEN_KERNELS)
        problems.append(f"no varlen kernel ran its forward and backward tests and passed them: {states}")
    return not problems, rows, problems


def _state(row: KernelRow) -> str:
    return f"forward {row.forward}, backward {row.backward}" if row.available == "yes" else row.available


def markdown_table(rows: list[KernelRow]) -> str:
    lines = ["| kernel | available | tests run | passed | failed | skipped | forward | backward | verdict |",
             "|---|---|---:|---:|---:|---:|---|---|---|"]
    for r in rows:
        available = r.available.replace("|", "/")
        lines.append(f"| {r.kernel} | {available} | {r.run} | {r.passed} | {r.failed} | {r.skipped} "
                     f"| {r.forward} | {r.backward} | {r.verdict} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", help="pytest --junitxml output of tests/test_gpu.py")
    parser.add_argument("--markdown", default=None, help="also write the table and verdict here")
    parser.add_argument("--json", default=None, help="also write rows, problems and every test result here")
    args = parser.parse_args(argv)
    if not Path(args.junit).is_file():
        print(f"gpu_report: no JUnit report at {args.junit} (did pytest run?)", file=sys.stderr)
        return 1
    results = read_junit(args.junit)
    ok, rows, problems = verdict(results)
    text = markdown_table(rows) + "\n\n" + ("GPU CHECK: PASS" if ok else "GPU CHECK: FAIL")
    text += "".join(f"\n- {p}" for p in problems)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(ok=ok, problems=problems,
                                                   kernels=[asdict(r) for r in rows],
                                                   tests=[asdict(t) for t in results]), indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
