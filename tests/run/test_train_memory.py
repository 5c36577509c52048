"""loss.chunk_tokens and train.activation_checkpointing through `python -m trainer.train`: the same run.

Each option is checked against the plain path tensor by tensor in tests/model/; here they reach the model
through Hydra, the config and the Trainer (trainer.run.loop), and the first steps of training and the held-out
loss must be those of a plain run with the same seed.
"""

from __future__ import annotations

import pytest

from tests.helpers import metrics, run_train

pytestmark = pytest.mark.slow

# measured over the 3 steps: |loss difference| <= 7.6e-7 (losses ~6.2: a few fp32 ulps), val_loss 5.1e-7
LOSS_TOL = 1e-5
GRAD_NORM_RTOL = 1e-5  # measured: <= 1.0e-7


@pytest.mark.parametrize("normalization, checkpointing",
                         [("global_tokens", "full"), ("document_mean", "selective")])
def test_chunked_loss_and_checkpointing_train_like_the_plain_path(demo_data, tmp_path, normalization,
                                                                  checkpointing):
    common = ("train.max_steps=3", "train.checkpoint_every=0", f"loss.normalization={normalization}")
    run_train(tmp_path / "plain", demo_data, *common)
    run_train(tmp_path / "lean", demo_data, *common, "loss.chunk_tokens=100",
              f"train.activation_checkpointing={checkpointing}")
    plain, lean = metrics(tmp_path / "plain"), metrics(tmp_path / "lean")
    assert [m["valid_tokens"] for m in lean] == [m["valid_tokens"] for m in plain]
    for a, b in zip(plain, lean, strict=True):
        assert abs(a["loss"] - b["loss"]) <= LOSS_TOL, (a["step"], a["loss"], b["loss"])
        assert abs(a["grad_norm"] - b["grad_norm"]) <= GRAD_NORM_RTOL * a["grad_norm"]
    assert plain[-1]["val_tokens"] == lean[-1]["val_tokens"] > 0  # eval at the last step, chunked too
    assert abs(plain[-1]["val_loss"] - lean[-1]["val_loss"]) <= LOSS_TOL
