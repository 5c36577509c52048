"""The tokenizer: packtrain's own byte-level BPE (training, saving in the Hugging Face layout) or a Hugging
Face model's; loading; the special ids and how a document is framed.

Byte-level means every string round-trips: decode(encode(text)) == text for any Unicode, because the
base alphabet is the 256 bytes. Four special tokens come first (ids 0..3 for a trained tokenizer):

    <|endoftext|>  end of a document; also the EOS (and BOS, for tools that want one)
    <|pad|>        padding
    <|im_start|>   chat: opens a turn ("<|im_start|>user\\n...<|im_end|>\\n", ChatML)
    <|im_end|>     chat: closes a turn

Texts are always encoded without special tokens (`encode(text, add_special_tokens=False)`): the framing is
explicit. A document is its text's ids + [EOS], or [BOS] + its text's ids + [EOS] for a tokenizer that
starts every sequence with BOS (`SpecialIds.frame`), so the manifest's token counts are
`len(encode(text)) + SpecialIds.added`. packtrain's own tokenizer has no BOS. A Hugging Face model
directory (GPT-2, SmolLM2, Qwen2.5, Llama-3.2) brings its framing in tokenizer_config.json (eos_token,
bos_token, pad_token, add_bos_token) and in tokenizer.json's post-processor (Llama-3's adds BOS);
`tokenizer_ids(directory)` reads both. A document that
literally contains "<|endoftext|>" is encoded with the special id, as in every Hugging Face tokenizer.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
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
"""A tokenizer directory as `save_tokenizer` writes it (the Hugging Face layout), beside shards and
weights."""
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


PAD_FROM_TOKEN, PAD_FROM_EOS = "pad_token", "eos"
"""How `SpecialIds.pad` was chosen: the tokenizer's own pad token, or (it has none) the EOS id."""


@dataclass(frozen=True)
class SpecialIds:
    """Ids of the special tokens in one tokenizer, and how it frames a document (`frame`)."""

    eos: int
    """Ends every document: appended by the stream."""
    pad: int
    """Fills the tail of a row: the tokenizer's pad token, or, when it has none, the EOS id (no token added
    to the vocabulary). Either is safe: a pad position is never a target and never attended across."""
    im_start: int | None = None
    """<|im_start|>: opens a chat turn; None if the tokenizer lacks it (only chat data needs it)."""
    im_end: int | None = None
    """<|im_end|>: closes a chat turn; None if the tokenizer lacks it."""
    bos: int | None = None
    """The tokenizer's BOS, when it has one distinct from EOS or starts documents with it; else None."""
    add_bos: bool = False
    """Every document starts with `bos` (the tokenizer's framing: Llama-3's post-processor, add_bos_token)."""
    pad_from: str = PAD_FROM_TOKEN
    """PAD_FROM_TOKEN or PAD_FROM_EOS: where `pad` came from."""

    @property
    def head(self) -> tuple[int, ...]:
        """What precedes a document's text: (bos,) when add_bos, else ()."""
        return (self.bos,) if self.add_bos else ()

    @property
    def added(self) -> int:
        """Tokens a document has beyond its text's: EOS, and BOS when add_bos."""
        return len(self.head) + 1

    def frame(self, ids: Sequence[int]) -> list[int]:
        """A document's tokens from its text's ids: [5, 6] -> [5, 6, eos]; with add_bos, [bos, 5, 6, eos]."""
        return [*self.head, *ids, self.eos]


def train_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> Tokenizer:
    """Train a byte-level BPE with the special tokens at ids 0..3. Deterministic for the same texts.

    Example: train_tokenizer(["hello world"] * 10, vocab_size=300) -> a tokenizer of at most 300
    tokens whose special_ids(...) are SpecialIds(eos=0, pad=1, im_start=2, im_end=3).
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise PrepareError(f"vocab size must be at least {MIN_VOCAB_SIZE} (256 bytes + special tokens), "
                           f"got {vocab_size}")
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
    # An iterator is consumed as it comes (prepare streams its sample): the trainer keeps word counts, not
    # texts.
    tok.train_from_iterator(texts, trainer=trainer,
                            length=len(texts) if isinstance(texts, Sequence) else None)
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
    """Give a tokenizer_config.json that still holds UNMARKED_CHAT_TEMPLATE the current CHAT_TEMPLATE (the
    same text, assistant turns marked); leave any other config as it is. tokenizer.json, and so its hash, is
    untouched."""
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
        raise PrepareError(f"no tokenizer at {path}: expected a directory holding {TOKENIZER_FILE}, or the "
                           "file")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as e:  # the Rust side raises a bare Exception for any parse error
        raise PrepareError(f"{file}: not a valid tokenizers JSON file ({e})") from e


@dataclass(frozen=True)
class FramedTokenizer:
    """A tokenizer with its special ids: a text encoded as the stream encodes it, and a document's framing."""

    tok: Tokenizer
    ids: SpecialIds

    @classmethod
    def load(cls, path: str | Path) -> FramedTokenizer:
        tok = load_tokenizer(path)
        return cls(tok, special_ids(tok, path))

    def encode(self, text: str) -> list[int]:
        """The text's ids, no special tokens added (the framing is `ids.frame`'s)."""
        return self.tok.encode(text, add_special_tokens=False).ids


