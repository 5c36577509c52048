"""What the load-time checks of issue 54 cost: the non-finite scan of a checkpoint's weights and AdamW state,
and the parameter count a config describes, on gpt2-124m (or --model), side by side in one run.

    OMP_NUM_THREADS=1 .venv/bin/python bench/load_checks.py

Prints the scan as shipped (a sum per tensor, the exact mask only when the sum is not finite) beside the plain
mask (torch.isfinite(t).all() per tensor), their ratio, and config_params beside a meta build of the whole
model.
"""

from __future__ import annotations

import argparse
import time

import torch

from trainer.checkpoint.tensors import config_params, first_nonfinite
from trainer.distributed.ddp import optimizer_state_by_name
from trainer.model import AttentionConfig, GPTConfig, build_model

MODELS = {"gpt2-124m": GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, max_seq_len=1024)}


def masked(state: dict) -> bool:
    tensors = [*state["model"].values(), *(t for s in state["optimizer"].values() for t in s.values())]
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=MODELS, default="gpt2-124m")
    cfg = MODELS[p.parse_args().model]
    model = build_model(cfg, AttentionConfig(backend="sdpa_docs"))
    opt = torch.optim.AdamW(model.parameters())
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    state = {"model": dict(model.named_parameters()), "optimizer": optimizer_state_by_name(opt, model)}
    shipped, mask = best_of(lambda: first_nonfinite(state)), best_of(lambda: masked(state))
    counted = best_of(lambda: config_params(cfg))
    built = best_of(lambda: build_model(cfg, AttentionConfig(backend="sdpa_docs"), meta=True))
    print(f"threads {torch.get_num_threads()}, {model.num_params() / 1e6:.1f} M parameters + AdamW state")
    print(f"non-finite scan: shipped {shipped:.3f} s, mask {mask:.3f} s, ratio {shipped / mask:.2f}x")
    print(f"parameter count: config_params {counted:.3f} s, whole meta build {built:.3f} s")


if __name__ == "__main__":
    main()
