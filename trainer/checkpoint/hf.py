"""Hugging Face GPT-2 (`GPT2LMHeadModel`) names and config for packtrain's GPT, both ways.

packtrain's learned-position GPT is GPT-2's architecture (pre-norm LayerNorm with eps 1e-5, tanh GELU, fused
q|k|v projection split in that order and head-major, attention scaled by 1/sqrt(head_dim), tied lm_head), so
its weights are GPT-2's under other names:

    packtrain                              GPT-2
    wte.weight                             transformer.wte.weight      (lm_head.weight is tied to it in both)
    wpe.weight                             transformer.wpe.weight
    blocks.N.ln_1.weight / .bias           transformer.h.N.ln_1.weight / .bias         (ln_2, ln_f alike)
    blocks.N.attn.c_attn.weight (3C, C)    transformer.h.N.attn.c_attn.weight (C, 3C)  (transposed)
    blocks.N.attn.c_attn.bias (3C,)        transformer.h.N.attn.c_attn.bias (3C,)

and the same for attn.c_proj, mlp.c_fc and mlp.c_proj. GPT-2's Conv1D computes x @ W + b with W (in, out);
nn.Linear computes x @ W.T + b with W (out, in): every Linear weight inside a block is transposed.

RoPE models have no GPT-2 equivalent and are refused. `transformers` is never imported here: the files are
plain JSON and safetensors, and a test loads them with `transformers` as an independent reference.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import load_file

from trainer.checkpoint.store import TIED_KEY
from trainer.checkpoint.weights import load_into
from trainer.data.tokenizer import SpecialIds
from trainer.errors import UserError
from trainer.model import GPT, AttentionConfig, GPTConfig

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
"""Hugging Face's name (transformers' SAFE_WEIGHTS_NAME) in an export directory: the same string as the checkpoint
store's WEIGHTS_FILE, but transformers' decision, not packtrain's (a checkpoint's names are the store's)."""
PREFIX = "transformer."
CONV1D_WEIGHTS = (".c_attn.weight", ".c_proj.weight", ".c_fc.weight")
"""Weights stored transposed by GPT-2 (its Conv1D layers): every Linear inside a block."""
LAYER_NORM_EPS = 1e-5
"""torch.nn.LayerNorm's default, which packtrain's GPT uses."""
ACTIVATION = "gelu_new"
"""transformers' name for the tanh approximation of GELU (F.gelu(approximate='tanh'))."""


class ExportError(UserError):
    """A model that cannot be written as, or a directory that does not hold, a GPT-2 export."""


def gpt2_name(name: str) -> tuple[str, bool]:
    """The GPT-2 key of packtrain parameter `name`, and whether its tensor is stored transposed.

    Example: "blocks.1.mlp.c_fc.weight" -> ("transformer.h.1.mlp.c_fc.weight", True).
    """
    return PREFIX + re.sub(r"^blocks\.", "h.", name), name.endswith(CONV1D_WEIGHTS)


