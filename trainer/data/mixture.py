"""A data mixture: each step's rows drawn from several sources by weight, the same in every layout, resumable.

Each source (an entry of data.sources) is a whole row stream of its own: its shards split over the ranks and
DataLoader workers, its shuffle buffer and resumable reader positions (trainer.data.loader.DocumentLoader, one
pass over the source per iteration), its own packer (trainer.data.pipeline.RowStream). The mixture hands out
this rank's rows one at a time, always from the source furthest behind its share of the document tokens so
far:

    next row from = argmin over sources s of tokens_s / weight_s        (ties: the one listed first)

where tokens_s counts the document tokens (not padding) of the rows handed out from s. So the weights are
shares of the document tokens of each step as trained: after any row, each source is within one row (seq_len
tokens) of its share, whatever the packer does. Mixing after packing, not before: mixed before, the packer's
buffer (packing.buffer_size documents) would hold back the documents it packs last, those of one source more
than the other's, and what a step trains would lag behind the weights by up to a buffer of them (measured:
75/25 trained for 70/30 read over the 100 steps of experiment=mixture_ablation). The price: a row holds
documents of one source only. Every layout lays out the rows handed out, so packed, unpacked and bucketed runs
see the same documents per step, with the same shares; deterministic (each source's order comes from the
seed).

Example, weights 0.7 / 0.3, rows of 128 tokens, every code row full, every prose row 100 tokens: code (0 = 0:
the first listed), prose (128/0.7 > 0), code, code (384/0.7 = 549 > 100/0.3 = 333: prose), prose, ... after 10
rows 7 are code: 896 of 1,196 tokens (75 %); the gap stays within a row and its share of the tokens shrinks.

An epoch of the mixture: every source starts a new pass (its next epoch: a new permutation of its shards). The
epoch ends when the first source runs out (data.mix_exhausted=stop: the weights hold to the end; what the
other sources had left of their pass is not trained in this epoch, and is counted: `passes_cut`, `docs_cut`)
or when the last one does (restart: a source that runs out earlier starts another pass at once, so its
documents repeat in the epoch). With data.epoch_lockstep the ranks then wait for each other at the epoch's
end, as with one source (`exhausted`, `next_epoch`).

Checkpoints hold every source's row stream state and the counters here. Resumed with other weights (same
source names), the shares follow the new weights from the resume on. Resumed on another number of ranks or
workers, each source's rest of the interrupted epoch is dealt as one source's is (`Mixture.reshaped_state`,
trainer.data.reshape).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence

from trainer.data import epochs
from trainer.data.batch import Document
from trainer.data.config import MIX_EXHAUSTED
from trainer.data.loader import DocumentLoader
from trainer.data.packing import PackingStats
from trainer.data.pipeline import RowStream
from trainer.data.reader import DataStreamError
from trainer.data.reshape import ReshapeError, require_lockstep, rows_state
from trainer.data.state import (
    MIXER_COUNTERS,
    MixerState,
    MixtureState,
    RowStreamState,
    StreamState,
    StreamStateError,
    is_mixture,
)

log = logging.getLogger(__name__)



class MixtureStateError(StreamStateError):
    """A stream state that does not fit this run's mixture (other sources, or none)."""


