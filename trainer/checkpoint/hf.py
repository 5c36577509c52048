"""Hugging Face model directories, both ways: GPT-2 and the Llama family as packtrain's GPT, and back.

Three transformers classes compute what packtrain's GPT computes (trainer.model.gpt), each for one setting of its
fields; `family` says which a config is:

    gpt2    GPT2LMHeadModel    pos_emb=learned, norm=layernorm, mlp=gelu, tied head, n_kv_head = n_head
    llama   LlamaForCausalLM   pos_emb=rope, norm=rmsnorm, mlp=swiglu; GQA, untied head, theta and rope
                               scaling (linear, llama3) from the config; biases everywhere or nowhere
    qwen2   Qwen2ForCausalLM   llama's, with biases on q, k and v alone (qkv_bias=true, bias=false)

The weights are the same tensors under other names (`pieces`). packtrain fuses two families of projections, so
one of its tensors can be several Hugging Face tensors stacked along dim 0 (rows):

    packtrain                         GPT-2                               Llama / Qwen2
    wte.weight                        transformer.wte.weight              model.embed_tokens.weight
    wpe.weight                        transformer.wpe.weight              -
    blocks.N.ln_1.*                   transformer.h.N.ln_1.*              model.layers.N.input_layernorm.weight
    blocks.N.attn.c_attn.* (q|k|v)    transformer.h.N.attn.c_attn.* (T)   ...self_attn.{q,k,v}_proj.*, stacked
    blocks.N.attn.c_proj.*            transformer.h.N.attn.c_proj.* (T)   ...self_attn.o_proj.*
    blocks.N.ln_2.*                   transformer.h.N.ln_2.*              ...post_attention_layernorm.weight
    blocks.N.mlp.c_fc.* (gate|up)     transformer.h.N.mlp.c_fc.* (T)      ...mlp.{gate,up}_proj.*, stacked
    blocks.N.mlp.c_proj.*             transformer.h.N.mlp.c_proj.* (T)    ...mlp.down_proj.*
    ln_f.*                            transformer.ln_f.*                  model.norm.weight
    lm_head.weight (untied only)      - (tied)                            lm_head.weight

(T): GPT-2's Conv1D stores W as (in, out), nn.Linear as (out, in): transposed. Llama's q and k are already in the
rotate-half layout packtrain's RoPE uses (transformers' conversion script permuted Meta's), so nothing is permuted.

Reading streams: one tensor at a time from safetensors (model.safetensors or a sharded index) into the built
model's parameters, never a second full copy. Pickles (pytorch_model.bin) are refused: loading them runs code.
`transformers` is never imported here: the files are plain JSON and safetensors, and the tests load them with
`transformers` as an independent reference.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from trainer.checkpoint.store import TIED_KEY
from trainer.checkpoint.tensors import check_fits, first_nonfinite, numel
from trainer.data.tokenizer import SpecialIds
from trainer.errors import UserError
from trainer.model import GPT, AttentionConfig, GPTConfig

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
"""Hugging Face's name (transformers' SAFE_WEIGHTS_NAME) in a model directory: the same string as the checkpoint
store's WEIGHTS_FILE, but transformers' decision, not packtrain's (a checkpoint's names are the store's)."""
INDEX_FILE = "model.safetensors.index.json"
"""A sharded model's map of tensor name -> shard file (transformers' SAFE_WEIGHTS_INDEX_NAME)."""
PICKLE_FILES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""transformers' names for the tanh approximation of GELU (F.gelu(approximate='tanh')); the first is written."""
CLASSES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED = ", ".join(f"{cls} (model_type {t!r})" for t, cls in CLASSES.items())
IGNORED_KEYS = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")
"""Buffers older transformers versions saved (GPT-2's causal mask, Llama's RoPE frequencies): not weights."""


class ExportError(UserError):
    """A model that cannot be written as, or a directory that does not hold, a supported Hugging Face model."""


# ---------------------------------------------------------------------------------------------------
# Which class, and the config.json of each
# ---------------------------------------------------------------------------------------------------


