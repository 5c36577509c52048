"""A data stream written on one shape (W ranks x K DataLoader workers) resumed on another (W' x K').

On the same shape each rank loads its own state and continues bit-exactly (trainer.data.loader,
trainer.data.pipeline). On another, every new rank reads the states of all old ranks and takes its part of
what was left of the interrupted epoch, dealt the same way on every rank (nothing is exchanged):

    left of the epoch                                    dealt
    shards no old reader opened                          balanced by tokens over the new ranks, then their
                                                         workers
    a shard an old reader read in part                   to one new reader, which continues after the samples
                                                         taken
    shuffle-buffer samples (read, not yet drawn)         over the new readers' buffers (samples still held as
                                                         references into a shard read in part go with that
                                                         shard)
    documents tokenized, not yet packed (pending)        over the new ranks, ahead of what their readers read
    the packers' buffered pieces                         over the new ranks' packers
    rows packed, not yet trained on                      over the new ranks, whole

So every document of the interrupted epoch that was not trained on is trained on exactly once in it, and none
twice; the order is not the uninterrupted run's (other readers read other shards). The next epoch is split for
the new shape as usual. With data.epoch_lockstep only: then every old reader is in the interrupted epoch or
done with it and waiting (without lockstep the slots drift apart by whole epochs).

Example: 2 ranks x 2 workers -> 3 ranks x 1 worker in epoch 0. Old slot 0 reads shard 5 (12 samples taken) and
has [7] after it; slot 1 is done; slot 2 reads shard 1 (3 taken); slot 3 has not opened shard 6 and has [2]
after it. Left: 5 from sample 12, 1 from sample 3, whole 7, 6, 2 (and what the buffers and packers hold). The
three new readers get, by tokens, e.g. [5 from 12, 2], [1 from 3, 7], [6]: partly read shards first.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from trainer.data import epochs
from trainer.data.reader import SlotState
from trainer.data.sources import url_file_name
from trainer.data.state import LoaderState, PackerState, RowStreamState
from trainer.data.stream import lpt
from trainer.data.workers import check_interrupt
from trainer.errors import UserError

RESHAPED = "reshaped"
"""SlotState.split of a reader whose shards of the epoch were dealt here."""


class ReshapeError(UserError):
    """A data stream state that cannot be resumed on another shape: says why and what works instead."""


@dataclass
class _Part:
    """A shard of the interrupted epoch still to be read: whole, or read in part by an old reader."""

    shard: int
    """Index in the stream's shard list."""
    taken: int = 0
    last_key: str = ""
    refs: list[int] = field(default_factory=list)
    """Members of it that an old shuffle buffer held as references (read, not yet drawn)."""


@dataclass
class _Left:
    """What the old shape left of the interrupted epoch, gathered from every old rank's state."""

    epoch: int
    parts: list[_Part] = field(default_factory=list)
    samples: list[tuple[str, int, str, object]] = field(default_factory=list)
    """Shuffle-buffer samples with their data: (shard URL, member, key, data)."""
    rows: list[list] = field(default_factory=list)
    pieces: list = field(default_factory=list)
    pending: list = field(default_factory=list)
    counters: list[tuple[dict, int]] = field(default_factory=list)
    """Per old slot: (samples skipped by reason, documents emitted), kept in the totals."""
    stats: list[dict] = field(default_factory=list)
    """Per old rank: its packing counts."""
    packer: dict = field(default_factory=dict)
    """seq_len and buffer_size of the old packers."""


def reshape_state(states: Sequence[dict | RowStreamState], stream, num_workers: int, lockstep: bool,
                  written_lockstep: bool = True) -> RowStreamState:
    """This rank's data stream state (a RowStream's) on the shape of `stream` (its rank and world size) x
    `num_workers`, made from `states`: every old rank's RowStream state (typed, or as a checkpoint holds it),
    in rank order. Deterministic: every new rank deals the same from the same states and seed.

    `stream`: the trainer.data.stream.DocumentStream of this run (its shards, their tokens, the seed).
    `lockstep`: data.epoch_lockstep, of this run and of the checkpoint's."""
    require_lockstep(lockstep, written_lockstep)
    states = [s if isinstance(s, RowStreamState) else RowStreamState.from_dict(s) for s in states]
    current = {state.epoch for state in states}
    if len(current) != 1:
        raise ReshapeError(f"the checkpoint's ranks are in different epochs ({sorted(current)}): "
                           "not a lockstep run")
    epoch = current.pop()
    return rows_state(states, stream, num_workers, [epoch] * len(states), epoch)


