"""Readers balanced by tokens (not a test): the shards each reader gets, by token count vs every S-th shard.

    python bench/balance.py                                   # 8 ranks x 4 workers, log-normal shards
    python bench/balance.py --shards 64 128 512 --sigma 1.5 --json out.json
    python bench/balance.py --real --work /tmp/bench_balance  # + real 2-rank x 2-worker runs (a few minutes)
    python bench/balance.py --real --work /tmp/bench_balance --old-code /tmp/packtrain_head   # + the old code

Assignment: a manifest.json of --shards shards with log-normal token counts (median --median-tokens, sigma
--sigma) is written to a temporary directory, and a `DocumentStream` over those shard paths, with the counts
`manifest_tokens` reads from it (as trainer.data.feed.build_data does), gives every slot its shards, epoch by
epoch, through `epoch_shards`: the rule the trainer runs. Beside it, the rule before issue 21: the same seeded
permutation, slot s of S reading every S-th shard from s (kept here only). Per epoch: max / mean tokens per
slot and per rank and the predicted lockstep wait. Each rank trains the same number of rows, so about the same
tokens, per step: a rank holding T_r tokens finishes the epoch after ~T_r / c steps, the epoch after
max T_r / c, and some rank waits for the slowest in (max T_r - min T_r) / c of them: the predicted wait
fraction is 1 - min T_r / max T_r. Mean and worst over --epochs epochs.

--real: a small skewed corpus for real runs: the first --real-docs demo documents, prepared once, re-cut into
--real-shards shards of log-normal document counts (manifest with tokens), then `trainer.train` under
torchrun, 2 ranks x 2 DataLoader workers, tiny model, ~--real-epochs epochs, `logging.record_doc_keys`: once
with the manifest (tokens known: balanced) and once over the same shard files in a directory without one
(data.urls: equal weights, the shards dealt out by count, as before issue 21). `lockstep_wait_steps` per epoch
comes from summary.json; "idle" counts the steps in which a rank trained no document, beside the epoch's steps
(from doc_keys, so also for --old-code, a checkout of packtrain before this change run on the manifest
corpus).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from trainer.data.shards import FORMAT_VERSION, load_manifest, shard_paths, write_manifest  # noqa: E402
from trainer.data.stream import DocumentStream, manifest_tokens  # noqa: E402


def stride_rule(seed: int, epoch: int, num_shards: int, slot: int, num_slots: int) -> list[int]:
    """The assignment before issue 21: the seeded permutation, slot s of S reading every S-th shard from s."""
    order = np.random.default_rng([seed, epoch]).permutation(num_shards)
    return [int(i) for i in order[slot::num_slots]]


def skewed_tokens(num_shards: int, median: float, sigma: float, seed: int) -> list[int]:
    return [max(1, int(t)) for t in np.random.default_rng(seed).lognormal(np.log(median), sigma, num_shards)]


def shares(tokens: list[int], slots: list[list[int]], workers: int) -> dict:
    """max / mean per slot and per rank, and the predicted lockstep wait fraction (1 - min / max per rank)."""
    per_slot = np.array([sum(tokens[i] for i in slot) for slot in slots], dtype=float)
    per_rank = per_slot.reshape(-1, workers).sum(axis=1)
    return {"slot_max_over_mean": per_slot.max() / per_slot.mean(), "rank_max_over_mean": per_rank.max() /
            per_rank.mean(), "predicted_wait": 1 - per_rank.min() / per_rank.max()}


def assignment(num_shards: int, ranks: int, workers: int, median: float, sigma: float, epochs: int,
               seed: int) -> dict:
    """{rule: {figure: (mean, worst) over the epochs}} for one skewed manifest."""
    tokens = skewed_tokens(num_shards, median, sigma, seed)
    slots_n = ranks * workers
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"train-{i:06d}.tar" for i in range(num_shards)]
        write_manifest(tmp, {"format": FORMAT_VERSION, "splits": {"train": {"shards": [
            {"name": n, "docs": 1, "tokens": t, "bytes": 0} for n, t in zip(names, tokens, strict=True)]}}})
        paths = [os.path.join(tmp, n) for n in names]
        stream = DocumentStream(paths, tmp, 0, seed=seed, world_size=ranks,
                                shard_tokens=manifest_tokens(paths, os.path.join(tmp, "manifest.json")))
        assert stream.shard_tokens == tokens  # the counts came from the manifest
        index = {p: i for i, p in enumerate(paths)}
        per_epoch: dict[str, list[dict]] = {"every S-th shard (before)": [], "balanced by tokens (now)": []}
        for epoch in range(epochs):
            old = [stride_rule(seed, epoch, num_shards, s, slots_n) for s in range(slots_n)]
            new = [[index[p] for p in stream.epoch_shards(epoch, s, slots_n)] for s in range(slots_n)]
            assert sorted(i for s in new for i in s) == list(range(num_shards))
            per_epoch["every S-th shard (before)"].append(shares(tokens, old, workers))
            per_epoch["balanced by tokens (now)"].append(shares(tokens, new, workers))
    return {rule: {k: (float(np.mean([r[k] for r in rows])), float(max(r[k] for r in rows))) for k in rows[0]}
            for rule, rows in per_epoch.items()}


# -- real runs --------------------------------------------------------------------------------------


def skewed_corpus(work: Path, docs: int, num_shards: int, sigma: float, seed: int) -> Path:
    """<work>/skewed: the first `docs` demo documents in `num_shards` shards of log-normal document counts,
    with a manifest holding each shard's tokens (`count_tokens`, as trainer.prepare counts them)."""
    from trainer.data.tokenizer import count_tokens, load_tokenizer
    from trainer.prepare import prepare

    src, out = work / "demo", work / "skewed"
    if (out / "manifest.json").is_file():
        return out
    if not (src / "manifest.json").is_file():
        prepare("demo", src, vocab_size=300, max_docs=docs, docs_per_shard=docs, val_fraction=0.0, seed=0)
    texts = []
    for shard in shard_paths(src, "train"):
        with tarfile.open(shard) as tar:
            texts += [(m.name.rsplit(".", 1)[0], tar.extractfile(m).read()) for m in tar if m.isfile()]
    weights = np.random.default_rng(seed).lognormal(0.0, sigma, num_shards)
    cuts = [int(c) for c in np.round(np.cumsum(weights) / weights.sum() * len(texts))]
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(src / "tokenizer", out / "tokenizer", dirs_exist_ok=True)
    tok = load_tokenizer(src / "tokenizer")
    entries, start = [], 0
    for i, end in enumerate(cuts):
        end = max(end, start + 1)
        name = f"train-{i:06d}.tar"
        with tarfile.open(out / name, "w", format=tarfile.PAX_FORMAT) as tar:
            for key, data in texts[start:end]:
                info = tarfile.TarInfo(f"{key}.txt")
                info.size = len(data)
                tar.addfile(info, fileobj=io.BytesIO(data))
        counts = count_tokens(tok, [d.decode() for _, d in texts[start:end]], desc=None)
        entries.append({"name": name, "docs": end - start, "tokens": sum(counts),
                        "bytes": (out / name).stat().st_size})
        start = end
    manifest = load_manifest(src)
    manifest["splits"]["train"] = {"shards": entries, "docs": start,
                                   "tokens": sum(e["tokens"] for e in entries)}
    write_manifest(out, manifest)
    return out


