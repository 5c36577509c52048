"""The rules that span config sections are checked once, when the typed config is built, one message each."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from trainer.config import cross_section_rules, from_container, resolve_dtype
from trainer.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def composed(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="config", overrides=list(overrides)), resolve=True)


RULES = {
    ("train.compile=true", "distributed=deepspeed_zero3"): "train.compile=true does not run under ZeRO-3",
    ("train.on_nonfinite=skip", "distributed=deepspeed_zero2"):
        "train.on_nonfinite=skip needs distributed.engine=ddp",
    ('tokenizer.add_tokens=["<|tool|>"]',): "extends the tokenizer of train.init_from's checkpoint",
}


@pytest.mark.parametrize("overrides, message", list(RULES.items()))
def test_each_cross_section_rule_is_one_message_when_the_config_is_built(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        from_container(composed(*overrides), str(tmp_path))
    assert message in str(err.value) and "; " not in str(err.value).split(message)[0]


def test_two_broken_rules_give_both_messages():
    cfg = from_container(composed(), "run")
    cfg.train.compile, cfg.distributed.engine, cfg.distributed.zero_stage = True, "deepspeed", 3
    cfg.train.on_nonfinite = "skip"
    problems = cross_section_rules(cfg)
    assert len(problems) == 2 and "ZeRO-3" in problems[0] and "on_nonfinite" in problems[1]


@pytest.mark.parametrize("overrides", [(), ("experiment=demo",), ("experiment=sft",),
                                       ("distributed=deepspeed_zero3",),
                                       ("train.compile=true", "distributed=deepspeed_zero2"),
                                       ("train.on_nonfinite=skip",)])
def test_the_shipped_configs_break_no_rule(overrides):
    assert cross_section_rules(from_container(composed(*overrides), "run")) == []


def test_each_rule_is_stated_only_in_the_config():
    """The trainer and the engines no longer re-check (and re-word) the rules."""
    for needle in ("does not run under ZeRO-3", "needs distributed.engine=ddp (DeepSpeed clips",
                   "extends the tokenizer of train.init_from"):
        homes = [p.relative_to(ROOT).as_posix() for p in (ROOT / "trainer").rglob("*.py")
                 if needle in p.read_text()]
        assert homes == ["trainer/config.py"], (needle, homes)


def test_dtype_resolution():
    assert resolve_dtype("auto", CPU) == "fp32"
    assert resolve_dtype("bf16", CPU) == "bf16" and resolve_dtype("fp32", CPU) == "fp32"
    with pytest.raises(ConfigError, match="train.dtype"):
        resolve_dtype("fp16", CPU)
