"""A resumed run's data streams: each data rank's stream state taken from the checkpoint, whatever shape wrote
it.

The stream belongs to the data ranks: under context and tensor parallelism the C x T ranks of a data rank hold
one stream's state alike, so a checkpoint written by W ranks at C x T = N holds W / N streams, in the state
files of ranks 0, N, 2N, ... (`Record.streams`). A run whose data ranks are as many, with as many DataLoader
workers, takes its own stream's state and continues bit-exactly; any other shape gets its part of every
written stream (trainer.data.reshape: each document of the interrupted epoch not yet trained on is trained on
once, in another order than the uninterrupted run's).
"""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint.store import Record, load_rank_states
from trainer.data.feed import RowSource
from trainer.distributed.groups import DistInfo, dist_sum


def restore_stream(rows: RowSource, path: Path, record: Record, rank_states: dict[int, dict], info: DistInfo,
                   num_workers: int, lockstep: bool) -> None:
    """This rank's data stream state into `rows`, from checkpoint `path` (`rank_states`: the written ranks'
    states the load already read; the others it needs are read here). `num_workers` and `lockstep`: this run's
    data.num_workers and data.epoch_lockstep."""
    streams = record.streams
    same_ranks = len(streams) == info.data_world
    if same_ranks and streams[info.data_rank] not in rank_states:
        rank_states = {**rank_states, **load_rank_states(path, [streams[info.data_rank]])}
    own = rank_states.get(streams[info.data_rank]) if same_ranks else None
    old_workers = (own or next(iter(rank_states.values())))["data"]["docs"]["num_workers"]
    if own is not None and old_workers == num_workers:
        return rows.load_state_dict(own["data"])
    # another shape: every written stream's state is dealt
    missing = [r for r in streams if r not in rank_states]
    rank_states = {**rank_states, **load_rank_states(path, missing)}
    state = rows.reshaped_state([rank_states[r]["data"] for r in streams], num_workers, lockstep=lockstep,
                                written_lockstep=record.section("data").get("epoch_lockstep", True))
    if info.is_main:
        print(f"resume on another shape: written by {len(streams)} rank(s) x {old_workers} DataLoader "
              f"worker(s), resumed on {info.data_world} x {num_workers}: what was left of epoch "
              f"{state.epoch} is dealt over the new readers (each document once; the order differs from the "
              "uninterrupted run's)", flush=True)
    rows.load_state(state)


def resume_read(rows: RowSource, info: DistInfo) -> dict:
    """Collective: what the data readers of all ranks read from shards to restore their positions (the ranks
    of a context or tensor group read the same, so they are counted once)."""
    samples, nbytes = dist_sum([float(n) for n in rows.resume_read()], info.device, info.data_group)
    return {"resume_samples_read": int(samples), "resume_bytes_read": int(nbytes)}
