"""A checkpoint's model alone: its shape, its weights and its tokenizer, read without running code.

Every packtrain checkpoint (DDP or DeepSpeed) holds `model.safetensors` (the tied `lm_head.weight` left out:
safetensors refuses shared storage), `meta.json` (with the resolved run config, whose `model` section is the
shape) and `conventions.json` (the tokenizer's sha256 and vocab size). This module turns those into a built
`GPT`, for `train.init_from`, `trainer.export` and `trainer.generate`; optimizer, schedule and data state are
never read here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from trainer.errors import UserError
from trainer.model import GPT, AttentionConfig, GPTConfig

WEIGHTS_FILE = "model.safetensors"
TIED_KEY = "lm_head.weight"
"""Tied to `wte.weight`; absent from the file and restored by the model's own tying."""


class WeightsError(UserError):
    """A directory that does not hold a packtrain checkpoint's model."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightsError(f"{path.parent} is not a packtrain checkpoint: no {path.name} (give a "
                           "<run dir>/checkpoints/step_NNNNNN directory)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: unreadable ({e})") from e


def checkpoint_meta(path: str | Path) -> dict:
    """meta.json of a checkpoint directory (step, counters, engine, the resolved run config)."""
    return _read_json(Path(path) / "meta.json")


def checkpoint_conventions(path: str | Path) -> dict:
    """conventions.json of a checkpoint directory (layout, labels, loss, tokenizer hash and size)."""
    return _read_json(Path(path) / "conventions.json")


def model_config(path: str | Path) -> GPTConfig:
    """The GPTConfig the checkpoint's weights were built with, vocab_size filled in."""
    meta, conv = checkpoint_meta(path), checkpoint_conventions(path)
    section = dict(meta.get("config", {}).get("model", {}))
    if not section:
        raise WeightsError(f"{Path(path) / 'meta.json'} holds no config.model: not a packtrain checkpoint")
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    cfg = GPTConfig(**{k: v for k, v in section.items() if k in known})
    if cfg.vocab_size is None:
        cfg = dataclasses.replace(cfg, vocab_size=int(conv["tokenizer"]["vocab_size"]))
    return cfg


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in `<path>/model.safetensors` (safetensors: loading never runs code), tied key omitted."""
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise WeightsError(f"{Path(path)} holds no {WEIGHTS_FILE}: not a packtrain checkpoint (or one written "
                           "before the weights were saved on their own)")
    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises its own SafetensorError for a corrupt or truncated file
        raise WeightsError(f"{file}: not a readable safetensors file ({e})") from e


def tokenizer_dir(path: str | Path) -> Path:
    """The tokenizer the checkpoint's weights were trained with."""
    out = Path(path) / "tokenizer"
    if not (out / "tokenizer.json").is_file():
        raise WeightsError(f"{Path(path)} holds no tokenizer/tokenizer.json: not a packtrain checkpoint")
    return out


def load_model(path: str | Path, attention: AttentionConfig | None = None,
               device: str | torch.device = "cpu") -> GPT:
    """The checkpoint's model in eval mode, weights loaded (strictly: every key but the tied head)."""
    model = GPT(model_config(path), attention or AttentionConfig(backend="sdpa_docs"))
    load_into(model, load_weights(path), where=Path(path) / WEIGHTS_FILE)
    return model.to(device).eval()


def load_into(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: str | Path) -> None:
    """Copy `weights` into `model`: the same keys (but the tied head) and shapes, or an error naming the differences."""
    own = {k: v for k, v in model.state_dict().items() if k != TIED_KEY}
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    wrong = sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        parts = [f"missing {missing[:4]}" if missing else "", f"unexpected {unexpected[:4]}" if unexpected else "",
                 "shapes differ: " + ", ".join(f"{k} {tuple(weights[k].shape)} vs model {tuple(own[k].shape)}"
                                               for k in wrong[:4]) if wrong else ""]
        raise WeightsError(f"{where} does not fit this model ({'; '.join(p for p in parts if p)}): "
                           "use the same model= config as the run that wrote it")
    model.load_state_dict(weights, strict=False)
