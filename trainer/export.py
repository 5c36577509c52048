"""Export a checkpoint as a Hugging Face GPT-2 model directory: `python -m trainer.export CHECKPOINT --out DIR`.

    python -m trainer.export runs/demo/<time>/0_layout=packed/checkpoints/step_000100 --out exports/demo
    python -c "from transformers import AutoTokenizer, GPT2LMHeadModel; \\
               m = GPT2LMHeadModel.from_pretrained('exports/demo'); t = AutoTokenizer.from_pretrained('exports/demo')"

DIR then holds:
    config.json               GPT2LMHeadModel: sizes, n_positions = max_seq_len, gelu_new (tanh GELU), tied head
    model.safetensors         the weights under GPT-2 names (Conv1D weights transposed; see trainer.checkpoint.hf)
    generation_config.json    generation stops at <|endoftext|> or <|im_end|>
    tokenizer.json, tokenizer_config.json (with the ChatML chat template), special_tokens_map.json
    conventions.json          the checkpoint's: how the weights were trained (provenance)

Only learned-position models export (GPT-2 has no RoPE). The checkpoint is read from its model.safetensors
(trainer.checkpoint.weights): engine.pt is never loaded. A user mistake ends as trainer/errors.py says.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from safetensors.torch import save_file

from trainer.checkpoint import hf
from trainer.checkpoint.store import CONVENTIONS_FILE, META_FILE, ROOT_DIR
from trainer.checkpoint.weights import load_model, model_config, tokenizer_dir
from trainer.data.tokenizer import TOKENIZER_CONFIG_FILE, TOKENIZER_FILES, load_tokenizer, special_ids
from trainer.errors import command
from trainer.model import GPT
from trainer.registry import METRICS_FILE


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """Write the GPT-2 directory of packtrain checkpoint `checkpoint` into `out`; returns `out`."""
    checkpoint, out = Path(checkpoint), Path(out)
    hf.check_exportable(model_config(checkpoint))  # before reading any weights
    check_out_dir(out)
    model = load_model(checkpoint)
    write_gpt2(model, tokenizer_dir(checkpoint), out)
    shutil.copyfile(checkpoint / CONVENTIONS_FILE, out / CONVENTIONS_FILE)
    return out


EXPORT_FILES = frozenset({hf.CONFIG_FILE, hf.WEIGHTS_FILE, hf.GENERATION_CONFIG_FILE, CONVENTIONS_FILE, *TOKENIZER_FILES})


def check_out_dir(out: Path) -> None:
    """Export writes only into a new or empty directory, or over a previous export (its files and nothing else,
    config.json a GPT-2 config) — never into a checkpoint, a run directory or anything inside one."""
    for parent in [out, *out.resolve().parents]:
        if (parent / META_FILE).is_file():
            raise hf.ExportError(f"--out {out} is inside the checkpoint {parent}: give a new directory "
                                 "(e.g. exports/NAME)")
        if parent.name == ROOT_DIR and (parent != out.resolve()) and (
                (parent.parent / METRICS_FILE).is_file() or any(parent.glob(f"*/{META_FILE}"))):
            # e.g. <run>/checkpoints/step_000099: train.resume=true would take it for a checkpoint of the run
            raise hf.ExportError(f"--out {out} is inside the run's checkpoint directory {parent}, where "
                                 "train.resume looks for checkpoints: give a directory outside it (e.g. exports/NAME)")
    if out.exists() and not out.is_dir():
        raise hf.ExportError(f"--out {out} is a file: give a new directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    foreign = sorted(p.name for p in out.iterdir() if p.name not in EXPORT_FILES or not p.is_file())
    if not foreign and _is_gpt2_config(out / hf.CONFIG_FILE):
        return  # a previous export: replaced file by file
    shown = ", ".join(foreign[:4]) + (" ..." if len(foreign) > 4 else "") if foreign else "no GPT-2 config.json"
    raise hf.ExportError(f"--out {out} is not empty and not an earlier export ({shown}): export writes only into a "
                         "new or empty directory or over an earlier export")


def _is_gpt2_config(path: Path) -> bool:
    try:
        return json.loads(path.read_text(encoding="utf-8")).get("model_type") == "gpt2"
    except (OSError, ValueError, AttributeError):
        return False


def write_gpt2(model: GPT, tok_dir: str | Path, out: str | Path) -> None:
    """config.json, model.safetensors, generation_config.json and the tokenizer files of `model` into `out`."""
    tok_dir, out = Path(tok_dir), Path(out)
    ids = special_ids(load_tokenizer(tok_dir), where=tok_dir)
    missing = [name for name in TOKENIZER_FILES if not (tok_dir / name).is_file()]
    if missing:
        raise hf.ExportError(f"{tok_dir} lacks {missing}: the tokenizer was not saved by trainer.prepare")
    out.mkdir(parents=True, exist_ok=True)
    config = hf.gpt2_config(model.cfg, ids, dtype=model.wte.weight.dtype)
    save_file(hf.gpt2_state_dict(model), str(out / hf.WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(out / hf.CONFIG_FILE, config)
    _write_json(out / hf.GENERATION_CONFIG_FILE, hf.generation_config(ids))
    for name in TOKENIZER_FILES:
        shutil.copyfile(tok_dir / name, out / name)
    # transformers warns on inputs longer than model_max_length: make it the model's context, not the tokenizer's.
    tok_config = json.loads((out / TOKENIZER_CONFIG_FILE).read_text())
    _write_json(out / TOKENIZER_CONFIG_FILE, {**tok_config, "model_max_length": model.cfg.max_seq_len})


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.export", description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", type=Path, help="a checkpoint directory: <run dir>/checkpoints/step_NNNNNN")
    p.add_argument("--out", type=Path, required=True, help="the Hugging Face model directory to write")
    return p.parse_args(argv)


@command(extra_user_errors=(OSError,))  # OSError: the output cannot be written (permissions, disk full)
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = export(args.checkpoint, args.out)
    print(f"exported {args.checkpoint} -> {out} (GPT2LMHeadModel)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