def to_gpt2(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """packtrain state (or gradients) -> GPT-2 keys, Conv1D weights transposed; the tied head left out."""
    out = {}
    for name, tensor in state.items():
        if name == TIED_KEY:
            continue
        key, transpose = gpt2_name(name)
        out[key] = (tensor.t() if transpose else tensor).contiguous()
    return out


def from_gpt2(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2 keys (with or without the "transformer." prefix) -> packtrain state; inverse of `to_gpt2`.

    Dropped: lm_head.weight (tied) and the causal-mask buffers `h.N.attn.bias` / `h.N.attn.masked_bias`
    that older transformers versions saved.
    """
    out = {}
    for key, tensor in state.items():
        name = key.removeprefix(PREFIX)
        if name == TIED_KEY or re.fullmatch(r"h\.\d+\.attn\.(masked_)?bias", name):
            continue
        name = re.sub(r"^h\.", "blocks.", name)
        out[name] = (tensor.t() if name.endswith(CONV1D_WEIGHTS) else tensor).contiguous()
    return out


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The model's weights under GPT-2 names. GPT-2 always has biases: a bias=False model exports zeros."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear | nn.LayerNorm) and module.bias is None and name != "lm_head":
            state[f"{name}.bias"] = torch.zeros(module.weight.shape[0], dtype=module.weight.dtype)
    return to_gpt2(state)


def check_exportable(cfg: GPTConfig) -> None:
    if cfg.pos_emb != "learned":
        raise ExportError(f"only learned positions export to GPT-2; this model has model.pos_emb={cfg.pos_emb}")


def gpt2_config(cfg: GPTConfig, ids: SpecialIds, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of the GPT-2 equivalent of `cfg` (learned positions only)."""
    check_exportable(cfg)
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.max_seq_len,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": None,  # 4 * n_embd, as in packtrain's MLP
        "activation_function": ACTIVATION,
        "layer_norm_epsilon": LAYER_NORM_EPS,
        "embd_pdrop": cfg.dropout,
        "resid_pdrop": cfg.dropout,
        "attn_pdrop": 0.0,  # packtrain has no dropout inside attention
        "initializer_range": cfg.init_std,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "bos_token_id": ids.eos,
        "eos_token_id": ids.eos,
        "pad_token_id": ids.pad,
        "use_cache": True,
        "dtype": str(dtype).removeprefix("torch."),
    }


def generation_config(ids: SpecialIds) -> dict:
    """generation_config.json: a reply ends at <|endoftext|> (documents) or <|im_end|> (chat turns)."""
    return {"bos_token_id": ids.eos, "eos_token_id": [ids.eos, ids.im_end], "pad_token_id": ids.pad}


def config_from_gpt2(config: dict, where: str | Path) -> GPTConfig:
    """The packtrain GPTConfig of a GPT-2 config.json; refuses variants packtrain's GPT does not compute."""
    if config.get("model_type") != "gpt2":
        raise ExportError(f"{where}: model_type {config.get('model_type')!r}, expected 'gpt2'")
    missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head") if k not in config]
    if missing:
        raise ExportError(f"{where}: no {missing} in the GPT-2 config")
    n_embd = config["n_embd"]
    unsupported = {
        "activation_function": (config.get("activation_function", ACTIVATION), (ACTIVATION, "gelu_pytorch_tanh")),
        "layer_norm_epsilon": (config.get("layer_norm_epsilon", LAYER_NORM_EPS), (LAYER_NORM_EPS,)),
        "n_inner": (config.get("n_inner"), (None, 4 * n_embd)),
        "scale_attn_weights": (config.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (config.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "add_cross_attention": (config.get("add_cross_attention", False), (False,)),
    }
    bad = [f"{k}={v!r}" for k, (v, ok) in unsupported.items() if v not in ok]
    if bad:
        raise ExportError(f"{where}: GPT-2 variant packtrain's GPT does not compute ({', '.join(bad)})")
    return GPTConfig(vocab_size=config["vocab_size"], n_layer=config["n_layer"], n_head=config["n_head"],
                     n_embd=n_embd, max_seq_len=config["n_positions"], bias=True, pos_emb="learned")


def is_export(path: str | Path) -> bool:
    """Whether `path` looks like a GPT-2 directory (config.json and model.safetensors)."""
    return (Path(path) / CONFIG_FILE).is_file() and (Path(path) / WEIGHTS_FILE).is_file()


def load_export(path: str | Path, device: str | torch.device = "cpu") -> GPT:
    """A GPT-2 directory (as `trainer.export` writes it) as packtrain's GPT, in eval mode."""
    path = Path(path)
    if not is_export(path):
        raise ExportError(f"{path} is not a GPT-2 export: it needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        weights = load_file(str(path / WEIGHTS_FILE))
    except Exception as e:  # JSON or safetensors errors: a corrupt or truncated file
        raise ExportError(f"{path}: unreadable {CONFIG_FILE} or {WEIGHTS_FILE} ({e})") from e
    model = GPT(config_from_gpt2(config, path / CONFIG_FILE), AttentionConfig(backend="sdpa_docs"))
    load_into(model, from_gpt2(weights), where=path / WEIGHTS_FILE)
    return model.to(device).eval()
