"""The data stream's state as typed objects: what a checkpoint's `rank_NNNNN.pt` holds under "data".

Each object owns its conversion to the plain dicts a checkpoint stores (`to_dict`: lists, ints, strings and
numpy arrays only, which `torch.load(weights_only=True)` reads back without running code) and from them
(`from_dict`, which also reads the dicts of older checkpoints). The parts, from the inside out:

    SlotState        one (rank, worker) reader: epoch, position in its shards, counters  (trainer.data.reader)
    LoaderState      one source's readers on this rank, and the documents of a chunk not handed out yet
    PackerState      the online packer's buffered documents
    RowStreamState   one source: its LoaderState, PackerState, rows packed but not taken, packing counts
    MixerState       a mixture's choice counters and per-source epoch bookkeeping
    MixtureState     a mixture: its MixerState and one RowStreamState per source

A document is kept as the tuple `Document.to_state` gives (key, tokens, loss_mask, source): the dealing of a
resume on another shape (trainer.data.reshape) moves them without building Document objects.

Versions (`STATE_VERSION`, the "version" key of a RowStreamState's or MixtureState's dict):
    0  checkpoints before the package was regrouped (tests/fixtures/v0): no reader positions, no split
    1  before issue 31 (tests/fixtures/v1): no "version" key, no MixerState "dealt"
    2  "version"; MixerState "dealt"
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.data import epochs
from trainer.data.reader import SlotState
from trainer.errors import UserError

STATE_VERSION = 2

DocState = tuple
"""A document as `Document.to_state` keeps it: (key, tokens, loss_mask, source)."""


class StreamStateError(UserError, ValueError):
    """A data stream state that does not fit this run's stream (a mixture's for one source, or the
    reverse)."""


@dataclass
class LoaderState:
    """One source's readers on this rank (trainer.data.loader.DocumentLoader)."""

    slot_states: dict[int, SlotState] = field(default_factory=dict)
    chunks_consumed: int = 0
    epoch_chunks: int = 0
    """Chunks consumed in the current lockstep epoch (which worker comes next)."""
    lockstep_epoch: int = 0
    num_workers: int = 0
    pending: list[DocState] = field(default_factory=list)
    """Documents of the current chunk not handed out yet."""

    def to_dict(self) -> dict:
        return {"slot_states": {slot: s.to_dict() for slot, s in self.slot_states.items()},
                "chunks_consumed": self.chunks_consumed, "epoch_chunks": self.epoch_chunks,
                "lockstep_epoch": self.lockstep_epoch, "num_workers": self.num_workers,
                "pending": list(self.pending)}

    @classmethod
    def from_dict(cls, d: dict) -> LoaderState:
        return cls(slot_states={int(slot): SlotState.from_dict(s) for slot, s in d["slot_states"].items()},
                   chunks_consumed=d["chunks_consumed"], epoch_chunks=d.get("epoch_chunks", 0),
                   lockstep_epoch=d.get("lockstep_epoch", 0), num_workers=d["num_workers"],
                   pending=list(d["pending"]))


@dataclass
class PackerState:
    """The online packer's buffered documents (trainer.data.packing.OnlinePacker)."""

    seq_len: int
    buffer_size: int
    docs: list[DocState] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"seq_len": self.seq_len, "buffer_size": self.buffer_size, "docs": list(self.docs)}

    @classmethod
    def from_dict(cls, d: dict) -> PackerState:
        return cls(seq_len=d["seq_len"], buffer_size=d["buffer_size"], docs=list(d["docs"]))


