"""trainer.report: run dirs in, a table, verdicts, plots, report.md and a self-contained report.html out.

Hand-built run dirs (config.json, metrics.jsonl, summary.json written here) check every number against a
value computed by hand; one test reads real tiny runs of `trainer.train`.
"""

from __future__ import annotations

import copy
import html
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import pytest

from trainer import report
from trainer.data.shards import FORMAT_VERSION
from trainer.reporting import plots as report_plots
from trainer.reporting import runs as report_runs
from trainer.reporting import tables as report_tables
from trainer.reporting import verdicts as report_verdicts
from trainer.reporting.html import make_report
from trainer.reporting.runs import (
    differing_keys,
    flatten,
    key_class,
    load_runs,
    throughput,
    time_to_reach,
    unpacked_match,
)
from trainer.reporting.tables import TABLE_COLUMNS
from trainer.reporting.verdicts import verdict

ROOT = Path(__file__).resolve().parents[2]
CONFIG = {
    "seed": 0,
    "train": {"seq_len": 128, "tokens_per_step": 1024, "micro_batch_tokens": 512, "max_steps": 6,
              "grad_clip": 1.0, "dtype": "fp32", "checkpoint_every": 50, "keep_last": 2, "resume": False,
              "warmup_marked_steps": 2, "eval_every": 3, "eval_docs": None, "eval_layout": "packed"},
    "data": {"path": "reportdata/demo", "split": "train", "num_workers": 1, "shuffle_buffer": 64,
             "on_error": "raise"},
    "packing": {"layout": "packed", "buffer_size": 64, "long_docs": "split", "reset_positions": True,
                "pad_to": "longest"},
    "model": {"vocab_size": 512, "n_layer": 2, "n_head": 2, "n_embd": 64, "max_seq_len": 128, "dropout": 0.0,
              "bias": True, "pos_emb": "learned", "rope_theta": 10000.0, "init_std": 0.02},
    "attention": {"backend": "sdpa_docs", "isolate_documents": True, "flex_compile": True},
    "loss": {"normalization": "global_tokens"},
    "optim": {"_target_": "torch.optim.AdamW", "lr": 0.003, "betas": [0.9, 0.95], "eps": 1e-8,
              "weight_decay": 0.1, "warmup_steps": 10, "min_lr_ratio": 0.1},
    "distributed": {"engine": "ddp", "backend": "auto", "device": "auto", "zero_stage": 0, "offload": False},
    "logging": {"log_every": 1, "progress": False, "wandb": {"mode": "disabled", "project": "packtrain"}},
}
LOSSES = [4.0, 3.5, 3.0, 2.5, 2.2, 2.0]


def make_run(root: Path, name: str, overrides: dict | None = None, losses: list[float] = LOSSES,
             step_times: list[float] | None = None, utilization: float = 0.5, docs: list[int] | None = None,
             token_losses: list[float] | None = None, val: dict[int, float] | None = None,
             summary: bool = True) -> Path:
    """A run dir as trainer.train writes it: 1000 valid tokens per step, `utilization` of the positions."""
    run = root / name
    run.mkdir(parents=True)
    config = copy.deepcopy(CONFIG)
    for key, value in (overrides or {}).items():
        *path, leaf = key.split(".")
        node = config
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    (run / "config.json").write_text(json.dumps(config))
    step_times = step_times or [1.0] * len(losses)
    val = {3: 3.2, 6: 2.4} if val is None else val
    lines, elapsed = [], 0.0
    for i, loss in enumerate(losses):
        step, elapsed = i + 1, elapsed + step_times[i]
        m = {"step": step, "loss": loss, "token_loss": (token_losses or losses)[i], "lr": 1e-3,
             "grad_norm": 1.0, "valid_tokens": 1000, "allocated_tokens": int(1000 / utilization),
             "token_utilization": utilization, "docs": (docs or [8] * len(losses))[i], "docs_per_row": 1.0,
             "valid_tokens_per_s": 1000 / step_times[i],
             "allocated_tokens_per_s": 1000 / utilization / step_times[i],
             "step_time_s": step_times[i], "data_time_s": 0.01, "elapsed_s": elapsed,
             "peak_mem_gb": 0.5 + i / 100, "warmup": step <= 2}
        if step in val:
            m.update(val_loss=val[step], val_tokens=500, val_docs=5, val_ppl=2.718 ** val[step],
                     eval_time_s=0.1)
        lines.append(json.dumps(m))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    if summary:
        (run / "summary.json").write_text(json.dumps({"final_step": len(losses), "final_loss": losses[-1],
                                                      "world_size": 1, "peak_mem_gb": 0.6}))
    return run


def one(root: Path, name: str, **kw) -> report_runs.Run:
    return load_runs([make_run(root, name, **kw)])[0]


def pair(tmp_path: Path, ref_kw: dict, run_kw: dict) -> tuple[report_runs.Run, report_runs.Run]:
    return one(tmp_path, "ref", **ref_kw), one(tmp_path, "run", **run_kw)


# ---------------------------------------------------------------------------------------------------
# Config keys
# ---------------------------------------------------------------------------------------------------


def test_flatten_and_key_classes():
    assert flatten({"seed": 0, "optim": {"lr": 0.1, "betas": [0.9, 0.95]}}) == {
        "seed": 0, "optim.lr": 0.1, "optim.betas": (0.9, 0.95)}
    assert key_class("logging.wandb.mode") == "ignored"
    assert key_class("train.checkpoint_every") == "ignored"
    assert key_class("packing.layout") == "same objective"
    assert key_class("distributed.backend") == "same objective"
    assert key_class("attention.isolate_documents") == "ablation"
    assert key_class("packing.buffer_size") == "other"
    assert key_class("seed") == "other"
    for key in ("train.compile", "train.activation_checkpointing", "loss.chunk_tokens", "data.prefetch",
                "optim.fused"):
        assert key_class(key) == "same objective", key  # loss-preserving (trainer/registry.py)
    # a key the registry does not know: not comparable
    assert key_class("train.from_another_version") == "other"


