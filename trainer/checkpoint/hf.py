"""Hugging Face model directories, both ways: each family packtrain's GPT computes, and back.

The families are declared in trainer/model/families/ (one file each: the class, which GPTConfig settings it
computes, its config.json both ways, its tensor names); this module applies them and names no module itself:

    gpt2     GPT2LMHeadModel     pos_emb=learned, norm=layernorm, mlp=gelu, tied head, n_kv_head = n_head
    llama    LlamaForCausalLM    pos_emb=rope, norm=rmsnorm, mlp=swiglu; GQA, untied head, theta and rope
                                 scaling (linear, llama3) from the config; biases everywhere or nowhere
    qwen2    Qwen2ForCausalLM    llama's, with biases on q, k and v alone (qkv_bias=true, bias=false)
    mistral  MistralForCausalLM  llama's without biases, sliding_window null

`family` says which a config is: `model.family` (set on import), else the first family that computes it. The
weights are the same tensors under other names (`pieces`): packtrain fuses q|k|v and gate|up, so one of its
tensors can be several Hugging Face tensors stacked along dim 0 (rows); GPT-2's Conv1D weights are transposed.

Reading streams: one tensor at a time from safetensors (model.safetensors or a sharded index) into the built
model's parameters, never a second full copy. Pickles (pytorch_model.bin) are refused: loading them runs code.
`transformers` is never imported here: the files are plain JSON and safetensors, and the tests load them with
`transformers` as an independent reference.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from trainer.checkpoint.store import TIED_KEY
from trainer.checkpoint.tensors import check_fits, first_nonfinite, numel
from trainer.data.tokenizer import SpecialIds
from trainer.errors import UserError
from trainer.model import GPT, AttentionConfig, GPTConfig
from trainer.model.families import FAMILIES, Piece, family_of

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
"""Hugging Face's name (transformers' SAFE_WEIGHTS_NAME) in a model directory: the same string as the
checkpoint store's WEIGHTS_FILE, but transformers' decision, not packtrain's (a checkpoint's names are the
store's)."""
INDEX_FILE = "model.safetensors.index.json"
"""A sharded model's map of tensor name -> shard file (transformers' SAFE_WEIGHTS_INDEX_NAME)."""
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
CLASSES = {kind: family.hf_class for kind, family in FAMILIES.items()}
SUPPORTED = ", ".join(f"{cls} (model_type {t!r})" for t, cls in CLASSES.items())
IGNORED_KEYS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
"""Buffers older transformers versions saved (GPT-2's causal mask, Llama's RoPE frequencies): not weights."""


class ExportError(UserError):
    """A model that cannot be written as, or a directory that does not hold, a supported Hugging Face
    model."""


# ---------------------------------------------------------------------------------------------------
# Which class, and the config.json of each (the families' own: trainer.model.families)
# ---------------------------------------------------------------------------------------------------


def family(cfg: GPTConfig) -> str:
    """The model_type of the transformers class that computes `cfg`'s model (`model.family`, else the first
    family that computes it); an ExportError if none does."""
    try:
        return family_of(cfg).model_type
    except ValueError as e:
        raise ExportError(str(e)) from None


