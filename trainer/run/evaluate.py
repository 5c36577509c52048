"""Held-out evaluation: the same documents, in the same order, every time, in every layout and world size.

The eval set is the prepared `val` split read in a fixed order (shards as listed in the manifest permuted
with seed 0, no sample shuffle), cut to `train.eval_docs` documents, long documents split into chunks of
seq_len. Rank r of W evaluates documents r, r + W, r + 2W, ...; packing (or not) only lays them out.

    val_loss = sum of token losses over every eval target (all ranks) / number of those targets
    val_ppl  = exp(val_loss)

so, as with the training objective, the number does not depend on the layout, the micro-batch size or
the world size (tested). Evaluation reads its own stream (the training stream and its position are
untouched), runs the model in eval mode without gradients (no dropout, no RNG drawn), and is rebuilt
identically after a resume.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trainer.data.batch import Batch, Document
from trainer.data.config import VAL_SPLIT, DataConfig, PackingConfig
from trainer.data.packing import OnlinePacker, PackingStats, split_long
from trainer.data.pipeline import micro_batches
from trainer.data.sources import ShardSourceError, resolve_source
from trainer.data.stream import DocumentStream
from trainer.distributed.engine import Engine
from trainer.distributed.groups import DistInfo, dist_sum
from trainer.model import model_inputs
from trainer.run.metrics import by_length
from trainer.run.step import empty_batch, with_length_groups


@dataclass
class EvalResult:
    val_loss: float
    val_ppl: float
    val_tokens: int
    """Eval targets, all ranks."""
    val_docs: int
    """Eval documents (chunks of split documents count once each), all ranks."""
    val_token_loss_by_length: dict[str, float | None] = field(default_factory=dict)
    """Per document-length bucket (logging.length_buckets): summed token loss / targets; {} when not measured."""
    val_targets_by_length: dict[str, int] = field(default_factory=dict)


def load_eval_docs(data: DataConfig | str | Path, tokenizer_dir: Path, eos_id: int, seq_len: int,
                   max_docs: int | None, on_error: str = "raise") -> list[Document]:
    """The first `max_docs` held-out documents in a fixed order, each split into chunks of <= seq_len.

    `data` is the run's data config (held-out shards: data.val_urls, else the manifest's val split; data.loss_on:
    which tokens are targets, as in training) or a prepared directory (every token a target).
    Example: max_docs=3 over val shards whose fixed order is [v7, v2, v9, ...] with
    len(v2) = 2.5 x seq_len -> [v7, v2#0, v2#1, v2#2, v9].
    """
    if data is None:
        raise ShardSourceError("load_eval_docs needs the data config (cfg.data) when data.urls is used")
    if not isinstance(data, DataConfig):
        data = DataConfig(path=str(data))
    source = resolve_source(data)
    if not source.val_urls:
        if source.manifest is not None and data.val_urls is None:
            raise ShardSourceError(f"{source.manifest}: the '{VAL_SPLIT}' split has no documents; set "
                                   "data.val_urls=SHARDS, prepare with --val-fraction > 0, or set train.eval_every=0")
        raise ShardSourceError("no held-out shards for the eval: data.urls is set but data.val_urls is not; set "
                               "data.val_urls=SHARDS (same syntax as data.urls) or train.eval_every=0")
    stream = DocumentStream(
        source.val_urls, tokenizer_dir, eos_id, seed=0, shuffle_buffer=1, epochs=1,
        on_error=on_error, expected_docs=source.expected_docs, retries=data.retries, loss_on=data.loss_on,
        read_timeout_s=data.read_timeout_s,
    )
    docs: list[Document] = []
    for _slot, _state, chunk in stream:  # one reader, in this process: no DataLoader, no rank split
        docs.extend(chunk)
        if max_docs is not None and len(docs) >= max_docs:
            break
    if not docs:
        shards = ", ".join(map(str, source.val_urls[:3])) + (", ..." if len(source.val_urls) > 3 else "")
        why = (" (data.on_error=skip skipped what it could not read: see the warnings above)"
               if on_error == "skip" else "")
        raise ShardSourceError(f"the eval read no document from its {len(source.val_urls)} held-out shard(s) "
                               f"[{shards}]{why}; check those shards, or set train.eval_every=0")
    stats = PackingStats()
    return [piece for doc in docs[:max_docs] for piece in split_long(doc, seq_len, "split", stats)]


class Evaluator:
    """This rank's share of the eval set, laid out once; `run(engine)` gives the global `EvalResult`."""

    def __init__(self, docs: list[Document], info: DistInfo, seq_len: int, layout: str,
                 micro_batch_tokens: int, pad_id: int, every: int = 0, length_buckets: Sequence[int] = ()) -> None:
        self.info = info
        self.length_buckets = list(length_buckets)
        self.every = every
        """train.eval_every: evaluate every `every` steps (0: only when `due` is told it is the last step)."""
        self.pad_id = pad_id
        mine = docs[info.rank :: info.world_size]
        rows = list(OnlinePacker(seq_len, buffer_size=max(1, len(mine))).pack(mine))
        self.batches: list[Batch] = micro_batches(rows, PackingConfig(layout=layout), seq_len, micro_batch_tokens,
                                                  pad_id)
        grouped = [with_length_groups(b, self.length_buckets) for b in self.batches]
        self.batches = [b for b, _ in grouped]
        num_groups = len(self.length_buckets) + 1 if self.length_buckets else 0  # the same on every rank
        self.group_targets = [sum(c[g] for _, c in grouped) for g in range(num_groups)]
        self.docs, self.tokens = sum(b.num_docs for b in self.batches), sum(b.num_valid_targets for b in self.batches)

    def due(self, step: int, last: bool) -> bool:
        """Whether the eval runs after optimizer step `step`: every `every` steps, and after the last one."""
        return last or (self.every > 0 and step % self.every == 0)

    def run(self, engine: Engine) -> EvalResult:
        """Collective: every rank runs as many forwards as the busiest one (ZeRO-3 gathers weights in each)."""
        info = self.info
        counts = [0.0] * info.world_size
        counts[info.rank] = len(self.batches)
        most = int(max(dist_sum(counts, info.device)))
        batches = self.batches + [empty_batch(self.pad_id)] * (most - len(self.batches))
        module = engine.module
        was_training = module.training
        module.eval()
        num_groups = len(self.length_buckets) + 1 if self.length_buckets else 0
        try:
            loss_sum, group_sums = 0.0, torch.zeros(num_groups)
            for mb in batches:
                mb_loss, _, mb_groups = engine.eval_forward(model_inputs(mb.to_device(info.device)))
                loss_sum = loss_sum + mb_loss.float()  # a tensor: no host sync per micro-batch
                if mb_groups is not None:
                    group_sums = group_sums.to(mb_groups.device) + mb_groups
        finally:
            module.train(was_training)
        total_loss, tokens, docs, *groups = dist_sum(
            [float(loss_sum), self.tokens, self.docs, *group_sums.tolist(), *self.group_targets],
            info.device)
        by = by_length(self.length_buckets, groups[:num_groups], groups[num_groups:], prefix="val_")
        if tokens == 0:
            raise ShardSourceError(f"the eval set's {int(docs)} documents hold no targets (each is a single token, "
                                   "or data.loss_on=assistant finds no assistant turn); set train.eval_every=0")
        val_loss = total_loss / tokens
        return EvalResult(val_loss=val_loss, val_ppl=math.exp(min(val_loss, 700.0)), val_tokens=int(tokens),
                          val_docs=int(docs), **by)
