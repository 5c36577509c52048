"""The checkpoint store: the one place that knows what a checkpoint directory holds, and every name in it.

Layout of `<run dir>/checkpoints/step_000050/` (the name of each entry is the constant beside it; nothing else
in packtrain spells these names):

    meta.json           META_FILE         step, token counters, the writer's world size and parallel sizes,
                                          engine, the resolved run config (read back typed: `Record`)
    conventions.json    CONVENTIONS_FILE  how inputs and objective were built (decided in trainer.run)
    tokenizer/          TOKENIZER_DIR     the tokenizer files the weights were trained with
    model.safetensors   WEIGHTS_FILE      the whole model's weights, TIED_KEY left out: in every DDP and
                                          DeepSpeed checkpoint; under FSDP2 and tensor parallelism (where
                                          writing it gathers the model) in the run's last one, or in each with
                                          train.save_weights=every (a checkpoint without it: the weights are
                                          read from dcp/ or engine.pt)
    rank_00000.pt ...   rank_file(rank)   each rank's data-stream state and RNG states
    engine.pt           ENGINE_FILE       a replicated engine's (DDP's) model, optimizer and LR schedule
    deepspeed/          DEEPSPEED_DIR     or, for DeepSpeed, its own checkpoint: one ZeRO shard per rank,
                                          which DeepSpeed writes itself into the directory named here (it also
                                          copies its recovery scripts, zero_to_fp32.py, beside it)
    dcp/                DCP_DIR           or, for FSDP2, torch.distributed.checkpoint's files: each rank's
                                          shards (__0_0.distcp, ...) and the .metadata, written by every rank
                                          in parallel
    checksums.json      CHECKSUMS_FILE    the sha256 of every other file above, written last (integrity)

Every .pt is plain data and tensors, read with weights_only=True (trainer.checkpoint.safe_io); DeepSpeed's own
files are checked that way (`check_deepspeed_files`) before DeepSpeed unpickles them; DCP's are read by the
FSDP2 engine's own reader, which unpickles nothing but plain data, tensors and DCP's metadata types.

Nothing is read before the checkpoint is checked (`verify_checkpoint`, trainer.checkpoint.integrity): no entry
leads outside its directory (a symlink out, or a name in CHECKSUMS_FILE with `..`; DCP's own names are checked
by its reader), and every file has the sha256 recorded at save. A checkpoint written before CHECKSUMS_FILE
existed loads unverified.

On another number of ranks: the model, optimizer and LR schedule load on any number (`load_engine`). DCP
reshards as it loads; DeepSpeed's shards are first converted, by rank 0, into `.tmp-resharded-step_000050/`
(RESHARDED_PREFIX) beside the checkpoint, which is never changed, and that copy is removed once every rank has
loaded it. Each rank then reads every old rank's RANK_FILE (`load_checkpoint`): its data stream is dealt from
all of them (trainer.checkpoint.streams, trainer.data.reshape).

Who writes what: the engines return state and never touch a file (trainer.distributed.engine): the store
writes `engine.state_dict()` and `engine.full_weights()` for a replicated engine, and only a sharded engine
writes (its shards, `engine.save_shards`) into the one directory the store hands it.

A save is atomic: every rank writes into `.tmp-step_000050/` (TMP_PREFIX), which rank 0 renames to
`step_000050/` once all parts are there; a directory that still has the prefix is never loaded.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from trainer.checkpoint import integrity, tensors
from trainer.checkpoint.integrity import DamagedCheckpointError
from trainer.checkpoint.safe_io import load_state, save_state
from trainer.data.workers import ReadInterrupted, check_interrupt
from trainer.distributed.dims import stream_ranks
from trainer.distributed.engine import Engine
from trainer.distributed.groups import DistInfo, barrier, dist_max
from trainer.errors import UserError

# ---------------------------------------------------------------------------------------------------
# The layout: every name of a checkpoint, once
# ---------------------------------------------------------------------------------------------------

ROOT_DIR = "checkpoints"
"""The run directory's sub-directory that holds its checkpoints."""
STEP_PREFIX = "step_"
STEP_DIR = re.compile(rf"^{STEP_PREFIX}(\d{{6,}})$")
"""A complete checkpoint's directory: `step_000050` (the step, at least six digits)."""
TMP_PREFIX = ".tmp-"
"""A checkpoint being written: `.tmp-step_000050/`, renamed to `step_000050/` once every rank has written its
part. A kill at any moment leaves either the complete renamed directory or a `.tmp-` one, which is never
loaded."""
RESHARDED_PREFIX = f"{TMP_PREFIX}resharded-"
"""A sharded engine's state converted for another number of ranks: `.tmp-resharded-step_000050/`, beside the
checkpoint it was converted from, and removed after the load (or, left by a kill, by the next save's
prune)."""