def hf_config(cfg: GPTConfig, ids: SpecialIds, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of the transformers model that computes `cfg`'s (an ExportError if none does)."""
    kind = family(cfg)
    bos = ids.bos if getattr(ids, "bos", None) is not None else ids.eos
    return {
        "architectures": [CLASSES[kind]],
        "model_type": kind,
        "vocab_size": cfg.vocab_size,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "bos_token_id": bos,
        "eos_token_id": ids.eos,
        "pad_token_id": ids.pad,
        "use_cache": True,
        # The tensors' dtype, under both spellings (transformers 5 reads dtype, 4.x torch_dtype).
        "dtype": str(dtype).removeprefix("torch."),
        "torch_dtype": str(dtype).removeprefix("torch."),
        **FAMILIES[kind].hf_config(cfg),
    }


def generation_config(ids: SpecialIds) -> dict:
    """generation_config.json: a reply ends at the EOS (documents) or <|im_end|> (chat turns), where there is
    one."""
    eos = [ids.eos] + ([ids.im_end] if getattr(ids, "im_end", None) is not None and ids.im_end != ids.eos
                       else [])
    bos = ids.bos if getattr(ids, "bos", None) is not None else ids.eos
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": ids.pad}


def config_from_hf(config: dict, where: str | Path) -> GPTConfig:
    """packtrain's GPTConfig of a transformers config.json (its family's `config_from_hf`); one line naming
    `where` and what is not supported otherwise.

    Example: a SmolLM2-135M config -> GPTConfig(n_layer=30, n_head=9, n_kv_head=3, n_embd=576,
    mlp_hidden=1536, norm='rmsnorm', mlp='swiglu', pos_emb='rope', rope_theta=100000.0, tie_embeddings=True,
    family='llama', ...).
    """
    kind = config.get("model_type")
    if kind not in CLASSES:
        raise ExportError(f"{where}: model_type {kind!r} is not supported; supported: {SUPPORTED}")
    architectures = config.get("architectures") or [CLASSES[kind]]
    if architectures != [CLASSES[kind]]:
        raise ExportError(f"{where}: architectures {architectures} is not a causal language model packtrain "
                          f"computes; supported: {SUPPORTED}")
    try:
        cfg = FAMILIES[kind].config_from_hf(config)
        family(cfg)  # the class it came from computes it: a check of the mapping itself
    except (ValueError, TypeError) as e:  # the family's checks, GPTConfig's own (sizes, rope scaling)
        raise ExportError(f"{where}: {e}") from e
    return cfg


# ---------------------------------------------------------------------------------------------------
# Names: which rows of which packtrain tensor each Hugging Face tensor is
# ---------------------------------------------------------------------------------------------------


def pieces(cfg: GPTConfig) -> list[Piece]:
    """Every Hugging Face tensor of `cfg`'s class and where it lives in packtrain's model (its family's map);
    the tied head absent."""
    return FAMILIES[family(cfg)].pieces(cfg)


def _view(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The part of packtrain's `tensor` that `piece` names, in the Hugging Face orientation."""
    part = tensor if piece.rows is None else tensor[piece.rows[0] : piece.rows[1]]
    return part.t() if piece.transpose else part


def hf_state_dict(model: GPT, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under its class's names, each its own contiguous tensor (in `dtype` if given); the
    tied head left out (written once, as transformers writes it). GPT-2 biases the model lacks are zeros."""
    return to_hf(model.state_dict(), model.cfg, dtype)


def to_hf(state: dict[str, torch.Tensor], cfg: GPTConfig,
          dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """packtrain-named tensors (weights, or gradients) of a `cfg` model -> its class's names; see
    `hf_state_dict`."""
    out = {}
    for piece in pieces(cfg):
        if piece.name in state:
            tensor = _view(state[piece.name].detach(), piece)
        else:  # GPT-2 always has biases: a bias=False packtrain model exports zeros
            weight = state[piece.name.removesuffix(".bias") + ".weight"]
            tensor = torch.zeros(weight.shape[0], dtype=weight.dtype)
        out[piece.hf] = tensor.to("cpu", dtype or tensor.dtype).contiguous().clone()
    return out


# ---------------------------------------------------------------------------------------------------
# Reading a Hugging Face model directory
# ---------------------------------------------------------------------------------------------------


def is_hf_dir(path: str | Path) -> bool:
    """Whether `path` holds a Hugging Face model: config.json and model.safetensors or a sharded index of them
    (or only pickles, which `read_config` then refuses by name)."""
    path = Path(path)
    return (path / CONFIG_FILE).is_file() and any(
        (path / name).is_file() for name in (WEIGHTS_FILE, INDEX_FILE, *PICKLE_FILES))


def read_config(path: str | Path) -> GPTConfig:
    """The GPTConfig of Hugging Face model directory `path` (its config.json)."""
    file = Path(path) / CONFIG_FILE
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ExportError(f"{path} is not a Hugging Face model directory: no {CONFIG_FILE}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ExportError(f"{file}: unreadable ({e})") from e
    if not isinstance(config, dict):
        raise ExportError(f"{file}: not a JSON object")
    cfg = config_from_hf(config, file)
    shapes = header_shapes(weight_files(path))
    tied = shapes.get(TIED_KEY, ()) if cfg.tie_embeddings else None
    check_fits(cfg, numel(s for k, s in shapes.items() if not k.endswith(IGNORED_KEYS)), file,
               ", ".join(sorted({str(f) for f in weight_files(path)})), numel([tied]) if tied else 0)
    return cfg


def header_shapes(files: list[Path]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from the headers of safetensors `files`, no tensor read."""
    out = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    out[key] = tuple(f.get_slice(key).get_shape())
        except Exception as e:  # safetensors raises its own SafetensorError for a corrupt or truncated file
            raise ExportError(f"{file}: not a readable safetensors file ({e})") from e
    return out


def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of `path`: model.safetensors, or every shard its index names (each a file
    directly in `path`: an index naming one elsewhere is refused). Pickled weights are refused: loading them
    could run code."""
    path = Path(path)
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    index = path / INDEX_FILE
    if not index.is_file():
        pickled = [n for n in PICKLE_FILES if (path / n).is_file()]
        if pickled:
            raise ExportError(f"{path} holds {pickled[0]} (a pickle: loading it could run code) and no "
                              f"{WEIGHTS_FILE}: convert it first (transformers: "
                              "model.save_pretrained(dir, safe_serialization=True))")
        raise ExportError(f"{path} is not a Hugging Face model directory: no {WEIGHTS_FILE} or {INDEX_FILE}")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ExportError(f"{index}: unreadable or without a weight_map ({e})") from e
    for name in names:
        if not isinstance(name, str) or Path(name).name != name or name.startswith("."):
            raise ExportError(f"{index}: shard {name!r} is not a file name in {path}: refused")
        if not (path / name).is_file():
            raise ExportError(f"{index}: shard {name} is missing from {path}")
    return [path / name for name in names]


def _tensors(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """(file, key, tensor) one tensor at a time: only the one being copied is in memory beside the model."""
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for key in f.keys():
                    yield file, key, f.get_tensor(key)
        except ExportError:
            raise
        except Exception as e:  # safetensors raises its own SafetensorError for a corrupt or truncated file
            raise ExportError(f"{file}: not a readable safetensors file ({e})") from e


@torch.no_grad()
def load_hf_into(model: GPT, path: str | Path) -> None:
    """Copy the weights of Hugging Face directory `path` into `model` (built for its config), tensor by
    tensor; an error naming the file and keys that are missing, unexpected or of another shape."""
    plan = {p.hf: p for p in pieces(model.cfg)}
    state = model.state_dict()
    tied = set(model.tied_keys)
    seen: set[str] = set()
    for file, key, tensor in _tensors(weight_files(path)):
        if key.endswith(IGNORED_KEYS) or key in tied:
            continue  # old buffers; a tied head some exports also write (it is the embedding)
        piece = plan.get(key)
        if piece is None:
            raise ExportError(f"{file}: unexpected tensor {key!r} for {CLASSES[family(model.cfg)]} with this "
                              f"config ({Path(path) / CONFIG_FILE})")
        target = _view(state[piece.name], piece)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ExportError(f"{file}: {key} has shape {tuple(tensor.shape)}, "
                              f"the config says {tuple(target.shape)}")
        if (bad := first_nonfinite(tensor, key)) is not None:
            raise ExportError(f"{file}: tensor {key} holds {bad[1]} values: the weights are damaged; refused")
        target.copy_(tensor)
        seen.add(key)
    missing = [k for k in plan if k not in seen]
    if missing:
        raise ExportError(f"{path}: the weights lack {len(missing)} tensor(s) of its config, "
                          f"e.g. {missing[:3]}")


def load_hf(path: str | Path, device: str | torch.device = "cpu",
            attention: AttentionConfig | None = None) -> GPT:
    """A Hugging Face model directory (GPT-2, Llama, Qwen2; or what `trainer.export` writes) as packtrain's
    GPT, in eval mode."""
    model = GPT(read_config(path), attention or AttentionConfig(backend="sdpa_docs"))
    load_hf_into(model, path)
    return model.to(device).eval()
