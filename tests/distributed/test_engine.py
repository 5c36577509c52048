"""The engine is one typed interface: both implementations satisfy `Engine`, hand their state to the
checkpoint store instead of writing files, and the modules import in one direction (process groups <- engines
<- parallelize), with no import circle anywhere in the package (tests/test_architecture.py)."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, import_graph
from trainer.distributed.ddp import DDPEngine
from trainer.distributed.engine import Engine

PACKAGE = ROOT / "trainer"


def protocol_members(proto: type) -> dict[str, object]:
    """Methods and annotated attributes the protocol declares."""
    methods = {n: f for n, f in vars(proto).items() if inspect.isfunction(f) and not n.startswith("_")}
    return {**methods, **{n: None for n in proto.__annotations__}}


@pytest.mark.parametrize("module, cls", [("trainer.distributed.ddp", "DDPEngine"),
                                         ("trainer.distributed.deepspeed", "DeepSpeedEngine")])
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


CHECKPOINT_MEMBERS = {"shard_format", "state_dict", "load_state_dict", "save_shards", "load_shards",
                      "converts_from", "full_weights"}
"""What the checkpoint store asks of an engine: state to write (replicated), or a directory to write into
(sharded)."""


def test_the_protocol_hands_state_to_the_store_and_chooses_no_file():
    members = protocol_members(Engine)
    assert CHECKPOINT_MEMBERS <= members.keys()
    assert not {"save", "load"} & members.keys()  # engines no longer write a checkpoint directory themselves
    # the store names it
    assert list(inspect.signature(Engine.save_shards).parameters) == ["self", "directory"]


@pytest.mark.parametrize("module", ["ddp", "deepspeed"])
def test_engines_write_no_file_themselves(module):
    """All checkpoint I/O is the store's: no engine saves, loads or names a file (DeepSpeed's own
    save_checkpoint / load_checkpoint get the directory the store chose)."""
    source = (PACKAGE / "distributed" / f"{module}.py").read_text()
    for call in ("torch.save(", "torch.load(", "save_file(", "load_file(", "open(", ".write_text(",
                 "load_state(", "save_state("):
        assert call not in source, f"trainer/distributed/{module}.py calls {call}"


def test_each_engine_refuses_the_half_of_the_checkpoint_protocol_it_does_not_have():
    """Replicated engines (shard_format None) have state_dict and refuse save_shards; sharded ones the other
    way round."""
    from trainer.distributed.deepspeed import DeepSpeedEngine

    # no process group needed to refuse
    ddp, zero = object.__new__(DDPEngine), object.__new__(DeepSpeedEngine)
    assert DDPEngine.shard_format is None and DeepSpeedEngine.shard_format == "deepspeed"
    for call in (lambda: ddp.save_shards(Path("x")), lambda: ddp.load_shards(Path("x"))):
        with pytest.raises(NotImplementedError, match="replicated"):
            call()
    for call in (zero.state_dict, lambda: zero.load_state_dict({})):
        with pytest.raises(NotImplementedError, match="sharded"):
            call()


def test_a_ddp_engine_state_round_trips_and_its_weights_are_rank_0s():
    import torch

    from trainer.distributed.groups import DistInfo

    def engine(seed: int, rank: int = 0) -> DDPEngine:
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        return DDPEngine(model, opt, sched, DistInfo(rank=rank, world_size=1, local_rank=0,
                                                     device=torch.device("cpu")), grad_clip=1.0, dtype="fp32")

    a = engine(0)
    a.module(torch.ones(4, 3)).sum().backward()
    a.optimizer_step()
    b = engine(1)
    b.load_state_dict(a.state_dict())
    assert b.lr() == a.lr() and b.optimizer.state_dict()["state"][0]["step"] == 1
    assert all(torch.equal(v, a.module.state_dict()[k]) for k, v in b.module.state_dict().items())
    weights = a.full_weights()
    assert (weights.keys() == a.module.state_dict().keys()
            and all(v.device.type == "cpu" for v in weights.values()))
    assert engine(0, rank=1).full_weights() == {}  # only rank 0 copies them out


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
    assert engine.name == "ddp" and engine.grad_average_factor == 1 and engine.micro_steps(0, 3) == 1


def test_process_groups_know_nothing_of_engines():
    graph = import_graph()
    assert not graph["trainer.distributed.groups"] & {"trainer.distributed.engine", "trainer.distributed.ddp",
                                                      "trainer.distributed.deepspeed"}
    assert "trainer.distributed.engine" not in (graph["trainer.distributed.ddp"]
                                                | graph["trainer.distributed.deepspeed"])


def test_the_deepspeed_engine_never_sets_up_a_process_group():
    source = (PACKAGE / "distributed" / "deepspeed.py").read_text()
    assert "init_process_group(" not in source
    code = ("import torch; from trainer.distributed.config import DistributedConfig; "
            "from trainer.distributed.groups import init_distributed; import torch.distributed as dist; "
            "init_distributed(DistributedConfig(engine='deepspeed', zero_stage=1, device='cpu')); "
            "assert dist.is_initialized() and dist.get_world_size() == 1; print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_engine_module_paths_exist():
    assert (PACKAGE / "distributed" / "engine.py").is_file()
    assert not hasattr(importlib.import_module("trainer.distributed.groups"), "parallelize")
    assert Path(inspect.getfile(DDPEngine)) == PACKAGE / "distributed" / "ddp.py"
