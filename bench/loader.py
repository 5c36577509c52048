"""The data loader's speed (not a test): the tokenizer alone, the stream from text, the stream from stored token ids,
side by side in one run on the same shards, at seq_len T (issue 35).

    python -m trainer.prepare --source demo --out data/demo          # once (token ids stored: the default)
    python bench/loader.py --data data/demo
    python bench/loader.py --data data/demo --seq-len 2048 --rounds 3 --workers 0,2 --json out.json

Every measurement runs in a fresh interpreter (one variant, nothing cached from another), single-threaded
(RAYON_NUM_THREADS=1, OMP_NUM_THREADS=1), and variants run in rounds (ABC ABC ...) so that load on the machine
hits them alike; the table gives the median round. Each reads one epoch of the training split:

    tokenizer alone    the documents' texts, already in memory, through `encode_batch_fast` (the tokenizer's
                       fastest call) in batches of 512 and of 64 (the stream's chunk); the ids of each
                       document taken as the stream takes them. The faster of the two is the baseline of the
                       ratios
    stream, text       trainer.data.stream as a run builds it (DocumentStream -> DocumentLoader -> RowStream:
                       read the tar shards, shuffle buffer, tokenize, pack rows of T), tokenizing every text
                       (`stored_ids=None`), on the same shards, and on a text-only copy of them (members
                       `.txt` only, as `trainer.prepare --text-only` writes them: what the stream read before
                       issue 35)
    stream, ids        the same, reading the stored ids (`stored_ids` from the manifest: the run's tokenizer)
    + layout           the rows laid out as the packed step's micro-batches (`micro_batches`, 4 rows each: the
                       tensors the step consumes), in the same process

Figures: tokens (EOS included) per second of wall time from the first row to the last (DataLoader workers
started before), and per CPU second (this process and its workers: user + system), which gives the cores one
GPU needs at --gpu-tokens-per-s. Ratios are to the tokenizer alone (its tokens per wall second, one core): of
the medians, and paired (each round's figure over the same round's tokenizer alone; the targets are judged on
their median). Also the shards' size on disk, text-only against text + ids, and each variant's peak resident
memory (its workers included).
"""  # noqa: E501 (line 1 is the --help description: __doc__.split("\n")[0])

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET_IDS = 5.0
"""The stream from stored ids >= 5x the tokenizer alone, one core (issue 35)."""
TARGET_TEXT = 0.85
"""The stream from text >= 0.85x the tokenizer alone."""


# -- one measurement (a fresh interpreter) -------------------------------------------------------


def measure(args: argparse.Namespace) -> dict:
    import numpy as np

    from trainer.data.config import PackingConfig
    from trainer.data.loader import DocumentLoader
    from trainer.data.pipeline import RowStream, micro_batches
    from trainer.data.shards import load_manifest, shard_paths, stored_ids
    from trainer.data.sources import read_shard
    from trainer.data.stream import DocumentStream
    from trainer.data.tokenizer import load_tokenizer, special_ids, tokenizer_hash

    data = Path(args.data)
    tok_dir = data / "tokenizer"
    shards = shard_paths(data, "train")
    tok = load_tokenizer(tok_dir)
    ids = special_ids(tok)
    if args.variant == "tokenizer":
        texts = [s["txt"].decode("utf-8") for shard in shards for s in read_shard(shard)]
        t0, c0 = time.perf_counter(), _cpu()
        tokens = 0
        for i in range(0, len(texts), args.batch):
            for enc in tok.encode_batch_fast(texts[i : i + args.batch], add_special_tokens=False):
                tokens += len(np.asarray(enc.ids, dtype=np.int32)) + 1
        return _result(tokens, time.perf_counter() - t0, _cpu() - c0, docs=len(texts))
    stored = (stored_ids(load_manifest(data), tokenizer_hash(tok_dir), False) if args.variant == "ids"
              else None)
    if args.variant == "ids" and stored is None:
        raise SystemExit(f"{data}: no stored ids for its tokenizer (prepared with --text-only?)")
    stream = DocumentStream(shards, tok_dir, ids.eos, seed=0, epochs=1, stored_ids=stored)
    rows = RowStream(DocumentLoader(stream, num_workers=args.num_workers), args.seq_len, PackingConfig())
    first = rows.take(1)  # the workers are up, the first chunk is in
    t0, c0 = time.perf_counter(), _cpu()
    tokens = docs = 0
    layout = PackingConfig(layout="packed")
    while batch := rows.take(16):
        tokens += sum(len(doc.tokens) for row in batch for doc in row)
        docs += sum(len(row) for row in batch)
        if args.layout:
            micro_batches(batch, layout, args.seq_len, 4 * args.seq_len, ids.pad)
    seconds, cpu = time.perf_counter() - t0, _cpu() - c0
    return _result(tokens, seconds, cpu, docs=docs, first_row_tokens=sum(len(d.tokens) for d in first[0]))


