"""The byte-level BPE tokenizer: training, saving in the Hugging Face layout, loading, special ids.

Byte-level means every string round-trips: decode(encode(text)) == text for any Unicode, because the
base alphabet is the 256 bytes. Four special tokens come first (ids 0..3 for a trained tokenizer):

    <|endoftext|>  end of a document; also the EOS (and BOS, for tools that want one)
    <|pad|>        padding
    <|im_start|>   chat: opens a turn ("<|im_start|>user\\n...<|im_end|>\\n", ChatML)
    <|im_end|>     chat: closes a turn

The tokenizer adds NO tokens itself (no post-processor): `encode("ab")` is the bytes of "ab" and nothing
else. The streaming reader appends the one EOS per document explicitly, and the manifest's token counts
are `len(encode(text)) + 1` for that reason. A document that literally contains "<|endoftext|>" is
encoded with the special id, as in every Hugging Face tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Encoding, Tokenizer, decoders, models, pre_tokenizers, trainers
from tqdm import tqdm

from trainer.data.shards import PrepareError, atomic_write_bytes

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, IM_START, IM_END)

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE = "tokenizer_config.json", "special_tokens_map.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE)
"""A tokenizer directory as `save_tokenizer` writes it (the Hugging Face layout), beside shards and weights."""
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # every byte plus the special tokens

# ChatML: each message is "<|im_start|>{role}\n{content}<|im_end|>\n"; a generation prompt opens the
# assistant's turn. The assistant's content and its <|im_end|> sit in a {% generation %} block, which marks
# them for `transformers`' return_assistant_tokens_mask and does not change the text. Rendered by
# trainer.data.chat (prepare) and by `transformers`' apply_chat_template.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '" + IM_START + "' + message['role'] + '\\n' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + '" + IM_END + "' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '" + IM_END + "' }}{% endif %}"
    "{{ '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + IM_START + "assistant\\n' }}{% endif %}"
)
# The template before the generation block (the same text). A copied tokenizer_config.json holding it is
# given CHAT_TEMPLATE (trainer.prepare), so that a tokenizer prepared earlier marks assistant tokens too.
UNMARKED_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '" + IM_START + "' + message['role'] + '\\n' + message['content'] + '" + IM_END + "' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + IM_START + "assistant\\n' }}{% endif %}"
)


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens in one tokenizer."""

    eos: int
    """<|endoftext|>: appended to every document by the stream."""
    pad: int
    """<|pad|>: fills the tail of a row; never a target."""
    im_start: int
    """<|im_start|>: opens a chat turn."""
    im_end: int
    """<|im_end|>: closes a chat turn."""


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> Tokenizer:
    """Train a byte-level BPE with the special tokens at ids 0..3. Deterministic for the same texts.

    Example: train_tokenizer(["hello world"] * 10, vocab_size=300) -> a tokenizer of at most 300
    tokens whose special_ids(...) are SpecialIds(eos=0, pad=1, im_start=2, im_end=3).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise PrepareError(f"vocab size must be at least {MIN_VOCAB_SIZE} (256 bytes + special tokens), got {vocab_size}")
    tok = Tokenizer(models.BPE())
    # No prefix space: it would change the text, and decode(encode(text)) must give it back exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=sys.stderr.isatty(),
    )
    # An iterator is consumed as it comes (prepare streams its sample): the trainer keeps word counts, not texts.
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts) if isinstance(texts, Sequence) else None)
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """`tokenizer_config.json` for `transformers.PreTrainedTokenizerFast.from_pretrained`."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,  # byte-level: nothing is unknown
        "additional_special_tokens": [IM_START, IM_END],
        "model_max_length": model_max_length,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,  # keep decode exact
        "chat_template": CHAT_TEMPLATE,
    }