def test_differing_keys_ignore_logging_and_checkpoint_cadence(tmp_path):
    runs = load_runs([
        make_run(tmp_path, "a"),
        make_run(tmp_path, "b", {"packing.layout": "unpacked", "logging.log_every": 5, "train.keep_last": 9}),
        make_run(tmp_path, "c", {"seed": 1, "train.checkpoint_every": 2, "hydra.run.dir": "x"}),
    ])
    assert differing_keys([r.config for r in runs]) == ["packing.layout", "seed"]
    assert differing_keys([runs[0].config, runs[0].config]) == []
    # An old run without a `loss` section trained with global_tokens: no difference.
    old = json.loads((tmp_path / "a" / "config.json").read_text())
    del old["loss"]
    (tmp_path / "a" / "config.json").write_text(json.dumps(old))
    assert differing_keys([load_runs([tmp_path / "a"])[0].config, runs[0].config]) == []


def test_old_and_crashed_runs_fall_back(tmp_path):
    """No token_loss, elapsed_s or `loss` section (older trainer), a line cut by a crash, a resumed step."""
    run_dir = make_run(tmp_path, "old", losses=[4.0, 3.0, 2.0], step_times=[1.0, 2.0, 3.0], summary=False)
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for m in lines:
        del m["token_loss"], m["elapsed_s"]
    rewritten = {**lines[1], "loss": 2.9}  # step 2 again after a resume: the last line wins
    text = "".join(json.dumps(m) + "\n" for m in [*lines, rewritten]) + '{"step": 4, "lo'
    (run_dir / "metrics.jsonl").write_text(text)
    config = json.loads((run_dir / "config.json").read_text())
    del config["loss"]
    (run_dir / "config.json").write_text(json.dumps(config))
    run = load_runs([run_dir])[0]
    assert report_runs.train_loss(run) == {1: 4.0, 2: 2.9, 3: 2.0}
    assert report_runs.elapsed(run) == {1: 1.0, 2: 3.0, 3: 6.0}  # the running sum of step_time_s
    assert run.config["loss.normalization"] == "global_tokens"
    assert run.notes == ["no summary.json (crashed or still running)",
                         "metrics.jsonl line 5 unreadable (skipped)"]


# ---------------------------------------------------------------------------------------------------
# Verdicts
# ---------------------------------------------------------------------------------------------------


def test_same_objective_within_tolerance(tmp_path):
    ref, run = pair(tmp_path, {"overrides": {"packing.layout": "unpacked"}, "step_times": [2.0] * 6},
                    {"losses": [x + 3e-7 for x in LOSSES], "utilization": 1.0})
    # max gap 3e-7; 1000 tokens per 1 s vs per 2 s; utilization 50% -> 100%.
    assert verdict(run, ref, 1e-4) == (
        "same objective: max |Δloss| 3e-07 over 6 steps; 2.00x valid tokens/s; utilization 50.0% -> 100.0%")
    assert verdict(ref, ref, 1e-4) == "reference run"


@pytest.mark.parametrize(("key", "value"), [
    ("train.compile", True), ("train.activation_checkpointing", "full"), ("loss.chunk_tokens", 256),
    ("data.prefetch", False), ("optim.fused", True),
])
def test_loss_preserving_settings_are_the_same_objective(tmp_path, key, value):
    ref, run = pair(tmp_path, {}, {"overrides": {key: value}})
    assert verdict(run, ref, 1e-4).startswith(
        "same objective: max |Δloss| 0 over 6 steps; 1.00x valid tokens/s")


def test_loss_gap_above_tolerance_is_not_comparable(tmp_path):
    ref, run = pair(tmp_path, {"overrides": {"packing.layout": "unpacked"}},
                    {"losses": [*LOSSES[:4], 2.23, 2.0]})
    text = verdict(run, ref, 1e-4)
    assert text.startswith("not comparable: loss gap 0.03 over the first 6 steps above tolerance 0.0001 "
                           "(same documents per step;")
    assert "packing.layout unpacked -> packed" in text
    # A looser tolerance still meets the drift bound: 0.03 at a loss of 2.2 is 1.4% apart.
    assert verdict(run, ref, 0.05).startswith("not comparable: loss drifts 1.4% apart (above 1%)")


def test_late_drift_is_tolerated_only_within_the_drift_bound(tmp_path):
    """Equal early steps, then float rounding amplified by training: fine up to 1% apart, not beyond."""
    base = [3.0 - 0.05 * i for i in range(30)]
    ok = base[:10] + [x * (1 + 0.0004 * (i + 1)) for i, x in enumerate(base[10:])]  # up to 0.8% apart
    drifted = base[:10] + [x * (1 + 0.004 * (i + 1)) for i, x in enumerate(base[10:])]  # up to 8% apart
    paths = [make_run(tmp_path, "ref", {"packing.layout": "unpacked"}, losses=base),
             make_run(tmp_path, "small", losses=ok), make_run(tmp_path, "large", losses=drifted)]
    runs = {r.name: r for r in load_runs(paths)}
    text = verdict(runs["small"], runs["ref"], 1e-4)
    assert text.startswith("same objective: max |Δloss| 0 over the first 10 steps (")
    assert "over all 30: float rounding amplified by training, within 1%" in text
    text = verdict(runs["large"], runs["ref"], 1e-4)
    assert text.startswith("not comparable: loss drifts 8.") and "apart (above 1%)" in text


def test_different_seed_is_not_comparable_naming_every_key(tmp_path):
    ref, run = pair(tmp_path, {}, {"overrides": {"seed": 1}})
    assert verdict(run, ref, 1e-4) == "not comparable: different seed (0 vs 1)"
    both = one(tmp_path, "both", overrides={"seed": 1, "optim.lr": 0.001, "packing.layout": "unpacked"})
    assert verdict(both, ref, 1e-4) == (
        "not comparable: different optim.lr (0.003 vs 0.001), different seed (0 vs 1)")
    buffer = one(tmp_path, "buffer", overrides={"packing.buffer_size": 128})
    assert verdict(buffer, ref, 1e-4) == "not comparable: different packing.buffer_size (64 vs 128)"


