"""Tensors read from elsewhere are checked before they are used: finite, and as many as their config says.

Non-finite state: a NaN in a checkpoint's weights or optimizer state trains every weight to NaN within a step
or two, after which the next checkpoint is saved with fresh, valid checksums. So weights and optimizer state
are checked when they are read (`first_nonfinite`), and refused with the file and the tensor named.

Bounded imports: a config.json (a Hugging Face directory's, or a checkpoint's meta.json) decides how much
memory a model build allocates. `num_hidden_layers: 1000000` beside a 1 MB safetensors file must not allocate
terabytes: the parameter count the config describes (`config_params`, from two one- and two-layer builds on
the meta device, never the whole one) is compared with the count the weight files' headers hold before any
model is built.

    first_nonfinite({"wte.weight": w, "optimizer": {"state": {0: {"exp_avg": nan_tensor}}}})
        -> ("optimizer.state.0.exp_avg", "NaN")
    check_fits(cfg, held=124_439_808, config_file=Path("hf/config.json"), weights="hf/model.safetensors")
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from trainer.errors import UserError


class ConfigDoesNotFitError(UserError, ValueError):
    """A model config that describes other (or more) parameters than its weight files hold."""


def first_nonfinite(state: Any, prefix: str = "") -> tuple[str, str] | None:
    """(dotted name, 'NaN' or 'inf') of the first floating tensor in `state` (nested dicts, lists, tuples)
    holding a NaN or an infinity; None if every one is finite. A DTensor is checked by its local part
    (collective-free)."""
    for name, tensor in _named_tensors(state, prefix):
        if not (tensor.is_floating_point() or tensor.is_complex()) or tensor.numel() == 0 or tensor.is_meta:
            continue
        # one pass, no mask: a NaN or an inf anywhere makes the sum non-finite
        if math.isfinite(tensor.sum().item()):
            continue
        if not bool(torch.isfinite(tensor).all()):  # else the sum overflowed: the exact check decides
            return name, "NaN" if bool(torch.isnan(tensor).any()) else "inf"
    return None


def _named_tensors(state: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(state, torch.Tensor):
        yield prefix, getattr(state, "_local_tensor", state)
    elif isinstance(state, dict):
        for key, value in state.items():
            yield from _named_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(state, (list, tuple)):
        for i, value in enumerate(state):
            yield from _named_tensors(value, f"{prefix}.{i}" if prefix else str(i))


def config_params(cfg) -> int:
    """The number of parameters (a tied head counted once) of the model `cfg` describes, computed without
    building it: on the meta device, a one- and a two-layer model; the count grows by the same amount for
    every layer.

    Example: gpt2-124m's config -> 124_439_808."""
    from trainer.model import AttentionConfig, build_model

    def count(layers: int) -> int:
        model = build_model(dataclasses.replace(cfg, n_layer=layers), AttentionConfig(backend="sdpa_docs"),
                            meta=True)
        return model.num_params()

    one, two = count(1), count(2)
    return one + (cfg.n_layer - 1) * (two - one)


def check_fits(cfg, held: int, config_file: Path, weights: str | Path, tied_head_held: int = 0) -> None:
    """Refuse (ConfigDoesNotFitError, naming `config_file`) a config whose model has another number of
    parameters than the `held` that the weight files' headers hold (`tied_head_held`: what a tied head the
    files also store adds to `held`). Before any model is built."""
    described = config_params(cfg)
    if described != held - tied_head_held:
        raise ConfigDoesNotFitError(
            f"{config_file}: describes a model of {described:,} parameters ({cfg.n_layer:,} layers, width "
            f"{cfg.n_embd:,}, vocabulary {cfg.vocab_size:,}), but its weights ({weights}) hold {held:,}: the "
            "config does not describe these weights (damaged or forged); refused before building the model")


def numel(shapes: Iterable[Iterable[int]]) -> int:
    """The number of elements of tensors of these shapes."""
    total = 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= int(d)
        total += n
    return total