def require_lockstep(lockstep: bool, written_lockstep: bool = True) -> None:
    """A ReshapeError unless both this run (`lockstep`) and the checkpoint's (`written_lockstep`) kept their
    epochs in lockstep (data.epoch_lockstep): only then is every old reader in the interrupted epoch or done
    with it."""
    if not written_lockstep:
        raise ReshapeError(
            "the checkpoint was written with data.epoch_lockstep=false (its readers drift into different "
            "epochs): its data stream resumes only on the number of ranks and DataLoader workers it was "
            "written on")
    if not lockstep:
        raise ReshapeError(
            "a data stream resumes on another number of ranks or DataLoader workers only with "
            "data.epoch_lockstep=true (the default; without it the readers are in different epochs): "
            "resume on the shape the checkpoint was written on")


def rows_state(states: Sequence[RowStreamState], stream, num_workers: int, rank_epochs: Sequence[int | None],
               epoch: int) -> RowStreamState:
    """`reshape_state` given each old rank's interrupted epoch: rank_epochs[r] is the epoch whose rest old
    rank r leaves (its readers in it, or done with it), or None where r is done with what there is to deal (a
    mixture's rank that waits, or whose source was read through: only its totals are kept). `epoch`: the new
    readers' epoch (the interrupted one; where no old rank leaves anything, the epoch the new readers start
    from scratch)."""
    world, workers = stream.world_size, max(1, num_workers)  # no workers: the rank reads as one slot
    if len(stream.shards) < world * workers:  # the next epoch's split would fail, maybe hours from now
        stream.epoch_shards(0, 0, world * workers)  # raises the error a fresh start gives
    left = _gather(states, stream, rank_epochs, epoch)
    tokenized = _tokenized_ranks(left, world)
    # nothing of the epoch to deal: each new reader starts it from scratch
    if all(e is None for e in rank_epochs):
        slots = [SlotState(epoch=epoch, skipped=skipped, docs=docs) for skipped, docs in
                 _kept_counters(left, world * workers)]
    else:
        slots = _deal(left, stream, world, workers, tokenized)
    mine = range(stream.rank * workers, (stream.rank + 1) * workers)
    rank_of = _deal_tokenized(left, [rank for _, rank in tokenized])
    stats = dict.fromkeys(left.stats[0], 0)
    for old_rank, old in enumerate(left.stats):
        if old_rank % world == stream.rank:  # totals kept: old rank r's counts go to new rank r mod W'
            for name, n in old.items():
                stats[name] += int(n)
    def mine_of(items: list, ranks: list[int]) -> list:
        return [item for item, r in zip(items, ranks, strict=True) if r == stream.rank]

    docs = LoaderState(slot_states={s: slots[s] for s in mine}, lockstep_epoch=left.epoch,
                       num_workers=num_workers, pending=mine_of(left.pending, rank_of["pending"]))
    packer = PackerState(**left.packer, docs=mine_of(left.pieces, rank_of["pieces"]))
    # every new rank reads its part of the epoch, possibly nothing, then waits as usual: not ended
    return RowStreamState(docs=docs, packer=packer, ready=mine_of(left.rows, rank_of["rows"]), stats=stats)


# -- what was left -------------------------------------------------------------------------------


