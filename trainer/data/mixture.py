"""A data mixture: this rank's documents drawn from several sources by weight, the same in every layout, resumable.

Each source (an entry of data.sources) is a whole stream of its own: its shards split over the ranks and
DataLoader workers, its shuffle buffer, its resumable reader positions (trainer.data.loader.DocumentLoader, one
pass over the source per iteration). The mixture takes this rank's documents from them one at a time, always
from the source furthest behind its share of the document tokens so far:

    next source = argmin over sources s of tokens_s / weight_s        (ties: the one listed first)

Deterministic (each source's order comes from the seed) and smooth: after any prefix of the stream, each
source's tokens are within one document of its weight x all tokens. The packer then makes rows of these
documents, and every layout lays out those rows, so packed, unpacked and bucketed runs see the same documents
per step, with the same shares. The weights are shares of document tokens (EOS included) as read, before long
documents are split; `Document.source` tells each document's source to the per-source metrics.

Example, weights 0.7 / 0.3, every code document 100 tokens, every prose one 300: code (0 = 0: the first
listed), prose (100/0.7 > 0), then code six times (until 700/0.7 = 300/0.3), code again (a tie), prose ...:
after 1,100 tokens 800 are code (73 %), after 2,000 exactly 70 %.

An epoch of the mixture: every source starts a new pass (its next epoch: a new permutation of its shards). The
epoch ends when the first source runs out (data.mix_exhausted=stop: the weights hold to the end; what the other
sources had left of their pass is not read in this epoch, and is counted: `passes_cut`) or when the last one
does (restart: a source that runs out earlier starts another pass at once, so its documents repeat in the
epoch). With data.epoch_lockstep the ranks then wait for each other at the epoch's end, as with one source.

Checkpoints hold every source's own stream state and the counters here. Resumed with other weights (same source
names), the shares follow the new weights from the resume on. A mixture resumes on the shape it was written on
(trainer.data.reshape refuses it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from trainer.data.batch import Document
from trainer.data.config import MIX_EXHAUSTED
from trainer.data.loader import DocumentLoader
from trainer.data.reader import DataStreamError
from trainer.errors import UserError

log = logging.getLogger(__name__)


class MixtureStateError(UserError, ValueError):
    """A stream state that does not fit this run's mixture (other sources, or none)."""


