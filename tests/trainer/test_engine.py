"""The engine is one typed interface: both implementations satisfy `Engine`, and the modules import in one
direction (process groups <- engines <- parallelize), with no import circle anywhere in the package."""

from __future__ import annotations

import ast
import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.test_train import ROOT
from trainer.ddp_engine import DDPEngine
from trainer.engine import Engine

PACKAGE = ROOT / "trainer"


def protocol_members(proto: type) -> dict[str, object]:
    """Methods and annotated attributes the protocol declares."""
    methods = {n: f for n, f in vars(proto).items() if inspect.isfunction(f) and not n.startswith("_")}
    return {**methods, **{n: None for n in proto.__annotations__}}


@pytest.mark.parametrize("module, cls", [("trainer.ddp_engine", "DDPEngine"), ("trainer.deepspeed_engine", "DeepSpeedEngine")])
def test_each_engine_implements_every_member_with_the_protocols_signature(module, cls):
    impl = getattr(__import__(module, fromlist=[cls]), cls)  # importing the module does not import deepspeed
    for name, proto_fn in protocol_members(Engine).items():
        if proto_fn is None:  # an attribute: a class attribute, or set in __init__
            assert hasattr(impl, name) or f"self.{name} =" in inspect.getsource(impl), f"{cls} lacks {name}"
            continue
        fn = getattr(impl, name, None)
        assert callable(fn), f"{cls} lacks {name}()"
        want = list(inspect.signature(proto_fn).parameters)
        assert list(inspect.signature(fn).parameters) == want, f"{cls}.{name} signature differs from Engine's"


def test_a_built_ddp_engine_is_an_engine(tmp_path):
    import torch

    from trainer.config import DistributedConfig
    from trainer.distributed import DistInfo
    from trainer.engine import parallelize

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    engine = parallelize(model, opt, sched, info, DistributedConfig(), grad_clip=1.0, dtype="fp32")
    assert isinstance(engine, Engine) and isinstance(engine, DDPEngine)
    assert engine.name == "ddp" and engine.grad_average_factor == 1 and engine.can_discard


def import_graph() -> dict[str, set[str]]:
    """trainer module -> the trainer modules it imports (at the top or inside functions)."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("trainer"):
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                # `from pkg import submodule` depends on the submodule; `from pkg import name` on the package
                graph[name] |= subs if len(subs) == len(node.names) else subs | ({node.module} & modules.keys())
            elif isinstance(node, ast.Import):
                graph[name] |= {a.name for a in node.names} & modules.keys()
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


def test_no_import_circle_in_the_package():
    graph = import_graph()
    assert "trainer.engine" in graph["trainer.loop"]  # the graph does see imports
    assert cycles(graph) == []
    assert cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b", "a"]]  # and the check can fail


def test_process_groups_know_nothing_of_engines():
    graph = import_graph()
    assert not graph["trainer.distributed"] & {"trainer.engine", "trainer.ddp_engine", "trainer.deepspeed_engine"}
    assert "trainer.engine" not in graph["trainer.ddp_engine"] | graph["trainer.deepspeed_engine"]


def test_the_deepspeed_engine_never_sets_up_a_process_group():
    source = (PACKAGE / "deepspeed_engine.py").read_text()
    assert "init_process_group(" not in source
    code = ("import torch; from trainer.config import DistributedConfig; from trainer.distributed import "
            "init_distributed; import torch.distributed as dist; "
            "init_distributed(DistributedConfig(engine='deepspeed', zero_stage=1, device='cpu')); "
            "assert dist.is_initialized() and dist.get_world_size() == 1; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_engine_module_paths_exist():
    assert (PACKAGE / "engine.py").is_file() and not hasattr(importlib.import_module("trainer.distributed"), "parallelize")
    assert Path(inspect.getfile(DDPEngine)).name == "ddp_engine.py"
