"""Built-in tasks made from held-out documents, so a run has a downstream score offline.

    continuation4   multiple choice: a document's opening, and its true next words among 4; the 3 distractors
                    are the next words of other held-out documents of the closest length (in characters)
    cloze           language modeling: a document's opening up to its last whole word in the window, that word
                    the continuation (LAMBADA's form: greedy match and log-likelihood)

Both are cut from the held-out split (the manifest's val split, or the run's data.val_urls): documents the run
never trains on. A text is cut into pieces, each a run of whitespace and the word after it, so query + choice
is always a prefix of the document as written and the whitespace between them starts the choice (lm-eval's
convention). Example: "def parse(s):\\n    return s" -> pieces ["def", " parse(s):", "\\n    return", " s"].
The same documents and `seed` give the same items; items whose longest query + choice passes `max_tokens` (the
model's context) are left out.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from trainer.data.config import DataConfig
from trainer.data.feed import load_eval_docs
from trainer.data.tokenizer import load_tokenizer, special_ids
from trainer.tasks.tasks import LANGUAGE_MODELING, MULTIPLE_CHOICE, Item, Task

QUERY_CHARS = 160
"""The longest opening (characters) a query takes from its document."""
CONTINUATION_CHARS = 48
"""continuation4: the true continuation's length, words added until it reaches this many characters."""
NUM_CHOICES = 4
MIN_QUERY_PIECES = 2
PIECE = re.compile(r"\s*\S+")
WORD_PIECE = re.compile(r"\s+[A-Za-z_][A-Za-z0-9_]*")
"""A cloze target: whitespace, then an identifier-like word and nothing else (no punctuation to guess)."""


def heldout_texts(data: DataConfig | str | Path, tokenizer_dir: Path, max_docs: int | None) -> list[str]:
    """The first `max_docs` held-out documents' texts, in the eval's fixed order (trainer.data.feed), whole.

    Read as token ids and decoded: the byte-level tokenizer gives the text back exactly, without the framing
    the stream adds (the EOS at the end, the BOS first where the tokenizer frames documents so)."""
    tok = load_tokenizer(tokenizer_dir)
    ids = special_ids(tok, tokenizer_dir)
    # no document is split
    docs = load_eval_docs(data, tokenizer_dir, ids.eos, seq_len=2**62, max_docs=max_docs)
    return [tok.decode(d.tokens[len(ids.head):-1].tolist(), skip_special_tokens=False) for d in docs]


def pieces(text: str) -> list[str]:
    """The text as whitespace + word pieces (trailing whitespace dropped).
    Example: "a  b\\n" -> ["a", "  b"]."""
    return PIECE.findall(text)


def opening(parts: Sequence[str], max_chars: int) -> int:
    """How many leading pieces fit in `max_chars` characters, leaving at least one piece after them."""
    n, chars = 0, 0
    while n < len(parts) - 1 and chars + len(parts[n]) <= max_chars:
        chars += len(parts[n])
        n += 1
    return n


def continuation4(texts: Sequence[str], seed: int = 0, max_items: int | None = None) -> Task:
    """The true continuation among 4 (see the module docstring); gold's position drawn with `seed`.

    Each document of at least MIN_QUERY_PIECES + 1 pieces gives a (query, continuation): the query its opening
    (<= QUERY_CHARS, at most half its pieces), the continuation the next pieces up to CONTINUATION_CHARS. The
    distractors of one item are 3 other documents' continuations, the closest in length (ties: a seeded
    order).
    """
    rng = np.random.default_rng(seed)
    pairs = []
    for text in texts:
        parts = pieces(text)
        q = min(opening(parts, QUERY_CHARS), len(parts) // 2)
        if q < MIN_QUERY_PIECES:
            continue
        end = q + 1
        while end < len(parts) and len("".join(parts[q:end])) < CONTINUATION_CHARS:
            end += 1
        pairs.append(("".join(parts[:q]), "".join(parts[q:end])))
    if len({c for _, c in pairs}) < NUM_CHOICES:
        return Task("continuation4", MULTIPLE_CHOICE, (), "builtin: too few held-out documents")
    items = []
    for i, (query, gold_text) in enumerate(pairs[:max_items]):
        tiebreak = rng.permutation(len(pairs))
        others = sorted((abs(len(c) - len(gold_text)), int(tiebreak[j]), c) for j, (_, c) in enumerate(pairs)
                        if j != i and c != gold_text)
        distractors = list(dict.fromkeys(c for _, _, c in others))[: NUM_CHOICES - 1]
        gold = int(rng.integers(NUM_CHOICES))
        choices = distractors[:gold] + [gold_text] + distractors[gold:]
        items.append(Item(query=query, choices=tuple(choices), gold=gold))
    return Task("continuation4", MULTIPLE_CHOICE, tuple(items),
                "builtin: the true continuation among 4, from held-out documents")


def cloze(texts: Sequence[str], max_items: int | None = None) -> Task:
    """A last-word cloze (see the module docstring): per document, its opening (<= QUERY_CHARS) up to the last
    piece in it that is a plain word; that piece, leading whitespace included, is the continuation."""
    items = []
    for text in texts:
        parts = pieces(text)
        window = opening(parts, QUERY_CHARS) + 1
        k = next((k for k in range(window - 1, 0, -1) if WORD_PIECE.fullmatch(parts[k])), None)
        if k is not None:
            items.append(Item(query="".join(parts[:k]), choices=(parts[k],), gold=0))
    return Task("cloze", LANGUAGE_MODELING, tuple(items[:max_items]),
                "builtin: the last word of a held-out document's opening")


BUILTINS: dict[str, Callable[[Sequence[str], int, int | None], Task]] = {
    "continuation4": continuation4,
    "cloze": lambda texts, seed, max_items: cloze(texts, max_items),
}
"""The built-in tasks by name: (held-out texts, seed, most items) -> Task."""


def fitting(task: Task, count_tokens: Callable[[str], int], max_tokens: int) -> Task:
    """`task` without the items whose query + longest choice passes `max_tokens` tokens."""
    def fits(item: Item) -> bool:
        return count_tokens(item.query) + max(map(count_tokens, item.choices)) <= max_tokens

    return Task(task.name, task.kind, tuple(i for i in task.items if fits(i)), task.source)