TRAIN = ("model=tiny", "train.seq_len=128", "train.tokens_per_step=2048", "train.micro_batch_tokens=1024",
         "data.num_workers=2", "data.shuffle_buffer=8", "packing.buffer_size=8", "attention=sdpa_docs",
         "train.eval_every=0", "train.checkpoint_every=0", "logging.record_doc_keys=true",
         "logging.progress=false", "logging.wandb.mode=disabled")


def train(run_dir: Path, code: Path, data: list[str], steps: int) -> float:
    shutil.rmtree(run_dir, ignore_errors=True)
    port = 20_000 + os.getpid() % 20_000
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port", str(port),
           "-m", "trainer.train", f"hydra.run.dir={run_dir}", *TRAIN, f"train.max_steps={steps}", *data]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code), "WANDB_MODE": "disabled"}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - t0


def idle_per_epoch(run_dir: Path) -> list[tuple[int, int]]:
    """Per epoch (a key's n-th appearance is epoch n - 1): (steps in which some rank trained no document,
    steps)."""
    ranks = {int(p.stem.split("_")[1]): {r["step"]: r["keys"]
                                         for r in map(json.loads, p.read_text().splitlines())}
             for p in (run_dir / "doc_keys").glob("rank_*.jsonl")}
    seen: Counter = Counter()
    idle: Counter = Counter()
    steps: Counter = Counter()
    epoch = 0
    for step in sorted(ranks[0]):
        keys = [k for r in sorted(ranks) for k in ranks[r][step]]
        epoch = max([epoch, *(seen[k] for k in keys)])
        seen.update(keys)
        idle[epoch] += any(not ranks[r][step] for r in ranks)
        steps[epoch] += 1
    return [(idle[e], steps[e]) for e in range(epoch + 1)]


