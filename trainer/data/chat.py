"""Chat data: conversations read and checked, rendered by the tokenizer's template, and assistant-only
targets.

A conversation is a JSON object {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}.
It is rendered by the chat template in the tokenizer's tokenizer_config.json, with jinja2 set up as
`transformers` sets it up (a sandbox, trim_blocks, lstrip_blocks, the `{% generation %}` block), and the
rendered text is stored as an ordinary document. The template must render ChatML (checked per conversation):

    <|im_start|>system\\nBrief.<|im_end|>\\n<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n

With data.loss_on=assistant the stream recomputes, from that text alone, which tokens are targets: the
assistant's content and its closing <|im_end|> (`assistant_spans`); a token is a target iff its characters
overlap such a span (`assistant_token_mask`), which is how `transformers`' return_assistant_tokens_mask
decides. Role headers, system and user turns, the "\\n" after each <|im_end|> and the EOS stay inputs.

Content may not hold a special token's string ("<|im_end|>", ...): it would be encoded as that special token
and forge a turn boundary. Such a record is bad input, like a missing field or an unknown role.
"""  # noqa: E501

from __future__ import annotations

import functools
import json
import os
import re
import time
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.filters
import numpy as np
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
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
        self.recording: ContextVar[tuple[list[str], list[Span]] | None] = ContextVar("generation",
                                                                                     default=None)

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


# A chat template comes with a tokenizer, from elsewhere: jinja's sandbox keeps it from reaching Python, but
# not from looping or allocating without end (nested `range(100000)` loops grew `generate --chat` to 23.5 GB;
# `'a' * 10**9` asked for a GB at once). One rendering is bounded in output, loop steps and time:
RENDER_MAX_CHARS = 1 << 20
"""Output characters one rendering may write, at least; 4x the messages' characters if that is more (a
template adds a header per turn, not megabytes)."""
RENDER_MAX_STEPS = 1_000_000
"""Loop steps over `range(...)` and over the messages, summed over every loop of one rendering."""
RENDER_MAX_SECONDS = 5.0
"""Wall-clock time of one rendering (checked at each loop step and each piece of output)."""


class TemplateLimitError(jinja2.exceptions.TemplateRuntimeError):
    """A rendering went past RENDER_MAX_CHARS, RENDER_MAX_STEPS or RENDER_MAX_SECONDS: the template's fault,
    not the conversation's."""


class _Budget:
    """What one rendering may still spend."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars, self.chars, self.steps = max_chars, 0, RENDER_MAX_STEPS
        self.deadline = time.monotonic() + RENDER_MAX_SECONDS

    def step(self, n: int = 1) -> None:
        self.steps -= n
        if self.steps < 0:
            raise TemplateLimitError(f"the chat template ran more than {RENDER_MAX_STEPS:,} loop steps in "
                                     "one rendering (trainer.data.chat.RENDER_MAX_STEPS)")
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran longer than {RENDER_MAX_SECONDS:g} s in one "
                                     "rendering (trainer.data.chat.RENDER_MAX_SECONDS)")

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise TemplateLimitError(f"the chat template {what} {n:,} characters, more than the "
                                     f"{self.max_chars:,} one rendering may write "
                                     "(trainer.data.chat.RENDER_MAX_CHARS)")


_budget: ContextVar[_Budget | None] = ContextVar("render_budget", default=None)


def _spend(n: int = 1) -> None:
    budget = _budget.get()
    if budget is not None:
        budget.step(n)


class _CountedList(list):
    """The messages as the template sees them: a list (the immutable sandbox keeps it unchanged) whose every
    iteration step is spent from the rendering's budget."""

    def __iter__(self):
        for item in super().__iter__():
            _spend()
            yield item


class _CountedRange:
    """`range(...)` in a template: a range whose iteration steps are spent from the rendering's budget."""

    def __init__(self, *args: int) -> None:
        self.range = range(*args)

    def __iter__(self):
        for i in self.range:
            _spend()
            yield i

    def __len__(self) -> int:
        return len(self.range)

    def __getitem__(self, index):
        return self.range[index]

    def __contains__(self, value) -> bool:
        return value in self.range


_FORMAT_WIDTH = re.compile(r"%[-+ #0]*(\d+)")
"""The widths of a printf-style format ("%0999999999d")."""
_BRACE_WIDTH = re.compile(r"\{[^{}]*:[^{}\d]*(\d+)")
"""The widths of a str.format spec ("{:>999999999}")."""
_WIDTH_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})
"""str methods whose integer argument is the width (or tab size) of what they build."""