def _gather(states: Sequence[RowStreamState], stream, rank_epochs: Sequence[int | None], epoch: int) -> _Left:
    """Everything of the interrupted epoch not yet trained on, from every old rank's state (`rows_state`)."""
    old_world = len(states)
    loaders = [state.docs for state in states]
    old_workers = {loader.num_workers for loader in loaders}
    if len(old_workers) != 1:
        raise ReshapeError(f"the checkpoint's ranks had different data.num_workers ({sorted(old_workers)})")
    old_workers = max(1, old_workers.pop())
    left = _Left(epoch=epoch, packer={"seq_len": states[0].packer.seq_len,
                                      "buffer_size": states[0].packer.buffer_size})
    index = {url: i for i, url in enumerate(stream.shards)}
    splits: dict[tuple[str, int], list[list[int]]] = {}
    for rank, (state, loader, rank_epoch) in enumerate(zip(states, loaders, rank_epochs, strict=True)):
        # a preemption signal ends the deal here (ReadInterrupted), as it ends a step's reads
        check_interrupt()
        left.stats.append(state.stats)
        for slot in range(rank * old_workers, (rank + 1) * old_workers):
            slot_state = loader.slot_states.get(slot) or SlotState(epoch=rank_epoch or 0)
            left.counters.append((slot_state.skipped, slot_state.docs))
            done = True if rank_epoch is None else epochs.reader_done(slot_state.epoch, rank_epoch)
            if done:
                continue  # done with the epoch
            if done is None:
                raise ReshapeError(f"reader {slot} of the checkpoint is in epoch {slot_state.epoch}, "
                                   f"its rank in {rank_epoch}: not a lockstep run")
            if slot_state.split == RESHAPED:
                shards = [_shard_index(index, url) for url in slot_state.shards]
            else:
                key = (slot_state.split, rank_epoch)
                if key not in splits:
                    splits[key] = stream.split_shards(rank_epoch, old_world, old_workers, slot_state.split)
                shards = splits[key][slot]
            _gather_slot(left, slot, slot_state, shards, stream.shards)
        if rank_epoch is not None:
            left.rows.extend(state.ready)
            left.pieces.extend(state.packer.docs)
            left.pending.extend(loader.pending)
    return left


def _kept_counters(left: _Left, num_slots: int) -> list[tuple[dict, int]]:
    """Per new slot: the old slots' counters it keeps (samples skipped by reason, documents), old slot s's
    going to new slot s mod S'."""
    out: list[tuple[dict, int]] = [({}, 0) for _ in range(num_slots)]
    for old_slot, (old_skipped, old_docs) in enumerate(left.counters):
        skipped, docs = out[old_slot % num_slots]
        for reason, n in old_skipped.items():
            skipped[reason] = skipped.get(reason, 0) + n
        out[old_slot % num_slots] = (skipped, docs + old_docs)
    return out


def _gather_slot(left: _Left, slot: int, state: SlotState, shards: list[int], urls: list[str]) -> None:
    """An old reader's shards left in the epoch (the current one from its position) and its buffered
    samples."""
    position = state.position
    if position is None and state.drawn:
        raise ReshapeError("the checkpoint was written before reader positions were saved: resume it on the "
                           "shape it was written on")
    current, taken, last_key, buffer = 0, *state.starts.get(0, (0, "")), []
    if position is not None:
        current, taken, last_key, buffer = (position.shard_index, position.taken, position.last_key,
                                            position.buffer)
    parts = {}
    for j in range(current, len(shards)):
        start = (taken, last_key) if j == current else state.starts.get(j, (0, ""))
        parts[j] = _Part(shards[j], *start)
        left.parts.append(parts[j])
    for shard, member, key, data in buffer:
        if member < 0:
            continue  # the marker of a shard that could not be read: counted already, nothing to train on
        if data is not None:
            left.samples.append((urls[shards[shard]], member, key, data))
        elif shard in parts:
            parts[shard].refs.append(member)
        else:
            raise ReshapeError(f"reader {slot} of the checkpoint buffers a reference into shard {shard} "
                               "of its list, which it is not reading: the checkpoint is damaged")


def _shard_index(index: dict[str, int], url: str) -> int:
    if url not in index:
        raise ReshapeError(f"the checkpoint's reader was reading {url}, which is not among this run's "
                           "shards: resume with the data it was written with")
    return index[url]


# -- how it is dealt -----------------------------------------------------------------------------


