"""Sample text from a checkpoint or an export:
`python -m trainer.generate CHECKPOINT_OR_EXPORT --prompt TEXT`.

    python -m trainer.generate runs/demo/<time>/0_layout=packed/checkpoints/step_000100 --prompt "def parse("
    python -m trainer.generate exports/demo --prompt "def parse(" --temperature 0          # greedy
    python -m trainer.generate exports/demo --chat --prompt "Write a haiku" --top-k 40 --seed 1

The path is a packtrain checkpoint (meta.json; weights from its model.safetensors, never engine.pt) or a
Hugging Face model directory (GPT-2, Llama, Qwen2: config.json + safetensors; what `python -m trainer.export`
writes). `--chat` renders the prompt as one user message through the tokenizer's chat template (ChatML) with
the assistant's generation prompt. Decoding uses a KV cache and stops at <|endoftext|> or <|im_end|>, after
--max-new-tokens, or when the model's context (max_seq_len) is full. --temperature 0 is greedy; --top-k K
samples among the K likeliest tokens; --seed makes sampling reproducible. Only the new text is printed. A user
mistake ends as trainer/errors.py says.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import jinja2
import torch
from tokenizers import Tokenizer

from trainer.checkpoint import hf
from trainer.checkpoint.store import META_FILE, PATH_HINT
from trainer.checkpoint.weights import load_model, tokenizer_dir
from trainer.data.chat import chat_template, render
from trainer.data.tokenizer import load_tokenizer, special_ids
from trainer.errors import UserError, command
from trainer.model import GPT, KVCache


class GenerateError(UserError):
    """A path that holds no model, a prompt that does not fit, a chat template that fails."""


# ---------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------


def load(path: str | Path, device: str | torch.device = "cpu") -> tuple[GPT, Path]:
    """(model in eval mode, its tokenizer directory) of a packtrain checkpoint or a Hugging Face model
    directory."""
    path = Path(path)
    if (path / META_FILE).is_file():
        return load_model(path, device=device), tokenizer_dir(path)
    if hf.is_hf_dir(path):
        return hf.load_hf(path, device=device), path
    raise GenerateError(f"{path} is neither a packtrain checkpoint (no {META_FILE}) nor a Hugging Face model "
                        f"(no {hf.CONFIG_FILE} + {hf.WEIGHTS_FILE}): give {PATH_HINT}, the "
                        "--out directory of python -m trainer.export, or a transformers model directory")


# ---------------------------------------------------------------------------------------------------
# Chat prompts
# ---------------------------------------------------------------------------------------------------


def special_texts(tok: Tokenizer) -> list[str]:
    """The texts the tokenizer reads as special tokens (<|endoftext|>, <|im_start|>, <|im_end|>, <|pad|>,
    ...)."""
    return [t.content for t in tok.get_added_tokens_decoder().values() if t.special]


def prompt_ids(tok: Tokenizer, tok_dir: str | Path, prompt: str, chat: bool) -> list[int]:
    """Token ids of `prompt`, or (chat) of one user message and the generation prompt, through the tokenizer's
    chat template as transformers' apply_chat_template renders it (trainer.data.chat). Example, ChatML:
    "hi" -> the ids of "<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n".
    """
    forged = sorted((t for t in special_texts(tok) if t in prompt), key=prompt.find)
    # encoded as that token, it would forge a turn (or end the text) where the user only typed text
    if forged:
        raise GenerateError(f"the prompt holds {forged[0]!r}, a special token's text: it would be read as "
                            "that token (forging a turn boundary); remove or escape it")
    if chat:
        try:
            prompt, _ = render([{"role": "user", "content": prompt}], chat_template(tok_dir),
                               add_generation_prompt=True)
        except jinja2.TemplateError as e:  # the template's raise_exception, or an error inside it
            raise GenerateError(f"{tok_dir}: the chat template failed: {e}") from e
    return tok.encode(prompt, add_special_tokens=False).ids


# ---------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------


def next_token(logits_V: torch.Tensor, temperature: float, top_k: int | None,
               generator: torch.Generator | None) -> int:
    """Greedy (temperature 0) or a sample from softmax(logits / temperature) over the top_k likeliest
    tokens."""
    if temperature == 0:
        return int(logits_V.argmax())
    logits_V = logits_V.float() / temperature
    if top_k is not None and top_k < logits_V.numel():
        kth = torch.topk(logits_V, top_k).values[-1]
        logits_V = logits_V.masked_fill(logits_V < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits_V, dim=-1), 1, generator=generator))


@torch.no_grad()
def generate(model: GPT, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = (),
             temperature: float = 0.0, top_k: int | None = None, generator: torch.Generator | None = None,
             use_cache: bool = True) -> list[int]:
    """The new tokens after `prompt`, a stop token included if one ended the reply (as transformers does).

    Stops after max_new_tokens, at a stop token, or when the sequence fills max_seq_len. use_cache=False
    recomputes the whole sequence every step (the reference the cache is tested against).
    """
    if not prompt:
        raise GenerateError("the prompt is empty: give at least one token")
    if len(prompt) > model.cfg.max_seq_len:
        raise GenerateError(f"the prompt is {len(prompt)} tokens, longer than the model's max_seq_len="
                            f"{model.cfg.max_seq_len}")
    device = model.wte.weight.device
    cache = KVCache(model.cfg.n_layer) if use_cache else None
    seq, new = list(prompt), []
    feed = seq  # what the next forward reads: the prompt, then (cached) only the last token
    while len(new) < max_new_tokens:
        logits = model(torch.tensor([feed], device=device), cache=cache).logits  # (1, len(feed), V)
        token = next_token(logits[0, -1], temperature, top_k, generator)
        new.append(token)
        seq.append(token)
        if token in stop_ids or len(seq) >= model.cfg.max_seq_len:
            break
        feed = [token] if use_cache else seq
    return new


# ---------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m trainer.generate", description=__doc__.split("\n")[0])
    p.add_argument("path", type=Path, metavar="CHECKPOINT_OR_EXPORT",
                   help="<run dir>/checkpoints/step_NNNNNN, or a directory written by "
                        "python -m trainer.export")
    p.add_argument("--prompt", required=True, help="the text to continue (with --chat: the user's message)")
    p.add_argument("--chat", action="store_true",
                   help="render the prompt through the tokenizer's chat template")
    p.add_argument("--max-new-tokens", type=int, default=100, help="most tokens to generate (default 100)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="softmax temperature; 0 = greedy (default 1.0)")
    p.add_argument("--top-k", type=int, default=None,
                   help="sample among the K likeliest tokens (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling generator (default 0)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    return p.parse_args(argv)


def check_device(name: str) -> None:
    """A GenerateError unless --device names a torch device this machine has. Example: "cuda" without a
    GPU."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise GenerateError(f"--device {name!r} is not a torch device ({e}); use cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise GenerateError(f"--device {name}: no CUDA device is visible on this machine; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise GenerateError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise GenerateError(f"--device {name}: generate runs on cpu or cuda")


@command(extra_user_errors=(OSError,))  # OSError: e.g. an unreadable checkpoint file
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (args.max_new_tokens < 1 or not (0 <= args.temperature < math.inf)
            or (args.top_k is not None and args.top_k < 1)):
        raise GenerateError("--max-new-tokens and --top-k must be >= 1 and --temperature a finite "
                            f"number >= 0, got {args.max_new_tokens}, {args.top_k} and {args.temperature}")
    check_device(args.device)
    model, tok_dir = load(args.path, args.device)
    tok = load_tokenizer(tok_dir)
    ids = special_ids(tok, where=tok_dir)
    # BOS where training documents had one
    prompt = [*ids.head, *prompt_ids(tok, tok_dir, args.prompt, args.chat)]
    stops = tuple(i for i in (ids.eos, ids.im_end) if i is not None)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    new = generate(model, prompt, args.max_new_tokens, stops, args.temperature, args.top_k, generator)
    stopped = new[-1] in stops
    print(tok.decode(new[:-1] if stopped else new, skip_special_tokens=True))
    if not stopped and len(new) < args.max_new_tokens:
        print(f"(stopped: the context is full, max_seq_len={model.cfg.max_seq_len})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
