"""A tensor-parallel rank loading a whole engine.pt, mapped or read whole (not a test): peak RSS and load
time.

    MMAP=0 OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node=2 bench/tp_load.py
    MMAP=1 OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node=2 bench/tp_load.py

gpt2-124m under distributed.tensor_parallel=2 (DDP engine), a whole one-rank engine.pt (model + AdamW moments,
1.5 GB, written once to $ENGINE or /tmp/tp_load_engine.pt) loaded as trainer.checkpoint.store.load_engine does
under TP (MMAP=1: `load_state(..., map_location="cpu", mmap=True)`) or read whole first (MMAP=0), then
DDPEngine.load_state_dict keeping this rank's slices. Prints each rank's peak RSS before and after, and the
time.
"""

import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from trainer.checkpoint.safe_io import load_state, save_state
    from trainer.distributed.config import DistributedConfig
    from trainer.distributed.engine import parallelize
    from trainer.distributed.groups import init_distributed
    from trainer.model import AttentionConfig, GPTConfig, build_model
    cfg = DistributedConfig(device="cpu", tensor_parallel=2)
    info = init_distributed(cfg)
    shape = GPTConfig(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, max_seq_len=1024)
    path = os.environ.get("ENGINE", "/tmp/tp_load_engine.pt")
    if not os.path.exists(path) and dist.get_rank() == 0:  # a whole one-rank state with AdamW moments
        torch.manual_seed(0)
        m = build_model(shape, AttentionConfig(backend="sdpa_docs"))
        o = torch.optim.AdamW(m.parameters())
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
        o.step()
        save_state({"model": m.state_dict(), "optimizer": o.state_dict(), "scheduler": {}}, path)
        del m, o
    dist.barrier()
    torch.manual_seed(0)
    model = build_model(shape, AttentionConfig(backend="sdpa_docs"), meta=True)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0)
    engine = parallelize(model, opt, sched, info, cfg, grad_clip=1.0, dtype="fp32")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    mmap = os.environ["MMAP"] == "1"
    t0 = time.perf_counter()
    state = load_state(path, map_location="cpu", mmap=mmap)
    state["scheduler"] = sched.state_dict()
    engine.load_state_dict(state)
    del state
    t = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    print(f"rank {dist.get_rank()} mmap={mmap}: peak RSS before the load {before:.2f} GB, "
          f"after {after:.2f} GB, load {t:.2f} s", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
