"""Export a checkpoint as a Hugging Face model directory: `python -m trainer.export CHECKPOINT --out DIR [--dtype]`.

    python -m trainer.export runs/demo/<time>/0_layout=packed/checkpoints/step_000100 --out exports/demo
    python -c "from transformers import AutoModelForCausalLM, AutoTokenizer; \\
               m = AutoModelForCausalLM.from_pretrained('exports/demo'); \\
               t = AutoTokenizer.from_pretrained('exports/demo')"

The class is the one that computes the model (trainer.checkpoint.hf.family): GPT2LMHeadModel for the GPT-2
family, LlamaForCausalLM or Qwen2ForCausalLM for the Llama family (a model started from one exports back to
the same class). DIR then holds:
    config.json               the class, its sizes and conventions; `dtype` (and `torch_dtype`) = the tensors'
                              dtype
    model.safetensors         the weights under the class's names, one file, a tied head written once (as the
                              embedding); see trainer.checkpoint.hf
    generation_config.json    generation stops at the EOS or <|im_end|>
    tokenizer.json, tokenizer_config.json (framing, chat template), special_tokens_map.json where the run
                              had one
    conventions.json          the checkpoint's: how the weights were trained (provenance)

The checkpoint is read from its model.safetensors (trainer.checkpoint.weights): engine.pt is never loaded.
--dtype (fp32, the trained weights, or bf16 / fp16) casts every tensor. A user mistake ends as
trainer/errors.py says.
"""  # noqa: E501 (line 1 is the --help description: __doc__.split("\n")[0])

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from trainer.checkpoint import hf
from trainer.checkpoint.store import CONVENTIONS_FILE, META_FILE, ROOT_DIR
from trainer.checkpoint.weights import load_model, model_config, tokenizer_dir
from trainer.data.tokenizer import (
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    TOKENIZER_FILES,
    load_tokenizer,
    special_ids,
)
from trainer.errors import command
from trainer.model import GPT
from trainer.outputs import check_not_inside_input
from trainer.registry import METRICS_FILE

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def export(checkpoint: str | Path, out: str | Path, dtype: str = "fp32") -> Path:
    """Write the Hugging Face directory of packtrain checkpoint `checkpoint` into `out`; returns `out`."""
    checkpoint, out = Path(checkpoint), Path(out)
    hf.family(model_config(checkpoint))  # exportable: before reading any weights
    check_out_dir(out)
    model = load_model(checkpoint)
    write_hf(model, tokenizer_dir(checkpoint), out, DTYPES[dtype])
    shutil.copyfile(checkpoint / CONVENTIONS_FILE, out / CONVENTIONS_FILE)
    return out


EXPORT_FILES = frozenset({hf.CONFIG_FILE, hf.WEIGHTS_FILE, hf.GENERATION_CONFIG_FILE, CONVENTIONS_FILE,
                          *TOKENIZER_FILES})


def check_out_dir(out: Path) -> None:
    """Export writes only into a new or empty directory, or over a previous export (its files and nothing
    else, config.json a supported model's) — never into a checkpoint, a run directory or anything inside
    one."""
    for parent in [out, *out.resolve().parents]:
        if (parent / META_FILE).is_file():
            raise hf.ExportError(f"--out {out} is inside the checkpoint {parent}: give a new directory "
                                 "(e.g. exports/NAME)")
        if parent.name == ROOT_DIR and (parent != out.resolve()) and (
                (parent.parent / METRICS_FILE).is_file() or any(parent.glob(f"*/{META_FILE}"))):
            # e.g. <run>/checkpoints/step_000099: train.resume=true would take it for a checkpoint of the run
            raise hf.ExportError(f"--out {out} is inside the run's checkpoint directory {parent}, where "
                                 "train.resume looks for checkpoints: give a directory outside it "
                                 "(e.g. exports/NAME)")
    if out.exists() and not out.is_dir():
        raise hf.ExportError(f"--out {out} is a file: give a new directory")
    check_not_inside_input(out, itself=False)  # inside a dataset, a tokenizer, a model; `out` itself below
    if not out.is_dir() or not any(out.iterdir()):
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES or not p.is_file())
    if not foreign and _is_hf_config(out / hf.CONFIG_FILE):
        return  # a previous export: replaced file by file
    shown = (", ".join(foreign[:4]) + (" ..." if len(foreign) > 4 else "") if foreign
             else "no Hugging Face config.json")
    raise hf.ExportError(f"--out {out} is not empty and not an earlier export ({shown}): export writes only "
                         "into a new or empty directory or over an earlier export")


def _is_hf_config(path: Path) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("model_type") in hf.CLASSES
    except (OSError, ValueError, AttributeError):
        return False


def write_hf(model: GPT, tok_dir: str | Path, out: str | Path, dtype: torch.dtype | None = None) -> None:
    """config.json, model.safetensors, generation_config.json and the tokenizer files of `model` into `out`,
    every tensor in `dtype` (None: the model's) and config.json saying so."""
    tok_dir, out = Path(tok_dir), Path(out)
    ids = special_ids(load_tokenizer(tok_dir), where=tok_dir)
    missing = [name for name in (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE) if not (tok_dir / name).is_file()]
    if missing:
        raise hf.ExportError(f"{tok_dir} lacks {missing}: the tokenizer was not saved by trainer.prepare")
    dtype = dtype or model.wte.weight.dtype
    config = hf.hf_config(model.cfg, ids, dtype=dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(hf.hf_state_dict(model, dtype), str(out / hf.WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(out / hf.CONFIG_FILE, config)
    _write_json(out / hf.GENERATION_CONFIG_FILE, hf.generation_config(ids))
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copyfile(tok_dir / name, out / name)
    # transformers warns on inputs longer than model_max_length: make it the model's context, not the
    # tokenizer's.
    tok_config = json.loads((out / TOKENIZER_CONFIG_FILE).read_text())
    _write_json(out / TOKENIZER_CONFIG_FILE, {**tok_config, "model_max_length": model.cfg.max_seq_len})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", type=Path, help="a checkpoint directory: <run dir>/checkpoints/step_NNNNNN")
    p.add_argument("--out", type=Path, required=True, help="the Hugging Face model directory to write")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                   help="the exported tensors' dtype, also written into config.json "
                        "(default: fp32, as trained)")
    return p.parse_args(argv)


@command(extra_user_errors=(OSError,))  # OSError: the output cannot be written (permissions, disk full)
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = export(args.checkpoint, args.out, args.dtype)
    kind = hf.family(model_config(args.checkpoint))
    print(f"exported {args.checkpoint} -> {out} ({hf.CLASSES[kind]}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
