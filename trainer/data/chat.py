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

import ast
import functools
import json
import os
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path

import jinja2
import jinja2.ext
import numpy as np
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from trainer.data.corpus import (
    ErrorPolicy,
    PrepareError,
    json_kind,
)
from trainer.data.tokenizer import (
    CHAT_TEMPLATE,
    IM_END,
    IM_START,
    SPECIAL_TOKENS,
    TOKENIZER_CONFIG_FILE,
    tokenizer_file,
)

ROLES = ("system", "user", "assistant")
TEMPLATE_NAME = "chatml"
ASSISTANT_HEADER = IM_START + "assistant\n"
DEMO_SYSTEM = "You answer questions about the Python standard library in a sentence or two."

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


# ---------------------------------------------------------------------------------------------
# Reading and checking conversations
# ---------------------------------------------------------------------------------------------


def message_problem(record: object) -> tuple[str, str, str] | None:
    """(reason, field, what is wrong) for a record that is not a usable conversation, None for a good one.

    Example: {"messages": [{"role": "bot", "content": "hi"}]} -> ("unknown_role", "messages[0].role",
    "is a string ("bot"); expected one of system, user, assistant"). The field is "" for the record itself.
    """
    if not isinstance(record, dict):
        return "invalid_json", "", f"expected a JSON object with a 'messages' list, got {json_kind(record)}"
    if "messages" not in record:
        return "missing_messages", "messages", f"is missing (fields: {sorted(record)[:8]})"
    messages = record["messages"]
    if not isinstance(messages, list):
        return "messages_not_list", "messages", f"is {json_kind(messages)}, not a list of messages"
    if not messages:
        return "empty_messages", "messages", "is empty"
    for i, message in enumerate(messages):
        field = f"messages[{i}]"
        if not isinstance(message, dict):
            return "bad_message", field, f"is {json_kind(message)}, not an object with 'role' and 'content'"
        for name in ("role", "content"):
            if name not in message:
                return "bad_message", f"{field}.{name}", f"is missing (fields: {sorted(message)[:8]})"
        if message["role"] not in ROLES:
            return "unknown_role", f"{field}.role", f"is {json_kind(message['role'])}; expected one of {', '.join(ROLES)}"
        content = message["content"]
        if not isinstance(content, str):
            return "content_not_string", f"{field}.content", f"is {json_kind(content)}, not a string"
        forged = sorted((token for token in SPECIAL_TOKENS if token in content), key=content.find)  # first one first
        if forged:
            return ("special_token_in_content", f"{field}.content",
                    f"holds {forged[0]!r}, a special token's text: it would be encoded as that token and forge a turn "
                    "boundary; remove or escape it")
    if not any(m["role"] == "assistant" for m in messages):
        return "no_assistant_turn", "messages", "has no assistant turn: nothing to train on"
    return None


# ---------------------------------------------------------------------------------------------
# The demo chat set: questions about the standard library, answered from its docstrings
# ---------------------------------------------------------------------------------------------


def module_conversations(module: str, tree: ast.Module, policy: ErrorPolicy, template: str) -> Iterator[tuple[str, str]]:
    """(name, rendered conversation) for each documented public top-level def/class of one module."""
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        summary = first_paragraph(ast.get_docstring(node) or "")
        if not summary:
            continue
        messages = demo_conversation(f"{module}.{node.name}", summary, def_line(node))
        problem = message_problem({"messages": messages})
        if problem is not None:
            policy.skip(problem[0], f"{module}.{node.name}", f"field {problem[1]!r} {problem[2]}")
            continue
        yield node.name, render_conversation(messages, template)


def demo_conversation(name: str, summary: str, signature: str) -> list[dict]:
    """One of four shapes, picked by a hash of `name`: a question about what it does, with or without a system
    message; that question then one about its signature (two turns); the signature question alone, with a
    system message."""
    what = {"role": "user", "content": f"What does `{name}` do?"}
    answer = {"role": "assistant", "content": summary}
    system = {"role": "system", "content": DEMO_SYSTEM}
    shape = zlib.crc32(name.encode()) % 4
    if shape == 0:
        return [what, answer]
    if shape == 1:
        return [system, what, answer]
    if shape == 2:
        return [what, answer, {"role": "user", "content": "What is its signature?"},
                {"role": "assistant", "content": signature}]
    return [system, {"role": "user", "content": f"What is the signature of `{name}`?"},
            {"role": "assistant", "content": signature}]


def first_paragraph(docstring: str) -> str:
    """The docstring's first paragraph on one line. Example: "Sum.\\n\\nMore." -> "Sum."."""
    paragraph = docstring.strip().split("\n\n")[0]
    return " ".join(line.strip() for line in paragraph.splitlines() if line.strip())


def def_line(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str:
    """The def (or class) line, rebuilt from the syntax tree on one line.

    Examples: "def dumps(obj, *, skipkeys=False, indent=None, **kw):", "class JSONDecoder(object):".
    """
    if isinstance(node, ast.ClassDef):
        bases = ", ".join(ast.unparse(b) for b in [*node.bases, *node.keywords])
        return f"class {node.name}({bases}):" if bases else f"class {node.name}:"
    prefix = "async def" if isinstance(node, ast.AsyncFunctionDef) else "def"
    returns = f" -> {ast.unparse(node.returns)}" if node.returns is not None else ""
    return f"{prefix} {node.name}({ast.unparse(node.args)}){returns}:"

