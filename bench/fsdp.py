"""FSDP2 and tensor parallelism against DDP and DeepSpeed (not a test): what each rank holds, peak memory,
step time, checkpoint save and load time.

    .venv/bin/python bench/fsdp.py                      # gpt2-124m, 1/2/4 ranks, ~5 minutes on 2 CPU cores
    .venv/bin/python bench/fsdp.py --model tiny --seq-len 128 --steps 2   # a quick look
    .venv/bin/python bench/fsdp.py --worlds 2 --no-deepspeed --builds meta cpu   # the meta-device init's RSS

Layouts: ddp, fsdp2, tp2 (distributed.tensor_parallel=2 under DDP: all ranks one tensor group at 2 ranks, DP 2
x TP 2 at 4), fsdp2-tp2 (the same under FSDP2: at 4 ranks each tensor shard sharded again over 2, expect 1/4
of DDP's state), zero2, zero3; each built on the meta device and materialized by parallelize (`meta`, what a
fresh run does; DeepSpeed always builds on the CPU) or built whole on the CPU first (`cpu`, --builds).

Each configuration runs on real gloo ranks (spawned, fp32, CPU, 1 thread each), the trainer's own engines
(trainer.distributed.engine.parallelize) and step (trainer.run.step.train_step), AdamW over the model's two
parameter groups, one packed row of --seq-len positions per rank per step:
  state per rank    the bytes this rank holds of parameters + gradients + AdamW state (exact: each tensor's
                    local part; a DTensor's to_local(), DeepSpeed's flat partitions), measured after the last
                    step's backward, before the optimizer zeroes the gradients
  peak RSS          the process's peak resident memory (ru_maxrss), the largest rank, after the build and the
                    wrapping (built), after the training steps (trained: what a run holds), and at the end
                    (with one checkpoint save and load): with a `cpu` build it includes the whole model every
                    rank builds before it is split, and always the Python / torch runtime (~0.4 GB)
  step time         median of --steps after one warm-up, the slowest rank (2 cores: 4 ranks oversubscribe
                    them)
  save / load       trainer.checkpoint.store.save_checkpoint and load_checkpoint of the run's state (every
                    rank's shards, the whole weights as safetensors, the tokenizer, the rank files), wall time
                    on rank 0;
                    "not the last": a save as the run makes before its last, without the gathered
                    model.safetensors under FSDP2 and TP (train.save_weights=end);
                    "load on 1" reads the 2-rank checkpoint on one rank: FSDP2's DCP reshards as it reads,
                    DeepSpeed converts to its universal checkpoint first
                    (trainer.checkpoint.store._load_resharded)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODELS = {
    "gpt2-124m": dict(vocab_size=50304, n_layer=12, n_head=12, n_embd=768, max_seq_len=1024),
    "tiny": dict(vocab_size=512, n_layer=2, n_head=4, n_embd=64, max_seq_len=512),
}


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.to_local()
    return t.numel() * t.element_size()


def state_bytes(engine) -> int:
    """This rank's parameters + gradients + optimizer state, in bytes (local parts only)."""
    import torch

    if engine.name.startswith("deepspeed"):
        opt = engine.ds.optimizer
        flat = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_partitioned_groups_flat
        master = sum(_local_bytes(t) for t in flat)  # fp32 master partition (= the parameters' share)
        moments = sum(_local_bytes(v) for s in opt.optimizer.state.values() for v in s.values()
                      if torch.is_tensor(v))
        grads = master  # ZeRO-2/3 keep the gradient partition the size of the master partition
        modules = sum(_local_bytes(p) for p in engine.module.parameters())  # ZeRO-3: partitions; else whole
        return master + moments + grads + modules
    params = sum(_local_bytes(p) for p in engine.module.parameters())
    grads = sum(_local_bytes(p.grad) for p in engine.module.parameters() if p.grad is not None)
    moments = sum(_local_bytes(v) for s in engine.optimizer.state.values() for v in s.values()
                  if torch.is_tensor(v))
    return params + grads + moments