def tokenizer_ids(path: str | Path) -> SpecialIds:
    """The special ids and framing of the tokenizer at `path` (a directory holding tokenizer.json, with its
    tokenizer_config.json if any, or the file itself). Example: a Llama-3.2 directory -> bos=128000,
    add_bos=True, eos=128001, pad=128001 (pad_from "eos": it has no pad token), im_start=im_end=None."""
    return special_ids(load_tokenizer(path), path)


def special_ids(tok: Tokenizer, where: str | Path | None = None) -> SpecialIds:
    """The special ids and framing of `tok`, loaded from `where` (a directory or tokenizer.json: for errors,
    and for the tokenizer_config.json beside it). With that config (a Hugging Face directory, or one saved by
    `save_tokenizer`): its eos_token (default <|endoftext|>), bos_token, pad_token and add_bos_token, each
    token a string or {"content": ...} (special_tokens_map.json fills in the tokens it lacks). Without one (a
    bare tokenizer.json, or no `where`): packtrain's four special tokens, all required. Either way a
    post-processor may add a BOS at the start (add_bos) and nothing else; an error names the file and why.

    Example: a tokenizer with <|endoftext|> and <|pad|> only, no config -> PrepareError "tokenizer lacks the
    special tokens ['<|im_start|>', '<|im_end|>'] ...".
    """
    file = tokenizer_file(where) if where is not None else None
    config, config_file = hf_token_config(file.parent) if file is not None else (None, None)
    if config is None:
        ids = _packtrain_ids(tok, file)
        bos, add_bos = _framing(tok, file, None, None, None, ids.eos)
        return replace(ids, bos=bos, add_bos=add_bos)
    names = {key: _token_name(config, key, config_file) for key in ("eos_token", "bos_token", "pad_token")}
    eos_name = names["eos_token"] or EOS_TOKEN
    if names["eos_token"] is None and tok.token_to_id(EOS_TOKEN) is None:
        raise PrepareError(f"{config_file}: no eos_token, and {file.name} has no {EOS_TOKEN}: set eos_token "
                           "to the token that ends a document")
    eos = _vocab_id(tok, eos_name, "eos_token", config_file)
    config_bos = _vocab_id(tok, names["bos_token"], "bos_token", config_file)
    pad = _vocab_id(tok, names["pad_token"], "pad_token", config_file)
    add_bos_token = config.get("add_bos_token")
    if add_bos_token is not None and not isinstance(add_bos_token, bool):
        raise PrepareError(f"{config_file}: add_bos_token is {add_bos_token!r}, expected true or false")
    bos, add_bos = _framing(tok, file, config_file, config_bos, add_bos_token, eos)
    return SpecialIds(eos=eos, pad=eos if pad is None else pad, im_start=tok.token_to_id(IM_START),
                      im_end=tok.token_to_id(IM_END), bos=bos, add_bos=add_bos,
                      pad_from=PAD_FROM_EOS if pad is None else PAD_FROM_TOKEN)


def hf_token_config(directory: Path) -> tuple[dict | None, Path]:
    """(tokenizer_config.json of `directory` with the tokens special_tokens_map.json adds, its path);
    (None, path) without the file. A file that is not a JSON object is an error naming it."""
    config_file = directory / TOKENIZER_CONFIG_FILE
    if not config_file.is_file():
        return None, config_file
    config = _json_object(config_file)
    map_file = directory / SPECIAL_TOKENS_MAP_FILE
    tokens = _json_object(map_file) if map_file.is_file() else {}
    return {**{k: v for k, v in tokens.items() if k.endswith("_token")}, **config}, config_file


def _json_object(file: Path) -> dict:
    try:
        obj = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PrepareError(f"{file}: not a readable JSON file ({e})") from e
    if not isinstance(obj, dict):
        raise PrepareError(f"{file}: holds a JSON {type(obj).__name__}, expected an object")
    return obj