def family(cfg: GPTConfig) -> str:
    """'gpt2', 'llama' or 'qwen2': the transformers class that computes `cfg`'s model; an ExportError if none does."""
    qkv_bias = cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias
    if (cfg.pos_emb, cfg.norm, cfg.mlp) == ("learned", "layernorm", "gelu"):
        if cfg.tie_embeddings and cfg.kv_heads == cfg.n_head and qkv_bias == cfg.bias and cfg.mlp_hidden in (
                None, 4 * cfg.n_embd):
            return "gpt2"
    elif (cfg.pos_emb, cfg.norm, cfg.mlp) == ("rope", "rmsnorm", "swiglu"):
        if qkv_bias == cfg.bias:
            return "llama"
        if qkv_bias and not cfg.bias:
            return "qwen2"
    raise ExportError(
        f"no Hugging Face class computes this model (pos_emb={cfg.pos_emb}, norm={cfg.norm}, mlp={cfg.mlp}, "
        f"tie_embeddings={cfg.tie_embeddings}, n_kv_head={cfg.n_kv_head}): GPT2LMHeadModel needs pos_emb=learned, "
        "norm=layernorm, mlp=gelu, a tied head and no GQA; LlamaForCausalLM and Qwen2ForCausalLM need pos_emb=rope, "
        "norm=rmsnorm, mlp=swiglu (configs/model/llama-tiny.yaml)")


