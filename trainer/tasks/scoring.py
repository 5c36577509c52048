"""Each query + choice a document in the project's own rows; its log-likelihood from the model's token losses.

A sequence is encode(query) + encode(choice), tokenized apart and concatenated (lm-eval's convention), with
nothing before the query except what the tokenizer's own framing puts before a training document (its BOS for
a tokenizer that starts documents with one, SpecialIds.head; nothing for packtrain's, whose documents only end
with EOS): a training document starts the same way. It becomes a `Document` whose loss mask keeps the choice's
tokens only, so the rows are the training layouts' own (trainer.data.feed.eval_batches: the packer, then collate_rows):

    packed     several sequences per row, block-diagonal attention, positions reset (any attention backend)
    unpacked   one sequence per row, padded to the micro-batch's longest (what harnesses do)

Worked example, query [q0 q1], choice [c0 c1] (key "7"), packed after another sequence [a0 b0]:
    input_ids = [a0 b0 | q0 q1 c0 c1]    labels = [-100 b0 | -100 -100 c0 c1]
    the token losses at q1 and c0 (predicting c0 and c1) are summed into sequence 7: its log-likelihood is
    minus that sum. Greedy match: the logits' argmax at q1 is c0 and at c0 is c1.
The token losses are the model's (trainer.model.loss.token_losses over its logits), taken a few rows at a time
so the extra (rows, L, V) fp32 memory stays bounded. Under torch.distributed rank r scores sequences r, r + W,
...; the sums are gathered with one all-reduce (each sequence is scored on one rank, the others add 0).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.data.batch import Batch, Document
from trainer.data.feed import IGNORE_INDEX, eval_batches
from trainer.distributed.groups import dist_sum
from trainer.model import GPT, model_inputs
from trainer.model.loss import shift_left, token_losses
from trainer.tasks.tasks import Task, TaskFileError

LAYOUTS = ("packed", "unpacked")
LOSS_ROWS = 8
"""Rows whose token losses are computed at once: bounds the fp32 log-softmax copy of the logits."""


@dataclass(frozen=True)
class Candidate:
    """One (query, choice) of an item as token ids, tokenized apart; the choice is the scored part."""

    query: tuple[int, ...]
    choice: tuple[int, ...]

    def document(self, key: int) -> Document:
        tokens = np.asarray(self.query + self.choice, dtype=np.int64)
        mask = np.zeros(len(tokens), dtype=bool)
        mask[len(self.query):] = True
        return Document(key=str(key), tokens=tokens, loss_mask=mask)


@dataclass
class Scores:
    """Per sequence: the summed log-likelihood of its choice and whether greedy decoding reproduces it."""

    loglikelihoods: list[float]
    greedy: list[bool]


def task_sequences(task: Task, encode: Callable[[str], list[int]], max_tokens: int,
                   head: Sequence[int] = ()) -> list[Candidate]:
    """Every (item, choice) of `task` in order, tokenized apart, each query after `head` (SpecialIds.head: the BOS a
    training document starts with, if any); a TaskFileError names an item too long."""
    out = []
    for n, item in enumerate(task.items):
        query = (*head, *encode(item.query))
        for choice in item.choices:
            seq = Candidate(query, tuple(encode(choice)))
            if len(seq.query) + len(seq.choice) > max_tokens:
                where = f"{task.source}:{item.line}" if item.line else f"{task.name} item {n}"
                raise TaskFileError(f"{where}: query + choice is {len(seq.query) + len(seq.choice)} tokens, more "
                                    f"than the model's context ({max_tokens}); shorten the item")
            out.append(seq)
    return out


@torch.no_grad()
def score(model: GPT, sequences: Sequence[Candidate], layout: str, pad_id: int, batch_tokens: int,
          device: torch.device | str = "cpu", rank: int = 0, world_size: int = 1, group=None) -> Scores:
    """The choice log-likelihood and greedy match of every sequence, in order, on every rank (collective when
    torch.distributed is initialized). Rows are model.cfg.max_seq_len long; `batch_tokens` positions a forward.
    rank / world_size: this rank's share of the rows; `group`: the ranks whose shares are summed (None: the world;
    under tensor parallelism the loss group, the ranks of a tensor group scoring the same rows together)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "packed" and not model.attention.isolate_documents:
        raise ValueError("packed scoring needs attention.isolate_documents=True: each sequence must see only itself")
    n = len(sequences)
    docs = [seq.document(i) for i, seq in enumerate(sequences)]
    ll_sums, mismatches = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        for batch in eval_batches(docs, rank, world_size, model.cfg.max_seq_len, layout, batch_tokens, pad_id):
            ce, wrong = batch_scores(model, batch.to_device(device), n)
            ll_sums -= ce.cpu()
            mismatches += wrong.cpu()
    finally:
        model.train(was_training)
    gathered = dist_sum([*ll_sums.tolist(), *mismatches.tolist()], torch.device(device), group)
    return Scores(loglikelihoods=gathered[:n], greedy=[m == 0 for m in gathered[n:]])


def batch_scores(model: GPT, batch: Batch, num_sequences: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_sequences,) summed token loss and count of greedy misses of each sequence's targets in `batch`."""
    logits = model(**{**model_inputs(batch), "labels": None}, return_logits=True).logits  # (B, L, V), whole
    targets_BL = shift_left(batch.labels, IGNORE_INDEX)  # position t scores labels[t + 1]
    seq_BL = shift_left(sequence_ids(batch), -1)  # ... of the target's sequence
    ce_BL = torch.cat([token_losses(logits[r:r + LOSS_ROWS], batch.labels[r:r + LOSS_ROWS])
                       for r in range(0, len(logits), LOSS_ROWS)])
    miss_BL = ((logits.argmax(-1) != targets_BL) & (targets_BL != IGNORE_INDEX)).float()
    return per_sequence(ce_BL, seq_BL, num_sequences), per_sequence(miss_BL, seq_BL, num_sequences)


def per_sequence(values_BL: torch.Tensor, seq_BL: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """(num_sequences,) float64 sums of `values_BL` by sequence id (-1: none). In float64: a sum of fp32 token
    losses then depends on neither the layout nor the order of its terms (fp32 sums of ~100 terms would drift
    by ~1e-5 between layouts). Example: values [0.5, 0, 2, 1], ids [0, -1, 1, 0], 2 sequences -> [1.5, 2.0]."""
    inside_N = (seq_BL >= 0).reshape(-1)
    out = torch.zeros(num_sequences, dtype=torch.float64, device=values_BL.device)
    return out.index_add_(0, seq_BL.reshape(-1)[inside_N], values_BL.reshape(-1)[inside_N].double())


def sequence_ids(batch: Batch) -> torch.Tensor:
    """(B, L) int64: the sequence (its document key) of every position, -1 on padding.

    Example: rows [[s3(2), s0(3)], [s1(4) pad(1)]] -> [[3 3 0 0 0], [1 1 1 1 -1]].
    """
    keys = iter(batch.doc_keys)
    seg_S = torch.tensor([-1 if src < 0 else int(next(keys)) for src in batch.segment_sources], dtype=torch.long)
    seg_lens_S = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long().cpu()
    return torch.repeat_interleave(seg_S, seg_lens_S).view(batch.shape).to(batch.labels.device)