def real_runs(args) -> list[dict]:
    data = skewed_corpus(args.work, args.real_docs, args.real_shards, args.sigma, args.seed)
    manifest = load_manifest(data)
    tokens = [s["tokens"] for s in manifest["splits"]["train"]["shards"]]
    steps = int(args.real_epochs * sum(tokens) / 2048)
    bare = args.work / "no_manifest"  # the same shard files, no manifest beside them: equal weights
    bare.mkdir(exist_ok=True)
    for name in (s["name"] for s in manifest["splits"]["train"]["shards"]):
        if not (bare / name).exists():
            os.symlink(data / name, bare / name)
    cases = [("balanced by tokens (now)", ROOT, [f"data.path={data}"]),
             ("equal weights, no manifest (now)", ROOT, [f"data.urls='{bare}/train-*.tar'",
                                                         f"data.tokenizer={data / 'tokenizer'}"])]
    if args.old_code:
        cases.append(("every S-th shard (old code)", args.old_code, [f"data.path={data}"]))
    out = []
    for name, code, overrides in cases:
        run_dir = args.work / "runs" / name.split(" ")[0]
        seconds = train(run_dir, code, overrides, steps)
        summary = json.loads((run_dir / "summary.json").read_text())
        idle = idle_per_epoch(run_dir)
        row = {"run": name, "steps": steps, "seconds": round(seconds, 1), "idle_and_steps_by_epoch": idle,
               "lockstep_wait_steps_by_epoch": summary.get("lockstep_wait_steps_by_epoch")}
        print(json.dumps(row), flush=True)
        out.append(row)
    slots = {"shards": len(tokens), "tokens": tokens,
             "predicted_wait_stride_epoch0": shares(tokens, [stride_rule(args.seed, 0, len(tokens), s, 4)
                                                             for s in range(4)], 2)["predicted_wait"]}
    print(json.dumps(slots))
    return [*out, slots]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shards", type=int, nargs="+", default=[64, 128, 256, 1024])
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--median-tokens", type=float, default=50_000)
    p.add_argument("--sigma", type=float, default=1.0, help="log-normal sigma of the shards' token counts")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--real", action="store_true", help="also the real 2-rank x 2-worker runs")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_balance"))
    p.add_argument("--real-docs", type=int, default=240)
    p.add_argument("--real-shards", type=int, default=16)
    p.add_argument("--real-epochs", type=float, default=2.2)
    p.add_argument("--old-code", type=Path,
                   help="a packtrain checkout before this change, run as a third case")
    p.add_argument("--json", type=Path)
    args = p.parse_args()

    results: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "assignment": []}
    print(f"{args.ranks} ranks x {args.workers} workers, shard tokens log-normal "
          f"(median {args.median_tokens:,.0f}, sigma {args.sigma}); mean / worst over {args.epochs} epochs")
    print(f"{'shards':>7} {'rule':<28} {'slot max/mean':>15} {'rank max/mean':>15} {'predicted wait':>16}")
    for n in args.shards:
        for rule, figures in assignment(n, args.ranks, args.workers, args.median_tokens, args.sigma,
                                        args.epochs, args.seed).items():
            s, r, w = figures["slot_max_over_mean"], figures["rank_max_over_mean"], figures["predicted_wait"]
            print(f"{n:>7} {rule:<28} {s[0]:>7.3f} / {s[1]:.3f} {r[0]:>7.3f} / {r[1]:.3f} "
                  f"{w[0]:>7.1%} / {w[1]:.1%}")
            results["assignment"].append({"shards": n, "rule": rule, **figures})
    if args.real:
        results["real"] = real_runs(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