META_FILE = "meta.json"
CONVENTIONS_FILE = "conventions.json"
TOKENIZER_DIR = "tokenizer"
WEIGHTS_FILE = "model.safetensors"
ENGINE_FILE = "engine.pt"
DEEPSPEED_DIR = "deepspeed"
DCP_DIR = "dcp"
SHARD_DIRS = {"deepspeed": DEEPSPEED_DIR, "dcp": DCP_DIR}
"""A sharded engine's directory, by its `shard_format`."""
CHECKSUMS_FILE = "checksums.json"
CHECKSUMS_KEY = "checksums"
"""META_FILE's record that CHECKSUMS_FILE was written (its algorithm): a checkpoint that says so and lacks the
file is damaged, not old (deleting the manifest must not turn verification off)."""
RANK_FILE = "rank_{rank:05d}.pt"
RANK_GLOB = "rank_*.pt"

TIED_KEY = "lm_head.weight"
"""The output head, tied to `wte.weight` (the model's own tying restores it): left out of WEIGHTS_FILE, since
safetensors refuses two names for one storage, and never expected by the readers of weights. An untied head
(model.tie_embeddings=false) is a weight of its own and is written."""


def head_is_tied(meta: dict) -> bool:
    """Whether the run config in `meta` ties the head to the embedding (model.tie_embeddings, true when
    absent)."""
    return ((meta.get("config") or {}).get("model") or {}).get("tie_embeddings", True) is not False

PARALLEL_KEY = "parallel"
"""META_FILE's record of the writer's parallel sizes: {"context": C, "tensor": T} (its world size is
"world_size")."""
TASKS_KEY = "eval_tasks"
"""META_FILE's {task name: sha256 of its items} of train.eval_tasks (trainer.run.evals.TaskScorer.digests)."""


@dataclass(frozen=True)
class Record:
    """A checkpoint's META_FILE, typed: the step it ends, what the run counted, its config, the engine that
    wrote it and the writer's parallel sizes, world_size = data x context x tensor (`streams`: the ranks that
    hold each data stream's state). A checkpoint older than PARALLEL_KEY has its sizes read from its
    config."""

    step: int
    world_size: int
    context: int = 1
    tensor: int = 1
    counters: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    engine: str | None = None
    tasks: dict | None = None

    @classmethod
    def of(cls, meta: dict) -> Record:
        """The record of a META_FILE as `read_meta` returns it (checked there)."""
        config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        context, tensor = parallel_sizes(meta)
        tasks = meta.get(TASKS_KEY)
        return cls(step=meta["step"], world_size=meta["world_size"], context=context, tensor=tensor,
                   counters=dict(meta.get("counters") or {}), config=config, engine=meta.get("engine"),
                   tasks=tasks if isinstance(tasks, dict) else None)

    @property
    def streams(self) -> list[int]:
        """The written rank holding each data stream, in data-rank order
        (trainer.distributed.dims.stream_ranks)."""
        return stream_ranks(self.world_size, self.context, self.tensor)

    def section(self, name: str) -> dict:
        """The written run config's section `name` ({} if the checkpoint has none)."""
        return self.config.get(name) or {}


