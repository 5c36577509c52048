"""The engine is one typed interface: both implementations satisfy `Engine`, and the modules import in one
direction (process groups <- engines <- parallelize), with no import circle anywhere in the package (tests/test_architecture.py)."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_architecture import import_graph
from tests.trainer.test_train import ROOT
from trainer.distributed.ddp import DDPEngine
from trainer.distributed.engine import Engine

PACKAGE = ROOT / "trainer"


def protocol_members(proto: type) -> dict[str, object]:
    """Methods and annotated attributes the protocol declares."""
    methods = {n: f for n, f in vars(proto).items() if inspect.isfunction(f) and not n.startswith("_")}
    return {**methods, **{n: None for n in proto.__annotations__}}


@pytest.mark.parametrize("module, cls", [("trainer.distributed.ddp", "DDPEngine"), ("trainer.distributed.deepspeed", "DeepSpeedEngine")])
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

    from trainer.distributed.config import DistributedConfig
    from trainer.distributed.engine import parallelize
    from trainer.distributed.groups import DistInfo

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    engine = parallelize(model, opt, sched, info, DistributedConfig(), grad_clip=1.0, dtype="fp32")
    assert isinstance(engine, Engine) and isinstance(engine, DDPEngine)
    assert engine.name == "ddp" and engine.grad_average_factor == 1 and engine.can_discard


def test_process_groups_know_nothing_of_engines():
    graph = import_graph()
    assert not graph["trainer.distributed.groups"] & {"trainer.distributed.engine", "trainer.distributed.ddp", "trainer.distributed.deepspeed"}
    assert "trainer.distributed.engine" not in graph["trainer.distributed.ddp"] | graph["trainer.distributed.deepspeed"]


def test_the_deepspeed_engine_never_sets_up_a_process_group():
    source = (PACKAGE / "distributed" / "deepspeed.py").read_text()
    assert "init_process_group(" not in source
    code = ("import torch; from trainer.distributed.config import DistributedConfig; from trainer.distributed.groups import "
            "init_distributed; import torch.distributed as dist; "
            "init_distributed(DistributedConfig(engine='deepspeed', zero_stage=1, device='cpu')); "
            "assert dist.is_initialized() and dist.get_world_size() == 1; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_engine_module_paths_exist():
    assert (PACKAGE / "distributed" / "engine.py").is_file()
    assert not hasattr(importlib.import_module("trainer.distributed.groups"), "parallelize")
    assert Path(inspect.getfile(DDPEngine)) == PACKAGE / "distributed" / "ddp.py"
