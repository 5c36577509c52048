"""Each query + choice a document in the project's own rows; its log-likelihood from the model's token losses.

A sequence is encode(query) + encode(choice), tokenized apart and concatenated (lm-eval's convention), with
nothing before the query except what the tokenizer's own framing puts before a training document (its BOS for
a tokenizer that starts documents with one, SpecialIds.head; nothing for packtrain's, whose documents only end
with EOS): a training document starts the same way. It becomes a `Document` whose loss mask keeps the choice's
tokens only, so the rows are the training layouts' own (trainer.data.feed.eval_batches: the packer, then
collate_rows):

    packed     several sequences per row, block-diagonal attention, positions reset (any attention backend)
    unpacked   one sequence per row, padded to the micro-batch's longest (what harnesses do)
    tree       the candidates sharing a query (an item's choices; lm-eval's requests of one context) as ONE
               document: the query once, then each choice as a branch attending to the query and itself only,
               its positions continuing from the query's end (trainer.data.batch.Tree); several per row. The
               query is computed once instead of once per choice. Kernels that take a mask: sdpa_docs, dense,
               flex (trainer.model.attention.TreeSegments); a choice's first token is scored from the query's
               last position, each later one from the choice's previous position.

Worked example, query [q0 q1], choice [c0 c1] (key "7"), packed after another sequence [a0 b0]:
    input_ids = [a0 b0 | q0 q1 c0 c1]    labels = [-100 b0 | -100 -100 c0 c1]
    the token losses at q1 and c0 (predicting c0 and c1) are summed into sequence 7: its log-likelihood is
    minus that sum. Greedy match: the logits' argmax at q1 is c0 and at c0 is c1.
The token losses are the model's (trainer.model.loss.token_losses over its logits), taken a few rows at a time
so the extra (rows, L, V) fp32 memory stays bounded. Under torch.distributed rank r scores sequences r, r + W,
...; the sums are gathered with one all-reduce (each sequence is scored on one rank, the others add 0).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.data.batch import Batch, Document, Tree, collate_trees
from trainer.data.feed import IGNORE_INDEX, eval_batches
from trainer.data.packing import OnlinePacker
from trainer.distributed.groups import DistInfo, dist_sum
from trainer.model import GPT, model_inputs
from trainer.model.loss import position_losses, shift_left, token_losses
from trainer.tasks.tasks import Task, TaskFileError

LAYOUTS = ("packed", "unpacked", "tree")
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
    """Every (item, choice) of `task` in order, tokenized apart, each query after `head` (SpecialIds.head: the
    BOS a training document starts with, if any); a TaskFileError names an item too long."""
    out = []
    for n, item in enumerate(task.items):
        query = (*head, *encode(item.query))
        for choice in item.choices:
            seq = Candidate(query, tuple(encode(choice)))
            if len(seq.query) + len(seq.choice) > max_tokens:
                where = f"{task.source}:{item.line}" if item.line else f"{task.name} item {n}"
                raise TaskFileError(f"{where}: query + choice is {len(seq.query) + len(seq.choice)} tokens, "
                                    f"more than the model's context ({max_tokens}); shorten the item")
            out.append(seq)
    return out


@torch.no_grad()
def score(model: GPT, sequences: Sequence[Candidate], layout: str, pad_id: int, batch_tokens: int,
          device: torch.device | str = "cpu", info: DistInfo | None = None) -> Scores:
    """The choice log-likelihood and greedy match of every sequence, in order, on every rank (collective when
    torch.distributed is initialized). Rows are model.cfg.max_seq_len long; `batch_tokens` positions a
    forward. `info`: this rank's layout; the rows are dealt over its loss group (data x context ranks: the
    ranks of a tensor group score the same rows together) and the group's shares summed; None: one process."""
    rank, world_size = (info.dims.loss_rank, info.dims.loss_size) if info is not None else (0, 1)
    group = info.loss_group if info is not None else None
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout != "unpacked" and not model.attention.isolate_documents:
        raise ValueError(f"{layout} scoring needs attention.isolate_documents=True: each sequence must see "
                         "only itself")
    n = len(sequences)
    if layout == "tree":
        parts = tree_parts(model, sequences, pad_id, batch_tokens, device, rank, world_size)
    else:
        docs = [seq.document(i) for i, seq in enumerate(sequences)]
        parts = (batch_scores(model, batch.to_device(device), n) for batch in
                 eval_batches(docs, rank, world_size, model.cfg.max_seq_len, layout, batch_tokens, pad_id))
    return gathered_scores(model, parts, n, device, group)