def _cpu() -> float:
    """CPU seconds of this process and its joined children (DataLoader workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _result(tokens: int, seconds: float, cpu: float, **extra) -> dict:
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
    return {"tokens": tokens, "seconds": seconds, "cpu_seconds": cpu, "peak_rss_mb": peak / 1024, **extra}


# -- the comparison ----------------------------------------------------------------------------------


def text_only_copy(data: Path, out: Path) -> Path:
    """`data` with every shard rewritten without its `.ids` members and a manifest without "ids": what
    `trainer.prepare --text-only` writes (tests/data/test_stored_ids.py checks that it holds the same
    text)."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    shutil.copytree(data / "tokenizer", out / "tokenizer")
    manifest = json.loads((data / "manifest.json").read_text())
    manifest.pop("ids", None)
    manifest["schema"] = {k: v for k, v in manifest["schema"].items() if k in ("__key__", "txt")}
    for split in manifest["splits"].values():
        for shard in split["shards"]:
            with tarfile.open(data / shard["name"]) as src, \
                    tarfile.open(out / shard["name"], "w", format=tarfile.PAX_FORMAT) as dst:
                for member in src:
                    if member.name.endswith(".txt"):
                        dst.addfile(member, src.extractfile(member))
            shard["bytes"] = (out / shard["name"]).stat().st_size
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return out


def disk(data: Path) -> dict:
    """Bytes on disk of the training shards, and of their members' contents by field."""
    fields: dict[str, int] = {}
    total = 0
    for shard in sorted(data.glob("train-*.tar")):
        total += shard.stat().st_size
        with tarfile.open(shard) as tar:
            for member in tar:
                field = member.name.split(".", 1)[1]
                fields[field] = fields.get(field, 0) + member.size
    return {"shards": total, **fields}