def parallel_sizes(meta: dict) -> tuple[int, int]:
    """(context, tensor) of the ranks that wrote META_FILE `meta`: its PARALLEL_KEY, or for a checkpoint
    written before it, its config's distributed.context_parallel and tensor_parallel (1 where absent). A
    ValueError saying what is wrong when they are not positive integers whose product divides world_size."""
    if PARALLEL_KEY in meta:
        written = meta[PARALLEL_KEY]
        if not isinstance(written, dict):
            raise ValueError(f"its {PARALLEL_KEY!r} is not an object of context and tensor sizes")
        sizes = (written.get("context", 1), written.get("tensor", 1))
    else:
        config = meta.get("config") if isinstance(meta.get("config"), dict) else {}
        written = config.get("distributed") if isinstance(config.get("distributed"), dict) else {}
        sizes = (written.get("context_parallel") or 1, written.get("tensor_parallel") or 1)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in sizes) or (
            meta["world_size"] % (sizes[0] * sizes[1])):
        raise ValueError(f"its writer's context x tensor sizes {sizes[0]!r} x {sizes[1]!r} do not tile its "
                         f"world_size {meta['world_size']}")
    return sizes


PATH_HINT = f"<run dir>/{ROOT_DIR}/{STEP_PREFIX}NNNNNN"
"""How messages name a checkpoint directory to the user."""


def step_name(step: int) -> str:
    """The directory name of step `step`'s checkpoint. Example: 50 -> 'step_000050'."""
    return f"{STEP_PREFIX}{step:06d}"


def rank_file(rank: int) -> str:
    """The file of rank `rank`'s own state. Example: 1 -> 'rank_00001.pt'."""
    return RANK_FILE.format(rank=rank)


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / ROOT_DIR


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    """Where step `step`'s checkpoint of run `run_dir` is (once complete)."""
    return checkpoint_root(run_dir) / step_name(step)


def _complete(root: Path) -> list[tuple[int, Path]]:
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return None
    steps = _complete(root)
    return steps[-1][1] if steps else None


def checkpoints_after(run_dir: str | Path, step: int) -> list[Path]:
    """The run dir's complete checkpoints of steps after `step`, oldest first."""
    root = checkpoint_root(run_dir)
    return [path for s, path in _complete(root) if s > step] if root.is_dir() else []