def _rank(rank: int, world: int, port: int, out: str, engine_name: str, stage: int, tp: int, meta: bool,
          model_name: str, seq_len: int, steps: int, ckpt: str, mode: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import numpy as np
    import torch
    import torch.distributed as dist

    from trainer.checkpoint import store
    from trainer.config import OptimConfig
    from trainer.data.batch import Document, collate_rows
    from trainer.distributed.config import DistributedConfig
    from trainer.distributed.engine import parallelize
    from trainer.distributed.groups import init_distributed
    from trainer.model import AttentionConfig, GPTConfig, build_model
    from trainer.run.optim import build_optimizer, build_scheduler
    from trainer.run.step import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    cfg = DistributedConfig(engine=engine_name, zero_stage=stage, device="cpu", tensor_parallel=tp)
    info = init_distributed(cfg)
    torch.manual_seed(0)
    model = build_model(GPTConfig(**MODELS[model_name]), AttentionConfig(backend="sdpa_docs"), meta=meta)
    optim = OptimConfig(lr=1e-4, warmup_steps=1)
    opt = build_optimizer(model, optim, info.device)
    engine = parallelize(model, opt, build_scheduler(opt, optim, 100), info, cfg, grad_clip=1.0, dtype="fp32")
    result: dict = {"built_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    rng = np.random.default_rng(info.data_rank)  # the ranks of a tensor group read the same rows
    vocab = MODELS[model_name]["vocab_size"]
    if mode == "load":  # the 2-rank checkpoint, read on this run's ranks
        dist.barrier()
        t0 = time.perf_counter()
        store.load_checkpoint(ckpt, info, engine)
        dist.barrier()
        result["load_s"] = time.perf_counter() - t0
    else:
        times = []
        for step in range(steps + 1):
            docs = [Document(key=f"d{i}", tokens=rng.integers(2, vocab, size=seq_len // 4)) for i in range(4)]
            batch = collate_rows([docs], seq_len, 0, "packed")
            if step == steps:  # the last step: measure the state between backward and the optimizer's zeroing
                apply = engine.step_if_finite
                measured = {}

                def measure_then(loss, step_fn=apply, measured=measured):
                    measured["state"] = state_bytes(engine)
                    return step_fn(loss)

                engine.step_if_finite = measure_then
            dist.barrier()
            t0 = time.perf_counter()
            train_step(engine, [batch], info, 0)
            elapsed = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if 0 < step:
                times.append(elapsed.item())
        result.update(state=measured["state"], step_s=statistics.median(times),
                      train_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # before any save
        tokenizer = Path(ckpt) / "tokenizer"
        tokenizer.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        t0 = time.perf_counter()
        path = store.save_checkpoint(Path(ckpt) / "run", steps, info, engine, rank_state={},
                                     meta={"counters": {}, "engine": engine.name}, conventions={},
                                     tokenizer_dir=tokenizer, keep_last=1)
        result["save_s"] = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()  # a save before the run's last: no model.safetensors under FSDP2 / TP
        store.save_checkpoint(Path(ckpt) / "run", steps + 1, info, engine, rank_state={},
                              meta={"counters": {}, "engine": engine.name}, conventions={},
                              tokenizer_dir=tokenizer, keep_last=2,
                              weights=not (engine.shard_format == "dcp" or tp > 1))
        result["save_mid_s"] = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        store.load_checkpoint(path, info, engine)
        dist.barrier()
        result["load_s"] = time.perf_counter() - t0
    result["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, engine: str, stage: int, tp: int, meta: bool, args, ckpt: str,
        mode: str = "train") -> list[dict]:
    import torch.multiprocessing as mp

    from tests.harness import free_port

    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(world, free_port(), out, engine, stage, tp, meta, args.model,
                                        args.seq_len, args.steps, ckpt, mode), nprocs=world,
                           start_method="spawn", join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(world)]


LAYOUTS = {"ddp": ("ddp", 0, 1), "fsdp2": ("fsdp2", 0, 1), "tp2": ("ddp", 0, 2), "fsdp2-tp2": ("fsdp2", 0, 2),
           "zero2": ("deepspeed", 2, 1), "zero3": ("deepspeed", 3, 1)}
"""name -> (distributed.engine, zero_stage, tensor_parallel)."""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-124m", choices=sorted(MODELS))
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--builds", nargs="+", default=["meta"], choices=["meta", "cpu"])
    p.add_argument("--no-deepspeed", action="store_true")
    args = p.parse_args()
    print(f"machine: {os.cpu_count()} CPU cores visible; python {sys.version.split()[0]}; "
          f"model {args.model}, one packed row of {args.seq_len} per data rank per step, fp32, gloo\n")
    layouts = [n for n in args.layouts if not (args.no_deepspeed and n.startswith("zero"))]
    print("| ranks | layout | build | state per rank (GB) | vs 1 rank | peak RSS: built (GB) | "
          "trained (GB) | vs DDP | with save + load (GB) | step (s) | vs DDP | save (s) | "
          "save, not the last (s) | load (s) |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    single: dict[str, float] = {}
    ddp: dict[tuple, dict] = {}
    with tempfile.TemporaryDirectory() as root:
        for world in args.worlds:
            for name in layouts:
                engine, stage, tp = LAYOUTS[name]
                if world % tp:
                    continue
                for build in args.builds:
                    meta = build == "meta" and engine != "deepspeed"
                    if engine == "deepspeed" and build == "meta" and "cpu" in args.builds:
                        continue
                    ckpt = str(Path(root) / f"{name}-{build}-{world}")
                    r = run(world, engine, stage, tp, meta, args, ckpt)
                    state = max(x["state"] for x in r) / 1e9
                    rss = max(x["train_rss"] for x in r) / 1e9
                    if world == 1:
                        single[name] = state
                    step = r[0]["step_s"]
                    if name == "ddp":
                        ddp[(world, build)] = {"step": step, "rss": rss}
                    base = ddp.get((world, build)) or ddp.get((world, "meta")) or {"step": step, "rss": rss}
                    ratio = f"{state / single[name]:.2f}" if name in single else "-"
                    print(f"| {world} | {name} | {'meta' if meta else 'cpu'} | {state:.3f} | {ratio} | "
                          f"{max(x['built_rss'] for x in r) / 1e9:.2f} | {rss:.2f} | "
                          f"{rss / base['rss']:.2f} | {max(x['rss'] for x in r) / 1e9:.2f} | {step:.2f} | "
                          f"{step / base['step']:.2f} | {r[0]['save_s']:.2f} | {r[0]['save_mid_s']:.2f} | "
                          f"{r[0]['load_s']:.2f} |",
                          flush=True)
        if 2 in args.worlds:
            print("\n| layout | 2-rank checkpoint loaded on 1 rank (s) |")
            print("|---|---:|")
            for name in layouts:
                engine, stage, tp = LAYOUTS[name]
                if name == "ddp" or tp > 1:  # replicated or whole-tensor checkpoints: nothing to reshard
                    continue
                build = args.builds[0]
                path = str(next((Path(root) / f"{name}-{build}-2" / "run" / "checkpoints").iterdir()))
                r = run(1, engine, stage, 1, build == "meta" and engine != "deepspeed", args, path,
                        mode="load")
                print(f"| {name} | {r[0]['load_s']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