class Mixture:
    """Rows of several per-source `RowStream`s (each over a `DocumentLoader` iterating one pass at a time),
    mixed by weight: a trainer.data.pipeline.RowSource, like one source's RowStream."""

    def __init__(self, sources: Sequence[RowStream], names: Sequence[str], weights: Sequence[float],
                 exhausted: str = "stop", lockstep: bool = True) -> None:
        if exhausted not in MIX_EXHAUSTED:
            raise ValueError(f"exhausted must be one of {MIX_EXHAUSTED}, got {exhausted!r}")
        if not (len(sources) == len(names) == len(weights)) or not sources:
            raise ValueError(f"{len(sources)} sources, {len(names)} names and {len(weights)} weights")
        if any(not getattr(rows.docs, "lockstep", False) for rows in sources):
            raise ValueError("each source's RowStream must read a DocumentLoader one pass at a time "
                             "(lockstep=True)")
        self.sources = list(sources)
        self.names = list(names)
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        """Each source's target share of the document tokens (the weights normalized)."""
        self.exhausted_policy = exhausted
        self.lockstep = lockstep
        """One mixture epoch, then `exhausted` until `next_epoch` (data.epoch_lockstep); else the epochs run
        on."""
        self.num_workers = self.loaders[0].num_workers
        n = len(self.sources)
        self.epoch = 0
        self.mixed = [0] * n
        """Document tokens of the rows handed out per source since the weights were set: what the choice
        balances."""
        self.tokens = [0] * n
        """Document tokens of the rows handed out per source since the start of training."""
        self.docs = [0] * n
        """Documents (chunks of split ones count once each) of those rows."""
        self.passes = [0] * n
        """Passes read to their end, per source."""
        self.passes_cut = [0] * n
        """Passes left at an epoch's end (mix_exhausted=stop; restart: the extra pass running then)."""
        self.docs_cut = [0] * n
        """Documents read or packed but not handed out when their pass was cut (the rest was not read at
        all)."""
        self.pass_rows = [0] * n
        """Rows handed out from each source's current pass (0: at the start of one)."""
        self.read_through = [False] * n
        """Whether each source ran out in the current epoch."""
        self.dealt = [False] * n
        """Whether each source's current pass is the rest of one dealt at a resume on another shape
        (`reshaped_state`): it may give no row on this rank, and is cut at the epoch's end before any was
        taken."""
        self._ready: deque[list[Document]] = deque()
        """Rows put back (`unread`), handed out again first."""
        self._ended = False
        """The epoch ended (lockstep): no row until `next_epoch`."""

    @property
    def loaders(self) -> list[DocumentLoader]:
        return [rows.docs for rows in self.sources]

    # -- rows ----------------------------------------------------------------------------------------

    def take(self, num_rows: int) -> list[list[Document]]:
        """The next `num_rows` rows (fewer at a lockstep epoch's end)."""
        out = [self._ready.popleft() for _ in range(min(num_rows, len(self._ready)))]
        while len(out) < num_rows and not self._ended:
            s = min(range(len(self.sources)), key=lambda i: (self.mixed[i] / self.weights[i], i))
            row = self.sources[s].take(1)
            if row:
                self._count(s, row[0])
                out.append(row[0])
                continue
            self._pass_ended(s)
        return out

    def _count(self, s: int, row: list[Document]) -> None:
        tokens = sum(len(doc) for doc in row)
        self.mixed[s] += tokens
        self.tokens[s] += tokens
        self.docs[s] += len(row)
        self.pass_rows[s] += 1

    def _pass_ended(self, s: int) -> None:
        """Source s ran out: it starts its next pass when asked again; the epoch may end here."""
        if self.pass_rows[s] == 0 and not self.dealt[s]:
            raise DataStreamError(f"source {self.names[s]!r}: a whole pass over this rank's share of its "
                                  "shards gave no document (empty shards, or every sample skipped)")
        self.sources[s].next_epoch()
        # a dealt rest that gave this rank nothing is no pass of its own
        self.passes[s] += bool(self.pass_rows[s])
        self.pass_rows[s] = 0
        self.dealt[s] = False
        self.read_through[s] = True
        if epochs.mixture_epoch_ends(self.exhausted_policy, self.read_through):
            self._end_epoch(s)

    def _end_epoch(self, ran_out: int) -> None:
        """Every source in the middle of a pass leaves its rest; the next epoch starts new passes."""
        cut = []
        for s, rows in enumerate(self.sources):
            if self.pass_rows[s] or self.dealt[s]:
                self.docs_cut[s] += rows.abandon_epoch()
                self.passes_cut[s] += 1
                self.pass_rows[s] = 0
                self.dealt[s] = False
                cut.append(f"{self.names[s]!r} after {self.tokens[s]:,} tokens in all")
        self.read_through = [False] * len(self.sources)
        why = (f"source {self.names[ran_out]!r} ran out (data.mix_exhausted=stop)"
               if self.exhausted_policy == "stop"
               else "every source was read through (data.mix_exhausted=restart)")
        log.info("mixture epoch %d ended: %s%s", self.epoch, why,
                 "; passes cut: " + ", ".join(cut) if cut else "")
        self.epoch = epochs.after(self.epoch)
        self._ended = self.lockstep

    def unread(self, rows: list[list[Document]]) -> None:
        """Put rows handed out by the last `take` back in front (a step abandoned before it ran): the next
        `take` and a checkpoint have them again; they stay counted, as handed out once."""
        self._ready.extendleft(reversed(rows))

    @property
    def exhausted(self) -> bool:
        """The lockstep epoch ended and every row of it was handed out."""
        return self._ended and not self._ready

    def next_epoch(self) -> None:
        self._ended = False

    @property
    def stats(self) -> PackingStats:
        """The sources' packing counts, summed."""
        total = PackingStats()
        for rows in self.sources:
            for key, value in rows.stats.state_dict().items():
                setattr(total, key, getattr(total, key) + value)
        return total

    def close(self) -> None:
        for rows in self.sources:
            rows.close()

    # -- what the trainer reports -------------------------------------------------------------------

    def start(self) -> None:
        """Start every source's workers now (after `load_state_dict`: their positions are restored on
        return)."""
        for loader in self.loaders:
            loader.start()

    def skipped(self) -> dict[str, int]:
        """Samples skipped under on_error=skip, summed over the sources (this rank's readers)."""
        total: dict[str, int] = {}
        for loader in self.loaders:
            for reason, n in loader.skipped().items():
                total[reason] = total.get(reason, 0) + n
        return total

    def resume_read(self) -> tuple[int, int]:
        """(samples, bytes) read from shards to restore every source's positions after a resume."""
        reads = [loader.resume_read() for loader in self.loaders]
        return sum(r[0] for r in reads), sum(r[1] for r in reads)

    def summary(self) -> dict[str, dict]:
        """Per source, what this rank handed out since the start of training, and what its cut passes left.

        Example: {"code": {"weight": 0.7, "docs": 812, "tokens": 70144, "passes": 1, "passes_cut": 0,
        "docs_cut": 0}, ...}."""
        return {name: {"weight": self.weights[s], "docs": self.docs[s], "tokens": self.tokens[s],
                       "passes": self.passes[s], "passes_cut": self.passes_cut[s],
                       "docs_cut": self.docs_cut[s]}
                for s, name in enumerate(self.names)}

    # -- checkpoints ----------------------------------------------------------------------------------

    def state(self) -> MixtureState:
        mixer = MixerState(names=list(self.names), weights=list(self.weights), epoch=self.epoch,
                           mixed=list(self.mixed),
                           **{key: list(getattr(self, key)) for key in MIXER_COUNTERS},
                           dealt=list(self.dealt), num_workers=self.num_workers)
        return MixtureState(mixer=mixer, sources=[rows.state() for rows in self.sources],
                            ready=[[doc.to_state() for doc in row] for row in self._ready],
                            stats=self.stats.state_dict(), ended=self._ended)

    def load_state(self, state: MixtureState) -> None:
        state = self._typed(state)
        self._check_names(state.mixer.names)
        for rows, source_state in zip(self.sources, state.sources, strict=True):
            rows.load_state(source_state)
        saved = state.mixer
        self.epoch = saved.epoch
        for key in MIXER_COUNTERS:
            setattr(self, key, list(getattr(saved, key)))
        self.dealt = list(saved.dealt)
        self._ready = deque([[Document.from_state(d) for d in row] for row in state.ready])
        self._ended = state.ended
        if [round(w, 12) for w in saved.weights] == [round(w, 12) for w in self.weights]:
            self.mixed = list(saved.mixed)
        else:
            # new weights: the shares follow them from here (the old counts would make a burst of one source)
            log.info("mixture weights changed from %s to %s at the resume: the shares follow the new weights "
                     "from here", saved.weights, self.weights)
            self.mixed = [0] * len(self.sources)

    def state_dict(self) -> dict:
        return self.state().to_dict()

    def load_state_dict(self, state: dict) -> None:
        self.load_state(self._typed(state))

    def _typed(self, state: dict | StreamState) -> MixtureState:
        if isinstance(state, MixtureState):
            return state
        if isinstance(state, RowStreamState) or not is_mixture(state):
            raise MixtureStateError(f"the checkpoint's data stream is one source; this run mixes "
                                    f"{self.names} (data.sources): resume with the checkpoint's data config, "
                                    "or start a new run")
        return MixtureState.from_dict(state)

    def _check_names(self, names: list[str]) -> None:
        if names != self.names:
            raise MixtureStateError(f"the checkpoint mixes the sources {names}; this run's data.sources "
                                    f"names {self.names}: a mixture resumes with the same sources, in the "
                                    "same order")

    def reshaped_state(self, states: Sequence[dict], num_workers: int, lockstep: bool,
                       written_lockstep: bool = True) -> MixtureState:
        """This rank's mixture state from `states` (every old rank's, in rank order), written on another
        number of ranks or DataLoader workers: each source's rest of the interrupted epoch is dealt as one
        source's is (trainer.data.reshape: every document of it not yet trained on, to one new reader), so
        every new rank reads its part of each source, then waits at the epoch's end as usual.

            old rank r (in the interrupted epoch e)       source s on it             dealt
            in the epoch, s in its pass of the epoch      its rest of that pass      yes
            in the epoch, s read through (restart)        an extra pass, begun       no: cut (as at e's end)
            waiting at e's end (the epoch ended on it)    its next pass, not begun   nothing left

        The totals are kept (old rank r's counts go to new rank r mod W'); the shares follow the weights from
        here (`mixed` starts at 0). Deterministic: every new rank deals the same from the same states."""
        require_lockstep(lockstep, written_lockstep)
        olds = [self._typed(state) for state in states]
        self._check_names(olds[0].mixer.names)
        current = {old.epoch for old in olds}
        if len(current) != 1:
            raise ReshapeError(f"the checkpoint's ranks are in different mixture epochs ({sorted(current)}): "
                               "not a lockstep run")
        epoch = current.pop()
        stream = self.sources[0].docs.stream
        world, rank = stream.world_size, stream.rank
        n = len(self.sources)
        totals = {key: [0] * n for key in ("tokens", "docs", "passes", "passes_cut", "docs_cut")}
        for old_rank, old in enumerate(olds):
            if old_rank % world == rank:  # totals kept: old rank r's counts go to new rank r mod W'
                for key, values in totals.items():
                    totals[key] = [a + b for a, b in zip(values, getattr(old.mixer, key), strict=True)]
        sources, read_through, dealt = [], [], []
        for s, rows in enumerate(self.sources):
            # what old rank r leaves of source s: its pass of the epoch, or nothing (it waits, or read s
            # through)
            gives = [None if old.ended or old.mixer.read_through[s] else old.sources[s].epoch for old in olds]
            for old_rank, (old, give) in enumerate(zip(olds, gives, strict=True)):
                if give is None and not old.ended and old_rank % world == rank:  # its extra pass, cut here
                    totals["passes_cut"][s] += 1
                    totals["docs_cut"][s] += old.sources[s].docs_held
            epochs = [g for g in gives if g is not None]
            start = max(epochs) if epochs else max(old.sources[s].docs.lockstep_epoch for old in olds)
            sources.append(rows_state([old.sources[s] for old in olds], rows.docs.stream, num_workers, gives,
                                      start))
            # all in extra passes: so is this
            read_through.append(not epochs and not all(old.ended for old in olds))
            dealt.append(bool(epochs))
        ended = all(old.ended for old in olds)
        mixer = MixerState(names=list(self.names), weights=list(self.weights),
                           epoch=epochs.after(epoch) if ended else epoch, mixed=[0] * n,
                           **totals, pass_rows=[0] * n, read_through=read_through,
                           dealt=[False] * n if ended else dealt, num_workers=num_workers)
        return MixtureState(mixer=mixer, sources=sources,
                            ready=_deal_rows([row for old in olds for row in old.ready], world, rank),
                            stats=_summed([source.stats for source in sources]), ended=ended)


def _summed(counts: list[dict]) -> dict:
    """Counts (e.g. PackingStats state dicts) added up key by key."""
    return {key: sum(c[key] for c in counts) for key in counts[0]}


def _deal_rows(rows: list[list], world: int, rank: int) -> list[list]:
    """This rank's share of rows put back (`Mixture.unread`) on the old ranks: each row whole, to the new rank
    with the fewest tokens so far (ties: the lower)."""
    load = [0] * world
    mine = []
    for row in rows:
        r = min(range(world), key=lambda i: (load[i], i))
        load[r] += sum(len(doc[1]) for doc in row)
        if r == rank:
            mine.append(row)
    return mine