def run_one(variant: str, data: Path, workers: int, layout: bool, args: argparse.Namespace,
            root: Path = ROOT) -> dict:
    """One measurement in a fresh interpreter, of this checkout's code or of `root`'s (--against)."""
    batch = 64 if variant == "tokenizer64" else 512
    variant = "tokenizer" if variant == "tokenizer64" else variant
    env = {**os.environ, "RAYON_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(root)}
    cmd = [sys.executable, str(root / "bench" / "loader.py"), "--one", variant, "--data", str(data),
           "--seq-len", str(args.seq_len), "--num-workers", str(workers),
           "--batch", str(batch)] + (["--layout"] if layout else [])
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", required=True, help="a directory prepared by trainer.prepare, with stored ids")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", default="0,2", help="DataLoader worker counts of the stream variants")
    p.add_argument("--gpu-tokens-per-s", type=float, default=600_000,
                   help="one GPU's training speed (124M, H100)")
    p.add_argument("--text-only-dir", default="/tmp/bench_loader_text_only")
    p.add_argument("--json", default=None)
    p.add_argument("--against", default=None, metavar="ROOT=DATA",
                   help="also measure another checkout's stream (e.g. `git archive HEAD | tar -x -C "
                        "/tmp/base` before a change) on a dataset its own prepare wrote, from ids and from "
                        "text, 0 workers, in the same rounds; prints each round's ratio of this checkout's "
                        "figure to that one's")
    p.add_argument("--ab", type=int, default=0, metavar="N",
                   help="with --against: only N pairs of the stream from ids, 0 workers, this checkout and "
                        "that one back to back (who goes first alternates); prints the paired ratios of "
                        "tok/s and tok/CPU-s")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--num-workers", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--layout", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=512, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        args.variant = args.one
        print(json.dumps(measure(args)))
        return 0
    data = Path(args.data)
    if args.ab:
        return ab(data, args)
    if "ids" not in json.loads((data / "manifest.json").read_text()):
        raise SystemExit(f"{data}: prepared with --text-only (no token ids stored): prepare it again "
                         "without it")
    plain = text_only_copy(data, Path(args.text_only_dir))
    workers = [int(w) for w in args.workers.split(",")]
    variants = [("tokenizer alone, batches of 512", "tokenizer", data, 0, False, ROOT),
                ("tokenizer alone, batches of 64", "tokenizer64", data, 0, False, ROOT)]
    for w in workers:
        variants += [(f"stream, text, text-only shards, {w} workers", "text", plain, w, False, ROOT),
                     (f"stream, text, {w} workers", "text", data, w, False, ROOT),
                     (f"stream, ids, {w} workers", "ids", data, w, False, ROOT),
                     (f"stream, ids, {w} workers + layout", "ids", data, w, True, ROOT)]
    if args.against:
        root, other = (Path(part) for part in args.against.split("=", 1))
        variants += [(f"stream, {v}, 0 workers [against]", v, other, 0, False, root) for v in ("text", "ids")]
    results: dict[str, list[dict]] = {name: [] for name, *_ in variants}
    for r in range(args.rounds):
        # rotated: no variant always first
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for name, variant, where, w, layout, root in order:
            results[name].append(run_one(variant, where, w, layout, args, root))
            last = results[name][-1]
            print(f"round {r + 1}: {name}: {last['tokens'] / last['seconds']:,.0f} tok/s", file=sys.stderr)
    tokens = {name: rs[0]["tokens"] + rs[0].get("first_row_tokens", 0) for name, rs in results.items()}
    if len(set(tokens.values())) != 1:  # every variant read the same documents
        raise SystemExit(f"the variants read different tokens: {tokens}")
    summary = {name: _median(rs) for name, rs in results.items()}
    best = max(("tokenizer alone, batches of 512", "tokenizer alone, batches of 64"),
               key=lambda n: summary[n]["tok_s"])
    base = summary[best]["tok_s"]  # the tokenizer at its best: the faster batch size
    alone = [r["tokens"] / r["seconds"] for r in results[best]]
    for name, rs in results.items():  # paired: each round's figure over the same round's tokenizer alone
        summary[name]["paired"] = sorted(r["tokens"] / r["seconds"] / a
                                         for r, a in zip(rs, alone, strict=True))
    report = {"baseline": best, "machine": _machine(), "seq_len": args.seq_len, "rounds": args.rounds,
              "tokens": tokens, "disk": {"text+ids": disk(data), "text-only": disk(plain)},
              "variants": summary, "gpu_tokens_per_s": args.gpu_tokens_per_s}
    print(_table(report, base))
    if args.against:
        report["against"] = _against(results)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=list))
    ids0 = statistics.median(summary["stream, ids, 0 workers"]["paired"]) if 0 in workers else 0.0
    text0 = statistics.median(summary["stream, text, 0 workers"]["paired"]) if 0 in workers else 0.0
    ok = ids0 >= TARGET_IDS and text0 >= TARGET_TEXT
    print(f"\nmedian of the paired ratios: stream from ids, 0 workers: {ids0:.2f}x the tokenizer alone "
          f"(target >= {TARGET_IDS}): "
          f"{'PASS' if ids0 >= TARGET_IDS else 'FAIL'}; from text: {text0:.2f}x (target >= {TARGET_TEXT}): "
          f"{'PASS' if text0 >= TARGET_TEXT else 'FAIL'}")
    return 0 if ok else 1


