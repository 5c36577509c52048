"""The token losses of the model's output: summed cross entropy over the targets of unshifted labels.

Labels arrive unshifted (-100 at each segment start and on padding; trainer.data.batch) and are shifted here,
in one place (`next_token_targets`), so the loss is the same sum over the same targets in the padded and the
packed layout; the caller (the step) divides by its own count of targets. The shift is done on the labels,
never on the logits: position t of a row is scored against labels[t + 1] and a row's last position against
nothing (`shift_left`), so the (B * L, V) logits are read in place, as one contiguous matrix (slicing off each
row's last position would copy them all, and so would a transposed (B, V, L) view).

Every sum comes from one tensor of token losses, computed once: the objective, the weighted sum of the other
loss normalizations and the per-group sums of the metrics are reductions of the same (B, L) values, so a
metric can neither change the objective nor drift from it. Two forms, each returning (loss sum, number of
targets, weighted sum or None, per-group sums or None), each from targets aligned with the positions (the
model's call) or, as `plain_cross_entropy` / `chunked_cross_entropy`, from unshifted labels:
    cross_entropy_sums          from whole logits (B, L, V): `position_losses`, then the sums
    chunked_cross_entropy_sums  from the final hidden states and the head's weight, a chunk of positions at a
                                time: the (B * L, V) logits never exist whole (loss.chunk_tokens); same values
                                and gradients as the plain form
`weights` (B, L) (loss.normalization modes other than global_tokens weigh each target by its document, row or
micro-batch) and `groups` (B, L) (a group id per target, e.g. its document's source x length bucket) come
aligned with the unshifted labels, like them, and are aligned with the targets by the same shift. The group
sums are a metric: detached, they change no value or gradient.

The logits hold the whole vocabulary (`WholeVocab`) or, under tensor parallelism, this rank's columns of it (a
trainer.distributed.tensor.VocabShard, the model's `vocab`): both answer the same three questions (each
target's cross entropy, a chunk's logsumexp and target logit, the logits the caller asked for), so no loss
here branches on the layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from trainer.data.batch import IGNORE_INDEX


class WholeVocab:
    """Logits over every column of the vocabulary: the `vocab` of the losses below when the head is not split
    (trainer.distributed.tensor.VocabShard answers the same calls for this rank's columns, joined over its
    group)."""

    start = 0
    """The vocabulary id of the logits' first column."""

    def cross_entropy(self, logits_NV: torch.Tensor, targets_N: torch.Tensor) -> torch.Tensor:
        """(N,) fp32 cross entropy of (N, V) logits against (N,) targets, 0 where -100."""
        return F.cross_entropy(logits_NV.float(), targets_N, ignore_index=IGNORE_INDEX, reduction="none")

    def chunk_stats(self, logits_nV: torch.Tensor, targets_n: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """fp32 (n, V) logits -> (the logits, their logsumexp (n,), each target's logit (n,); ignored targets
        read column 0, never used)."""
        # gather needs an index in [0, V)
        safe_n = torch.where(targets_n != IGNORE_INDEX, targets_n, 0)[:, None]
        return logits_nV, torch.logsumexp(logits_nV, dim=-1), logits_nV.gather(1, safe_n).squeeze(1)

    def returned(self, logits_BLV: torch.Tensor, asked: bool | None) -> torch.Tensor | None:
        """The logits a forward returns: these, unless the caller said False."""
        return None if asked is False else logits_BLV


WHOLE_VOCAB = WholeVocab()


def shift_left(x_BL: torch.Tensor, fill: float) -> torch.Tensor:
    """(B, L): x[:, 1:] with `fill` appended to each row, so that position t holds what labels[t + 1] scores.

    Example, one row [a0 a1 | b0 b1], labels [-100 a1 -100 b1], fill -100 -> targets [a1 -100 b1 -100]:
    a1 is predicted from a0, b1 from b0; a1 (A's EOS) predicts nothing from B, b1 nothing at all.
    """
    return F.pad(x_BL[:, 1:], (0, 1), value=fill)


def next_token_targets(labels: torch.Tensor, weights: torch.Tensor | None = None,
                       groups: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Unshifted labels (and their weights and groups) -> what each position predicts:
    the one place of the shift.

    Returns (targets, weights or None, groups or None), each (B, L) and aligned with the positions: targets[t]
    = labels[t + 1], -100 at each row's last position (weights 0 there, groups -1). A context-parallel shard
    is cut from targets made on the whole rows (trainer.distributed.context), so the loss never sees a shift
    or a shard.
    """
    return (shift_left(labels, IGNORE_INDEX), None if weights is None else shift_left(weights, 0.0),
            None if groups is None else shift_left(groups, -1))


def position_losses(logits: torch.Tensor, targets: torch.Tensor,
                    vocab: WholeVocab = WHOLE_VOCAB) -> torch.Tensor:
    """(B, L) fp32 cross entropy of each position's logits against its target (`next_token_targets`), 0 where
    it is -100. One kernel over the contiguous (B * L, V) logits. `vocab`: which columns of the vocabulary the
    logits are (this rank's under tensor parallelism: a trainer.distributed.tensor.VocabShard, whose
    cross_entropy joins the group's)."""
    B, L, V = logits.shape
    return vocab.cross_entropy(logits.reshape(B * L, V), targets.reshape(-1)).view(B, L)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, L) fp32 cross entropy of each position's next-token target
    (logits at t predicting labels at t + 1), 0 where ignored and at each row's last position."""
    return position_losses(logits, next_token_targets(labels)[0])


def group_sums(ce_N: torch.Tensor, groups_N: torch.Tensor, num_groups: int) -> torch.Tensor:
    """(num_groups,) fp32: the sum of ce_N over the positions of each group, detached (a metric). Positions
    whose group is outside [0, num_groups) (-1: no group) and ignored targets (ce 0) add nothing.

    Example: ce [0.5, 0, 2, 1], groups [0, -1, 1, 0], 2 groups -> [1.5, 2.0].
    """
    ce_N, groups_N = ce_N.detach().float().reshape(-1), groups_N.reshape(-1)
    inside = (groups_N >= 0) & (groups_N < num_groups)
    out = torch.zeros(num_groups, dtype=torch.float32, device=ce_N.device)
    return out.index_add_(0, torch.where(inside, groups_N, 0), torch.where(inside, ce_N, 0.0))


def num_targets(targets: torch.Tensor) -> torch.Tensor:
    """Targets aligned with positions (`next_token_targets`): every one but -100."""
    return (targets != IGNORE_INDEX).sum()


def cross_entropy_sums(
    logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None = None,
    groups: torch.Tensor | None = None, num_groups: int = 0, vocab: WholeVocab = WHOLE_VOCAB,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(summed fp32 cross entropy, number of targets, sum of weights[t] * ce(t) or None, per-group sums or
    None) of whole logits (B, L, V) (or of this rank's vocabulary columns: `vocab`, as `position_losses`)
    against targets aligned with the positions, their weights and groups aligned too (`next_token_targets`).
    Every sum reduces the same `position_losses`: with or without weights and groups, the loss sum is the
    same, bit for bit.

    weights[b, t] weighs position t's target, e.g. 1 / (targets of its document) makes the weighted sum the
    sum of per-document mean losses; groups[b, t] is the group of that target (-1: none), as in `group_sums`.
    """
    ce_BL = position_losses(logits, targets, vocab)
    weighted = None if weights is None else (ce_BL * weights).sum()
    grouped = None if groups is None else group_sums(ce_BL, groups, num_groups)
    return ce_BL.sum(), num_targets(targets), weighted, grouped


def plain_cross_entropy(
    logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None,
    groups: torch.Tensor | None = None, num_groups: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`cross_entropy_sums` of unshifted labels (with their weights and groups aligned with them, as the batch
    holds them): the targets made by `next_token_targets`."""
    targets, weights, groups = next_token_targets(labels, weights, groups)
    return cross_entropy_sums(logits, targets, weights, groups, num_groups)


def shifted_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed fp32 cross entropy, number of targets) with logits at t predicting labels at t + 1: the
    objective's sum, as `plain_cross_entropy` gives it.

    Labels are unshifted with -100 at each segment start, so the shift never asks the last token of
    one document to predict the first token of the next. Example, one row [a0 a1 | b0 b1]:
        labels  = [-100 a1 -100 b1]  -> targets of positions 0..3 = [a1 -100 b1 -100]
    a1 is predicted from a0, b1 from b0, and a1 (A's EOS) predicts nothing from B.
    """
    loss_sum, count, _, _ = plain_cross_entropy(logits, labels)
    return loss_sum, count


class _ChunkedHeadLoss(torch.autograd.Function):
    """Summed (and weighted) cross entropy of logits h_NC @ weight_VC.T, one chunk of positions at a time.

    Forward computes a chunk's logits (fp32), its token losses and, when a gradient is wanted, its share of
    the gradients right away (d ce / d logits = softmax - one_hot needs only the chunk's own logits), then
    frees the chunk. Backward only scales the stored gradients by the incoming ones: no matmul is recomputed,
    and the largest live tensor is one chunk's (n, V) logits instead of all (N, V). Stored until backward:
    dh (N, C) and dW (V, C) fp32 (a second dW with weights: the weighted sum's differs; its dh is row-scaled).
    Like the plain path under autocast, the matmuls run in `compute_dtype` and the loss in fp32.
    """

    @staticmethod
    def forward(ctx, h_NC, weight_VC, targets_N, weights_N, chunk_tokens: int, compute_dtype: torch.dtype,
                want_grad: bool, groups_N=None, num_groups: int = 0, vocab: WholeVocab = WHOLE_VOCAB):
        need_h, need_w = want_grad and ctx.needs_input_grad[0], want_grad and ctx.needs_input_grad[1]
        weight_cd = weight_VC.to(compute_dtype)  # (V, C); a copy only under autocast
        loss_sum = torch.zeros((), dtype=torch.float32, device=h_NC.device)
        weighted_sum = torch.zeros_like(loss_sum)
        grouped = torch.zeros(num_groups, dtype=torch.float32, device=h_NC.device)  # a metric: no gradient
        grad_h_NC = torch.empty_like(h_NC) if need_h else None
        grad_w_VC = (torch.zeros(weight_VC.shape, dtype=torch.float32, device=weight_VC.device) if need_w
                     else None)
        grad_ww_VC = torch.zeros_like(grad_w_VC) if need_w and weights_N is not None else None
        for start in range(0, h_NC.shape[0], chunk_tokens):
            end = min(start + chunk_tokens, h_NC.shape[0])
            h_nC = h_NC[start:end].to(compute_dtype)
            targets_n = targets_N[start:end]
            valid_n = targets_n != IGNORE_INDEX
            logits_nV = (h_nC @ weight_cd.T).float()
            logits_nV, lse_n, target_n = vocab.chunk_stats(logits_nV, targets_n)  # joined over a vocab group
            local_n = targets_n - vocab.start
            mine_n = valid_n & (local_n >= 0) & (local_n < logits_nV.shape[1])  # the target is a column here
            safe_n = torch.where(mine_n, local_n, 0)[:, None]
            ce_n = torch.where(valid_n, lse_n - target_n, 0.0)  # (n,), 0 if ignored
            loss_sum += ce_n.sum()
            if weights_N is not None:
                weighted_sum += (ce_n * weights_N[start:end]).sum()
            if groups_N is not None:
                grouped += group_sums(ce_n, groups_N[start:end], num_groups)
            if not (need_h or need_w):
                continue
            grad_nV = logits_nV.sub_(lse_n[:, None]).exp_()  # softmax, in place: the logits are done with
            grad_nV.scatter_add_(1, safe_n, -mine_n[:, None].to(grad_nV.dtype))  # minus the one-hot target
            grad_nV = grad_nV.mul_(valid_n[:, None]).to(compute_dtype)  # ignored targets give no gradient
            if need_h:
                grad_h_NC[start:end] = grad_nV @ weight_cd
            if need_w:
                grad_w_VC += (grad_nV.T @ h_nC).float()
                if grad_ww_VC is not None:  # sum_t w_t g_t h_t^T = G^T (w * h)
                    grad_ww_VC += (grad_nV.T @ (h_nC * weights_N[start:end, None].to(compute_dtype))).float()
        ctx.save_for_backward(grad_h_NC, grad_w_VC, grad_ww_VC, weights_N)
        ctx.weight_dtype = weight_VC.dtype
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(grouped)
        return loss_sum, weighted_sum, grouped

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, grad_weighted, _grad_grouped):
        grad_h_NC, grad_w_VC, grad_ww_VC, weights_N = ctx.saved_tensors
        dh = dw = None
        if grad_h_NC is not None:  # d/dh of (a * loss_sum + b * weighted_sum): row t scaled by a + b * w_t
            scale_N = torch.zeros((), device=grad_h_NC.device) if grad_loss is None else grad_loss
            if grad_weighted is not None and weights_N is not None:
                scale_N = scale_N + grad_weighted * weights_N
            dh = grad_h_NC * scale_N.to(grad_h_NC.dtype).reshape(-1, 1)
        if grad_w_VC is not None:
            dw = torch.zeros_like(grad_w_VC) if grad_loss is None else grad_w_VC * grad_loss
            if grad_weighted is not None and grad_ww_VC is not None:
                dw = dw + grad_ww_VC * grad_weighted
            dw = dw.to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None, None, None


def chunked_cross_entropy_sums(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor | None,
    chunk_tokens: int, groups: torch.Tensor | None = None, num_groups: int = 0,
    vocab: WholeVocab = WHOLE_VOCAB,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`cross_entropy_sums` of the logits `hidden @ weight.T`, never all in memory.

    hidden (B, L, C) is the final norm's output, weight (V, C) the output head, targets (and weights, groups)
    aligned with the positions (`next_token_targets`); the logits are made and consumed `chunk_tokens` flat
    positions at a time (see `_ChunkedHeadLoss`). Returns (loss sum, number of targets, weighted sum or None,
    per-group sums or None: `groups` given), the same values and gradients as the plain path.
    `vocab`: `weight` holds this rank's rows of the vocabulary (tensor parallelism: a
    trainer.distributed.tensor.
    VocabShard, whose `chunk_stats` joins each chunk's logsumexp and target logits over the group); the
    gradient of `hidden` is then this rank's part, summed where the sequence is gathered.
    """
    B, L, C = hidden.shape
    weights_N = None if weights is None else weights.float().reshape(-1)
    groups_N = None if groups is None else groups.reshape(-1)
    device_type = hidden.device.type
    compute_dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                     else weight.dtype)
    want_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    with torch.autocast(device_type, enabled=False):  # the dtypes are chosen above, explicitly
        loss_sum, weighted_sum, grouped = _ChunkedHeadLoss.apply(
            hidden.reshape(B * L, C), weight, targets.reshape(-1), weights_N, chunk_tokens, compute_dtype,
            want_grad, groups_N, num_groups, vocab,
        )
    return (loss_sum, num_targets(targets), None if weights is None else weighted_sum,
            None if groups is None else grouped)


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None,
    chunk_tokens: int, groups: torch.Tensor | None = None, num_groups: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`chunked_cross_entropy_sums` of unshifted labels: position t of a row is scored against labels[t + 1],
    a row's last position against nothing. Example, one row [a0 a1 | b0 b1], labels [-100 a1 -100 b1] ->
    targets of positions 0..3 [a1 -100 b1 -100]."""
    targets, weights, groups = next_token_targets(labels, weights, groups)
    return chunked_cross_entropy_sums(hidden, weight, targets, weights, chunk_tokens, groups, num_groups)