def _deal(left: _Left, stream, world: int, workers: int, tokenized: list[tuple[int, int]]) -> list[SlotState]:
    """Every new slot's state: its shards (parts), its buffered samples, a fresh shuffle RNG, the old
    counters. `tokenized`: (tokens, new rank) of each tokenized leftover (`_tokenized_ranks`), which weigh on
    their ranks."""
    num_slots = world * workers
    known = stream.tokens_known
    mean_doc = sum(stream.shard_tokens) / max(1, sum(stream.expected_docs.values())) if known else 0.0
    rank_load = [0.0] * world
    if known:
        for tokens, rank in tokenized:
            rank_load[rank] += tokens
    slot_load = [rank_load[s // workers] / workers for s in range(num_slots)]
    samples: list[list] = [[] for _ in range(num_slots)]
    for sample in left.samples:  # each to the slot with the least (ties: the lower)
        s = min(range(num_slots), key=lambda s: (slot_load[s], len(samples[s]), s))
        samples[s].append(sample)
        slot_load[s] += mean_doc
    # The shards: a seeded order, largest first, each to the rank with the fewest tokens, then to its worker.
    order = np.random.default_rng([stream.seed, left.epoch, world, workers]).permutation(len(left.parts))
    parts = [left.parts[i] for i in order]
    weight = [_weight(p, stream) for p in parts]
    by_size = sorted(range(len(parts)), key=lambda k: -weight[k])
    rank_of = lpt(by_size, weight, [sum(slot_load[r * workers:(r + 1) * workers]) for r in range(world)])
    slot_parts: list[list[int]] = [[] for _ in range(num_slots)]
    for rank in range(world):
        ks = [k for k in by_size if rank_of[k] == rank]
        for k, worker in zip(ks, lpt(ks, weight, slot_load[rank * workers:(rank + 1) * workers]),
                             strict=True):
            slot_parts[rank * workers + worker].append(k)
    states = []
    for s in range(num_slots):
        check_interrupt()
        # Partly read shards first (their samples are already in the buffer), then the rest in the seeded
        # order.
        ks = sorted(slot_parts[s], key=lambda k: (parts[k].taken == 0, k))
        states.append(_slot_state(left, stream, s, [parts[k] for k in ks], samples[s], num_slots, world,
                                  workers))
    return states


def _slot_state(left: _Left, stream, slot: int, parts: list[_Part], samples: list, num_slots: int, world: int,
                workers: int) -> SlotState:
    """A new reader's state: shard list = the shards its buffered samples came from (already read) + its
    parts."""
    origins = {url: i for i, url in enumerate(dict.fromkeys(url for url, *_ in samples))}
    first = len(origins)
    shards = list(origins) + [stream.shards[p.shard] for p in parts]
    starts = {first + k: (p.taken, p.last_key) for k, p in enumerate(parts) if p.taken}
    buffer = [(origins[url], member, key, data) for url, member, key, data in samples]
    buffer += [(first + k, member, "", None) for k, p in enumerate(parts) for member in p.refs]
    seed = int(np.random.SeedSequence([stream.seed, left.epoch, slot, world, workers]).generate_state(1)[0])
    taken, last_key = starts.get(first, (0, ""))
    position = {"shard_index": first, "taken": taken, "last_key": last_key,
                "rng": random.Random(seed).getstate()[1], "draining": False, "buffer": buffer}
    skipped, docs = _kept_counters(left, num_slots)[slot]  # totals kept
    return SlotState.from_dict({"epoch": left.epoch, "drawn": 0, "shard": "", "skipped": skipped,
                                "docs": docs, "position": position, "split": RESHAPED, "shards": shards,
                                "starts": starts})


def _weight(part: _Part, stream) -> float:
    """Tokens left in a part: all of a whole shard's; a shard read in part, its share of samples not yet taken
    or still buffered as references (by the manifest's count; half when unknown). Without token counts: 1 per
    shard. Example: 100 samples, 30,000 tokens, 72 taken of which 8 still buffered ->
    30000 * 36/100 = 10,800."""
    size = stream.shard_tokens[part.shard] if stream.tokens_known else 1
    if not part.taken:
        return float(size)
    docs = stream.expected_docs.get(url_file_name(stream.shards[part.shard]))
    return size * (min(docs, max(0, docs - part.taken + len(part.refs))) / docs if docs else 0.5)


def _tokenized_ranks(left: _Left, world: int) -> list[tuple[int, int]]:
    """(tokens, new rank) of each ready row, packer piece and pending document, in that order: each to the
    new rank with the fewest tokens so far (ties: the lower), so rows stay whole and each packer keeps its
    pieces in their old order."""
    load = [(0, r) for r in range(world)]
    out = []
    for items, size in ((left.rows, lambda row: sum(len(d[1]) for d in row)),
                        (left.pieces, lambda d: len(d[1])), (left.pending, lambda d: len(d[1]))):
        for item in items:
            tokens, rank = heapq.heappop(load)
            out.append((size(item), rank))
            heapq.heappush(load, (tokens + size(item), rank))
    return out


def _deal_tokenized(left: _Left, ranks: list[int]) -> dict[str, list[int]]:
    """`ranks` (`_tokenized_ranks`, in its order) split into those of the ready rows, packer pieces and
    pending documents."""
    n_rows, n_pieces = len(left.rows), len(left.pieces)
    return {"rows": ranks[:n_rows], "pieces": ranks[n_rows:n_rows + n_pieces],
            "pending": ranks[n_rows + n_pieces:]}


