"""Where a command may write: never into something the user owns as an input,
never over a file it did not write.

Every command's output path (evaluate and harness --out FILE; report, inspect_mask, export and prepare --out
DIR) is checked here before anything is written:

- not inside an input: a checkpoint (meta.json), a training run's dir (metrics.jsonl), a prepared dataset
  (manifest.json), a tokenizer (tokenizer.json) or a Hugging Face model directory (config.json beside
  model.safetensors), judged where a symlink leads;
- an existing file is replaced only if it is this command's own earlier output (`own(path)`),
  or with --overwrite.

    check_out_file(Path("ck/step_000100/model.safetensors"), "trainer.evaluate", own=is_scores)
        -> OutputError("--out ck/step_000100/model.safetensors is inside ck/step_000100, which is a checkpoint
           (meta.json): give a path of its own")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from trainer.errors import UserError


def inputs() -> tuple[tuple[tuple[str, ...], str], ...]:
    """((the files that make a directory this input, what it is), ...): nothing is written at or under one.
    Imported here, not at the top: trainer.prepare checks its --out with this module and never imports torch
    (its workers stay light), which the checkpoint's names would import with it."""
    from trainer.checkpoint import hf
    from trainer.checkpoint.store import META_FILE
    from trainer.data.shards import MANIFEST_FILE
    from trainer.data.tokenizer import TOKENIZER_FILE
    from trainer.registry import METRICS_FILE

    return (((META_FILE,), "a checkpoint"), ((METRICS_FILE,), "a training run's dir"),
            ((MANIFEST_FILE,), "a prepared dataset"), ((TOKENIZER_FILE,), "a tokenizer"),
            ((hf.CONFIG_FILE, hf.WEIGHTS_FILE), "a Hugging Face model"))


class OutputError(UserError):
    """An output path that would overwrite or land inside something the user owns."""


def enclosing_input(path: Path, itself: bool = True) -> tuple[Path, str, str] | None:
    """(directory, what it is, the file that says so) of the nearest input at or above `path` (resolved),
    or None.

    Example: RUN/checkpoints/step_000100/scores.json ->
    (RUN/checkpoints/step_000100, 'a checkpoint', 'meta.json')."""
    resolved, kinds = path.resolve(), inputs()
    for directory in (resolved, *resolved.parents) if itself else resolved.parents:
        for names, what in kinds:
            if all((directory / name).is_file() for name in names):
                return directory, what, names[0]
    return None


def check_not_inside_input(path: Path, flag: str = "--out", what: str = "a directory",
                           itself: bool = True) -> None:
    """Refuse `path` if it is (unless not `itself`), or lies inside, an input (`enclosing_input`)."""
    found = enclosing_input(path, itself)
    if found is None:
        return
    directory, kind, name = found
    resolved = path.resolve()
    shown = path if resolved == path.absolute() else f"{path} (a link to {resolved})"
    where = "is" if directory == resolved else f"is inside {directory}, which is"
    raise OutputError(f"{flag} {shown} {where} {kind} ({name}): give {what} of its own")


def check_out_file(path: Path, command: str, own: Callable[[Path], bool], overwrite: bool = False,
                   flag: str = "--out") -> None:
    """Refuse output file `path` of `command` if it lies inside an input, is a directory, or exists and is not
    `command`'s own earlier output (`own(path)`) unless `overwrite` (the command's --overwrite)."""
    if path.is_dir():
        raise OutputError(f"{flag} {path} is a directory: give a file path")
    check_not_inside_input(path, flag, "a path")
    if path.exists() and not overwrite and not own(path):
        raise OutputError(f"{flag} {path} exists and is not an earlier output of {command}: it would be "
                          "overwritten; give another path, or --overwrite to replace it")


WRITTEN_BY = "written_by"
"""The key each command's JSON output carries, naming the command: what `written_by` reads back."""


def written_by(command: str) -> Callable[[Path], bool]:
    """`own` for a command whose output is a JSON object carrying {WRITTEN_BY: command}."""
    def own(path: Path) -> bool:
        import json

        try:
            with open(path, encoding="utf-8") as f:
                value = json.loads(f.read(1 << 26))
        except (OSError, ValueError, RecursionError):
            return False
        return isinstance(value, dict) and value.get(WRITTEN_BY) == command
    return own


def write_json_output(path: Path, value: dict, command: str) -> None:
    """`value` with {WRITTEN_BY: command} as JSON into `path` (checked first by the caller:
    `check_out_file`)."""
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({WRITTEN_BY: command, **value}, indent=1, default=str) + "\n")
