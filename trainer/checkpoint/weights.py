"""A checkpoint's model alone: its shape, its weights and its tokenizer, read without running code.

Every packtrain checkpoint (DDP or DeepSpeed; the files are the store's, trainer.checkpoint.store) holds the
weights as safetensors (WEIGHTS_FILE, the tied head left out), the meta file (with the resolved run config,
whose `model` section is the shape), the conventions (the tokenizer's sha256 and vocab size) and the
tokenizer. This module turns those into a built `GPT`, for `train.init_from`, `trainer.export` and
`trainer.generate`; optimizer, schedule and data state are never read here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from trainer.checkpoint import hf
from trainer.checkpoint.store import (
    CONVENTIONS_FILE,
    DCP_DIR,
    ENGINE_FILE,
    META_FILE,
    PATH_HINT,
    TIED_KEY,
    TOKENIZER_DIR,
    WEIGHTS_FILE,
    verify_file,
)
from trainer.checkpoint.tensors import check_fits, first_nonfinite, numel
from trainer.errors import UserError
from trainer.model import GPT, AttentionConfig, GPTConfig, build_model


class WeightsError(UserError):
    """A directory that does not hold a packtrain checkpoint's model."""


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightsError(f"{path.parent} is not a packtrain checkpoint: no {path.name} (give a "
                           f"{PATH_HINT} directory)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WeightsError(f"{path}: unreadable ({e})") from e
    if not isinstance(value, dict):
        raise WeightsError(f"{path}: not a JSON object (got {type(value).__name__}): the checkpoint is "
                           "damaged")
    return value


def checkpoint_meta(path: str | Path) -> dict:
    """The meta file of a checkpoint directory (step, counters, engine, the resolved run config), verified."""
    if (Path(path) / META_FILE).is_file():
        verify_file(path, META_FILE)
    return _read_json(Path(path) / META_FILE)


def checkpoint_conventions(path: str | Path) -> dict:
    """The conventions of a checkpoint directory (layout, labels, loss, tokenizer hash and size)."""
    if (Path(path) / CONVENTIONS_FILE).is_file():
        verify_file(path, CONVENTIONS_FILE)
    conv = _read_json(Path(path) / CONVENTIONS_FILE)
    tok = conv.get("tokenizer")
    if not (isinstance(tok, dict) and isinstance(tok.get("sha256"), str)
            and isinstance(tok.get("vocab_size"), int)):
        raise WeightsError(f"{Path(path) / CONVENTIONS_FILE} holds no tokenizer sha256 and vocab_size: the "
                           "checkpoint is damaged")
    return conv


def model_config(path: str | Path) -> GPTConfig:
    """The GPTConfig the checkpoint's weights were built with, vocab_size filled in; refused if it describes
    another number of weights than the checkpoint holds (tensors.check_fits: before anything is built from
    it)."""
    meta, conv = checkpoint_meta(path), checkpoint_conventions(path)
    section = dict(meta.get("config", {}).get("model", {}))
    if not section:
        raise WeightsError(f"{Path(path) / META_FILE} holds no config.model: not a packtrain checkpoint")
    known = {f.name for f in dataclasses.fields(GPTConfig)}
    try:
        cfg = GPTConfig(**{k: v for k, v in section.items() if k in known})
        if cfg.vocab_size is None:
            cfg = dataclasses.replace(cfg, vocab_size=int(conv["tokenizer"]["vocab_size"]))
    except (TypeError, ValueError) as e:
        raise WeightsError(f"{Path(path) / META_FILE}: config.model is not a model config ({e}): the "
                           "checkpoint is damaged") from e
    held, where = held_params(path)
    check_fits(cfg, held, Path(path) / META_FILE, where)
    return cfg


def held_params(path: str | Path) -> tuple[int, Path]:
    """(the number of weights checkpoint `path` holds, the file or directory holding them), read from headers
    alone (WEIGHTS_FILE's safetensors header, engine.pt mapped, dcp/.metadata): what `model_config` compares
    its config with before anything is built. The tied head is not counted (no file stores it)."""
    path = Path(path)
    if (path / WEIGHTS_FILE).is_file():
        return numel(hf.header_shapes([verify_file(path, WEIGHTS_FILE)]).values()), path / WEIGHTS_FILE
    if (path / ENGINE_FILE).is_file():
        from trainer.checkpoint.safe_io import load_state

        state = load_state(verify_file(path, ENGINE_FILE), map_location="cpu", mmap=True)["model"]
        tied = checkpoint_meta(path).get("config", {}).get("model", {}).get("tie_embeddings", True)
        return numel(v.shape for k, v in state.items() if not (tied and k == TIED_KEY)), path / ENGINE_FILE
    if (path / DCP_DIR / ".metadata").is_file():
        from trainer.distributed.fsdp import SafeReader

        metadata = SafeReader(path / DCP_DIR).read_metadata()
        prefix = "model."
        return numel(m.size for k, m in metadata.state_dict_metadata.items()
                     if k.startswith(prefix) and hasattr(m, "size")
                     and k[len(prefix):] != TIED_KEY), path / DCP_DIR
    raise WeightsError(f"{path} holds no {WEIGHTS_FILE}: not a packtrain checkpoint (or a DeepSpeed one "
                       "written before the weights were saved on their own)")


def load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in the checkpoint's WEIGHTS_FILE (safetensors: loading never runs code), tied key
    omitted; the file checked first (inside the checkpoint, its recorded sha256: store.verify_file), every
    tensor finite."""
    weights = _load_weights(path)
    if (bad := first_nonfinite(weights)) is not None:
        raise WeightsError(f"{_weights_source(Path(path))}: tensor {bad[0]} holds {bad[1]} values: the "
                           "checkpoint's weights are damaged; use an earlier checkpoint")
    return weights


def _weights_source(path: Path) -> Path:
    for name in (WEIGHTS_FILE, ENGINE_FILE, DCP_DIR):
        if (path / name).exists():
            return path / name
    return path


def _load_weights(path: str | Path) -> dict[str, torch.Tensor]:
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        engine_file = Path(path) / ENGINE_FILE
        if engine_file.is_file():  # a DDP checkpoint from before WEIGHTS_FILE: its plain-data engine state
            from trainer.checkpoint.safe_io import (
                load_state,  # weights_only=True: refuses anything but data and tensors
            )

            verify_file(path, ENGINE_FILE)  # a DDP (or tensor-parallel) checkpoint: its engine state is whole
            state = load_state(engine_file, map_location="cpu")["model"]
            tied = checkpoint_meta(path).get("config", {}).get("model", {}).get("tie_embeddings", True)
            return {k: v for k, v in state.items() if not (tied and k == TIED_KEY)}
        if (Path(path) / DCP_DIR).is_dir():  # FSDP2, a save before the run's last (train.save_weights=end)
            return _dcp_weights(Path(path))
        raise WeightsError(f"{Path(path)} holds no {WEIGHTS_FILE}: not a packtrain checkpoint (or a "
                           "DeepSpeed one written before the weights were saved on their own)")
    verify_file(path, WEIGHTS_FILE)
    try:
        return load_file(str(file))
    except Exception as e:  # safetensors raises its own SafetensorError for a corrupt or truncated file
        raise WeightsError(f"{file}: not a readable safetensors file ({e})") from e


def _dcp_weights(path: Path) -> dict[str, torch.Tensor]:
    """The whole weights (tied key omitted) from an FSDP2 checkpoint's DCP shards, every shard file checked
    first."""
    from trainer.distributed.fsdp import read_dcp_weights

    for file in sorted((path / DCP_DIR).iterdir()):
        verify_file(path, f"{DCP_DIR}/{file.name}")
    model = build_model(model_config(path), AttentionConfig(backend="sdpa_docs"), meta=True)
    shapes = {k: v for k, v in model.whole_shapes.items() if k not in model.tied_keys}
    return read_dcp_weights(path / DCP_DIR, shapes)


def tokenizer_dir(path: str | Path) -> Path:
    """The tokenizer the checkpoint's weights were trained with."""
    out = Path(path) / TOKENIZER_DIR
    if not (out / "tokenizer.json").is_file():
        raise WeightsError(f"{Path(path)} holds no {TOKENIZER_DIR}/tokenizer.json: not a packtrain "
                           "checkpoint")
    for file in sorted(out.iterdir()):
        verify_file(path, f"{TOKENIZER_DIR}/{file.name}")
    return out


def load_model(path: str | Path, attention: AttentionConfig | None = None,
               device: str | torch.device = "cpu") -> GPT:
    """The checkpoint's model in eval mode, weights loaded (strictly: every key but the tied head)."""
    model = GPT(model_config(path), attention or AttentionConfig(backend="sdpa_docs"))
    load_into(model, load_weights(path), where=Path(path) / WEIGHTS_FILE)
    return model.to(device).eval()


def load_into(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: str | Path) -> None:
    """Copy `weights` into `model`: the same keys (but the tied head) and shapes, or an error naming the
    differences."""
    tied = getattr(model, "tied_keys", (TIED_KEY,))
    own = {k: v for k, v in model.state_dict().items() if k not in tied}
    missing, unexpected = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    wrong = sorted(k for k in set(own) & set(weights) if own[k].shape != weights[k].shape)
    if missing or unexpected or wrong:
        parts = [f"missing {missing[:4]}" if missing else "",
                 f"unexpected {unexpected[:4]}" if unexpected else "",
                 "shapes differ: " + ", ".join(f"{k} {tuple(weights[k].shape)} vs model {tuple(own[k].shape)}"
                                               for k in wrong[:4]) if wrong else ""]
        raise WeightsError(f"{where} does not fit this model ({'; '.join(p for p in parts if p)}): "
                           "use the same model= config as the run that wrote it")
    model.load_state_dict(weights, strict=False)


# ---------------------------------------------------------------------------------------------------
# Starting a run from a checkpoint's weights (train.init_from), and the tokenizer that must go with them
# ---------------------------------------------------------------------------------------------------

SHAPE_KEYS = ("n_layer", "n_head", "n_embd", "max_seq_len", "bias", "pos_emb", "rope_theta", "norm",
              "norm_eps", "mlp", "mlp_hidden", "n_kv_head", "qkv_bias", "tie_embeddings", "rope_scaling")
"""GPTConfig fields that must match between a checkpoint and the model it initializes (dropout, init may
differ)."""


def checkpoint_tokenizer_hash(path: str | Path) -> str:
    """sha256 of the tokenizer checkpoint `path` was trained with: of its own tokenizer/tokenizer.json (the
    bytes, as train.init_from reads them), else the record in its conventions.json; a WeightsError when it
    holds neither, since a run's data could not be checked against it."""
    from trainer.data.tokenizer import tokenizer_hash

    path = Path(path)
    if (path / TOKENIZER_DIR / "tokenizer.json").is_file():
        return tokenizer_hash(path / TOKENIZER_DIR)
    if (path / CONVENTIONS_FILE).is_file():
        return checkpoint_conventions(path)["tokenizer"]["sha256"]
    raise WeightsError(f"{path} holds neither {TOKENIZER_DIR}/tokenizer.json nor {CONVENTIONS_FILE}: the "
                       "tokenizer its weights were trained with is unknown; copy that tokenizer's files into "
                       f"{path / TOKENIZER_DIR}")


def tokenizer_mismatch(path: str | Path, ckpt_hash: str, data_tokenizer: str | Path, data_hash: str,
                       purpose: str) -> str:
    """The refusal for a checkpoint whose tokenizer (sha256 `ckpt_hash`) is not the data's: both hashes and
    the supported path."""
    return (f"{purpose}: {path} was trained with tokenizer sha256 {ckpt_hash}, but the data's tokenizer "
            f"({data_tokenizer}) is sha256 {data_hash}: the same ids would mean other tokens. Prepare the "
            "data with the checkpoint's tokenizer "
            f"(python -m trainer.prepare ... --tokenizer {Path(path) / TOKENIZER_DIR}); "
            "to add tokens, prepare with that --tokenizer and --add-tokens TOKEN ..., and train with "
            "tokenizer.add_tokens=[TOKEN,...]")


def init_from_checkpoint(model: GPT, path: str | Path, data_tokenizer: str | Path, data_hash: str,
                         add_tokens: list[str]) -> dict:
    """Load the weights of checkpoint `path` into `model` (built for the data's tokenizer); returns the record
    for the new run's conventions. Only weights: the caller's optimizer, schedule and data stream stay fresh.

    Same tokenizer (same sha256): the weights load as they are. Otherwise the data's tokenizer must be the
    checkpoint's extended by exactly `add_tokens` (tokenizer.extend_tokenizer): the embedding (and the tied
    head) then grows by one row per new token, each the mean of the checkpoint's token rows, so every old
    token's logits are unchanged. Anything else is refused with both hashes named.
    """
    from trainer.data.tokenizer import extension_problem, load_tokenizer, tokenizer_hash

    path = Path(path)
    if not (path / META_FILE).is_file() and hf.is_hf_dir(path):
        return init_from_hf(model, path, data_tokenizer, data_hash, add_tokens)
    ckpt_cfg, meta = model_config(path), checkpoint_meta(path)
    differ = [f"{k}: checkpoint {getattr(ckpt_cfg, k)!r}, this run {getattr(model.cfg, k)!r}"
              for k in SHAPE_KEYS if getattr(ckpt_cfg, k) != getattr(model.cfg, k)]
    if differ:
        raise WeightsError(f"train.init_from: {path} is another model ({'; '.join(differ)}): use the model= "
                           f"config it was trained with (its {META_FILE} holds it)")
    weights = load_weights(path)
    ckpt_tok_dir = tokenizer_dir(path)
    ckpt_hash = tokenizer_hash(ckpt_tok_dir)
    record = {"checkpoint": str(path.resolve()), "step": meta.get("step"), "tokenizer_sha256": ckpt_hash}
    if ckpt_hash != data_hash or add_tokens:
        if not add_tokens:
            raise WeightsError(tokenizer_mismatch(path, ckpt_hash, data_tokenizer, data_hash,
                                                  "train.init_from"))
        base, extended = load_tokenizer(ckpt_tok_dir), load_tokenizer(data_tokenizer)
        problem = extension_problem(base, extended, add_tokens)
        if problem:
            raise WeightsError(f"tokenizer.add_tokens={add_tokens}: the data's tokenizer ({data_tokenizer}, "
                               f"sha256 {data_hash}) is not the checkpoint's (sha256 {ckpt_hash}) extended "
                               f"by them: {problem}. Prepare the data with --tokenizer {ckpt_tok_dir} "
                               f"--add-tokens {' '.join(add_tokens)}")
        for key in ("wte.weight", TIED_KEY):  # the head too, where it is its own (model.tie_embeddings=false)
            if key in weights:
                weights[key] = grow_rows(weights[key], model.wte.weight.shape[0], base.get_vocab_size(),
                                         len(add_tokens))
        record["extension"] = {"base_sha256": ckpt_hash, "added_tokens": list(add_tokens),
                               "new_ids": [base.get_vocab_size() + i for i in range(len(add_tokens))],
                               "new_rows": "mean of the checkpoint's token embedding rows (tied head alike)"}
    load_into(model, weights, where=path / WEIGHTS_FILE)
    return record


def init_from_hf(model: GPT, path: Path, data_tokenizer: str | Path, data_hash: str,
                 add_tokens: list[str]) -> dict:
    """train.init_from=DIR for a Hugging Face model directory: its weights streamed into `model` (built from
    DIR's config.json: trainer.config takes the model section from there); the data must be prepared with
    DIR's own tokenizer (the same tokenizer.json bytes). Returns the record for the new run's conventions."""
    from trainer.data.tokenizer import TOKENIZER_FILE, tokenizer_hash, tokenizer_ids

    cfg = hf.read_config(path)
    differ = [f"{k}: {path / hf.CONFIG_FILE} says {getattr(cfg, k)!r}, this run {getattr(model.cfg, k)!r}"
              for k in SHAPE_KEYS if getattr(cfg, k) != getattr(model.cfg, k)]
    if differ:
        raise WeightsError(f"train.init_from: {path} is another model ({'; '.join(differ)}): leave model= "
                           "out, the architecture comes from its config.json")
    if not (path / TOKENIZER_FILE).is_file():
        raise WeightsError(f"train.init_from: {path} holds no {TOKENIZER_FILE}: the tokenizer its weights "
                           "were trained with is unknown; copy the model's tokenizer files into it")
    own_hash = tokenizer_hash(path)
    if own_hash != data_hash:
        raise WeightsError(f"train.init_from: {path}'s tokenizer is sha256 {own_hash}, but the data's "
                           f"({data_tokenizer}) is sha256 {data_hash}: the same ids would mean other tokens. "
                           "Prepare the data with the model's tokenizer "
                           f"(python -m trainer.prepare ... --tokenizer {path})")
    own_ids, data_ids = tokenizer_ids(path), tokenizer_ids(data_tokenizer)
    # the same tokenizer.json, framed otherwise (tokenizer_config.json edited on one side)
    if own_ids != data_ids:
        raise WeightsError(f"train.init_from: {path}'s tokenizer frames documents as {own_ids}, the data's "
                           f"({data_tokenizer}) as {data_ids}: prepare the data again with --tokenizer "
                           f"{path}")
    if add_tokens:
        raise WeightsError(f"tokenizer.add_tokens={add_tokens} with a Hugging Face train.init_from ({path}) "
                           "is not supported: add them to the model first (transformers: "
                           "resize_token_embeddings)")
    hf.load_hf_into(model, path)
    return {"hf_model": str(path.resolve()), "architecture": hf.CLASSES[hf.family(cfg)], "step": None,
            "tokenizer_sha256": own_hash}


def grow_rows(table_VC: torch.Tensor, rows: int, base_vocab: int, added: int) -> torch.Tensor:
    """`table_VC` grown to `rows` rows; rows of the `added` new ids (base_vocab, base_vocab + 1, ...) and any
    appended row hold the mean of the first `base_vocab` rows (the old tokens').

    Example: a (512, C) embedding grown to 514 rows for 2 new tokens keeps rows 0..511 and adds two copies of
    their mean. (With model.vocab_size padded above the tokenizer, the new ids' padding rows are overwritten.)
    With a tied head, a new token's logit is then the mean of the old logits' pre-activations, never
    dominating, and the old tokens' logits are unchanged (their rows are).
    """
    if rows < table_VC.shape[0]:
        raise WeightsError(f"the model has {rows} embedding rows, fewer than the checkpoint's "
                           f"{table_VC.shape[0]}")
    mean_C = table_VC[:base_vocab].float().mean(dim=0).to(table_VC.dtype)
    extra = mean_C.expand(rows - table_VC.shape[0], -1)
    out_VC = torch.cat([table_VC, extra], dim=0).contiguous()
    out_VC[base_vocab : base_vocab + added] = mean_C
    return out_VC
