"""Chat data: conversations read and checked, rendered by the tokenizer's template, and assistant-only targets.

A conversation is a JSON object {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}.
It is rendered by the chat template in the tokenizer's tokenizer_config.json, with jinja2 set up as
`transformers` sets it up (a sandbox, trim_blocks, lstrip_blocks, the `{% generation %}` block), and the
rendered text is stored as an ordinary document. The template must render ChatML (checked per conversation):

    <|im_start|>system\\nBe brief.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n

With data.loss_on=assistant the stream recomputes, from that text alone, which tokens are targets: the
assistant's content and its closing <|im_end|> (`assistant_spans`); a token is a target iff its characters
overlap such a span (`assistant_token_mask`), which is how `transformers`' return_assistant_tokens_mask
decides. Role headers, system and user turns, the "\\n" after each <|im_end|> and the EOS stay inputs.

Content may not hold a special token's string ("<|im_end|>", ...): it would be encoded as that special token
and forge a turn boundary. Such a record is bad input, like a missing field or an unknown role.
"""

from __future__ import annotations

import functools
import json
import os
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trainer.data.shards import PrepareError
from trainer.data.tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    TOKENIZER_CONFIG_FILE,
    tokenizer_file,
)

ROLES = ("system", "user", "assistant")
TEMPLATE_NAME = "chatml"
ASSISTANT_HEADER = IM_START + "assistant\n"

Span = tuple[int, int]  # [start, end) character offsets into a rendered conversation


# ---------------------------------------------------------------------------------------------
# Rendering with the tokenizer's template
# ---------------------------------------------------------------------------------------------


class GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body unchanged and, while a recording is active,
    notes the body's character span in the output (what transformers' AssistantTracker does)."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.recording: ContextVar[tuple[list[str], list[Span]] | None] = ContextVar("generation", default=None)

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        text = caller()
        recording = self.recording.get()
        if recording is not None:
            blocks, spans = recording  # the output rendered so far, and the spans found in it
            start = sum(len(b) for b in blocks)
            spans.append((start, start + len(text)))
        return text

    @contextmanager
    def record(self, blocks: list[str], spans: list[Span]):
        token = self.recording.set((blocks, spans))
        try:
            yield
        finally:
            self.recording.reset(token)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it (templates are untrusted code: sandboxed)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise PrepareError(f"the tokenizer's chat template does not compile: {e}") from e


def render(messages: list[dict], template: str, add_generation_prompt: bool = False) -> tuple[str, list[Span]]:
    """(text, spans of the `{% generation %}` blocks) of `messages` rendered by `template`.

    Example, CHAT_TEMPLATE and [user "Hi", assistant "Hello"]:
        text  = "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n"
        spans = [(52, 67)]   (text[52:67] == "Hello<|im_end|>")
    """
    compiled = compile_template(template)
    extension = next(e for e in compiled.environment.extensions.values() if isinstance(e, GenerationBlock))
    blocks: list[str] = []
    spans: list[Span] = []
    with extension.record(blocks, spans):
        for block in compiled.generate(messages=messages, add_generation_prompt=add_generation_prompt):
            blocks.append(block)
    return "".join(blocks), spans


def chatml(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """ChatML written out in Python: what every template used here must render."""
    turns = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return turns + (ASSISTANT_HEADER if add_generation_prompt else "")


def render_conversation(messages: list[dict], template: str) -> str:
    """The document text of a checked conversation: `template`'s rendering, which must be ChatML and, where the
    template marks `{% generation %}` blocks, must mark exactly the assistant spans the stream will find."""
    text, generation = render(messages, template)
    expected = chatml(messages)
    if text != expected:
        at = len(os.path.commonprefix([text, expected]))
        raise PrepareError(
            f"the tokenizer's chat template does not render ChatML: at character {at} it gives "
            f"{text[at : at + 40]!r}, ChatML has {expected[at : at + 40]!r}; data.loss_on=assistant reads ChatML turns "
            "(use a tokenizer prepared by this project, or set its tokenizer_config.json chat_template to ChatML)"
        )
    if generation and generation != assistant_spans(text):
        raise PrepareError(f"the tokenizer's chat template marks {generation} with {{% generation %}}, but the "
                           f"assistant turns (content and <|im_end|>) are {assistant_spans(text)}")
    return text


def chat_template(tokenizer_dir: str | Path) -> str:
    """The `chat_template` of the tokenizer_config.json beside tokenizer.json; CHAT_TEMPLATE if there is none
    (without the file, prepare writes one holding it)."""
    config = tokenizer_file(tokenizer_dir).parent / TOKENIZER_CONFIG_FILE
    if not config.is_file():
        return CHAT_TEMPLATE
    try:
        template = json.loads(config.read_text(encoding="utf-8")).get("chat_template", CHAT_TEMPLATE)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise PrepareError(f"{config}: cannot read the chat template ({e})") from e
    if not isinstance(template, str):
        raise PrepareError(f"{config}: chat_template is {type(template).__name__}, expected one template string")
    return template


# ---------------------------------------------------------------------------------------------
# Assistant-only targets
# ---------------------------------------------------------------------------------------------


def assistant_spans(text: str) -> list[Span]:
    """Character spans of the assistant turns of a ChatML text: the content and the closing <|im_end|>.

    The header "<|im_start|>assistant\\n" and the "\\n" after <|im_end|> are outside. A turn left open (a text
    cut short) runs to the end. Example:
        "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n"
         0           12   16  19        29 30          42        52   57        67 68
        -> [(52, 67)]: "Hello<|im_end|>"
    """
    spans = []
    header = text.find(ASSISTANT_HEADER)
    while header != -1:
        start = header + len(ASSISTANT_HEADER)
        close = text.find(IM_END, start)
        end = len(text) if close == -1 else close + len(IM_END)
        spans.append((start, end))
        header = text.find(ASSISTANT_HEADER, end)
    return spans


def assistant_token_mask(text: str, offsets: list[Span] | np.ndarray) -> np.ndarray:
    """(n,) bool: True for the tokens whose characters [start, end) overlap an assistant span of `text`.

    `offsets` are the tokenizer's character offsets of each token (tokenizers' `Encoding.offsets`). Example,
    the text of `assistant_spans` tokenized byte by byte (no merges), span (52, 67):
        tokens  <|im_start|> u s e r \\n H i <|im_end|> \\n <|im_start|> a s s i s t a n t \\n H e l l o <|im_end|> \\n
        mask         0       0 0 0 0  0 0 0     0      0       0      0 0 0 0 0 0 0 0 0  0 1 1 1 1 1     1      0
    A token that straddles a span's edge (a merged "\\n\\n" of the header's and the content's newline) is a target.
    """
    offsets_N2 = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask_N = np.zeros(len(offsets_N2), dtype=bool)
    spans = assistant_spans(text)
    if not spans or not len(offsets_N2):
        return mask_N
    starts_S, ends_S = np.asarray(spans, dtype=np.int64).T
    # Spans are sorted and disjoint: the only candidate for token t is the first span ending after t starts.
    first_S = np.searchsorted(ends_S, offsets_N2[:, 0], side="right")
    has = first_S < len(spans)
    mask_N[has] = starts_S[first_S[has]] < offsets_N2[has, 1]
    return mask_N