def test_isolation_ablation_names_the_setting_and_its_effect(tmp_path):
    ref, run = pair(tmp_path, {}, {"overrides": {"attention.isolate_documents": False},
                                   "losses": [*LOSSES[:5], 2.05], "val": {3: 3.2, 6: 2.5}})
    assert verdict(run, ref, 1e-4) == (
        "ablation attention.isolate_documents true -> false: final train loss 2.0000 -> 2.0500 (+0.05) at "
        "step 6, final val loss 2.4000 -> 2.5000 (+0.1) at step 6, at equal documents per step (6 steps)")
    also_layout = one(tmp_path, "also",
                      overrides={"attention.isolate_documents": False, "packing.layout": "unpacked"})
    assert verdict(also_layout, ref, 1e-4).endswith(
        "; also differs in packing.layout packed -> unpacked (objective-neutral)")


def test_ablation_with_different_documents_per_step_is_not_comparable(tmp_path):
    ref, run = pair(tmp_path, {}, {"overrides": {"packing.reset_positions": False},
                                   "docs": [8, 8, 9, 8, 8, 8]})
    assert verdict(run, ref, 1e-4) == (
        "not comparable: different documents per step (from step 3: docs 8 vs 9, valid tokens 1000 vs 1000) "
        "although only packing.reset_positions true -> false differs")


def test_normalization_ablation_compares_token_loss(tmp_path):
    ref, run = pair(tmp_path, {}, {"overrides": {"loss.normalization": "document_mean"},
                                   "losses": [5.0] * 6, "token_losses": [*LOSSES[:5], 1.9]})
    assert verdict(run, ref, 1e-4).startswith(
        "ablation loss.normalization global_tokens -> document_mean: "
        "final train loss 2.0000 -> 1.9000 (-0.1)")


def test_layout_dependent_normalization_reports_the_loss_difference(tmp_path):
    row_mean = {"loss.normalization": "row_mean"}
    ref, run = pair(tmp_path, {"overrides": {**row_mean, "packing.layout": "unpacked"}},
                    {"overrides": row_mean, "losses": [*LOSSES[:5], 2.02]})
    assert verdict(run, ref, 1e-4) == (
        "layout-dependent objective: under loss.normalization=row_mean the loss depends on the layout; "
        "packing.layout unpacked -> packed changes it by up to 0.02 over 6 steps "
        "(final 2.0000 -> 2.0200 (+0.02)); 1.00x valid tokens/s; utilization 50.0% -> 50.0%")


# ---------------------------------------------------------------------------------------------------
# Numbers of the table
# ---------------------------------------------------------------------------------------------------


def test_speed_up_and_time_to_reach_by_hand(tmp_path):
    unpacked = one(tmp_path, "u", overrides={"packing.layout": "unpacked"}, step_times=[2.0] * 6)
    packed = one(tmp_path, "p", step_times=[5, 5, 1, 1, 2, 1], losses=[4.0, 3.0, 2.4, 2.0, 1.9, 1.8])
    slow = one(tmp_path, "s", overrides={"seed": 1}, losses=[4.0, 3.0, 2.5, 2.4, 2.2, 2.1])
    # Steady steps 3..6: 4 x 1000 tokens in 1 + 1 + 2 + 1 s = 800 tokens/s, vs 4000 / 8 s = 500: 1.60x.
    assert throughput(packed) == pytest.approx(800.0)
    assert throughput(unpacked) == pytest.approx(500.0)
    # The reference's final loss is 2.0; the packed run first reaches it at step 4, after 5 + 5 + 1 + 1 s.
    assert time_to_reach(packed, 2.0) == (12.0, 4)
    assert time_to_reach(slow, 2.0) is None
    assert time_to_reach(unpacked, 2.0) == (12.0, 6)
    table = {row[0]: dict(zip(TABLE_COLUMNS, row, strict=True))
             for row in report_tables.table_rows([unpacked, packed, slow], unpacked)}
    assert table["p"]["speed-up vs unpacked"] == "1.60x vs u"
    assert table["u"]["speed-up vs unpacked"] == "1.00x vs u"
    assert table["p"]["time to ref. loss"] == "12.0 s (step 4)"
    assert table["s"]["time to ref. loss"] == "n/a"
    assert table["p"]["max |Δ train loss|"] == "0.6 (6 steps)"  # |3.0 - 3.5| ... |2.4 - 3.0| = 0.6
    assert table["p"]["differs"] == "packing.layout=packed, seed=0"
    assert table["p"]["token utilization"] == "50.0%"
    assert table["p"]["valid tokens/s"] == "800"
    assert table["p"]["allocated tokens/s"] == "1,600"
    assert table["p"]["peak mem (GB)"] == "0.60"
    assert table["p"]["work imbalance (data / context)"] == "— / —"  # one data rank, no context parallelism
    assert table["p"]["measured (compute imbalance / wait s)"] == "— / —"
    assert table["u"]["notes"] == "reference"


def test_the_work_imbalance_column_is_the_mean_of_the_logged_steps(tmp_path):
    """dp_imbalance and cp_imbalance (issue 55), averaged over the steps that logged them."""
    run_dir = make_run(tmp_path, "b")
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for i, m in enumerate(lines):
        m.update(dp_imbalance=0.01 * i, **({"cp_imbalance": 0.5} if i == 0 else {}))
        m.update(dp_compute_imbalance=0.02 * i, dp_wait_s=0.1 * (i % 2))
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    run = load_runs([run_dir])[0]
    assert report_tables.work_imbalance(run) == "2.5% / 50.0%"  # mean of 0, 1, ..., 5 %
    assert report_tables.measured_imbalance(run) == "5.0% / 0.050"  # and the measured one (issue 55)

def test_unpacked_match_prefers_the_closest_settings(tmp_path):
    runs = load_runs([
        make_run(tmp_path, "u0", {"packing.layout": "unpacked"}),
        make_run(tmp_path, "u1", {"packing.layout": "unpacked", "seed": 1}),
        make_run(tmp_path, "p1", {"seed": 1}),
        make_run(tmp_path, "b0", {"packing.layout": "bucketed"}),
    ])
    assert [unpacked_match(r, runs).name for r in runs] == ["u0", "u1", "u1", "u0"]
    packed_only = load_runs([tmp_path / "p1", tmp_path / "b0"])
    assert unpacked_match(packed_only[0], packed_only) is None


# ---------------------------------------------------------------------------------------------------
# Files written
# ---------------------------------------------------------------------------------------------------

