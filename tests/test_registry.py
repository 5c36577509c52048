"""trainer.registry: every config key of the composed config has a class, every metric and summary key a
meaning, nothing stale stays registered, and the trainer writes no key that is not registered."""

from __future__ import annotations

import ast
import copy
import functools
import json
import re
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from trainer import registry
from trainer.config import NORMALIZATIONS, WandbConfig
from trainer.registry import CLASSES, CONFIG_KEYS, FROM_SUMMARY, METRIC_KEYS, SAME_OBJECTIVE, SUMMARY_KEYS
from trainer.reporting.runs import flatten
from trainer.run.metrics import MetricsLogger

ROOT = Path(__file__).resolve().parents[1]
COMPOSITIONS = [
    [], ["experiment=demo"], ["distributed=deepspeed_zero2"], ["distributed=fsdp2"], ["model=gpt2-124m"],
    ["experiment=sft"],
    ["experiment=positions_ablation"], ["packing=unpacked", "attention=dense"],
]
"""Overrides composed as `python -m trainer.train` would (config.json is the resolved result)."""


@functools.cache
def composed_keys(overrides: tuple[str, ...]) -> frozenset[str]:
    """The dotted leaf keys of config.json for these overrides."""
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose("config", overrides=list(overrides))
    return frozenset(flatten(OmegaConf.to_container(cfg, resolve=True)))


def all_composed_keys() -> set[str]:
    return set().union(*(composed_keys(tuple(o)) for o in COMPOSITIONS))


def not_registered(keys, table) -> list[str]:
    """Keys without an entry of their own (a `section.*` wildcard does not count)."""
    return sorted(set(keys) - set(table))


def stale(table, keys) -> list[str]:
    """Entries (not wildcards, not taken from summary.json) that no composed config holds."""
    return sorted(k for k in table if not k.endswith(".*") and k not in FROM_SUMMARY and k not in keys)


# ---------------------------------------------------------------------------------------------------
# Config keys
# ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides", COMPOSITIONS, ids=lambda o: " ".join(o) or "default")
def test_every_config_key_is_registered_explicitly(overrides):
    keys = composed_keys(tuple(overrides))
    assert {"seed", "data.prefetch", "optim._target_"} <= keys  # the composition did reach the leaves
    assert not_registered(keys, CONFIG_KEYS) == []
    # ...and the check can fail: a copy of the registry missing one entry.
    without = copy.deepcopy(CONFIG_KEYS)
    del without["data.prefetch"]
    assert not_registered(keys, without) == ["data.prefetch"]


def test_no_stale_config_key_is_registered():
    keys = all_composed_keys()
    assert {"distributed.zero_stage", "distributed.offload"} <= keys  # only under deepspeed
    assert "distributed.reshard_after_forward" in keys  # only under fsdp2
    assert stale(CONFIG_KEYS, keys) == []
    assert stale({**CONFIG_KEYS, "train.gone": ("other", "")}, keys) == ["train.gone"]  # the check can fail
    assert FROM_SUMMARY <= SUMMARY_KEYS.keys() and FROM_SUMMARY <= CONFIG_KEYS.keys()


def test_every_entry_has_a_known_class_and_a_reason():
    for key, (cls, why) in CONFIG_KEYS.items():
        assert cls in CLASSES and why.strip(), key
    assert registry.OLDER_RUN_VALUES.keys() <= CONFIG_KEYS.keys()
    assert registry.LAYOUT_INVARIANT_NORMALIZATIONS < set(NORMALIZATIONS)


def test_loss_preserving_settings_are_same_objective():
    """The settings the README documents as loss-preserving (tested to 1e-6); the report once missed them."""
    for key in ("train.compile", "train.activation_checkpointing", "loss.chunk_tokens", "data.prefetch",
                "optim.fused", "packing.layout", "attention.backend", "train.micro_batch_tokens",
                "data.num_workers", "distributed.engine", "world_size"):
        assert registry.config_key_class(key) == SAME_OBJECTIVE, key


def test_config_key_class_and_its_wildcards():
    assert registry.config_key_class("hydra.run.dir") == "ignored"
    assert registry.config_key_class("model.pos_emb") == "ablation"
    assert registry.config_key_class("seed") == "other"
    assert registry.config_key_class("train.no_such_key") is None


