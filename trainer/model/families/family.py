"""What a model family declares: the Hugging Face class that computes it, which GPTConfig settings that is,
its config.json both ways, and its tensor names (`Piece`s). trainer.checkpoint.hf applies these and names no
module.

One family, one file beside this one; the fused projections are the model's (trainer.model.gpt: q|k|v in
`attn.c_attn`, gate|up in `mlp.c_fc`), so a Hugging Face tensor can be rows of one of its tensors
(`Piece.rows`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.model.gpt import GPTConfig

HEAD = "lm_head.weight"
"""The model's untied head; under tie_embeddings it is `wte.weight` again, left out of every map."""


@dataclass(frozen=True)
class Piece:
    """Hugging Face tensor `hf` is rows [start, stop) of packtrain tensor `name` (all of it: None), transposed
    (GPT-2's Conv1D) or not."""

    hf: str
    name: str
    rows: tuple[int, int] | None = None
    transpose: bool = False


class Family:
    """One Hugging Face class packtrain's GPT computes. A family file makes one instance (`FAMILY`), and
    trainer/model/families/__init__.py lists it; nothing else names it."""

    model_type: str
    """config.json's model_type, and the name `model.family` takes."""
    hf_class: str
    """config.json's architectures[0]: the transformers class."""

    def computes(self, cfg: GPTConfig) -> bool:
        """Whether the class computes a GPT of `cfg`'s settings (exported as it, imported into it)."""
        raise NotImplementedError

    def hf_config(self, cfg: GPTConfig) -> dict:
        """The class's own config.json fields for `cfg` (the common ones, vocab_size, ids and dtype, are the
        caller's)."""
        raise NotImplementedError

    def config_from_hf(self, config: dict) -> GPTConfig:
        """The GPTConfig of the class's config.json; a ValueError naming the key that is missing or
        unsupported."""
        raise NotImplementedError

    def pieces(self, cfg: GPTConfig) -> list[Piece]:
        """Every Hugging Face tensor of `cfg`'s model and where it lives in packtrain's; the tied head
        absent."""
        raise NotImplementedError


def required(config: dict, keys: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    """Every key of `keys` present, and each of them (and of `optional`, where present and not null) a
    positive integer: a ValueError naming the key otherwise (a size read as a string, or -4 heads)."""
    missing = [k for k in keys if k not in config]
    if missing:
        raise ValueError(f"no {missing} in the {config.get('model_type')} config")
    for key in (*keys, *(k for k in optional if config.get(k) is not None)):
        value = config[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")


def refuse_variants(config: dict, unsupported: dict) -> None:
    """{key: (value, the values packtrain computes)}: a ValueError naming every key whose value is not one."""
    bad = [f"{k}={v!r}" for k, (v, ok) in unsupported.items() if v not in ok]
    if bad:
        raise ValueError(f"a {config.get('model_type')} variant packtrain's GPT does not compute "
                         f"({', '.join(bad)})")
