"""The folder listing is the architecture: rooms import downward only, nothing imports in a circle, and every
room's __init__ says what it owns and what it must not import."""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import LAYERS, PACKAGE, ROOT, cycles, import_graph, modules, room, upward_imports


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
    assert "must not import" in " ".join(doc.lower().split()), (
        f"trainer/{package}/__init__.py: say what the room must not import")


MAP_ENTRY = re.compile(r"^\s+((?:[\w/]+,\s*)*[\w/]+)\s{2,}\S", re.M)
"""A line of a room's map: indented names (`stream, loader`, `prepare/`), two spaces, what they are."""


def map_names(doc: str) -> set[str]:
    """The module names a room's docstring map lists, and any `name.py` it mentions."""
    names = {n.strip().rstrip("/") for m in MAP_ENTRY.finditer(doc) for n in m.group(1).split(",")}
    return names | set(re.findall(r"\b(\w+)\.py\b", doc))


@pytest.mark.parametrize("init", sorted(str(p.relative_to(ROOT)) for p in PACKAGE.rglob("__init__.py")))
def test_every_module_is_named_in_its_rooms_map(init):
    """Each package's __init__ docstring is the map of its folder: every module and subpackage in it has a
    line."""
    folder = (ROOT / init).parent
    present = {p.stem for p in folder.glob("*.py")} - {"__init__"}
    present |= {p.name for p in folder.iterdir() if (p / "__init__.py").is_file()}
    missing = sorted(present - map_names(ast.get_docstring(ast.parse((ROOT / init).read_text())) or ""))
    assert missing == [], f"{init}: its docstring's map does not name {missing}"
    assert map_names("Map:\n    stream, loader    the split\n    prepare/  offline\n") == {
        "stream", "loader", "prepare"}


def test_the_root_holds_only_commands_and_shared_modules():
    root_modules = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    assert root_modules == {"train", "prepare", "report", "inspect_mask", "export", "generate", "evaluate",
                            "harness", "launcher", "certify", "config", "errors", "registry", "outputs"}


SHARED_TEST_MODULES = {"tests.helpers", "tests.harness", "tests.browser", "tests.conftest", "tests.shards"}


def cross_test_imports(test_root: Path) -> list[str]:
    """'a -> b' for each test module importing another test module (shared code belongs in
    tests/helpers.py)."""
    found = []
    for path in sorted(test_root.rglob("*.py")):
        name = ".".join(path.relative_to(test_root.parent).with_suffix("").parts)
        if name in SHARED_TEST_MODULES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{name} -> {t}" for t in targets
                      if t.startswith("tests.") and t not in SHARED_TEST_MODULES]
    return found


def test_test_modules_share_code_through_helpers_only(tmp_path):
    assert cross_test_imports(ROOT / "tests") == []
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("from tests.test_b import run\n")
    assert cross_test_imports(tmp_path / "tests") == ["tests.test_a -> tests.test_b"]  # the check can fail