def _packtrain_ids(tok: Tokenizer, file: Path | None) -> SpecialIds:
    """packtrain's four special tokens, by name; an error naming the missing ones."""
    names = ("eos", "pad", "im_start", "im_end")
    ids = {name: tok.token_to_id(token) for name, token in zip(names, SPECIAL_TOKENS, strict=True)}
    missing = [token for token, i in zip(SPECIAL_TOKENS, ids.values(), strict=True) if i is None]
    if missing:
        prefix = f"{file}: " if file is not None else ""
        raise PrepareError(
            f"{prefix}tokenizer lacks the special tokens {missing}; without a {TOKENIZER_CONFIG_FILE} beside "
            f"it this project needs all of {list(SPECIAL_TOKENS)}: use a tokenizer trained by `python -m "
            "trainer.prepare` (it adds them), or a Hugging Face model directory (its "
            f"{TOKENIZER_CONFIG_FILE} names eos_token)"
        )
    return SpecialIds(**ids)


def _token_name(config: dict, key: str, config_file: Path) -> str | None:
    """A token named by the config: a string, or {"content": ...} (an AddedToken as transformers saves it)."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not (isinstance(value, str) and value):
        raise PrepareError(f"{config_file}: {key} is {config[key]!r}, expected a token string or "
                           '{"content": TOKEN}')
    return value


def _vocab_id(tok: Tokenizer, name: str | None, key: str, config_file: Path) -> int | None:
    if name is None:
        return None
    i = tok.token_to_id(name)
    if i is None:
        raise PrepareError(f"{config_file}: {key} {name!r} is not in the vocabulary of {TOKENIZER_FILE}")
    return i


FRAMING_SAMPLE = "Hello world"


def _framing(tok: Tokenizer, file: Path | None, config_file: Path | None, config_bos: int | None,
             add_bos_token: bool | None, eos: int) -> tuple[int | None, bool]:
    """(bos, add_bos) from the post-processor (what `tok.encode` adds to a text) and the config. A
    post-processor may add one token at the start, the BOS (Llama-3's TemplateProcessing); anything else is
    refused, as is a config that disagrees with it. packtrain encodes without special tokens and adds the
    BOS."""
    where = f"{file}: " if file is not None else ""
    bare = tok.encode(FRAMING_SAMPLE, add_special_tokens=False).ids
    full = tok.encode(FRAMING_SAMPLE).ids
    pp_bos = None
    if full != bare:
        if len(full) != len(bare) + 1 or full[1:] != bare:
            shown = [tok.id_to_token(i) for i in full]
            raise PrepareError(f"{where}its post-processor adds special tokens other than a BOS at the start "
                               f"({FRAMING_SAMPLE!r} -> {shown}); packtrain frames documents as [BOS] text "
                               '[EOS] itself: remove the post-processor ("post_processor": null) or make it '
                               "add only the BOS")
        pp_bos = full[0]
        if config_bos is not None and config_bos != pp_bos:
            raise PrepareError(f"{config_file}: bos_token is {tok.id_to_token(config_bos)!r}, but the "
                               f"post-processor of {TOKENIZER_FILE} starts each text with "
                               f"{tok.id_to_token(pp_bos)!r}")
        if add_bos_token is False:
            raise PrepareError(f"{config_file}: add_bos_token is false, but the post-processor of "
                               f"{TOKENIZER_FILE} adds {tok.id_to_token(pp_bos)!r} at the start of each "
                               "text: make them agree")
        return pp_bos, True
    if add_bos_token and config_bos is None:
        raise PrepareError(f"{config_file}: add_bos_token is true but no bos_token is set")
    add_bos = bool(add_bos_token)
    return (None if config_bos == eos and not add_bos else config_bos), add_bos


def tokenizer_hash(path: str | Path) -> str:
    """sha256 hex digest of the tokenizer.json bytes (a directory holding it, or the file)."""
    file = tokenizer_file(path)
    try:
        return hashlib.sha256(file.read_bytes()).hexdigest()
    except OSError as e:
        raise PrepareError(f"cannot read {file}: {e.strerror or e}") from e


def count_tokens(tok: Tokenizer, texts: Sequence[str], batch_size: int = 512, desc: str | None = "tokenizing",
                 added: int = 1) -> list[int]:
    """Tokens per document as the stream will produce them: len(encode(text)) + `added` (SpecialIds.added:
    1 for the EOS, 2 with a BOS too).

    Example: if encode("ab") is [64, 65], count_tokens(tok, ["ab"]) == [3]. `desc=None`: no progress bar.
    """
    return [len(e.ids) + added for e in encode_documents(tok, texts, batch_size=batch_size, desc=desc)]


def encode_documents(tok: Tokenizer, texts: Sequence[str], offsets: bool = False, batch_size: int = 512,
                     desc: str | None = None) -> list[Encoding]:
    """The documents' encodings without special tokens, as the stream tokenizes them (it frames them). Without
    `offsets` by `encode_batch_fast` (the same ids, no character offsets, ~1.5x faster; tokenizers < 0.20
    lacks it). `desc`: a progress bar's label (None: none)."""
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