def incomplete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Directories of saves that were interrupted (the process died before the rename)."""
    root = checkpoint_root(run_dir)
    return sorted(p for p in root.glob(f"{TMP_PREFIX}{STEP_PREFIX}*") if p.is_dir()) if root.is_dir() else []


# ---------------------------------------------------------------------------------------------------
# Save and load (collective: every rank calls them)
# ---------------------------------------------------------------------------------------------------


class CheckpointError(UserError, ValueError):
    """A checkpoint that this run cannot resume from (not one, another world size or engine)."""


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: str | Path,
    step: int,
    info: DistInfo,
    engine: Engine,
    rank_state: dict,
    meta: dict,
    conventions: dict,
    tokenizer_dir: str | Path,
    keep_last: int,
    weights: bool = True,
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint directory. weights: also write
    WEIGHTS_FILE (gathered by engine.full_weights, a collective: every rank passes the same value)."""
    root = checkpoint_root(run_dir)
    final = root / step_name(step)
    tmp = root / f"{TMP_PREFIX}{final.name}"
    if info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    # A write that fails (a full disk, a quota, permissions) is caught on its rank and agreed on by all ranks
    # (dist_max) before anyone moves on: the partial directory is removed, the previous checkpoint is intact,
    # and every rank raises the same one-line error instead of a traceback from deep inside torch.save. A
    # sharded engine's save_shards raises its write failure only after its own collectives
    # (DeepSpeedEngine.save_shards says which writes that covers), so no rank is left waiting inside it.
    failure: BaseException | None = None
    try:
        save_state({"rng": rng_state(), **rank_state}, tmp / rank_file(info.rank))
    except (OSError, RuntimeError) as e:
        failure = e
    if engine.shard_format is not None:
        try:
            # collective: every rank writes its shard
            engine.save_shards(tmp / SHARD_DIRS[engine.shard_format])
        except (OSError, RuntimeError) as e:
            failure = failure or e
    else:
        state = engine.state_dict()  # on every rank: tensor parallelism gathers the whole tensors here
        if info.is_main and failure is None:
            try:
                save_state(state, tmp / ENGINE_FILE)  # replicated: rank 0's copy is everyone's
            except (OSError, RuntimeError) as e:
                failure = e
    # collective (ZeRO-3 gathers the partitions); {} off rank 0
    whole = engine.full_weights() if weights else {}
    if info.is_main and failure is None:
        try:
            if weights:
                tied = head_is_tied(meta)
                save_file({k: v for k, v in whole.items() if not (tied and k == TIED_KEY)},
                          tmp / WEIGHTS_FILE)
            (tmp / META_FILE).write_text(json.dumps({
                **meta, "step": step, "world_size": info.world_size, CHECKSUMS_KEY: integrity.HASH,
                PARALLEL_KEY: {"context": info.context_size, "tensor": info.tensor_size}}, indent=2))
            (tmp / CONVENTIONS_FILE).write_text(json.dumps(conventions, indent=2))
            shutil.copytree(tokenizer_dir, tmp / TOKENIZER_DIR)
        except (OSError, RuntimeError) as e:
            failure = e
    # Also the barrier before the rename. "No space" is agreed too: it is seen before rank 0 frees the disk,
    # so every rank's line names the full disk, the ranks whose own writes went through as well.
    status = _WRITTEN if failure is None else _NO_SPACE if _no_space(failure, root) else _FAILED
    agreed = dist_max(float(status), info.device)
    if agreed > 0:
        if info.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise _save_error(failure, root, step, no_space=agreed == _NO_SPACE)
    _record_checksums(tmp, info)  # collective; the last file written before the rename
    if info.is_main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _prune(root, keep_last)
    barrier()
    return final


def _record_checksums(directory: Path, info: DistInfo) -> None:
    """Collective: the sha256 of every file of `directory` (the ranks share the hashing), into its
    CHECKSUMS_FILE, written by rank 0 last."""
    names = integrity.files_of(directory, exclude={CHECKSUMS_FILE})
    try:
        share: dict | str = integrity.digests(directory, names[info.rank::info.world_size])
    except OSError as e:  # agreed below, so that no rank waits for this one
        share = f"cannot hash {e.filename or directory} for its {CHECKSUMS_FILE}: {e.strerror or e}"
    shares = _gathered(share)
    failures = [s for s in shares if isinstance(s, str)]
    if failures:
        if info.is_main:
            shutil.rmtree(directory, ignore_errors=True)
        raise CheckpointError(f"{failures[0]}; the partial directory was removed")
    recorded = {name: digest for share in shares for name, digest in share.items()}
    failure: OSError | None = None
    if info.is_main:
        try:
            record_checksums(directory, recorded)
        except OSError as e:
            failure = e
    # a full disk at the last file: every rank stops
    if dist_max(float(failure is not None), info.device) > 0:
        if info.is_main:
            shutil.rmtree(directory, ignore_errors=True)
        raise CheckpointError(f"cannot write {directory / CHECKSUMS_FILE}"
                              f"{f': {failure.strerror or failure}' if failure else ' (on rank 0)'}; "
                              "the partial directory was removed")


def record_checksums(directory: str | Path, recorded: dict[str, str] | None = None) -> None:
    """Write `directory`'s CHECKSUMS_FILE: `recorded` ({name: sha256}), or every file's, hashed here."""
    directory = Path(directory)
    if recorded is None:
        recorded = integrity.digests(directory, integrity.files_of(directory, exclude={CHECKSUMS_FILE}))
    manifest = {"algorithm": integrity.HASH, "files": dict(sorted(recorded.items()))}
    (directory / CHECKSUMS_FILE).write_text(json.dumps(manifest, indent=1))