def test_the_commands_that_never_compile_do_not_load_dynamo():
    """torch._dynamo costs ~1 s of a process's start; only train.compile needs it (trainer/model/compile.py
    wraps the attention call in torch.compiler.disable then, not at import). Training builds an optimizer,
    whose add_param_group imports it anyway; export, generate and inspect_mask never do."""
    code = ("import sys, trainer.export, trainer.generate, trainer.inspect_mask, trainer.model; "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def data_imports_of_run(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each module a of trainer.run importing a module b of trainer.data other than its
    facade."""
    return sorted(f"{a} -> {b}" for a, targets in graph.items() if room(a) == "trainer.run" for b in targets
                  if room(b) == "trainer.data" and b != "trainer.data.feed")


def test_the_run_takes_its_data_through_one_module():
    graph = import_graph()
    assert "trainer.data.feed" in graph["trainer.run.inputs"]
    assert data_imports_of_run(graph) == []
    assert data_imports_of_run({"trainer.run.step": {"trainer.data.batch"}}) == [
        "trainer.run.step -> trainer.data.batch"]  # the check can fail


EPOCH_ARITHMETIC = re.compile(r"\b\w*epoch\w*(['\"]?\s*\]|\))?\s*[-+]=?\s*(1\b|bool\(|self\.|ended|state\.)"
                              r"|=\s*len\(\w*wait\w*\)\s*-|\bepoch\s*\+=")
"""An epoch counted or compared by arithmetic: `epoch += 1`, `lockstep_epoch + 1`, `epoch - bool(ended)`,
..."""


def epoch_arithmetic(path: Path) -> list[str]:
    """The lines of `path` that count epochs by themselves (not through trainer.data.epochs)."""
    return [f"{path.name}:{i}: {line.strip()}" for i, line in enumerate(path.read_text().splitlines(), 1)
            if EPOCH_ARITHMETIC.search(line.split("#")[0]) and "epoch_chunks" not in line]


def test_one_module_decides_epochs(tmp_path):
    """trainer.data.epochs holds every rule of when an epoch ends and the next begins; the others ask it."""
    owner = PACKAGE / "data" / "epochs.py"
    assert epoch_arithmetic(owner)  # the rules are there, and the pattern sees them
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if path != owner
             for line in epoch_arithmetic(path)]
    assert found == []
    probe = tmp_path / "probe.py"
    probe.write_text("state.epoch += 1\nstop = self.lockstep_epoch + 1\n"
                     "e = loader['lockstep_epoch'] - bool(s)\n")
    assert len(epoch_arithmetic(probe)) == 3  # the check can fail


PREPARE_MAY_IMPORT = {"trainer.data.shards", "trainer.data.tokenizer", "trainer.data.chat",
                      "trainer.data.config", "trainer.data.workers", "trainer.errors"}
"""What the offline flow shares with the training stream (trainer/data/prepare/__init__.py)."""


def flows_crossed(graph: dict[str, set[str]]) -> list[str]:
    """'a -> b' for each import across the two flows of trainer.data: into the prepare room from outside it
    (but its command), or out of it into anything but what both flows share."""
    def inside(m: str) -> bool:
        return m.startswith("trainer.data.prepare")

    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                  if (inside(b) and not inside(a) and a != "trainer.prepare")
                  or (inside(a) and not inside(b) and b not in PREPARE_MAY_IMPORT))


def test_the_offline_preparation_and_the_training_stream_are_apart():
    graph = import_graph()
    assert "trainer.data.prepare.dataset" in graph["trainer.prepare"]
    assert flows_crossed(graph) == []
    assert flows_crossed({"trainer.data.stream": {"trainer.data.prepare.plan"},
                          "trainer.data.prepare.units": {"trainer.data.stream"}}) == [
        "trainer.data.prepare.units -> trainer.data.stream",
        "trainer.data.stream -> trainer.data.prepare.plan"]


NOT_ROOMS = {"fixtures", "__pycache__"}
"""Folders of tests/ that hold data, not tests of a room."""


def misplaced_tests(test_root: Path, package: Path) -> list[str]:
    """What breaks the mirror of the package in tests/: a folder that is not a room of the package, or a test
    file in tests/<room>/ that neither imports trainer.<room> nor names it in its docstring (a test of another
    room)."""
    rooms = {p.parent.name for p in package.glob("*/__init__.py")}
    found = []
    for folder in sorted(p for p in test_root.iterdir() if p.is_dir() and p.name not in NOT_ROOMS):
        if folder.name not in rooms:
            found.append(f"{folder.name}/: not a room of {package.name}/")
            continue
        for path in sorted(folder.glob("test_*.py")):
            tree = ast.parse(path.read_text())
            imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | {
                n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
            named = f"trainer.{folder.name}" in (ast.get_docstring(tree) or "") + " ".join(imported)
            if not named:
                found.append(f"{folder.name}/{path.name}: tests no module of trainer.{folder.name}")
    return found


def test_the_tests_mirror_the_rooms(tmp_path):
    assert misplaced_tests(ROOT / "tests", PACKAGE) == []
    (tmp_path / "trainer" / "run").mkdir(parents=True)
    (tmp_path / "trainer" / "run" / "__init__.py").write_text("")
    (tmp_path / "tests" / "run").mkdir(parents=True)
    (tmp_path / "tests" / "run" / "test_a.py").write_text("from trainer.data.batch import Batch\n")
    (tmp_path / "tests" / "trainer").mkdir()
    assert misplaced_tests(tmp_path / "tests", tmp_path / "trainer") == [
        "run/test_a.py: tests no module of trainer.run",
        "trainer/: not a room of trainer/"]  # the check can fail


TP_BRANCH = re.compile(r"\b(tensor|vocab|vocab_shard)\s+is\s+(not\s+)?None|tensor_size\s*>"
                       r"|tensor_parallel\s*>|\.is_split\(")
"""A branch on tensor parallelism: `if self.tensor is not None`, `tensor_size > 1`, `vocab is None`,
`is_split(`."""
LAYOUT_FREE = ("trainer/distributed/ddp.py", "trainer/distributed/fsdp.py",
               "trainer/distributed/deepspeed.py", "trainer/checkpoint/store.py", "trainer/model/loss.py",
               "trainer/model/gpt.py", "trainer/run/loop.py", "trainer/run/step.py",
               "trainer/run/checkpointer.py", "trainer/run/parts.py", "trainer/checkpoint/streams.py")


def test_engines_store_loss_and_loop_never_branch_on_tensor_parallelism():
    """Issue 58: a split parameter is treated like any other; the tensor layout (trainer.distributed.tensor's
    `Unsplit` / `TensorParallel`, the model's `vocab`) answers, and nobody asks which it is."""
    found = [f"{path}:{i}: {line.strip()}" for path in LAYOUT_FREE
             for i, line in enumerate((ROOT / path).read_text().splitlines(), 1) if TP_BRANCH.search(line)]
    assert found == []
    assert TP_BRANCH.search("        if self.tensor is not None:") and TP_BRANCH.search("if vocab is None:")


MODULE_NAMES = re.compile(r"\b(c_attn|c_proj|c_fc|wte|wpe|lm_head|ln_f|ln_1|ln_2|blocks)\b")


@pytest.mark.parametrize("path", ["trainer/distributed/tensor.py", "trainer/checkpoint/hf.py"])
def test_tensor_parallelism_and_hf_import_name_no_module_of_the_model(path):
    """The model's structure has one owner: its modules and `tensor_plan` (trainer/model/gpt.py) and its
    families' name maps (trainer/model/families/); the code that applies them names no module (docstrings
    may)."""
    tree = ast.parse((ROOT / path).read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef) and node.body
                  and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    named = sorted({f"{node.lineno}: {node.value!r}" for node in ast.walk(tree)
                    if isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and id(node) not in docstrings and MODULE_NAMES.search(node.value)})
    code_names = sorted({f"{node.lineno}: .{node.attr}" for node in ast.walk(tree)
                         if isinstance(node, ast.Attribute) and MODULE_NAMES.fullmatch(node.attr)})
    assert named == [] and code_names == []
    assert MODULE_NAMES.search("blocks.0.attn.c_attn.weight")  # the check can fail
