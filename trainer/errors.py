"""Errors that are the user's mistake, and how they are shown: one line, `error: <message>`, exit status 2.

A `UserError` says what is wrong with what the user gave (a config value, a data directory, a shard, a
tokenizer, an attention backend this machine cannot run) and what to do about it, so its message alone is
enough and a traceback would only bury it. Any other exception is a bug and keeps its traceback.
`python -m trainer.train` prints user errors this way (unless HYDRA_FULL_ERROR=1 asks for every traceback),
and so does `python -m trainer.prepare`.
"""

from __future__ import annotations


class UserError(Exception):
    """A mistake in the user's config, data or environment; the message names it and what to do."""


class ConfigError(UserError, ValueError):
    """An unknown key, or a value of the wrong type or out of range, in the composed config."""


def original_message(error: BaseException) -> str:
    """The message of `error`, without the wrapping torch adds when it re-raises a DataLoader worker's error.

    torch re-raises `DataStreamError("a.tar: bad")` from a worker as `DataStreamError("Caught DataStreamError
    in DataLoader worker process 0.\\nOriginal Traceback (most recent call last):\\n  File ...\\n
    trainer.data.reader.DataStreamError: a.tar: bad\\n")`; this returns "a.tar: bad". Other messages are
    returned as they are.
    """
    text = str(error)
    if not (text.startswith("Caught ") and "\nOriginal Traceback (most recent call last):" in text):
        return text
    lines = text.rstrip("\n").splitlines()
    # The last traceback block is the exception that was raised (earlier ones are its causes). Its frame
    # lines are indented; the first line that is not is "<module>.<Type>: <message>".
    start = max(i for i, line in enumerate(lines) if line.endswith("Traceback (most recent call last):"))
    body = [i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")]
    if not body:
        return text
    first = lines[body[0]]
    message = first.split(": ", 1)[1] if ": " in first else first
    return "\n".join([message, *lines[body[0] + 1 :]])


def one_line(message: str) -> str:
    """A message on one line: its non-blank lines, stripped, joined by "; " (by " " after a colon).

    Example: "Could not find 'attention/x'\\n\\nAvailable options:\\n\\tauto\\n\\tdense" ->
    "Could not find 'attention/x'; Available options: auto; dense".
    """
    parts = [line.strip() for line in message.splitlines() if line.strip()]
    out = parts[0] if parts else ""
    for part in parts[1:]:
        out += (" " if out.endswith(":") else "; ") + part
    return out