def _gathered(obj) -> list:
    """Every rank's `obj`, in rank order (a list of one without a process group)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


_WRITTEN, _FAILED, _NO_SPACE = 0, 1, 2
"""A rank's outcome of a save, agreed over the ranks by their maximum."""


def _no_space(failure: BaseException, root: Path) -> bool:
    """Whether `failure` is a full disk (torch.save reports one as "unexpected pos ...", not as ENOSPC)."""
    return getattr(failure, "errno", None) == errno.ENOSPC or _nearly_full(root)


def _save_error(failure: BaseException | None, root: Path, step: int, no_space: bool) -> BaseException:
    """The one-line error for a checkpoint that could not be written (`no_space`: on some rank, a full disk),
    or `failure` itself if it is not about the file system (a bug keeps its traceback)."""
    done = _complete(root)
    last = f"step {done[-1][0]}" if done else "none"
    where = f"the checkpoint of step {step} ({root})"
    if no_space:
        return CheckpointError(f"no space left on {_mount_point(root)} while writing {where}; the partial "
                               f"directory was removed; the last complete checkpoint is {last}")
    if isinstance(failure, OSError):
        return CheckpointError(f"cannot write {where}: {failure.strerror or failure}; the last complete "
                               f"checkpoint is {last}")
    if failure is None:  # another rank failed
        return CheckpointError(f"another rank could not write {where}; the last complete checkpoint is "
                               f"{last}")
    return failure


def _nearly_full(path: Path, margin: int = 1 << 20) -> bool:
    try:
        return shutil.disk_usage(path).free < margin
    except OSError:
        return False


def _mount_point(path: Path) -> Path:
    """The mount point of the file system holding `path` (what `df` names)."""
    path = path.resolve()
    dev = path.stat().st_dev
    while path.parent != path and path.parent.stat().st_dev == dev:
        path = path.parent
    return path


