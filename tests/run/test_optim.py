"""optim.fused and train.dtype=auto: what each resolves to on this device, and that the fused AdamW kernel
makes the same update as the default (foreach) one up to float rounding; which optimizer classes
optim._target_ takes; the warm-up's first steps."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.config import OptimConfig, TrainConfig, _build, resolve_dtype
from trainer.errors import ConfigError
from trainer.run.optim import build_optimizer, lr_factor, use_fused

CPU = torch.device("cpu")


def test_dtype_auto_is_fp32_on_cpu_and_explicit_dtypes_stay():
    assert TrainConfig().dtype == "auto"
    assert resolve_dtype("auto", CPU) == "fp32"
    assert resolve_dtype("bf16", CPU) == "bf16" and resolve_dtype("fp32", CPU) == "fp32"
    with pytest.raises(ConfigError, match="train.dtype must be one of"):
        _build(TrainConfig, {"dtype": "fp16"}, "train")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dtype_auto_is_bf16_on_a_gpu_that_has_it():
    assert resolve_dtype("auto", torch.device("cuda")) == ("bf16" if torch.cuda.is_bf16_supported()
                                                           else "fp32")


def test_fused_auto_is_cuda_only_true_needs_a_fused_kernel():
    class NoFused(torch.optim.SGD):
        def __init__(self, params, lr=0.1):
            super().__init__(params, lr=lr)

    assert use_fused(torch.optim.AdamW, "auto", CPU) is False
    assert use_fused(torch.optim.AdamW, "auto", torch.device("cuda")) is True
    assert use_fused(NoFused, "auto", torch.device("cuda")) is False
    assert (use_fused(torch.optim.AdamW, True, CPU) is True
            and use_fused(torch.optim.AdamW, False, CPU) is False)
    with pytest.raises(ConfigError, match="takes no `fused`"):
        use_fused(NoFused, True, CPU)
    with pytest.raises(ConfigError, match="optim.fused must be auto, true or false"):
        _build(OptimConfig, {"fused": "yes"}, "optim")


def test_fused_adamw_on_cpu_makes_the_default_update_up_to_rounding():
    """Five AdamW steps (weight decay on the matrix, none on the vector; gradients from 1 down to 1e-6) from
    the same parameters: the fused CPU kernel and the default foreach implementation end within 4 float32 ulps
    of each other (measured: 1 ulp), while the parameters moved by ~1e-2."""
    g = torch.Generator().manual_seed(0)
    start = [torch.randn(300, 50, generator=g), torch.randn(50, generator=g)]
    grads = [[torch.randn(300, 50, generator=g) * s, torch.randn(50, generator=g) * s]
             for s in (1, 1e-2, 1e-4, 1e-6, 1)]
    finals = {}
    for fused in (False, True):
        model = nn.Module()
        model.w, model.b = nn.Parameter(start[0].clone()), nn.Parameter(start[1].clone())
        opt = build_optimizer(model, OptimConfig(fused=fused))
        assert bool(opt.param_groups[0].get("fused")) is fused
        for gw, gb in grads:
            model.w.grad, model.b.grad = gw.clone(), gb.clone()
            opt.step()
        finals[fused] = (model.w.detach(), model.b.detach())
    for default, fused, first in zip(finals[False], finals[True], start, strict=True):
        assert (default - first).abs().max() > 1e-3  # it moved
        ulps = (default - fused).abs() / (torch.finfo(torch.float32).eps * default.abs().clamp(min=1.0))
        assert ulps.max() <= 4, ulps.max()


@pytest.mark.parametrize("target", ["torch.optim.AdamW", "torch.optim.Adam", "torch.optim.Adamax",
                                    "torch.optim.NAdam", "torch.optim.RAdam"])
def test_the_classes_the_config_names_build(target):
    model = nn.Linear(4, 3)
    opt = build_optimizer(model, OptimConfig(target=target))
    assert type(opt).__name__ == target.rsplit(".", 1)[1]
    assert [g["weight_decay"] for g in opt.param_groups] == [OptimConfig().weight_decay, 0.0]


def test_an_optimizer_without_betas_and_eps_is_a_config_error_not_a_type_error():
    with pytest.raises(ConfigError,
                       match=r"^optim._target_=torch.optim.SGD does not take betas, eps: ") as caught:
        build_optimizer(nn.Linear(4, 3), OptimConfig(target="torch.optim.SGD"))
    assert "torch.optim.AdamW" in str(caught.value) and "\n" not in str(caught.value)


def test_warm_up_starts_at_lr_over_warmup_steps():
    assert [lr_factor(s, 4, 100, 0.1) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