def special_tokens_map() -> dict:
    return {
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, IM_END],
    }


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 8192) -> str:
    """Write `tok` in the Hugging Face layout under `out_dir`; return the sha256 of tokenizer.json.

    Files: tokenizer.json (the tokenizer), tokenizer_config.json (class, special tokens, ChatML
    template), special_tokens_map.json. `model_max_length` only matters to `transformers`, which
    warns when a text encodes to more tokens.
    """
    special_ids(tok)  # refuse to save a tokenizer the stream could not use
    out_dir = Path(out_dir)
    atomic_write_bytes(out_dir / TOKENIZER_FILE, tok.to_str().encode("utf-8"))
    write_hf_configs(out_dir, model_max_length)
    return tokenizer_hash(out_dir)


def write_hf_configs(out_dir: str | Path, model_max_length: int = 8192) -> None:
    """The two small JSON files that sit next to tokenizer.json."""
    out_dir = Path(out_dir)
    atomic_write_bytes(out_dir / TOKENIZER_CONFIG_FILE, _json_bytes(tokenizer_config(model_max_length)))
    atomic_write_bytes(out_dir / SPECIAL_TOKENS_MAP_FILE, _json_bytes(special_tokens_map()))


def upgrade_chat_template(out_dir: str | Path) -> None:
    """Give a tokenizer_config.json that still holds UNMARKED_CHAT_TEMPLATE the current CHAT_TEMPLATE (the same
    text, assistant turns marked); leave any other config as it is. tokenizer.json, and so its hash, is untouched."""
    file = Path(out_dir) / TOKENIZER_CONFIG_FILE
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(config, dict) and config.get("chat_template") == UNMARKED_CHAT_TEMPLATE:
        atomic_write_bytes(file, _json_bytes({**config, "chat_template": CHAT_TEMPLATE}))


def tokenizer_file(path: str | Path) -> Path:
    """tokenizer.json given either a directory holding it or the file itself."""
    path = Path(path)
    return path / TOKENIZER_FILE if path.is_dir() else path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load tokenizer.json from a directory (or the file itself), with an error naming what is missing."""
    file = tokenizer_file(path)
    if not file.is_file():
        raise PrepareError(f"no tokenizer at {path}: expected a directory holding {TOKENIZER_FILE}, or the file")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception for any parse error
        raise PrepareError(f"{file}: not a valid tokenizers JSON file ({e})") from e


def special_ids(tok: Tokenizer, where: str | Path | None = None) -> SpecialIds:
    """Ids of the four special tokens; an error naming the ones `tok` lacks (and `where` it came from, if given).

    Example: a tokenizer with <|endoftext|> and <|pad|> only -> PrepareError "tokenizer lacks the special
    tokens ['<|im_start|>', '<|im_end|>'] ...".
    """
    ids = {name: tok.token_to_id(token) for name, token in zip(("eos", "pad", "im_start", "im_end"), SPECIAL_TOKENS, strict=True)}
    missing = [token for token, i in zip(SPECIAL_TOKENS, ids.values(), strict=True) if i is None]
    if missing:
        prefix = f"{tokenizer_file(where)}: " if where is not None else ""
        raise PrepareError(
            f"{prefix}tokenizer lacks the special tokens {missing}; this project needs all of {list(SPECIAL_TOKENS)}: "
            "use a tokenizer trained by `python -m trainer.prepare` (it adds them), or add them to yours as special tokens"
        )
    return SpecialIds(**ids)


def check_no_added_tokens(tok: Tokenizer) -> None:
    """Refuse a tokenizer whose post-processor adds tokens (BOS/EOS): the stream appends EOS itself,
    so such a tokenizer would put two EOS per document and make the manifest's counts wrong."""
    sample = "hello"
    if tok.encode(sample).ids != tok.encode(sample, add_special_tokens=False).ids:
        raise PrepareError("tokenizer adds special tokens itself (a post-processor); the stream appends EOS "
                           "explicitly, so use a tokenizer without one")


def tokenizer_hash(path: str | Path) -> str:
    """sha256 hex digest of the tokenizer.json bytes (a directory holding it, or the file)."""
    file = tokenizer_file(path)
    try:
        return hashlib.sha256(file.read_bytes()).hexdigest()
    except OSError as e:
        raise PrepareError(f"cannot read {file}: {e.strerror or e}") from e


