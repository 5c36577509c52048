"""The folder listing is the architecture: rooms import downward only, nothing imports in a circle, and every
room's __init__ says what it owns and what it must not import."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "trainer"

LAYERS: list[set[str]] = [
    {"trainer.errors", "trainer.registry"},  # shared vocabulary: imports nothing of the package
    {"trainer.data"},  # shards -> documents -> rows -> batches
    {"trainer.model"},  # single-device GPT, attention kernels, losses
    {"trainer.distributed"},  # process groups and engines
    {"trainer.checkpoint"},  # the checkpoint store and everything that reads weights
    {"trainer.config"},  # the typed config, assembled from the rooms' sections
    {"trainer.run"},  # the loop and its parts
    {"trainer.train", "trainer.prepare", "trainer.report", "trainer.inspect_mask", "trainer.export",
     "trainer.generate", "trainer"},  # the commands
]
"""Each module may import from its own layer and the layers above it in this list (lower = more basic).
A room is a subpackage or a root module; `trainer.data.config` belongs to `trainer.data`."""


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """trainer module -> the trainer modules it imports (at the top, inside functions, under TYPE_CHECKING)."""
    mods = modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
                # `from pkg import submodule` depends on the submodule; `from pkg import name` on the package
                graph[name] |= subs if len(subs) == len(node.names) else subs | ({node.module} & mods.keys())
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names} & mods.keys()
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, done = [], set()

    def visit(node: str, path: list[str]) -> None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                found.append(path[path.index(nxt):] + [nxt])
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    return found


def room(module: str) -> str:
    """The room of a module: its subpackage (trainer.data.stream -> trainer.data) or itself at the root."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or (PACKAGE / parts[-1]).is_dir() else module


def layer(module: str) -> int:
    r = room(module)
    return next(i for i, rooms in enumerate(LAYERS) if r in rooms)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each import of a module from a higher layer (a room that should depend on a, not a on it)."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if room(a) != room(b) and layer(b) > layer(a))


def test_every_module_is_in_a_layer():
    unplaced = sorted(m for m in modules() if not any(room(m) in rooms for rooms in LAYERS))
    assert unplaced == [], f"place these in LAYERS: {unplaced}"


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert "trainer.distributed.engine" in graph["trainer.run.loop"]  # the graph does see imports
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]  # and the check can fail


def test_no_room_imports_from_a_room_above_it():
    assert upward_imports(import_graph()) == []
    assert upward_imports({"trainer.data.batch": {"trainer.run.loop"}, "trainer.run.loop": set()}) == [
        "trainer.data.batch -> trainer.run.loop"]  # the check can fail


def test_the_model_knows_nothing_of_ranks():
    for name, path in modules().items():
        if room(name) != "trainer.model":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            imported = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [m for m in imported if m.startswith(("torch.distributed", "deepspeed"))], name


@pytest.mark.parametrize("package", sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
def test_each_room_says_what_it_owns_and_what_it_must_not_import(package):
    doc = importlib.import_module(f"trainer.{package}").__doc__ or ""
    assert len(doc.split()) >= 20, f"trainer/{package}/__init__.py needs a docstring: what the room owns"
    assert "must not import" in " ".join(doc.lower().split()), f"trainer/{package}/__init__.py: say what the room must not import"


def test_the_root_holds_only_commands_and_shared_modules():
    root_modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert root_modules == {"train", "prepare", "report", "inspect_mask", "export", "generate", "config",
                            "errors", "registry"}
