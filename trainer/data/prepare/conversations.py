"""Chat records checked before they are rendered (`message_problem`), and the demo chat set: questions about
the standard library answered from its docstrings (`module_conversations`). A conversation's form and its
rendering are trainer.data.chat's.
"""

from __future__ import annotations

import ast
import zlib
from collections.abc import Iterator

from trainer.data.chat import ROLES, render_conversation
from trainer.data.prepare.corpus import ErrorPolicy, json_kind
from trainer.data.tokenizer import SPECIAL_TOKENS

DEMO_SYSTEM = "You answer questions about the Python standard library in a sentence or two."


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
            return ("unknown_role", f"{field}.role",
                    f"is {json_kind(message['role'])}; expected one of {', '.join(ROLES)}")
        content = message["content"]
        if not isinstance(content, str):
            return "content_not_string", f"{field}.content", f"is {json_kind(content)}, not a string"
        # first one first
        forged = sorted((token for token in SPECIAL_TOKENS if token in content), key=content.find)
        if forged:
            return ("special_token_in_content", f"{field}.content",
                    f"holds {forged[0]!r}, a special token's text: it would be encoded as that token and "
                    "forge a turn boundary; remove or escape it")
    if not any(m["role"] == "assistant" for m in messages):
        return "no_assistant_turn", "messages", "has no assistant turn: nothing to train on"
    return None


# ---------------------------------------------------------------------------------------------
# The demo chat set: questions about the standard library, answered from its docstrings
# ---------------------------------------------------------------------------------------------


def module_conversations(module: str, tree: ast.Module, policy: ErrorPolicy,
                         template: str) -> Iterator[tuple[str, str]]:
    """(name, rendered conversation) for each documented public top-level def/class of one module."""
    for node in tree.body:
        if (not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                or node.name.startswith("_")):
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