def _prune(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, and the leftovers of interrupted saves. A checkpoint
    is renamed out of the `step_` namespace before it is deleted, so a kill mid-delete never leaves a partial
    `step_` directory behind."""
    steps = _complete(root)
    for _, path in steps[: max(0, len(steps) - max(1, keep_last))]:
        doomed = path.with_name(f"{TMP_PREFIX}deleting-{path.name}")
        os.replace(path, doomed)
        shutil.rmtree(doomed)
    for leftover in root.glob(f"{TMP_PREFIX}*"):
        shutil.rmtree(leftover, ignore_errors=True)


def verify_checkpoint(path: str | Path, info: DistInfo) -> bool:
    """Collective: refuse checkpoint `path` if an entry leads outside it (OutsideCheckpointError), or its
    CHECKSUMS_FILE does not list exactly its files, or a file is not what was recorded at save
    (DamagedCheckpointError, one line naming the file, alike on every rank); the ranks share the hashing.
    False for a checkpoint written before checksums existed (no CHECKSUMS_FILE, and its META_FILE does not say
    one was written): nothing to compare, loaded unverified; True once every file is verified.

    Example: 64 bytes overwritten in dcp/__0_0.distcp -> "<ckpt>/dcp/__0_0.distcp: checksum mismatch: the
    checkpoint is damaged; resume from an earlier one".
    """
    path = Path(path)
    integrity.check_confined(path)
    recorded = on_every_rank(lambda: _recorded_checksums(path))
    if recorded is None:
        return False
    names = sorted(recorded)
    share = {name: recorded[name] for name in names[info.rank::info.world_size]}

    def check_share() -> None:
        problem = integrity.damaged(path, share, f"its {CHECKSUMS_FILE}")
        if problem is not None:
            raise DamagedCheckpointError(problem)

    on_every_rank(check_share)
    return True


def on_every_rank(read):
    """Collective: `read()` on this rank, its refusal agreed over the ranks. If it raised a UserError (or was
    stopped by a preemption signal: ReadInterrupted) on any rank, every rank raises the first such error (its
    type and message, lowest rank first), so that no rank goes on alone into a collective that the refusing
    one never reaches (gloo's "Connection closed by peer" traceback). Returns what `read` returned."""
    failure, result = None, None
    try:
        result = read()
    except (UserError, ReadInterrupted) as e:
        failure = (type(e), str(e))
    failures = [f for f in _gathered(failure) if f is not None]
    if failures:
        kind, message = failures[0]
        raise kind(message)
    return result


def verify_file(path: str | Path, name: str) -> Path:
    """`path / name`, one file of checkpoint `path`, checked as `verify_checkpoint` checks them all (inside
    the checkpoint; listed with the sha256 recorded, and the list covering the checkpoint, unless it was
    written before checksums): for the readers of one file (the weights readers, trainer.checkpoint.weights).
    Not collective."""
    path = Path(path)
    file = integrity.inside(path, name, "its entry")
    recorded = _recorded_checksums(path)
    if recorded is not None and name in recorded and (
            problem := integrity.damaged(path, {name: recorded[name]}, f"its {CHECKSUMS_FILE}")):
        raise DamagedCheckpointError(problem)
    return file


def _recorded_checksums(path: Path) -> dict[str, str] | None:
    """{name: sha256} from checkpoint `path`'s CHECKSUMS_FILE, which must list every file of the checkpoint
    and nothing else (a name missing from disk is left to `integrity.damaged`, which says "is missing"); None
    for a checkpoint written before checksums. A missing, malformed, empty or incomplete list:
    DamagedCheckpointError.

    Example: {"files": {}} beside engine.pt -> "<ckpt>/checksums.json lists no files: ..."; an entry removed
    -> "<ckpt>/engine.pt is not listed in its checksums.json (every file of a checkpoint is): ..."."""
    file = path / CHECKSUMS_FILE
    if not file.exists():
        if _meta_records_checksums(path):
            raise DamagedCheckpointError(f"{file} is missing (its {META_FILE} says it was written): "
                                         f"{integrity.DAMAGED}")
        return None
    try:
        manifest = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise DamagedCheckpointError(f"{file} is not valid JSON ({e}): {integrity.DAMAGED}") from e
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("algorithm") != integrity.HASH or not all(
            isinstance(v, str) for v in files.values()):
        raise DamagedCheckpointError(f"{file} is not a {integrity.HASH} manifest of the checkpoint's files: "
                                     f"{integrity.DAMAGED}")
    if not files:
        raise DamagedCheckpointError(f"{file} lists no files: {integrity.DAMAGED}")
    for name in files:  # a name leading outside is refused as such, before the listing is compared
        integrity.inside(path, name, f"its {CHECKSUMS_FILE} names")
    unlisted = [n for n in integrity.files_of(path, exclude={CHECKSUMS_FILE}) if n not in files]
    if unlisted:
        raise DamagedCheckpointError(f"{path / unlisted[0]} is not listed in its {CHECKSUMS_FILE} (every "
                                     f"file of a checkpoint is){_more(unlisted)}: {integrity.DAMAGED}")
    return files


def _more(names: list[str]) -> str:
    return f" ({len(names) - 1} more files are not)" if len(names) > 1 else ""


def _meta_records_checksums(path: Path) -> bool:
    """Whether checkpoint `path`'s META_FILE says a CHECKSUMS_FILE was written (False if it cannot tell)."""
    try:
        meta = json.loads((path / META_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return False
    return isinstance(meta, dict) and CHECKSUMS_KEY in meta


def read_meta(path: str | Path) -> dict:
    """The META_FILE of checkpoint `path`: a JSON object with an integer step and world_size, or a
    CheckpointError.

    Example: a meta.json cut short by a full disk -> "ckpt/meta.json is not valid JSON (...): the checkpoint
    is damaged; resume from an earlier one".
    """
    meta_file = Path(path) / META_FILE
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a packtrain checkpoint (no {META_FILE}): give train.resume a "
                              f"{PATH_HINT} directory, or true for the run dir's latest")
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{meta_file} is not valid JSON ({e}): the checkpoint is damaged; resume from "
                              "an earlier one") from e
    if not isinstance(meta, dict) or not all(isinstance(meta.get(k), int) for k in ("step", "world_size")):
        raise CheckpointError(f"{meta_file} is not a packtrain checkpoint's meta (a JSON object with an "
                              "integer step and world_size): the checkpoint is damaged; resume from an "
                              "earlier one")
    try:
        parallel_sizes(meta)
    except ValueError as e:
        raise CheckpointError(f"{meta_file}: {e}: the checkpoint is damaged; resume from an earlier "
                              "one") from None
    return meta


def load_checkpoint(path: str | Path, info: DistInfo, engine: Engine,
                    verified: bool = False) -> tuple[dict, dict[int, dict]]:
    """Collective: check the checkpoint (`verify_checkpoint`, unless already `verified`), restore the engine
    and this rank's RNG; returns (meta, rank states): {rank: its RANK_FILE's state, with
    'data' etc.}, this rank's alone when the checkpoint was written by this many ranks, else every written
    rank's (a data stream resumed on another shape is dealt from all of them, trainer.data.reshape). The RNG
    states are this rank's, or on another number of ranks old rank `rank % W`'s."""
    path = Path(path)
    if not verified:
        verify_checkpoint(path, info)
    meta = read_meta(path)
    load_engine(path, info, engine, meta)
    written = meta["world_size"]
    states = on_every_rank(lambda: load_rank_states(path, [info.rank] if written == info.world_size
                                                    else range(written)))
    set_rng_state(states[info.rank % written]["rng"])
    for state in states.values():
        state.pop("rng")
    return meta, states


def load_rank_states(path: str | Path, ranks) -> dict[int, dict]:
    """{rank: the state in its RANK_FILE} for each of `ranks` (weights_only=True, as every .pt). A preemption
    signal stops it between files (ReadInterrupted: trainer.data.workers.interrupt_reads), as it stops a shard
    read: a resume on another shape reads every old rank's file, thousands of them after a large run."""
    out = {}
    for rank in ranks:
        check_interrupt()
        file = Path(path) / rank_file(rank)
        if not file.is_file():
            raise CheckpointError(f"{file} is missing: the checkpoint is damaged (it was written by "
                                  f"{read_meta(path)['world_size']} ranks); resume from an earlier one")
        out[rank] = load_state(file)
    return out


def load_engine(path: str | Path, info: DistInfo, engine: Engine, meta: dict | None = None) -> None:
    """Collective: the model, optimizer and LR schedule of checkpoint `path` into `engine`, on any number of
    ranks.

    A replicated engine reads ENGINE_FILE whatever the world size (no part of it depends on the ranks: DDP's
    gradient averaging factor is the running world size, not saved). A sharded engine reads its shards as
    written on the same number of ranks, or on any number if it reshards as it loads (FSDP2's DCP); else,
    written on another number, rank 0 converts them first (`_load_resharded`, DeepSpeed).
    `meta`: the checkpoint's META_FILE, if already read.
    """
    path = Path(path)
    meta = read_meta(path) if meta is None else meta
    if meta.get("engine", engine.name) != engine.name:
        raise CheckpointError(f"{path} was written by engine {meta['engine']!r} and this run uses "
                              f"{engine.name!r}; resume with the same distributed= config")
    if engine.shard_format is None:
        # Where the whole model exists on no rank (tensor parallelism: each keeps a slice of every whole
        # tensor), the file is mapped on the CPU, so a rank reads only its slices' pages (shared with the
        # other ranks), and copies only them to its device.
        split = engine.gathers_weights
        engine.load_state_dict(load_state(path / ENGINE_FILE, map_location="cpu" if split else info.device,
                                          mmap=split))
    elif not engine.converts_from(meta["world_size"]):
        shards = path / SHARD_DIRS[engine.shard_format]
        if not shards.is_dir():
            raise CheckpointError(f"{shards} is missing: the checkpoint is damaged; resume from an "
                                  "earlier one")
        if engine.shard_format == "deepspeed":
            check_deepspeed_files(shards)  # DeepSpeed itself unpickles with weights_only=False
        engine.load_shards(shards)  # collective
    else:
        _load_resharded(path, info, engine)
    check_finite(path, engine)


class NonFiniteCheckpointError(CheckpointError):
    """A checkpoint whose weights or optimizer state hold NaN or infinity (damaged before its checksums were
    taken)."""


def check_finite(path: Path, engine: Engine) -> None:
    """Collective: refuse checkpoint `path`, just loaded into `engine`, if any rank's weights or optimizer
    state hold a NaN or an infinity, in one line on every rank naming the file and the tensor (before: NaN in
    an `exp_avg` resumed, trained every weight to NaN a step later, and was saved again with valid
    checksums)."""
    source = path / (ENGINE_FILE if engine.shard_format is None else SHARD_DIRS[engine.shard_format])

    def check() -> None:
        bad = tensors.first_nonfinite(engine.local_state())
        if bad is not None:
            raise NonFiniteCheckpointError(f"{source}: {bad[0]} holds {bad[1]} values: the checkpoint is "
                                           "damaged; resume from an earlier one")

    on_every_rank(check)


def _load_resharded(path: Path, info: DistInfo, engine: Engine) -> None:
    """Collective: rank 0 converts the shards of `path` into RESHARDED_PREFIX + its name beside it (its inputs
    and outputs checked with weights_only=True, as DeepSpeed unpickles both without), every rank loads the
    copy, rank 0 removes it. A conversion that fails is agreed on, so that no rank waits for rank 0."""
    shards = path / DEEPSPEED_DIR
    scratch = path.with_name(f"{RESHARDED_PREFIX}{path.name}")
    failure: BaseException | None = None
    if info.is_main:
        try:
            shutil.rmtree(scratch, ignore_errors=True)  # a copy left by a kill
            check_deepspeed_files(shards)
            engine.convert_shards(shards, scratch / DEEPSPEED_DIR)
        except Exception as e:  # whatever it is, raised below (on rank 0 as itself) once every rank knows
            failure = e
    if dist_max(float(failure is not None), info.device) > 0:
        if failure is not None:
            shutil.rmtree(scratch, ignore_errors=True)
            raise failure
        raise CheckpointError(f"rank 0 could not convert {shards} for {info.world_size} ranks; see its error")
    check_deepspeed_files(scratch / DEEPSPEED_DIR)  # every rank, before its DeepSpeed reads the copy
    engine.load_shards(scratch / DEEPSPEED_DIR, converted=True)  # collective
    barrier()
    if info.is_main:
        shutil.rmtree(scratch, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------
# DeepSpeed's own files, checked before DeepSpeed opens them
# ---------------------------------------------------------------------------------------------------

DEEPSPEED_SAFE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
"""The only non-plain types in DeepSpeed's ZeRO-1/2/3 checkpoints (found by loading them with
weights_only=True)."""


def check_deepspeed_files(directory: Path) -> None:
    """Load every file of a DeepSpeed checkpoint (or of its converted copy) with `weights_only=True`, in every
    sub-directory, allowing DEEPSPEED_SAFE_GLOBALS only.

    DeepSpeed's `load_checkpoint` calls `torch.load(weights_only=False)` and has no switch for it, so this
    check runs first: a file carrying anything else (a pickle that would run code) is refused before DeepSpeed
    opens it. What remains: the file could change between this check and DeepSpeed's read.
    """
    allowed = []
    for name in DEEPSPEED_SAFE_GLOBALS:
        module, _, attr = name.rpartition(".")
        allowed.append(getattr(importlib.import_module(module), attr))
    with torch.serialization.safe_globals(allowed):
        for path in sorted(directory.rglob("*.pt")):  # a converted copy keeps a file per parameter in zero/
            load_state(path, map_location="cpu")
