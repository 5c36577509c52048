"""Loading a checkpoint never runs code from it: crafted pickles are refused, weights also travel as
safetensors."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.harness import require_module
from tests.helpers import ROOT, SMALL, run_train
from trainer.checkpoint import store
from trainer.checkpoint.safe_io import UnsafeCheckpointError, decode, encode, load_state, save_state


class RunsCode:
    """Unpickling this runs a shell command: what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def finished_run(demo_data, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("safe") / "run"
    run_train(run_dir, demo_data, "train.max_steps=2", "train.checkpoint_every=1", "train.eval_every=0")
    return run_dir


@pytest.mark.parametrize("victim", [store.rank_file(0), store.ENGINE_FILE])
def test_a_crafted_pickle_is_refused_and_never_runs(finished_run, demo_data, tmp_path, victim):
    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    shutil.rmtree(store.checkpoint_dir(run_dir, 2))
    marker = tmp_path / "pwned"
    target = store.checkpoint_dir(run_dir, 1) / victim
    torch.save({"model": {}, "rng": RunsCode(marker)}, target)
    store.record_checksums(target.parent)  # as a forger would: the file itself must be refused
    cmd = [sys.executable, "-m", "trainer.train", f"data.path={demo_data}", f"hydra.run.dir={run_dir}",
           *SMALL, "train.max_steps=2", "train.resume=true", "train.eval_every=0"]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2
    assert f"error: {target}: refused to load" in proc.stderr and "weights_only=False" in proc.stderr
    assert not marker.exists()


def test_load_state_refuses_without_fallback(tmp_path):
    marker, path = tmp_path / "pwned", tmp_path / "x.pt"
    torch.save([RunsCode(marker)], path)
    with pytest.raises(UnsafeCheckpointError, match="refused to load"):
        load_state(path)
    assert not marker.exists()


def test_deepspeed_files_are_checked_before_deepspeed_opens_them(tmp_path):
    require_module("deepspeed", "pip install -e '.[deepspeed]'")
    from trainer.checkpoint.store import check_deepspeed_files

    marker = tmp_path / "pwned"
    torch.save({"optimizer_state_dict": RunsCode(marker)},
               tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(UnsafeCheckpointError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt: refused"):
        check_deepspeed_files(tmp_path)
    assert not marker.exists()


def test_states_round_trip_through_plain_types():
    state = {
        "rng": {"python": __import__("random").getstate(), "numpy": np.random.get_state(),
                "torch": torch.get_rng_state()},
        "docs": [("k", np.array([5, 9, 2], np.int32), np.array([True, False, True]))],
        "count": np.int64(3),
    }
    back = decode(encode(state))
    assert back["rng"]["python"] == state["rng"]["python"]
    np.testing.assert_array_equal(back["rng"]["numpy"][1], state["rng"]["numpy"][1])
    assert back["rng"]["numpy"][1].dtype == np.uint32
    assert back["docs"][0][1].dtype == np.int32 and back["docs"][0][2].dtype == bool
    np.testing.assert_array_equal(back["docs"][0][1], [5, 9, 2])
    assert back["count"] == 3 and isinstance(back["count"], int)


def test_weights_are_also_written_as_safetensors(finished_run, tmp_path):
    ckpt = store.checkpoint_dir(finished_run, 2)
    weights = load_file(ckpt / store.WEIGHTS_FILE)  # the safetensors library's own reader
    engine = load_state(ckpt / store.ENGINE_FILE)
    assert set(weights) == set(engine["model"]) - {store.TIED_KEY}  # the tied head is the embedding
    for name, tensor in weights.items():
        assert torch.equal(tensor, engine["model"][name]), name
    save_state({"w": weights["wte.weight"]}, tmp_path / "w.pt")
    assert torch.equal(load_state(tmp_path / "w.pt")["w"], weights["wte.weight"])