class MixtureLoader:
    """Documents of several `DocumentLoader`s (one per source, each iterating one pass), mixed by weight.

    The interface the trainer uses of a DocumentLoader (iterate, start, state_dict, load_state_dict, skipped,
    resume_read); with `lockstep` one iteration covers one epoch of the mixture.
    """

    def __init__(self, loaders: Sequence[DocumentLoader], names: Sequence[str], weights: Sequence[float],
                 exhausted: str = "stop", lockstep: bool = True) -> None:
        if exhausted not in MIX_EXHAUSTED:
            raise ValueError(f"exhausted must be one of {MIX_EXHAUSTED}, got {exhausted!r}")
        if not (len(loaders) == len(names) == len(weights)) or not loaders:
            raise ValueError(f"{len(loaders)} loaders, {len(names)} names and {len(weights)} weights")
        if any(not loader.lockstep for loader in loaders):
            raise ValueError("each source's DocumentLoader must iterate one pass at a time (lockstep=True)")
        self.loaders = list(loaders)
        self.names = list(names)
        total = float(sum(weights))
        self.weights = [float(w) / total for w in weights]
        """Each source's target share of the document tokens (the weights normalized)."""
        self.exhausted = exhausted
        self.lockstep = lockstep
        """One mixture epoch per iteration (data.epoch_lockstep); else the epochs follow each other."""
        self.num_workers = self.loaders[0].num_workers
        self.stream = None
        """No single DocumentStream: trainer.data.reshape, which deals one, refuses a mixture."""
        n = len(self.loaders)
        self.epoch = 0
        self.mixed = [0] * n
        """Document tokens handed out per source since the weights were set: what the next choice balances."""
        self.tokens = [0] * n
        """Document tokens handed out per source since the start of training."""
        self.docs = [0] * n
        self.passes = [0] * n
        """Passes read to their end, per source."""
        self.passes_cut = [0] * n
        """Passes left unread at an epoch's end (mix_exhausted=stop; restart: the extra pass running then)."""
        self.pass_docs = [0] * n
        """Documents handed out from each source's current pass (0: at the start of one)."""
        self.read_through = [False] * n
        """Whether each source ran out in the current epoch."""
        self._iters: list[Iterator[Document] | None] = [None] * n

    @property
    def lockstep_epoch(self) -> int:
        return self.epoch

    def start(self) -> None:
        """Start every source's workers now (after `load_state_dict`: their positions are restored on return)."""
        for loader in self.loaders:
            loader.start()

    def __iter__(self) -> Iterator[Document]:
        try:
            while True:
                s = min(range(len(self.loaders)), key=lambda i: (self.mixed[i] / self.weights[i], i))
                doc = self._pull(s)
                if doc is not None:
                    doc.source = s
                    n = len(doc)
                    self.mixed[s] += n
                    self.tokens[s] += n
                    self.docs[s] += 1
                    self.pass_docs[s] += 1
                    yield doc
                    continue
                if self.pass_docs[s] == 0:
                    raise DataStreamError(f"source {self.names[s]!r}: a whole pass over this rank's share of its "
                                          "shards gave no document (empty shards, or every sample skipped)")
                self.passes[s] += 1
                self.pass_docs[s] = 0
                self.read_through[s] = True
                if self.exhausted == "stop" or all(self.read_through):
                    self._end_epoch(s)
                    if self.lockstep:
                        return
        finally:  # also when the consumer stops early: every source's workers end with the iteration
            self._close()

    def _pull(self, s: int) -> Document | None:
        """The next document of source s's pass, or None at the pass's end (the next pull starts its next one)."""
        if self._iters[s] is None:
            self._iters[s] = iter(self.loaders[s])
        doc = next(self._iters[s], None)
        if doc is None:
            self._iters[s] = None
        return doc

    def _end_epoch(self, ran_out: int) -> None:
        """Every source in the middle of a pass leaves its rest unread; the next epoch starts new passes."""
        cut = []
        for s, loader in enumerate(self.loaders):
            if self.pass_docs[s]:
                self._close(s)
                loader.skip_rest_of_epoch()
                self.passes_cut[s] += 1
                cut.append(f"{self.names[s]!r} after {self.pass_docs[s]} documents of its pass")
                self.pass_docs[s] = 0
        self.read_through = [False] * len(self.loaders)
        why = (f"source {self.names[ran_out]!r} ran out (data.mix_exhausted=stop)" if self.exhausted == "stop"
               else "every source was read through (data.mix_exhausted=restart)")
        log.info("mixture epoch %d ended: %s%s", self.epoch, why, "; left unread in it: " + ", ".join(cut) if cut else "")
        self.epoch += 1

    def _close(self, only: int | None = None) -> None:
        for s, it in enumerate(self._iters):
            if it is not None and only in (None, s):
                it.close()  # DocumentLoader's finally: its workers end
                self._iters[s] = None

    # -- what the trainer reports -------------------------------------------------------------------

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
        """Per source, what this rank's readers handed out since the start of training.

        Example: {"code": {"weight": 0.7, "docs": 812, "tokens": 70144, "passes": 1, "passes_cut": 0}, ...}."""
        return {name: {"weight": self.weights[s], "docs": self.docs[s], "tokens": self.tokens[s],
                       "passes": self.passes[s], "passes_cut": self.passes_cut[s]}
                for s, name in enumerate(self.names)}

    # -- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "mixture": {"names": list(self.names), "weights": list(self.weights), "exhausted": self.exhausted,
                        "epoch": self.epoch, "mixed": list(self.mixed), "tokens": list(self.tokens),
                        "docs": list(self.docs), "passes": list(self.passes), "passes_cut": list(self.passes_cut),
                        "pass_docs": list(self.pass_docs), "read_through": list(self.read_through)},
            "sources": [loader.state_dict() for loader in self.loaders],
            "num_workers": self.num_workers,  # what the trainer compares with data.num_workers
            "lockstep_epoch": self.epoch,
        }

    def load_state_dict(self, state: dict) -> None:
        saved = state.get("mixture")
        if saved is None:
            raise MixtureStateError(f"the checkpoint's data stream is one source; this run mixes {self.names} "
                                    "(data.sources): resume with the checkpoint's data config, or start a new run")
        if saved["names"] != self.names:
            raise MixtureStateError(f"the checkpoint mixes the sources {saved['names']}; this run's data.sources "
                                    f"names {self.names}: a mixture resumes with the same sources, in the same order")
        self._close()
        for loader, loader_state in zip(self.loaders, state["sources"], strict=True):
            loader.load_state_dict(loader_state)
        self.epoch = saved["epoch"]
        for key in ("tokens", "docs", "passes", "passes_cut", "pass_docs", "read_through"):
            setattr(self, key, list(saved[key]))
        if [round(w, 12) for w in saved["weights"]] == [round(w, 12) for w in self.weights]:
            self.mixed = list(saved["mixed"])
        else:  # new weights: the shares follow them from here (the old counts would make a burst of one source)
            log.info("mixture weights changed from %s to %s at the resume: the shares follow the new weights from "
                     "here", saved["weights"], self.weights)
            self.mixed = [0] * len(self.loaders)