PNGS = ["loss_vs_step.png", "loss_vs_time.png", "val_loss_vs_step.png", "valid_tokens_per_s.png",
        "token_utilization.png", "doc_lengths.png"]


class _HTMLCheck(HTMLParser):
    """Collects every src/href and img, and checks that non-void tags nest and close."""

    VOID = {"meta", "link", "img", "br", "hr", "input"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.urls: list[str] = []
        self.imgs: list[dict] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.urls += [v for k, v in attrs.items() if k in ("src", "href")]
        if tag == "img":
            self.imgs.append(attrs)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(f"unexpected </{tag}>")


def write_data(root: Path, histogram: bool = True) -> Path:
    data = root / "reportdata" / "demo"
    data.mkdir(parents=True)
    lengths = {"min": 3, "max": 900, "mean": 80.0}
    if histogram:
        lengths["histogram"] = {"edges": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024],
                                "counts": [0, 1, 4, 10, 30, 60, 50, 20, 8, 2]}
    (data / "manifest.json").write_text(json.dumps({"format": FORMAT_VERSION,
                                                    "splits": {"train": {"lengths": lengths}}}))
    return data


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, list[Path]]:
    """A Hydra-style sweep under <root>/multirun/: jobs 0 (packed), 1 (unpacked), 2 (seed 1), 10 (isolation
    off, crashed: no summary.json); the data dir at <root>/reportdata/demo, found relative to the run dirs'
    parents. Reported once with the default --out (the sweep dir); returns it and the paths written."""
    root = tmp_path_factory.mktemp("sweep")
    write_data(root)
    sweep = root / "multirun" / "2025-06-01"
    make_run(sweep, "0", losses=[x + 1e-7 for x in LOSSES], step_times=[1.0] * 6, utilization=0.99)
    make_run(sweep, "1", {"packing.layout": "unpacked"}, step_times=[2.0] * 6, utilization=0.4)
    make_run(sweep, "2", {"seed": 1}, losses=[4.1, 3.6, 3.1, 2.6, 2.3, 2.1])
    make_run(sweep, "10", {"packing.layout": "unpacked", "attention.isolate_documents": False},
             losses=LOSSES[:4], summary=False)
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    return sweep, make_report([sweep])


def check_html(page: str, n_images: int) -> None:
    """Well nested, no script, no URL leaving the file, every image an inline PNG with alt text."""
    assert page.startswith("<!DOCTYPE html>")
    check = _HTMLCheck()
    check.feed(page)
    check.close()
    assert not check.errors and not check.stack, (check.errors, check.stack)
    assert not [u for u in check.urls if re.match(r"(?i)\s*(https?:)?//", u)]
    assert len(check.imgs) == n_images
    assert all(img["src"].startswith("data:image/png;base64,") and img["alt"] for img in check.imgs)
    assert "<script" not in page.lower()
    for column in TABLE_COLUMNS:
        assert f"<th>{html.escape(column)}</th>" in page


def check_files(out: Path, paths: list[Path], pngs: list[str]) -> str:
    """Every PNG written and non-empty, the markdown holding every column and image; the markdown."""
    assert paths == [out / name for name in [*pngs, "report.md", "report.html"]]
    for name in pngs:
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 2000, name
    md = (out / "report.md").read_text()
    for column in TABLE_COLUMNS:
        assert column.replace("|", "\\|") in md
    for name in pngs:
        assert f"]({name})" in md  # relative paths, next to report.md
    check_html((out / "report.html").read_text(), len(pngs))
    return md