def ab(data: Path, args: argparse.Namespace) -> int:
    """--ab N: the stream from ids (0 workers) of this checkout over that of --against, N pairs back to back:
    on a shared machine the pairs see the same load, and CPU seconds are less sensitive to it than wall
    time."""
    root, other = (Path(part) for part in args.against.split("=", 1))
    ratios: dict[str, list[float]] = {"tok/s": [], "tok/CPU-s": []}
    for r in range(args.ab):
        pair = [(ROOT, data), (root, other)]
        mine, theirs = (run_one("ids", d, 0, False, args, c) for c, d in (pair if r % 2 == 0 else pair[::-1]))
        if r % 2:
            mine, theirs = theirs, mine
        if mine["tokens"] != theirs["tokens"]:
            raise SystemExit(f"the two read different tokens: {mine['tokens']} and {theirs['tokens']}")
        ratios["tok/s"].append(theirs["seconds"] / mine["seconds"])
        ratios["tok/CPU-s"].append(theirs["cpu_seconds"] / mine["cpu_seconds"])
        print(f"pair {r + 1}: {mine['tokens'] / mine['seconds']:,.0f} "
              f"against {theirs['tokens'] / theirs['seconds']:,.0f} "
              f"tok/s; CPU s {mine['cpu_seconds']:.3f} against {theirs['cpu_seconds']:.3f}", file=sys.stderr)
    for name, values in ratios.items():
        values.sort()
        print(f"stream from ids, 0 workers, this checkout / --against, {name}: "
              f"median {statistics.median(values):.3f} "
              f"(quartiles {values[len(values) // 4]:.3f}-{values[3 * len(values) // 4]:.3f}, "
              f"{len(values)} pairs)")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": _machine(), "ab": ratios}, indent=2))
    return 0


def _against(results: dict[str, list[dict]]) -> dict[str, list[float]]:
    """Each round's tokens per second of this checkout's stream (0 workers) over the --against checkout's,
    printed."""
    ratios = {}
    for v in ("text", "ids"):
        mine, theirs = results[f"stream, {v}, 0 workers"], results[f"stream, {v}, 0 workers [against]"]
        ratios[v] = sorted((a["tokens"] / a["seconds"]) / (b["tokens"] / b["seconds"])
                           for a, b in zip(mine, theirs, strict=True))
        print(f"stream from {v}, 0 workers, this checkout / --against, paired by round: median "
              f"{statistics.median(ratios[v]):.3f} ({', '.join(f'{r:.3f}' for r in ratios[v])})")
    return ratios


def _median(runs: list[dict]) -> dict:
    """The median round by tokens per wall second, with its other figures."""
    ranked = sorted(runs, key=lambda r: r["tokens"] / r["seconds"])
    mid = ranked[len(ranked) // 2]
    return {"tok_s": mid["tokens"] / mid["seconds"], "tok_cpu_s": mid["tokens"] / mid["cpu_seconds"],
            "seconds": mid["seconds"], "cpu_seconds": mid["cpu_seconds"], "peak_rss_mb": mid["peak_rss_mb"],
            "all_tok_s": [round(r["tokens"] / r["seconds"]) for r in runs]}


def _table(report: dict, base: float) -> str:
    gpu = report["gpu_tokens_per_s"]
    lines = [f"Machine: {report['machine']}; T = {report['seq_len']}; median of {report['rounds']} rounds; "
             f"ratios to: {report['baseline']} (the faster batch size)", "",
             "| variant | tok/s (rounds) | vs tokenizer alone: medians | paired (min-max) | tok per CPU-s | "
             f"cores per GPU at {gpu / 1e6:.1f}M tok/s | peak RSS MB |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name, s in report["variants"].items():
        rounds = ", ".join(f"{t / 1e3:,.0f}k" for t in s["all_tok_s"])
        paired = s["paired"]
        lines.append(f"| {name} | {s['tok_s']:,.0f} ({rounds}) | {s['tok_s'] / base:.2f}x | "
                     f"{statistics.median(paired):.2f}x ({paired[0]:.2f}-{paired[-1]:.2f}) | "
                     f"{s['tok_cpu_s']:,.0f} | {gpu / s['tok_cpu_s']:.2f} | {s['peak_rss_mb']:,.0f} |")
    d_ids, d_txt = report["disk"]["text+ids"], report["disk"]["text-only"]
    lines += ["", "| training shards | bytes on disk | txt members | ids members |", "|---|---:|---:|---:|",
              f"| text-only | {d_txt['shards']:,} | {d_txt.get('txt', 0):,} | - |",
              f"| text + ids | {d_ids['shards']:,} ({d_ids['shards'] / d_txt['shards']:.2f}x) "
              f"| {d_ids.get('txt', 0):,} "
              f"| {d_ids.get('ids', 0):,} ({d_ids.get('ids', 0) / max(d_ids.get('txt', 1), 1):.2f}x "
              "the text) |"]
    return "\n".join(lines)


def _machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        model = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                     if line.startswith("model name"))
        cpu = model
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


if __name__ == "__main__":
    sys.exit(main())