def count_tokens(tok: Tokenizer, texts: Sequence[str], batch_size: int = 512, desc: str | None = "tokenizing") -> list[int]:
    """Tokens per document as the stream will produce them: len(encode(text)) + 1 for the EOS.

    Example: if encode("ab") is [64, 65], count_tokens(tok, ["ab"]) == [3]. `desc=None`: no progress bar.
    """
    return [len(e.ids) + 1 for e in encode_documents(tok, texts, batch_size=batch_size, desc=desc)]


def encode_documents(tok: Tokenizer, texts: Sequence[str], offsets: bool = False, batch_size: int = 512,
                     desc: str | None = None) -> list[Encoding]:
    """The documents' encodings without special tokens, as the stream tokenizes them (it appends the EOS). Without
    `offsets` by `encode_batch_fast` (the same ids, no character offsets, ~1.5x faster; tokenizers < 0.20 lacks
    it). `desc`: a progress bar's label (None: none)."""
    encode = tok.encode_batch if offsets else getattr(tok, "encode_batch_fast", tok.encode_batch)
    out: list[Encoding] = []
    with tqdm(total=len(texts), desc=desc, unit="doc", disable=None if desc else True) as bar:
        for i in range(0, len(texts), batch_size):
            batch = encode(list(texts[i : i + batch_size]), add_special_tokens=False)
            out.extend(batch)
            bar.update(len(batch))
    return out


def _json_bytes(obj: dict) -> bytes:
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")


# ---------------------------------------------------------------------------------------------------
# Extending a trained tokenizer (tokenizer.add_tokens): new ids after the old ones, nothing else changed
# ---------------------------------------------------------------------------------------------------


def extend_tokenizer(tok: Tokenizer, new_tokens: Sequence[str]) -> Tokenizer:
    """A copy of `tok` with `new_tokens` appended as special tokens: ids V, V + 1, ... (V = tok's size).

    Every existing id keeps its token, and texts without the new tokens encode exactly as before. Example:
    a 512-token tokenizer extended by ["<|tool|>"] encodes "<|tool|>" as [512] and "hello" unchanged.
    """
    taken = [t for t in new_tokens if tok.token_to_id(t) is not None]
    if taken:
        raise PrepareError(f"cannot add {taken}: the tokenizer already has them (ids "
                           f"{[tok.token_to_id(t) for t in taken]})")
    if len(set(new_tokens)) != len(new_tokens):
        raise PrepareError(f"tokens to add are listed twice: {list(new_tokens)}")
    out = Tokenizer.from_str(tok.to_str())
    out.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in new_tokens])
    return out


def extension_problem(base: Tokenizer, extended: Tokenizer, new_tokens: Sequence[str]) -> str | None:
    """Why `extended` is not `base` with exactly `new_tokens` appended (in order), or None if it is.

    Checked: the BPE model (vocabulary and merges), pre-tokenizer and decoder are identical, every old
    id maps to the same token, and the new tokens hold ids V, V + 1, ... with nothing else added.
    """
    a, b = json.loads(base.to_str()), json.loads(extended.to_str())
    for part in ("model", "pre_tokenizer", "decoder", "normalizer", "post_processor"):
        if a.get(part) != b.get(part):
            return f"its {part.replace('_', '-')} differs from the checkpoint's"
    size = base.get_vocab_size()
    want = {t: size + i for i, t in enumerate(new_tokens)}
    old = base.get_vocab(with_added_tokens=True)
    new = extended.get_vocab(with_added_tokens=True)
    changed = sorted(t for t, i in old.items() if new.get(t) != i)
    if changed:
        return f"tokens of the checkpoint's tokenizer changed id: {changed[:5]}"
    added = {t: i for t, i in new.items() if t not in old}
    if added != want:
        return (f"it adds {sorted(added, key=added.get)} at ids {sorted(added.values())}, not "
                f"{list(new_tokens)} at ids {list(want.values())}")
    return None