@dataclass
class RowStreamState:
    """One source's row stream (trainer.data.pipeline.RowStream)."""

    docs: LoaderState | None
    """None when the documents come from an iterable that keeps no state (tests, benchmarks)."""
    packer: PackerState
    ready: list[list[DocState]] = field(default_factory=list)
    """Rows packed, not handed out yet."""
    stats: dict[str, int] = field(default_factory=dict)
    """Packing counts (trainer.data.packing.PackingStats)."""
    ended: bool = False
    """The documents of the (lockstep) epoch ended and the packer was flushed; rows of it may still be
    `ready`. Stored as "exhausted", the name checkpoints have always given it."""

    @property
    def epoch(self) -> int:
        """The epoch this rank's readers are in or, where its documents of it ended, are done with."""
        return epochs.current(self.docs.lockstep_epoch, self.ended)

    @property
    def docs_held(self) -> int:
        """Documents read but not handed out: its ready rows', packer's and pending ones."""
        pending = 0 if self.docs is None else len(self.docs.pending)
        return sum(map(len, self.ready)) + len(self.packer.docs) + pending

    def to_dict(self) -> dict:
        return {"version": STATE_VERSION, "docs": None if self.docs is None else self.docs.to_dict(),
                "packer": self.packer.to_dict(), "ready": [list(row) for row in self.ready],
                "stats": dict(self.stats), "exhausted": self.ended}

    @classmethod
    def from_dict(cls, d: dict) -> RowStreamState:
        if is_mixture(d):
            raise StreamStateError("the checkpoint's data stream mixes the sources "
                                   f"{d['docs']['mixture']['names']}; this run reads one source: "
                                   "resume with the checkpoint's data config (data.sources)")
        return cls(docs=None if d["docs"] is None else LoaderState.from_dict(d["docs"]),
                   packer=PackerState.from_dict(d["packer"]), ready=[list(row) for row in d["ready"]],
                   stats=dict(d["stats"]), ended=bool(d.get("exhausted", False)))


MIXER_COUNTERS = ("tokens", "docs", "passes", "passes_cut", "docs_cut", "pass_rows", "read_through")
"""Per-source counters of a MixerState besides `mixed` and `dealt` (trainer.data.mixture.Mixture's)."""


@dataclass
class MixerState:
    """A mixture's counters (trainer.data.mixture.Mixture: what each is)."""

    names: list[str]
    weights: list[float]
    epoch: int
    mixed: list[int]
    tokens: list[int]
    docs: list[int]
    passes: list[int]
    passes_cut: list[int]
    docs_cut: list[int]
    pass_rows: list[int]
    read_through: list[bool]
    dealt: list[bool]
    num_workers: int = 0

    def to_dict(self) -> dict:
        mixture = {"names": list(self.names), "weights": list(self.weights), "epoch": self.epoch,
                   "mixed": list(self.mixed), **{key: list(getattr(self, key)) for key in MIXER_COUNTERS},
                   "dealt": list(self.dealt)}
        return {"mixture": mixture,
                "num_workers": self.num_workers,  # what the trainer compares with data.num_workers
                "lockstep_epoch": self.epoch}

    @classmethod
    def from_dict(cls, d: dict) -> MixerState:
        m = d["mixture"]
        return cls(names=list(m["names"]), weights=list(m["weights"]), epoch=m["epoch"],
                   mixed=list(m["mixed"]), **{key: list(m[key]) for key in MIXER_COUNTERS},
                   dealt=list(m.get("dealt", [False] * len(m["names"]))), num_workers=d["num_workers"])


@dataclass
class MixtureState:
    """A data mixture (trainer.data.mixture.Mixture)."""

    mixer: MixerState
    sources: list[RowStreamState]
    ready: list[list[DocState]] = field(default_factory=list)
    """Rows put back (Mixture.unread)."""
    stats: dict[str, int] = field(default_factory=dict)
    """The sources' packing counts, summed (for reports; not read back)."""
    ended: bool = False
    """The (lockstep) epoch ended on this rank: no row until the next one. Stored as "exhausted"."""

    @property
    def epoch(self) -> int:
        """The mixture epoch this rank is in or, where it ended on this rank, is done with."""
        return epochs.current(self.mixer.epoch, self.ended)

    def to_dict(self) -> dict:
        return {"version": STATE_VERSION, "docs": self.mixer.to_dict(),
                "sources": [source.to_dict() for source in self.sources],
                "ready": [list(row) for row in self.ready], "stats": dict(self.stats),
                "exhausted": self.ended}

    @classmethod
    def from_dict(cls, d: dict) -> MixtureState:
        return cls(mixer=MixerState.from_dict(d["docs"]),
                   sources=[RowStreamState.from_dict(s) for s in d["sources"]],
                   ready=[list(row) for row in d["ready"]], stats=dict(d["stats"]),
                   ended=bool(d["exhausted"]))


StreamState = RowStreamState | MixtureState


def is_mixture(d: dict) -> bool:
    """Whether a checkpoint's data state dict is a mixture's."""
    return d.get("docs") is not None and "mixture" in d["docs"]


def stream_state(d: dict | StreamState) -> StreamState:
    """The typed state of a checkpoint's data state dict, of one source or of a mixture (typed states
    pass)."""
    if isinstance(d, RowStreamState | MixtureState):
        return d
    return MixtureState.from_dict(d) if is_mixture(d) else RowStreamState.from_dict(d)