def gathered_scores(model: GPT, parts: Iterable[tuple[torch.Tensor, torch.Tensor]], n: int,
                    device: torch.device | str, group) -> Scores:
    """Run `parts` (each batch's per-sequence summed token loss and greedy misses) with the model in eval
    mode, sum them, and gather every rank's sums (one all-reduce: each sequence is scored on one rank)."""
    ll_sums, mismatches = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        for ce, wrong in parts:
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
    by ~1e-5 between layouts). Example: values [0.5, 0, 2, 1], ids [0, -1, 1, 0], 2 sequences ->
    [1.5, 2.0]."""
    inside_N = (seq_BL >= 0).reshape(-1)
    out = torch.zeros(num_sequences, dtype=torch.float64, device=values_BL.device)
    return out.index_add_(0, seq_BL.reshape(-1)[inside_N], values_BL.reshape(-1)[inside_N].double())


def sequence_ids(batch: Batch) -> torch.Tensor:
    """(B, L) int64: the sequence (its document key) of every position, -1 on padding.

    Example: rows [[s3(2), s0(3)], [s1(4) pad(1)]] -> [[3 3 0 0 0], [1 1 1 1 -1]].
    """
    keys = iter(batch.doc_keys)
    seg_S = torch.tensor([-1 if src < 0 else int(next(keys)) for src in batch.segment_sources],
                         dtype=torch.long)
    seg_lens_S = (batch.cu_seqlens[1:] - batch.cu_seqlens[:-1]).long().cpu()
    return torch.repeat_interleave(seg_S, seg_lens_S).view(batch.shape).to(batch.labels.device)


def trees_of(sequences: Sequence[Candidate], max_tokens: int) -> list[tuple[Tree, list[int]]]:
    """The candidates as trees, with the candidate index of each branch: candidates with the same query share
    one trunk (an item's choices; lm-eval's requests of one context, wherever they sit in the list), in the
    order the queries first appear, as many choices per tree as fit `max_tokens` (the rest start another tree
    with the same trunk). Example: queries [q, r, q, q], each 4 + a choice of 2 tokens, max 8 -> trees
    (q; 0, 2), (q; 3), (r; 1)."""
    by_query: dict[tuple[int, ...], list[int]] = {}
    for i, seq in enumerate(sequences):
        by_query.setdefault(seq.query, []).append(i)
    out: list[tuple[Tree, list[int]]] = []
    for query, indices in by_query.items():
        members: list[int] = []
        used = len(query)
        for i in [*indices, None]:
            if members and (i is None or used + len(sequences[i].choice) > max_tokens):
                branches = tuple(np.asarray(sequences[m].choice, dtype=np.int64) for m in members)
                out.append((Tree(key=str(len(out)), trunk=np.asarray(query, dtype=np.int64),
                                 branches=branches), members))
                members, used = [], len(query)
            if i is not None:
                if len(query) + len(sequences[i].choice) > max_tokens:  # task_sequences refuses these first
                    raise ValueError(f"candidate {i} does not fit {max_tokens} tokens")
                members.append(i)
                used += len(sequences[i].choice)
    return out


def tree_parts(model: GPT, sequences: Sequence[Candidate], pad_id: int, batch_tokens: int,
               device: torch.device | str, rank: int,
               world_size: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The tree layout's batches, scored one at a time (`gathered_scores` sums them): rank r takes trees
    r, r + W, ...; rows of max_seq_len packed by the project's packer, `batch_tokens` positions a forward;
    each target's loss from the logits of the position predicting it (Batch.predictors)."""
    n, row_len = len(sequences), model.cfg.max_seq_len
    trees = trees_of(sequences, row_len)[rank::world_size]
    by_key = {tree.key: (tree, members) for tree, members in trees}
    rows = [[by_key[doc.key] for doc in row]
            for row in OnlinePacker(row_len,
                                    buffer_size=max(1, len(trees))).pack(t.document() for t, _ in trees)]
    per_forward = max(1, batch_tokens // row_len)
    for start in range(0, len(rows), per_forward):
        chunk = rows[start:start + per_forward]
        batch = collate_trees([[tree for tree, _ in row] for row in chunk], row_len, pad_id).to_device(device)
        yield tree_scores(model, batch, candidate_ids(chunk, row_len), n)


def candidate_ids(rows: Sequence[Sequence[tuple[Tree, list[int]]]], row_len: int) -> torch.Tensor:
    """(B, L) int64: the candidate each branch position belongs to, -1 on trunks and padding."""
    out = torch.full((len(rows), row_len), -1, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for tree, members in row:
            at += len(tree.trunk)
            for branch, member in zip(tree.branches, members, strict=True):
                out[r, at:at + len(branch)] = member
                at += len(branch)
    return out


def tree_scores(model: GPT, batch: Batch, candidates_BL: torch.Tensor, num_sequences: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(num_sequences,) summed token loss and greedy misses of each candidate's targets in a tree batch."""
    logits = model(**model_inputs(batch), return_logits=True).logits  # (B, L, V), whole
    B, L, V = logits.shape
    target_N = (batch.predictors >= 0).reshape(-1)
    rows_N = torch.arange(B, device=logits.device).repeat_interleave(L)[target_N]
    source_N = rows_N * L + batch.predictors.reshape(-1)[target_N]  # the flat position predicting each target
    tokens_N = batch.input_ids.reshape(-1)[target_N]
    seq_N = candidates_BL.to(logits.device).reshape(-1)[target_N]
    flat = logits.reshape(B * L, V)
    ce, miss = [], []
    for i in range(0, len(source_N), LOSS_ROWS * L):  # bounded fp32 copies, as the other layouts
        rows, tokens = flat[source_N[i:i + LOSS_ROWS * L]], tokens_N[i:i + LOSS_ROWS * L]
        ce.append(position_losses(rows[None], tokens[None])[0])  # the model's own loss, as token_losses
        miss.append((rows.argmax(-1) != tokens).float())
    ce_N = torch.cat(ce) if ce else flat.new_zeros(0)
    miss_N = torch.cat(miss) if miss else flat.new_zeros(0)
    return per_sequence(ce_N, seq_N, num_sequences), per_sequence(miss_N, seq_N, num_sequences)