def test_report_writes_table_plots_markdown_and_self_contained_html(sweep):
    out, paths = sweep  # the default --out of one sweep dir is the sweep dir
    md = check_files(out, paths, PNGS)
    rows = [line for line in md.splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == ["| run", "| 0", "| 1", "| 2", "| 10"]  # job order
    assert "Reference run: **1**" in md
    assert ("- **0**: same objective: max |Δloss| 1e-07 over 6 steps; 2.00x valid tokens/s; "
            "utilization 40.0% -> 99.0%") in md
    assert "- **2**: not comparable: different seed (0 vs 1)" in md
    assert "- **10**: ablation attention.isolate_documents true -> false" in md
    assert "no summary.json (crashed or still running)" in rows[4]
    # Run 0 reaches the reference's final loss 2.0 (within the tolerance) at step 6, after 6 x 1 s.
    assert "| 2.00x vs 1 | 6.0 s (step 6) |" in rows[1]


def test_report_html_renders_without_console_errors(sweep, browser):
    from tests.browser import console_errors, images_rendered

    out, _ = sweep
    browser.get((out / "report.html").as_uri())
    assert console_errors(browser) == []
    assert images_rendered(browser)
    assert browser.execute_script("return document.images.length") == len(PNGS)


def test_missing_histogram_and_val_loss_become_notes(tmp_path, capsys):
    write_data(tmp_path, histogram=False)
    runs = [make_run(tmp_path / "runs", name, {"packing.layout": layout}, val={})
            for name, layout in [("p", "packed"), ("u", "unpacked")]]
    out = tmp_path / "out"
    assert report.main([*map(str, runs), "--out", str(out), "--reference", "p"]) == 0
    printed = [Path(line) for line in capsys.readouterr().out.split()]
    check_files(out, printed, [p for p in PNGS if p not in ("doc_lengths.png", "val_loss_vs_step.png")])
    md = (out / "report.md").read_text()
    assert "Document-length histogram not available: " in md and "has no lengths.histogram" in md
    assert "Validation loss: no run logged val_loss" in md
    assert "Reference run: **p**" in md


def test_cli_errors(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    proc = subprocess.run([sys.executable, "-m", "trainer.report", str(tmp_path / "empty")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"error: {tmp_path / 'empty'}: no runs found (a run dir holds "
                                   "metrics.jsonl and config.json; a sweep dir holds run dirs one "
                                   "level down)")
    proc = subprocess.run([sys.executable, "-m", "trainer.report", str(tmp_path / "nope")], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stderr.strip()) == (2, f"error: {tmp_path / 'nope'}: not a directory")
    make_run(tmp_path, "a")
    with pytest.raises(report_runs.ReportError, match="--reference nope: no such run"):
        make_report([tmp_path / "a"], tmp_path / "out", reference="nope")


# ---------------------------------------------------------------------------------------------------
# Real runs of trainer.train
# ---------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_report_over_real_tiny_runs(demo_data, tmp_path):
    """Packed, unpacked and seed=1, 6 steps each (the three trainings run side by side)."""
    from tests.helpers import run_train

    variants = {"packed": ["packing=packed"], "unpacked": ["packing=unpacked"],
                "seed1": ["packing=packed", "seed=1"]}
    with ThreadPoolExecutor(len(variants)) as pool:
        list(pool.map(lambda item: run_train(tmp_path / item[0], demo_data, "train.max_steps=6",
                                             "train.eval_every=3", "train.checkpoint_every=0",
                                             "logging.position_buckets=[64,256]",
                                             *item[1]), variants.items()))
    out = tmp_path / "report"
    paths = make_report([tmp_path / name for name in variants], out)
    manifest = json.loads((demo_data / "manifest.json").read_text())
    has_histogram = "histogram" in manifest["splits"]["train"]["lengths"]
    pngs = [p for p in PNGS if has_histogram or p != "doc_lengths.png"]
    at = pngs.index("token_utilization.png") + 1
    pngs[at:at] = ["loss_by_length.png", "loss_by_position.png"]  # these runs log both kinds of buckets
    md = check_files(out, paths, pngs)
    verdicts = dict(line[4:].split("**: ", 1) for line in md.splitlines() if line.startswith("- **"))
    assert verdicts["seed1"] == "not comparable: different seed (0 vs 1)"
    assert verdicts["packed"].startswith("same objective: max |Δloss| ")  # same documents, same loss
    assert verdicts["packed by document length"].startswith("every length bucket within 0.0001 of unpacked")
    assert "seed1 by document length" not in verdicts  # not comparable: no per-bucket judgement
    assert "## Token loss by document length" in md and "| packed | <=64 | " in md
    assert verdicts["packed by position in document"].startswith(
        "every position bucket within 0.0001 of unpacked")
    assert "## Token loss by position in the document" in md
    rows = {row[0]: dict(zip(TABLE_COLUMNS, row, strict=True))
            for row in report_tables.table_rows(load_runs([tmp_path / n for n in variants]),
                                         load_runs([tmp_path / "unpacked"])[0])}
    for row in rows.values():
        assert row["steps"] == "6" and row["final val loss"] != "n/a" and row["valid tokens/s"] != "n/a"
    assert rows["packed"]["speed-up vs unpacked"].endswith("x vs unpacked")


def verdicts_of(sweep: Path, out: Path) -> dict[str, str]:
    """Run name -> verdict, as report.md writes them ("- **name**: verdict"; the reference run has none)."""
    make_report([sweep], out)
    md = (out / "report.md").read_text()
    assert "Reference run: **0**." in md
    return dict(line[4:].split("**: ", 1) for line in md.splitlines() if line.startswith("- **"))


@pytest.mark.slow
def test_real_prefetch_and_compile_sweeps_are_the_same_objective(neutral_sweeps, tmp_path):
    """data.prefetch and train.compile preserve the loss: the report says "same objective", not "not
    comparable"; a seed change next to them still is not comparable."""
    prefetch = verdicts_of(neutral_sweeps["prefetch"], tmp_path / "prefetch")
    # Jobs in Hydra's order (the last override varies fastest): 0 prefetch seed 0 (the reference), 1 prefetch
    # seed 1, 2 no prefetch seed 0, 3 no prefetch seed 1.
    assert prefetch["1"] == "not comparable: different seed (0 vs 1)"
    assert prefetch["2"].startswith("same objective: max |Δloss| "), prefetch["2"]
    assert prefetch["3"] == "not comparable: different seed (0 vs 1)"
    compiled = verdicts_of(neutral_sweeps["compile"], tmp_path / "compile")
    assert compiled["1"].startswith("same objective: max |Δloss| "), compiled["1"]
    assert json.loads((neutral_sweeps["compile"] / "0" / "summary.json").read_text())["compile"] is True


def test_each_packed_run_is_also_judged_against_its_unpacked_counterpart(tmp_path):
    """A normalization x layout sweep: beyond the reference, each packed run meets its own unpacked run."""
    for i, (norm, layout, losses) in enumerate([
        ("global_tokens", "packed", LOSSES), ("global_tokens", "unpacked", LOSSES),
        ("row_mean", "packed", LOSSES), ("row_mean", "unpacked", [x + 0.05 for x in LOSSES]),
    ]):
        make_run(tmp_path, f"{i}_{norm}_{layout}", {"loss.normalization": norm, "packing.layout": layout},
                 losses=losses)
    runs = load_runs([tmp_path])
    pairs = dict(report_verdicts.layout_verdicts(runs, runs[1], 1e-4))
    # 0 vs 1 is the reference's own verdict
    assert list(pairs) == ["2_row_mean_packed vs 3_row_mean_unpacked"]
    assert pairs["2_row_mean_packed vs 3_row_mean_unpacked"].startswith(
        "layout-dependent objective: under loss.normalization=row_mean the loss depends on the layout; "
        "packing.layout unpacked -> packed changes it by up to 0.05 over 6 steps")


# ---------------------------------------------------------------------------------------------------
# Loss by document length
# ---------------------------------------------------------------------------------------------------


def metric_lines(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def write_metric_lines(run_dir: Path, lines: list[dict]) -> None:
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))


def add_to_summary(run_dir: Path, extra: dict) -> None:
    summary = json.loads((run_dir / "summary.json").read_text())
    (run_dir / "summary.json").write_text(json.dumps({**summary, **extra}))


def with_groups(run_dir: Path, by: report_tables.Breakdown, train: dict[str, list[float | None]],
                targets: dict[str, list[int]], val: dict[str, float], **per_step: dict[str, list]) -> Path:
    """Add `by`'s per-group token losses and targets to every step of a hand-built run, its val losses to the
    last eval step, and each `per_step` key's {group: value of the step} (tokens_by_source=...) to every
    step."""
    lines = metric_lines(run_dir)
    for i, m in enumerate(lines):
        m[by.loss] = {g: train[g][i] for g in train}
        m[by.targets] = {g: targets[g][i] for g in targets}
        for key, values in per_step.items():
            m[key] = {g: values[g][i] for g in values}
    evals = [m for m in lines if "val_loss" in m]
    evals[-1][by.val_loss] = val
    write_metric_lines(run_dir, lines)
    return run_dir


def test_loss_by_length_table_and_verdicts_by_hand(tmp_path):
    by = report_tables.BY_LENGTH
    targets = {"<=64": [100] * 6, ">64": [900] * 6}
    ref_train = {"<=64": [3.0, 3.0, 3.0, 2.0, 2.0, 2.0], ">64": [2.5] * 6}
    ref = with_groups(make_run(tmp_path, "unpacked", {"packing.layout": "unpacked"}), by, ref_train, targets,
                      {"<=64": 2.2, ">64": 2.4})
    same = with_groups(make_run(tmp_path, "packed"), by,
                       {b: [x + 1e-6 for x in v] for b, v in ref_train.items()},
                       targets, {"<=64": 2.2, ">64": 2.4 + 2e-6})
    # Without isolation short documents read their neighbours: their loss drops by 0.05, long ones' do not.
    mixed = with_groups(make_run(tmp_path, "mixed", {"attention.isolate_documents": False}), by,
                        {"<=64": [x - 0.05 for x in ref_train["<=64"]], ">64": [2.5] * 6}, targets,
                        {"<=64": 2.15, ">64": 2.4})
    runs = load_runs([ref, same, mixed])
    # Train token loss of a bucket over a run: its steps weighted by their targets (equal here: the mean).
    assert report_tables.train_by_group(runs[0], by) == {"<=64": (2.5, 600), ">64": (2.5, 5400)}
    rows = report_tables.group_rows(runs, runs[0], by)
    assert rows[0] == ["unpacked", "<=64", "2.5000", "—", "2.2000", "—", "600"]
    assert rows[4] == ["mixed", "<=64", "2.4500", "-0.05", "2.1500", "-0.05", "600"]
    assert rows[5] == ["mixed", ">64", "2.5000", "+0", "2.4000", "+0", "5,400"]
    verdicts = dict(report_tables.group_verdicts(runs, runs[0], 1e-4, by))
    assert verdicts["packed by document length"] == (
        "every length bucket within 0.0001 of unpacked (max |Δ| 2e-06)")
    assert verdicts["mixed by document length"] == ("documents <=64 tokens: train token loss -0.05, "
                                                    "final val token loss -0.05 against unpacked "
                                                    "(beyond 0.0001)")
    out = tmp_path / "out"
    paths = make_report([ref, same, mixed], out)
    assert out / "loss_by_length.png" in paths and out / "loss_by_source.png" not in paths
    md = (out / "report.md").read_text()
    assert "| mixed | <=64 | 2.4500 | -0.05 | 2.1500 | -0.05 | 600 |" in md
    assert "- **mixed by document length**: documents <=64 tokens" in md
    assert "## Token loss by source" not in md and "mixture**" not in md  # no run logged sources
    page = (out / "report.html").read_text()
    assert "<h2>Token loss by document length</h2>" in page and "<td>-0.05</td>" in page


# ---------------------------------------------------------------------------------------------------
# Data mixtures: loss by source, token shares
# ---------------------------------------------------------------------------------------------------


def sources(functions: float, modules: float) -> list[dict]:
    return [{"name": "functions", "path": "reportdata/demo", "weight": functions},
            {"name": "modules", "path": "reportdata/modules", "weight": modules}]


def mixture_run(root: Path, name: str, weights: tuple[float, float], layout: str = "packed",
                train: dict[str, list[float | None]] | None = None, val: dict[str, float] | None = None,
                tokens: dict[str, list[int]] | None = None, targets: dict[str, list[int]] | None = None,
                share_summary: dict | None = None) -> Path:
    """A hand-built run of a two-source mixture: 6 steps; by default functions' targets 100, 100, 100, 300,
    300, 300 and modules' 700; the losses, shares and summary keys given."""
    target_share = {"functions": weights[0] / sum(weights), "modules": weights[1] / sum(weights)}
    run = make_run(root, name, {"data.sources": sources(*weights), "data.path": None,
                                "packing.layout": layout})
    train = train or {"functions": [3.0, 3.0, 3.0, 2.0, 2.0, 2.0], "modules": [2.0] * 6}
    tokens = tokens or {"functions": [300] * 6, "modules": [700] * 6}
    targets = targets or {"functions": [100] * 3 + [300] * 3, "modules": [700] * 6}
    with_groups(run, report_tables.BY_SOURCE, train, targets,
                val or {"functions": 2.3, "modules": 1.9}, tokens_by_source=tokens,
                token_share_by_source={g: [n / 1000 for n in v] for g, v in tokens.items()},
                target_share_by_source={g: [share] * 6 for g, share in target_share.items()})
    add_to_summary(run, share_summary or {})
    return run


def test_loss_by_source_table_and_verdicts_by_hand(tmp_path):
    by = report_tables.BY_SOURCE
    ref = mixture_run(tmp_path, "unpacked", (0.3, 0.7), "unpacked")
    same = mixture_run(tmp_path, "packed", (0.3, 0.7),
                       train={"functions": [3.0, 3.0, 3.0, 2.0, 2.0, 2.0 + 4e-5], "modules": [2.0] * 6})
    # Another weighting: not comparable step by step (data.sources differs), so no verdict line by source; its
    # last step holds no module target (a null loss).
    other = mixture_run(tmp_path, "w70", (0.7, 0.3),
                        train={"functions": [2.8] * 6, "modules": [2.2] * 5 + [None]},
                        targets={"functions": [100] * 3 + [300] * 3, "modules": [700] * 5 + [0]},
                        val={"functions": 2.1, "modules": 2.0})
    runs = load_runs([ref, same, other])
    # Functions over the run: (3 x 100 x 3.0 + 3 x 300 x 2.0) / 1200 = 2.25; modules 2.0 on 4200 targets.
    assert report_tables.train_by_group(runs[0], by) == {"functions": (2.25, 1200), "modules": (2.0, 4200)}
    assert report_tables.train_by_group(runs[2], by)["modules"] == (pytest.approx(2.2), 3500)
    rows = report_tables.group_rows(runs, runs[0], by)
    assert (report_tables.SOURCE_COLUMNS[1] == "source"
            and report_tables.SOURCE_COLUMNS[-2:] == ["token share", "target share"])
    assert rows[0] == ["unpacked", "functions", "2.2500", "—", "2.3000", "—", "1,200", "30.0%", "30.0%"]
    # +4e-5 on step 6's 300 of the 1200 targets: +1e-5.
    assert rows[2] == ["packed", "functions", "2.2500", "+1e-05", "2.3000", "+0", "1,200", "30.0%", "30.0%"]
    # 2.8 against 2.25 over the shared steps; target share of functions 0.7 / 1.0.
    assert rows[4] == ["w70", "functions", "2.8000", "+0.55", "2.1000", "-0.2", "1,200", "30.0%", "70.0%"]
    verdicts = dict(report_tables.group_verdicts(runs, runs[0], 1e-4, by))
    assert verdicts == {"packed by source": "every source within 0.0001 of unpacked (max |Δ| 1e-05)"}
    assert dict(report_tables.group_verdicts(runs, runs[0], 5e-6, by)) == {
        "packed by source": "source functions: train token loss +1e-05, final val token loss +0 against "
                            "unpacked (beyond 5e-06)"}


def test_token_shares_held_or_not_by_hand(tmp_path):
    # Steps of 300 and 700 document tokens: 30% functions, the 0.3 / (0.3 + 0.7) target.
    held = mixture_run(tmp_path, "held", (0.3, 0.7))
    # 330 / 670 on the first three steps, 280 / 720 on the rest: 30.5% over the run, 3 points off at worst.
    wobbly = mixture_run(tmp_path, "wobbly", (0.3, 0.7),
                         tokens={"functions": [330] * 3 + [280] * 3, "modules": [670] * 3 + [720] * 3})
    # The summary's whole-run shares win over the logged steps (log_every > 1 logs only some steps).
    drifted = mixture_run(tmp_path, "drifted", (0.7, 0.3),
                          tokens={"functions": [700] * 6, "modules": [300] * 6},
                          share_summary={"token_share_by_source": {"functions": 0.65, "modules": 0.35},
                                         "target_share_by_source": {"functions": 0.7, "modules": 0.3},
                                         "mixture": {"functions": {"weight": 0.7, "docs": 90, "tokens": 6900},
                                                     "modules": {"weight": 0.3, "docs": 2, "tokens": 3100}}})
    plain = make_run(tmp_path, "plain")  # one source, no mixture: no line
    runs = load_runs([held, wobbly, drifted, plain])
    assert report_tables.token_shares(runs[1]) == pytest.approx({"functions": 0.305, "modules": 0.695})
    assert report_tables.step_share_gap(runs[1]) == pytest.approx(0.03)
    assert dict(report_tables.share_verdicts(runs)) == {
        "held mixture": "token shares held within 2 points of the targets: functions 30.0% (target 30.0%), "
                        "modules 70.0% (target 70.0%); single steps up to 0.0 points off",
        "wobbly mixture": "token shares held within 2 points of the targets: functions 30.5% (target 30.0%), "
                          "modules 69.5% (target 70.0%); single steps up to 3.0 points off",
        "drifted mixture": "token shares off target (functions, modules beyond 2 points): functions 65.0% "
                           "(target 70.0%), modules 35.0% (target 30.0%); single steps up to 0.0 points off; "
                           "the mixer's count: functions 69.0%, modules 31.0%",
    }


def test_loss_by_source_plot_averages_over_logged_steps_by_targets(tmp_path):
    run = load_runs([mixture_run(tmp_path, "mix", (0.3, 0.7),
                                 train={"functions": [2.0, 3.0, 1.0, None, 4.0, 4.0], "modules": [2.0] * 6},
                                 targets={"functions": [10, 30, 10, 0, 10, 10], "modules": [700] * 6})])[0]
    # Window 2 over the steps with targets (step 4 has none): (2.0), (2 x 10 + 3 x 30) / 40,
    # (3 x 30 + 1 x 10) / 40, then (1.0 + 4.0) / 2 at step 5 and 4.0 at step 6.
    assert report_plots.trailing_loss(run, report_tables.BY_SOURCE, "functions", 2) == pytest.approx(
        {1: 2.0, 2: 2.75, 3: 2.5, 5: 2.5, 6: 4.0})
    assert report_plots.trailing_loss(run, report_tables.BY_SOURCE, "functions", 1) == {
        1: 2.0, 2: 3.0, 3: 1.0, 5: 4.0, 6: 4.0}


def with_flops(run_dir: Path, model: list[float], hardware: list[float], summary: dict | None = None) -> Path:
    """Add model_flops / hardware_flops to every step of a hand-built run (a CPU run: no mfu), and
    `summary`."""
    lines = metric_lines(run_dir)
    for m, a, b in zip(lines, model, hardware, strict=True):
        m.update(model_flops=a, hardware_flops=b)
    write_metric_lines(run_dir, lines)
    add_to_summary(run_dir, summary or {})
    return run_dir


def test_the_keys_the_report_reads_are_registered():
    """A metric renamed in trainer/registry.py (its one owner) fails here, not as a report section gone
    quiet."""
    from trainer.registry import METRIC_KEYS, SUMMARY_KEYS

    for by in (report_tables.BY_LENGTH, report_tables.BY_SOURCE):
        assert {by.loss, by.targets, by.val_loss} <= set(METRIC_KEYS), by
    assert {"tokens_by_source", "token_share_by_source", "target_share_by_source", "model_flops",
            "hardware_flops", "mfu", "hfu"} <= set(METRIC_KEYS)
    assert {"token_share_by_source", "target_share_by_source", "mean_model_flops_per_s",
            "mean_hardware_flops_per_s", "mean_mfu", "mean_hfu"} <= set(SUMMARY_KEYS)


def test_flops_both_ways_by_hand(tmp_path):
    # Steady steps 3..6 (1 and 2 are warm-up): (2 + 4 + 6 + 6) GFLOP in 1 + 1 + 2 + 2 s = 3 GFLOP/s.
    model = [9e9, 9e9, 2e9, 4e9, 6e9, 6e9]
    cpu = with_flops(make_run(tmp_path, "cpu", step_times=[1, 1, 1, 1, 2, 2]), model,
                     [1.5 * x for x in model])
    assert report_tables.flop_rates(load_runs([cpu])[0]) == pytest.approx(
        {"mean_model_flops_per_s": 3e9, "mean_hardware_flops_per_s": 4.5e9, "mean_mfu": None,
         "mean_hfu": None})
    assert report_tables.flops_table(load_runs([cpu])) == (
        ["run", "model FLOPs/s", "hardware FLOPs/s", "hardware / model"],
        [["cpu", "3 GFLOP/s", "4.5 GFLOP/s", "1.50"]])  # no peak known: FLOPs/s only
    gpu = with_flops(make_run(tmp_path, "gpu"), model, model, {
        "mean_model_flops_per_s": 2.5e14, "mean_hardware_flops_per_s": 3e14, "mean_mfu": 0.253,
        "mean_hfu": 0.3036})
    old = make_run(tmp_path, "old")  # before FLOPs were logged
    columns, rows = report_tables.flops_table(load_runs([cpu, gpu, old]))
    assert columns == report_tables.FLOPS_COLUMNS
    assert rows == [["cpu", "3 GFLOP/s", "4.5 GFLOP/s", "1.50", "n/a", "n/a"],
                    ["gpu", "250 TFLOP/s", "300 TFLOP/s", "1.20", "25.3%", "30.4%"],
                    ["old", "n/a", "n/a", "n/a", "n/a", "n/a"]]
    # no section at all
    assert report_tables.flops_table(load_runs([old])) == (report_tables.FLOPS_COLUMNS, [])


def test_mixture_report_sections_and_html(tmp_path):
    """The mixture sweep's report: per-source table, share and per-source verdicts, FLOPs table, the plot, the
    histograms of both sources; report.html still well-formed and self-contained."""
    write_data(tmp_path)
    modules = tmp_path / "reportdata" / "modules"
    modules.mkdir()
    (modules / "manifest.json").write_text(json.dumps({"format": FORMAT_VERSION, "splits": {"train": {
        "lengths": {"histogram": {"edges": [256, 512, 1024, 2048, 4096], "counts": [10, 30, 40, 20]}}}}}))
    sweep = tmp_path / "multirun"
    runs = [mixture_run(sweep, "0_w30_packed", (0.3, 0.7)),
            mixture_run(sweep, "1_w30_unpacked", (0.3, 0.7), "unpacked"),
            mixture_run(sweep, "2_w70_packed", (0.7, 0.3),
                        tokens={"functions": [700] * 6, "modules": [300] * 6})]
    for run in runs:
        with_flops(run, [3e9] * 6, [4e9] * 6)
    out = tmp_path / "out"
    paths = make_report([sweep], out)
    pngs = [p for p in PNGS if p != "doc_lengths.png"] + ["loss_by_source.png", "doc_lengths.png"]
    md = check_files(out, paths, pngs)
    assert "Reference run: **1_w30_unpacked**" in md
    assert "| 0_w30_packed | functions | 2.2500 | +0 | 2.3000 | +0 | 1,200 | 30.0% | 30.0% |" in md
    assert "| 2_w70_packed | functions | 2.2500 | +0 | 2.3000 | +0 | 1,200 | 70.0% | 70.0% |" in md
    assert "- **0_w30_packed by source**: every source within 0.0001 of 1_w30_unpacked (max |Δ| 0)" in md
    assert "2_w70_packed by source" not in md  # not comparable: other weights
    assert ("- **2_w70_packed mixture**: token shares held within 2 points of the targets: functions 70.0%"
            in md)
    assert ("- **2_w70_packed**: not comparable: different data.sources ([{name: functions, "
            "path: reportdata/demo, weight: 0.3}, {name: modules, path: reportdata/modules, weight: 0.7}] vs "
            "[{name: functions, ") in md
    assert "## FLOPs both ways" in md and "| 0_w30_packed | 3 GFLOP/s | 4 GFLOP/s | 1.33 |" in md
    assert "| run | model FLOPs/s | hardware FLOPs/s | hardware / model |\n" in md  # CPU runs: no MFU columns
    assert "Document-length histogram" not in md  # both sources' histograms found
    page = (out / "report.html").read_text()
    assert "<h2>Token loss by source</h2>" in page and "<h2>FLOPs both ways</h2>" in page
    assert "<td>70.0%</td>" in page


def test_hostile_run_names_stay_text_in_markdown_and_plots(tmp_path):
    """A run dir named like HTML is escaped in report.md too (Markdown renderers pass raw HTML through), and
    one named like TeX (`$\\frac{1}{$`: matplotlib's mathtext would fail on it) still gets its plots."""
    runs_dir = tmp_path / "runs"
    names = ["<img src=x onerror=alert(1)>", "$\\frac{1}{$", "$\\undefinedcmd$"]
    for name in names:
        make_run(runs_dir, name)
    written = make_report([runs_dir], tmp_path / "out")
    md = (tmp_path / "out" / "report.md").read_text()
    assert "<img" not in md and "&lt;img src=x onerror=alert(1)>" in md
    assert "$\\frac{1}{$" in md
    assert ((tmp_path / "out" / "loss_vs_step.png") in written
            and (tmp_path / "out" / "loss_vs_step.png").stat().st_size)


def test_the_table_shows_how_many_ranks_and_the_context_parallel_split(tmp_path):
    """The "ranks" column: the world size from summary.json; under context parallelism the data x context
    split (the CP degree of each run); n/a without summary.json."""
    plain = one(tmp_path, "plain")
    cp = one(tmp_path, "cp", overrides={"distributed.context_parallel": 2})
    cp.config["world_size"] = 4
    lost = one(tmp_path, "lost", summary=False)
    table = {row[0]: dict(zip(TABLE_COLUMNS, row, strict=True))
             for row in report_tables.table_rows([plain, cp, lost], plain)}
    assert table["plain"]["ranks"] == str(plain.config["world_size"])
    assert table["cp"]["ranks"] == "4 (2 data x 2 context)"
    assert table["lost"]["ranks"] == "n/a"