def test_the_registry_imports_the_standard_library_only():
    tree = ast.parse((ROOT / "trainer" / "registry.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert {m.split(".")[0] for m in imported} <= set(sys.stdlib_module_names) | {"__future__"}


# ---------------------------------------------------------------------------------------------------
# Metric and summary keys
# ---------------------------------------------------------------------------------------------------


def step_metrics(**extra) -> dict:
    m = {"step": 1, "loss": 3.0, "valid_tokens": 10, "allocated_tokens": 12, "step_time_s": 0.5,
         "token_utilization": 0.9, "warmup": False}
    return {**m, **extra}


@pytest.mark.parametrize("enabled", [True, False], ids=["rank0", "other_rank"])
def test_metrics_logger_refuses_an_unregistered_key(tmp_path, enabled):
    logger = MetricsLogger(tmp_path, WandbConfig(mode="disabled"), resolved_config={}, tags=[], group=None,
                           enabled=enabled)
    logger.log(step_metrics(val_loss=2.0))
    with pytest.raises(ValueError, match=r"metrics\.jsonl key 'val_los' is not registered: register it in "
                                         r"trainer/registry\.py \(METRIC_KEYS\)"):
        logger.log(step_metrics(val_los=2.0))
    assert logger.summary({"final_step": 1})["final_step"] == 1
    with pytest.raises(ValueError, match=r"summary\.json keys 'a', 'b' are not registered: "
                                         r".*trainer/registry\.py \(SUMMARY_KEYS\)"):
        logger.summary({"a": 1, "b": 2})
    if enabled:  # the refused line was not written
        assert [json.loads(line)["step"]
                for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_every_key_has_a_one_line_meaning():
    for table in (METRIC_KEYS, SUMMARY_KEYS):
        for key, meaning in table.items():
            assert meaning.strip() and "\n" not in meaning, key


@pytest.mark.slow
def test_a_real_run_writes_registered_keys_only(neutral_sweeps):
    """Real runs (eval on, compile on and off, prefetch on and off): every key they wrote is registered."""
    run_dirs = [d for sweep in neutral_sweeps.values() for d in sweep.iterdir()
                if (d / "summary.json").is_file()]
    assert len(run_dirs) == 6
    metric_keys, summary_keys = set(), set()
    for run_dir in run_dirs:
        metric_keys |= {k for line in (run_dir / "metrics.jsonl").read_text().splitlines()
                        for k in json.loads(line)}
        summary_keys |= set(json.loads((run_dir / "summary.json").read_text()))
    # eval and compile ran
    assert {"val_loss", "eval_time_s", "compile_recompiles", "data_time_s"} <= metric_keys
    assert not_registered(metric_keys, METRIC_KEYS) == []
    assert not_registered(summary_keys, SUMMARY_KEYS) == []


# ---------------------------------------------------------------------------------------------------
# docs/metrics.md
# ---------------------------------------------------------------------------------------------------


def documented_metric_keys(text: str) -> list[str]:
    """The backticked keys of the first column of the table under "## Metric keys".

    Example: "## Metric keys\\n\\n| key | meaning |\\n| --- | --- |\\n| `step` | ... |\\n| `a`, `b` | ... |"
    -> ["step", "a", "b"].
    """
    section = text.split("\n## Metric keys\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and the rule
    return [key for row in rows for key in re.findall(r"`([^`]+)`", row.split("|")[1])]


def test_docs_metric_table_lists_exactly_the_registered_metrics():
    path = ROOT / "docs" / "metrics.md"
    assert path.is_file(), ("docs/metrics.md is missing: it documents every metric key "
                            "(see trainer/registry.py)")
    documented = documented_metric_keys(path.read_text())
    assert documented, "docs/metrics.md: no table of metric keys under '## Metric keys'"
    assert not_registered(documented, METRIC_KEYS.keys() | SUMMARY_KEYS.keys()) == [], \
        "documented, not registered"
    assert sorted(METRIC_KEYS.keys() - set(documented)) == [], "registered, not in docs/metrics.md's table"
    assert documented_metric_keys("x\n## Metric keys\n\n| key | m |\n| --- | --- |\n| `step` | s |\n"
                                  "| `a`, `b` | m |\n\n## Next\n| `c` | m |") == ["step", "a", "b"]