def _limit() -> int:
    budget = _budget.get()
    return budget.max_chars if budget is not None else RENDER_MAX_CHARS


def _check_width(width, what: str) -> None:
    if isinstance(width, int) and width > (limit := _limit()):
        raise TemplateLimitError(f"the chat template {what} with a width of {width:,}, past the {limit:,} "
                                 "characters one rendering may write")


def _check_format(spec, what: str) -> None:
    if isinstance(spec, str):
        for width in _FORMAT_WIDTH.findall(spec) + _BRACE_WIDTH.findall(spec):
            _check_width(int(width), what)


def _check_size(n: int, what: str) -> None:
    if n > (limit := _limit()):
        raise TemplateLimitError(f"the chat template {what} {n:,} characters or items, past the {limit:,} "
                                 "one rendering may write")


class _BoundedCodeGenerator(CodeGenerator):
    """jinja's code generator, but `a ~ b` (a Concat) joins through the environment's `bounded_join`, which
    measures the parts before it builds the string: repeated `{% set s = s ~ s %}` doubles a string per
    line."""

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with everything that builds a large value from a small template checked before it
    allocates, against the rendering's bound (RENDER_MAX_CHARS): `*` (a string or list repeated), `+` and `~`
    (joined), `**` (a power's digits), `%` and str.format / the format filter (a width), str.ljust, rjust,
    center, zfill, expandtabs (a width) and replace (the result's length at most)."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})
    code_generator_class = _BoundedCodeGenerator

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _check_size(len(seq) * n, f"repeats a {type(seq).__name__} of {len(seq):,} {n:,} times:")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                _check_size(len(left) + len(right), "adds up to")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and (
                    right > 256 or abs(left).bit_length() * right > 4096):
                raise TemplateLimitError(f"the chat template raises a number of {abs(left).bit_length()} "
                                         f"bits to the power {right}: a number of more than 4096 bits is not "
                                         "a template's business")
        elif operator == "%":
            _check_format(left, "formats")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name in _WIDTH_METHODS and args:
                _check_width(args[0], f"calls str.{name}")
            elif name == "replace" and len(args) >= 2 and isinstance(args[1], str):
                _check_size(len(owner) * max(1, len(args[1])), "replaces into up to")
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """str.format / format_map as the sandbox wraps them, the format's widths checked first."""
        if (isinstance(getattr(value, "__self__", None), str)
                and getattr(value, "__name__", "") in ("format", "format_map")):
            what = f"calls str.{value.__name__}"
            _check_format(value.__self__, what)
            wrapped = super().wrap_str_format(value)
            if ":{" not in value.__self__:
                return wrapped

            def nested_widths_checked(*args, **kwargs):  # "{0:{1}}": a width given as an argument
                for arg in [*args, *kwargs.values(),
                            *(a for m in args if isinstance(m, dict) for a in m.values())]:
                    _check_width(arg, what)
                return wrapped(*args, **kwargs)

            return nested_widths_checked
        return super().wrap_str_format(value)

    def bounded_join(self, parts) -> str:
        parts = [str(part) for part in parts]
        _check_size(sum(map(len, parts)), "joins")
        return "".join(parts)


def _bounded_width(filter_fn):
    """A jinja filter taking a width (center, indent) whose width is checked against the rendering's bound."""

    def bounded(value, width=80, *args, **kwargs):
        _check_width(width, f"asks {filter_fn.__name__}")
        return filter_fn(value, width, *args, **kwargs)

    return bounded


def _bounded_format(value, *args, **kwargs):
    """jinja's `format` filter (printf-style), its widths checked first."""
    _check_format(value, "formats")
    return jinja2.filters.do_format(value, *args, **kwargs)


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    """A chat template compiled as transformers compiles it (templates are untrusted code: sandboxed), and
    bounded (RENDER_MAX_CHARS, RENDER_MAX_STEPS, RENDER_MAX_SECONDS)."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.globals["range"] = _CountedRange
    for name in ("center", "indent"):
        env.filters[name] = _bounded_width(env.filters[name])
    env.filters["format"] = _bounded_format
    env.globals["raise_exception"] = _raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise PrepareError(f"the tokenizer's chat template does not compile: {e}") from e


def render(messages: list[dict], template: str,
           add_generation_prompt: bool = False) -> tuple[str, list[Span]]:
    """(text, spans of the `{% generation %}` blocks) of `messages` rendered by `template`.

    Example, CHAT_TEMPLATE and [user "Hi", assistant "Hello"]:
        text  = "<|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\nHello<|im_end|>\\n"
        spans = [(52, 67)]   (text[52:67] == "Hello<|im_end|>")
    """
    compiled = compile_template(template)
    extension = next(e for e in compiled.environment.extensions.values() if isinstance(e, GenerationBlock))
    blocks: list[str] = []
    spans: list[Span] = []
    given = sum(len(str(m.get("content", ""))) for m in messages if isinstance(m, dict))
    budget = _Budget(max(RENDER_MAX_CHARS, 4 * given))
    token = _budget.set(budget)
    try:
        with extension.record(blocks, spans):
            for block in compiled.generate(messages=_CountedList(messages),
                                           add_generation_prompt=add_generation_prompt):
                blocks.append(block)
                budget.chars += len(block)
                budget.size(budget.chars, "wrote")
                budget.check_time()
    except RecursionError:
        raise TemplateLimitError("the chat template recursed deeper than Python's recursion limit (a macro "
                                 "that calls itself without end)") from None
    except (ArithmeticError, TypeError, ValueError, LookupError, MemoryError) as e:
        # the template's own code failed
        raise jinja2.exceptions.TemplateRuntimeError(f"the chat template failed: {type(e).__name__}: "
                                                     f"{e}") from e
    finally:
        _budget.reset(token)
    return "".join(blocks), spans


def chatml(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """ChatML written out in Python: what every template used here must render."""
    turns = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return turns + (ASSISTANT_HEADER if add_generation_prompt else "")


def render_conversation(messages: list[dict], template: str) -> str:
    """The document text of a checked conversation: `template`'s rendering, which must be ChatML and, where
    the template marks `{% generation %}` blocks, must mark exactly the assistant spans the stream will
    find."""
    text, generation = render(messages, template)
    expected = chatml(messages)
    if text != expected:
        at = len(os.path.commonprefix([text, expected]))
        raise PrepareError(
            f"the tokenizer's chat template does not render ChatML: at character {at} it gives "
            f"{text[at : at + 40]!r}, ChatML has {expected[at : at + 40]!r}; data.loss_on=assistant reads "
            "ChatML turns (use a tokenizer prepared by this project, or set its tokenizer_config.json "
            "chat_template to ChatML)"
        )
    if generation and generation != assistant_spans(text):
        raise PrepareError(f"the tokenizer's chat template marks {generation} with {{% generation %}}, but "
                           f"the assistant turns (content and <|im_end|>) are {assistant_spans(text)}")
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
        raise PrepareError(f"{config}: chat_template is {type(template).__name__}, expected one template "
                           "string")
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
        tokens  <|im_start|> u s e r \\n H i <|im_end|> \\n
                <|im_start|> a s s i s t a n t \\n H e l l o <|im_end|> \\n
        mask         0       0 0 0 0  0 0 0     0      0
                   0      0 0 0 0 0 0 0 0 0  0 1 1 1 1 1     1      0
    A token that straddles a span's edge (a merged "\\n\\n" of the header's and the content's newline) is a
    target.
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


def mask_ranges(mask_N: np.ndarray) -> np.ndarray:
    """(k, 2) uint32 little-endian: the [start, end) index ranges of a bool mask's runs of True (what prepare
    stores as a chat document's `assistant` field). Example: [0, 1, 1, 0, 1] -> [[1, 3], [4, 5]]."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask_N.astype(np.int8), [0]))))
    return edges.astype("<u4").reshape(-1, 2)


def ranges_mask(ranges: bytes, n: int) -> np.ndarray:
    """(n,) bool from stored [start, end) ranges (`mask_ranges`' bytes; valid by `ranges_problem`): the
    inverse. Example: [[1, 3]], 4 -> [0, 1, 1, 0]."""
    pairs = np.frombuffer(ranges, dtype="<u4").astype(np.int64)
    mask_N = np.zeros(n + 1, dtype=np.int32)
    np.add.at(mask_N, pairs[0::2], 1)
    np.add.at(mask_N, pairs[1::2], -1)
    return np.cumsum(mask_N[:-1]) > 0


def ranges_problem(ranges: bytes, n: int) -> str | None:
    """What is wrong with stored ranges for a document of `n` tokens, or None: whole uint32 pairs, each within
    [0, n] and start <= end. Example: 12 bytes -> "12 bytes are not uint32 pairs"."""
    if len(ranges) % 8:
        return f"{len(ranges)} bytes are not uint32 pairs"
    pairs = np.frombuffer(ranges, dtype="<u4")
    if len(pairs) and (pairs.max() > n or np.any(pairs[0::2] > pairs[1::2])):
        return f"ranges {pairs.reshape(-1, 2).tolist()[:4]} are not [start, end) within the {n} tokens"
    return None