def hf_config(cfg: GPTConfig, ids: SpecialIds, dtype: torch.dtype = torch.float32) -> dict:
    """config.json of the transformers model that computes `cfg`'s (an ExportError if none does)."""
    kind = family(cfg)
    bos = ids.bos if getattr(ids, "bos", None) is not None else ids.eos
    common = {
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
    }
    if kind == "gpt2":
        return {
            **common,
            "n_positions": cfg.max_seq_len,
            "n_embd": cfg.n_embd,
            "n_layer": cfg.n_layer,
            "n_head": cfg.n_head,
            "n_inner": None,  # 4 * n_embd, as in packtrain's MLP
            "activation_function": GPT2_ACTIVATIONS[0],
            "layer_norm_epsilon": cfg.norm_eps,
            "embd_pdrop": cfg.dropout,
            "resid_pdrop": cfg.dropout,
            "attn_pdrop": 0.0,  # packtrain has no dropout inside attention
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
    scaling = dict(cfg.rope_scaling or {})
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    out = {
        **common,
        "hidden_size": cfg.n_embd,
        "intermediate_size": cfg.hidden,
        "num_hidden_layers": cfg.n_layer,
        "num_attention_heads": cfg.n_head,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters, 4.x rope_theta and rope_scaling: both, the same numbers.
        "rope_theta": cfg.rope_theta,
        "rope_scaling": {"rope_type": rope_type, **scaling} if rope_type != "default" else None,
        "rope_parameters": {"rope_type": rope_type, "rope_theta": cfg.rope_theta, **scaling},
        "attention_dropout": 0.0,
    }
    if kind == "llama":
        return {**out, "attention_bias": cfg.bias, "mlp_bias": cfg.bias}
    return {**out, "use_sliding_window": False, "sliding_window": None, "max_window_layers": cfg.n_layer}


def generation_config(ids: SpecialIds) -> dict:
    """generation_config.json: a reply ends at the EOS (documents) or <|im_end|> (chat turns), where there is one."""
    eos = [ids.eos] + ([ids.im_end] if getattr(ids, "im_end", None) is not None and ids.im_end != ids.eos else [])
    bos = ids.bos if getattr(ids, "bos", None) is not None else ids.eos
    return {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": ids.pad}


def config_from_hf(config: dict, where: str | Path) -> GPTConfig:
    """packtrain's GPTConfig of a transformers config.json; one line naming what is not supported otherwise.

    Example: a SmolLM2-135M config -> GPTConfig(n_layer=30, n_head=9, n_kv_head=3, n_embd=576, mlp_hidden=1536,
    norm='rmsnorm', mlp='swiglu', pos_emb='rope', rope_theta=100000.0, tie_embeddings=True, ...).
    """
    kind = config.get("model_type")
    if kind not in CLASSES:
        raise ExportError(f"{where}: model_type {kind!r} is not supported; supported: {SUPPORTED}")
    architectures = config.get("architectures") or [CLASSES[kind]]
    if architectures != [CLASSES[kind]]:
        raise ExportError(f"{where}: architectures {architectures} is not a causal language model packtrain "
                          f"computes; supported: {SUPPORTED}")
    try:
        cfg = _gpt2_config(config, where) if kind == "gpt2" else _llama_config(config, kind, where)
    except (ValueError, TypeError) as e:  # GPTConfig's own checks (sizes, rope scaling)
        raise ExportError(f"{where}: {e}") from e
    family(cfg)  # the class it came from computes it: a check of the mapping itself
    return cfg


def _required(config: dict, keys: tuple[str, ...], where: str | Path, optional: tuple[str, ...] = ()) -> None:
    """Every key of `keys` present, and each of them (and of `optional`, where present and not null) a positive
    integer: one line naming `where` and the key otherwise (a size read as a string, or -4 heads)."""
    missing = [k for k in keys if k not in config]
    if missing:
        raise ExportError(f"{where}: no {missing} in the {config.get('model_type')} config")
    for key in (*keys, *(k for k in optional if config.get(k) is not None)):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ExportError(f"{where}: {key} must be a positive integer, got {value!r}")


def _refuse_variants(config: dict, unsupported: dict, where: str | Path) -> None:
    bad = [f"{k}={v!r}" for k, (v, ok) in unsupported.items() if v not in ok]
    if bad:
        raise ExportError(f"{where}: a {config.get('model_type')} variant packtrain's GPT does not compute "
                          f"({', '.join(bad)})")


def _gpt2_config(config: dict, where: str | Path) -> GPTConfig:
    _required(config, ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head"), where, ("n_inner",))
    n_embd = config["n_embd"]
    _refuse_variants(config, {
        "activation_function": (config.get("activation_function", GPT2_ACTIVATIONS[0]), GPT2_ACTIVATIONS),
        "n_inner": (config.get("n_inner"), (None, 4 * n_embd)),
        "scale_attn_weights": (config.get("scale_attn_weights", True), (True,)),
        "scale_attn_by_inverse_layer_idx": (config.get("scale_attn_by_inverse_layer_idx", False), (False,)),
        "add_cross_attention": (config.get("add_cross_attention", False), (False,)),
    }, where)
    return GPTConfig(vocab_size=config["vocab_size"], n_layer=config["n_layer"], n_head=config["n_head"],
                     n_embd=n_embd, max_seq_len=config["n_positions"], bias=True, pos_emb="learned",
                     norm_eps=float(config.get("layer_norm_epsilon", 1e-5)),
                     init_std=float(config.get("initializer_range", 0.02)))


def _llama_config(config: dict, kind: str, where: str | Path) -> GPTConfig:
    _required(config, ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                       "num_attention_heads"), where, ("num_key_value_heads", "head_dim", "max_position_embeddings"))
    n_embd, n_head = config["hidden_size"], config["num_attention_heads"]
    attention_bias, mlp_bias = config.get("attention_bias", False), config.get("mlp_bias", False)
    _refuse_variants(config, {
        "hidden_act": (config.get("hidden_act", "silu"), ("silu",)),
        "head_dim": (config.get("head_dim", n_embd // n_head), (n_embd // n_head,)),
        "attention_dropout": (config.get("attention_dropout", 0.0), (0, 0.0)),
        "use_sliding_window": (config.get("use_sliding_window", False), (False,)),
        "layer_types": (sorted(set(config.get("layer_types") or ["full_attention"])), (["full_attention"],)),
        # Llama's biases: q, k, v and o together, the MLP's together; packtrain has one switch for both.
        "mlp_bias": (mlp_bias, (attention_bias,)),
    }, where)
    rope = dict(config.get("rope_parameters") or {})  # transformers 5: theta and scaling in one dict
    theta = rope.pop("rope_theta", config.get("rope_theta", 10000.0))
    scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else config.get("rope_scaling")
    qkv_bias = True if kind == "qwen2" else None
    return GPTConfig(
        vocab_size=config["vocab_size"], n_layer=config["num_hidden_layers"], n_head=n_head, n_embd=n_embd,
        n_kv_head=config.get("num_key_value_heads") or n_head, mlp_hidden=config["intermediate_size"],
        max_seq_len=config.get("max_position_embeddings", 2048), bias=bool(attention_bias) if kind == "llama" else False,
        qkv_bias=qkv_bias, pos_emb="rope", rope_theta=float(theta), rope_scaling=dict(scaling) if scaling else None,
        norm="rmsnorm", norm_eps=float(config.get("rms_norm_eps", 1e-6)), mlp="swiglu",
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        init_std=float(config.get("initializer_range", 0.02)))


# ---------------------------------------------------------------------------------------------------
# Names: which rows of which packtrain tensor each Hugging Face tensor is
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Piece:
    """Hugging Face tensor `hf` is rows [start, stop) of packtrain tensor `name` (all of it: None), transposed
    (GPT-2's Conv1D) or not."""

    hf: str
    name: str
    rows: tuple[int, int] | None = None
    transpose: bool = False


def pieces(cfg: GPTConfig) -> list[Piece]:
    """Every Hugging Face tensor of `cfg`'s class and where it lives in packtrain's model; the tied head absent.

    Example (llama, n_head 4, n_kv_head 2, head_dim 8): Piece("model.layers.0.self_attn.k_proj.weight",
    "blocks.0.attn.c_attn.weight", rows=(32, 48)).
    """
    kind = family(cfg)
    if kind == "gpt2":
        return _gpt2_pieces(cfg)
    H, KV, inner = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim, cfg.hidden  # rows of q, of k and v, of gate
    qkv_bias = cfg.bias if cfg.qkv_bias is None else cfg.qkv_bias
    out = [Piece("model.embed_tokens.weight", "wte.weight")]
    for i in range(cfg.n_layer):
        hf, ours = f"model.layers.{i}.", f"blocks.{i}."
        out.append(Piece(hf + "input_layernorm.weight", ours + "ln_1.weight"))
        for suffix in ("weight", "bias") if qkv_bias else ("weight",):
            for proj, rows in (("q", (0, H)), ("k", (H, H + KV)), ("v", (H + KV, H + 2 * KV))):
                out.append(Piece(f"{hf}self_attn.{proj}_proj.{suffix}", f"{ours}attn.c_attn.{suffix}", rows))
        for suffix in ("weight", "bias") if cfg.bias else ("weight",):
            out.append(Piece(f"{hf}self_attn.o_proj.{suffix}", f"{ours}attn.c_proj.{suffix}"))
            out.append(Piece(f"{hf}mlp.gate_proj.{suffix}", f"{ours}mlp.c_fc.{suffix}", (0, inner)))
            out.append(Piece(f"{hf}mlp.up_proj.{suffix}", f"{ours}mlp.c_fc.{suffix}", (inner, 2 * inner)))
            out.append(Piece(f"{hf}mlp.down_proj.{suffix}", f"{ours}mlp.c_proj.{suffix}"))
        out.append(Piece(hf + "post_attention_layernorm.weight", ours + "ln_2.weight"))
    out.append(Piece("model.norm.weight", "ln_f.weight"))
    if not cfg.tie_embeddings:
        out.append(Piece("lm_head.weight", TIED_KEY))  # transformers' name; packtrain's is the store's
    return out


def _gpt2_pieces(cfg: GPTConfig) -> list[Piece]:
    """GPT-2 always has biases: a bias-free packtrain model's are exported as zeros (`hf_state_dict`)."""
    out = [Piece("transformer.wte.weight", "wte.weight"), Piece("transformer.wpe.weight", "wpe.weight")]
    for i in range(cfg.n_layer):
        hf, ours = f"transformer.h.{i}.", f"blocks.{i}."
        for module in ("ln_1", "attn.c_attn", "attn.c_proj", "ln_2", "mlp.c_fc", "mlp.c_proj"):
            conv1d = not module.startswith("ln")
            out.append(Piece(f"{hf}{module}.weight", f"{ours}{module}.weight", transpose=conv1d))
            out.append(Piece(f"{hf}{module}.bias", f"{ours}{module}.bias"))
    out += [Piece("transformer.ln_f.weight", "ln_f.weight"), Piece("transformer.ln_f.bias", "ln_f.bias")]
    return out


def _view(tensor: torch.Tensor, piece: Piece) -> torch.Tensor:
    """The part of packtrain's `tensor` that `piece` names, in the Hugging Face orientation."""
    part = tensor if piece.rows is None else tensor[piece.rows[0] : piece.rows[1]]
    return part.t() if piece.transpose else part


def hf_state_dict(model: GPT, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The model's weights under its class's names, each its own contiguous tensor (in `dtype` if given); the tied
    head left out (written once, as transformers writes it). GPT-2 biases the model lacks are zeros."""
    return to_hf(model.state_dict(), model.cfg, dtype)


def to_hf(state: dict[str, torch.Tensor], cfg: GPTConfig, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """packtrain-named tensors (weights, or gradients) of a `cfg` model -> its class's names; see `hf_state_dict`."""
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
    """Whether `path` holds a Hugging Face model: config.json and model.safetensors or a sharded index of them (or
    only pickles, which `read_config` then refuses by name)."""
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
    """The safetensors files of `path`: model.safetensors, or every shard its index names (each a file directly in
    `path`: an index naming one elsewhere is refused). Pickled weights are refused: loading them could run code."""
    path = Path(path)
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    index = path / INDEX_FILE
    if not index.is_file():
        pickled = [n for n in PICKLE_FILES if (path / n).is_file()]
        if pickled:
            raise ExportError(f"{path} holds {pickled[0]} (a pickle: loading it could run code) and no {WEIGHTS_FILE}: "
                              "convert it first (transformers: model.save_pretrained(dir, safe_serialization=True))")
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
    """Copy the weights of Hugging Face directory `path` into `model` (built for its config), tensor by tensor;
    an error naming the file and keys that are missing, unexpected or of another shape."""
    plan = {p.hf: p for p in pieces(model.cfg)}
    state = model.state_dict()
    tied = set(model.tied_keys)
    seen: set[str] = set()
    for file, key, tensor in _tensors(weight_files(path)):
        if key.endswith(IGNORED_KEYS) or key in tied:
            continue  # old buffers; a tied head some exports also write (it is the embedding)
        piece = plan.get(key)
        if piece is None:
            raise ExportError(f"{file}: unexpected tensor {key!r} for {CLASSES[family(model.cfg)]} with this config "
                              f"({Path(path) / CONFIG_FILE})")
        target = _view(state[piece.name], piece)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ExportError(f"{file}: {key} has shape {tuple(tensor.shape)}, the config says {tuple(target.shape)}")
        if (bad := first_nonfinite(tensor, key)) is not None:
            raise ExportError(f"{file}: tensor {key} holds {bad[1]} values: the weights are damaged; refused")
        target.copy_(tensor)
        seen.add(key)
    missing = [k for k in plan if k not in seen]
    if missing:
        raise ExportError(f"{path}: the weights lack {len(missing)} tensor(s) of its config, e.g. {missing[:3]}")


def load_hf(path: str | Path, device: str | torch.device = "cpu", attention: AttentionConfig | None = None) -> GPT:
    """A Hugging Face model directory (GPT-2, Llama, Qwen2; or what `trainer.export` writes) as packtrain's GPT,
    in eval mode."""
    model = GPT(read_config(path), attention or AttentionConfig(backend="sdpa_docs"))
    load_hf_into(model, path)
    return model.to(device).eval()
