"""Items/s of downstream scoring, tree vs packed vs unpacked rows, on the same items (trainer.tasks.scoring).

Not a test. Packed and unpacked score every query + choice as one sequence; packed puts several in a row of
max_seq_len (documents isolated), unpacked gives each its own row, padded to the micro-batch's longest (what
harnesses do); tree lays out an item's query once with its choices as branches (trainer.data.batch.Tree). All
run the same forward budget (--batch-tokens positions a forward). The log-likelihoods must agree with packed's
(max |diff| is printed); rounds rotate the layouts' order and the median of each is reported, with the ratios,
and the forward positions per item (real tokens, and allocated: padding included).

Items: a checkpoint or export with --checkpoint and --tasks (files or built-ins, as
`python -m trainer.evaluate` takes them), or by default synthetic 4-choice items (queries of 16..160 tokens,
choices of 4..32, lengths uniform) on a randomly initialized GPT of --n-layer / --n-embd (no data needed).

    python bench/evaluate.py                                    # synthetic items, a small random GPT
    python bench/evaluate.py --checkpoint runs/.../step_000100 --tasks continuation4 cloze
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.data.feed import eval_batches  # noqa: E402
from trainer.data.packing import OnlinePacker  # noqa: E402
from trainer.model import GPT, AttentionConfig, GPTConfig  # noqa: E402
from trainer.model.attention import resolve_backend  # noqa: E402
from trainer.tasks.scoring import Candidate, score, task_sequences, trees_of  # noqa: E402

LAYOUTS = ("tree", "packed", "unpacked")

PAD_ID = 1


def synthetic(num_items: int, vocab: int, seed: int) -> list[Candidate]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_items):
        query = tuple(int(t) for t in rng.integers(4, vocab, size=rng.integers(16, 161)))
        out += [Candidate(query, tuple(int(t) for t in rng.integers(4, vocab, size=rng.integers(4, 33))))
                for _ in range(4)]
    return out


def from_checkpoint(args: argparse.Namespace) -> tuple[GPT, list[Candidate], int, int]:
    """(model, sequences, pad id, items) of --checkpoint and --tasks, as trainer.evaluate builds them."""
    from trainer.data.tokenizer import load_tokenizer, special_ids
    from trainer.evaluate import tasks_of
    from trainer.generate import load

    model, tok_dir = load(args.checkpoint, args.device)
    tok = load_tokenizer(tok_dir)
    ns = argparse.Namespace(path=args.checkpoint, tasks=args.tasks, data=args.data,
                            builtin_docs=args.builtin_docs, builtin_items=None, seed=0)
    tasks = tasks_of(ns, tok, tok_dir, model.cfg.max_seq_len)
    seqs = [s for t in tasks for s in task_sequences(t, lambda x: tok.encode(x, add_special_tokens=False).ids,
                                                     model.cfg.max_seq_len)]
    return model, seqs, special_ids(tok, tok_dir).pad, sum(len(t.items) for t in tasks)


def forward_positions(seqs: list[Candidate], row_len: int, batch_tokens: int,
                      pad: int) -> dict[str, tuple[int, int]]:
    """{layout: (real token positions, allocated positions)} the forwards of each layout compute."""
    docs = [s.document(i) for i, s in enumerate(seqs)]
    out = {layout: (sum(b.num_tokens for b in batches), sum(b.num_allocated for b in batches))
           for layout in ("packed", "unpacked")
           for batches in [eval_batches(docs, 0, 1, row_len, layout, batch_tokens, pad)]}
    trees = [tree.document() for tree, _ in trees_of(seqs, row_len)]
    rows = list(OnlinePacker(row_len, buffer_size=max(1, len(trees))).pack(trees))
    out["tree"] = (sum(len(t) for t in trees), len(rows) * row_len)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", type=Path, default=None)
    p.add_argument("--tasks", nargs="+", default=["continuation4", "cloze"])
    p.add_argument("--data", type=Path, default=None)
    p.add_argument("--builtin-docs", type=int, default=500)
    p.add_argument("--items", type=int, default=200, help="synthetic items (4 choices each)")
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--batch-tokens", type=int, default=8192)
    p.add_argument("--attention", default="auto")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.checkpoint is None:
        torch.manual_seed(0)
        cfg = GPTConfig(vocab_size=args.vocab, n_layer=args.n_layer, n_head=max(1, args.n_embd // 64),
                        n_embd=args.n_embd, max_seq_len=args.max_seq_len)
        model, seqs, pad, items = GPT(cfg, AttentionConfig()).to(device).eval(), \
            synthetic(args.items, args.vocab, 0), PAD_ID, args.items
    else:
        model, seqs, pad, items = from_checkpoint(args)
    model.attention.backend = resolve_backend(args.attention, device, torch.float32, requires_grad=False)

    def run(layout: str) -> tuple[float, list[float]]:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        lls = score(model, seqs, layout, pad, args.batch_tokens, device).loglikelihoods
        if device.type == "cuda":
            torch.cuda.synchronize()
        return items / (time.perf_counter() - t0), lls

    for layout in LAYOUTS:  # warm-up
        run(layout)
    rates: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
    lls = {}
    for r in range(args.rounds):
        for layout in LAYOUTS[r % 3:] + LAYOUTS[:r % 3]:  # each layout first once in three rounds
            rate, lls[layout] = run(layout)
            rates[layout].append(rate)
    med = {k: statistics.median(v) for k, v in rates.items()}
    diff = {layout: float(np.abs(np.array(lls[layout]) - np.array(lls["packed"])).max())
            for layout in LAYOUTS}
    positions = forward_positions(seqs, model.cfg.max_seq_len, args.batch_tokens, pad)
    result = {"items": items, "sequences": len(seqs), "max_seq_len": model.cfg.max_seq_len,
              "params": model.num_params(), "backend": model.attention.backend, "device": str(device),
              "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
              "items_per_s": med, "rounds": rates, "tree_over_packed": med["tree"] / med["packed"],
              "packed_over_unpacked": med["packed"] / med["unpacked"], "max_abs_ll_diff_vs_packed": diff,
              "positions_per_item": {k: {"real": r / items, "allocated": a / items}
                                     for k, (r, a) in positions.items()}}
    print(f"{items} items, {len(seqs)} sequences, rows of {model.cfg.max_seq_len}, "
          f"{model.num_params() / 1e6:.1f} M params, {model.attention.backend}, {device}")
    for layout, rate in med.items():
        real, allocated = (x / items for x in positions[layout])
        print(f"  {layout:9s} {rate:8.1f} items/s, forward positions per item {real:6.1f} real, "
              f"{allocated:6.1f} allocated (rounds: {', '.join(f'{x:.1f}' for x in rates[layout])}); "
              f"max |ll - packed| {diff[layout]:.2g}")
    tree_share = positions["tree"][0] / positions["packed"][0]
    print(f"  tree / packed = {result['tree_over_packed']:.2f}x items/s at {tree_share:.2f}x the real "
          f"positions; packed / unpacked = {result['packed_over_unpacked']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
