"""The run's side of checkpoints: when it saves, which checkpoint it resumes from, and what goes in.

What a checkpoint directory holds, and how it is written and read, is the checkpoint store's
(trainer.checkpoint.store); this component decides only the cadence (`due`, `weights_due`) and the run's
choices (train.resume, train.keep_last, train.save_weights, train.init_from: `init_from`).
"""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint import hf, integrity, store
from trainer.checkpoint.weights import init_from_checkpoint
from trainer.config import RunConfig
from trainer.data.feed import DataSource
from trainer.distributed.engine import Engine
from trainer.distributed.groups import DistInfo
from trainer.errors import ConfigError

RESUME_KEYS = ("seed", "train.seq_len", "data.shuffle_buffer", "data.loss_on", "model.vocab_size",
               "model.n_layer", "model.n_head", "model.n_embd", "model.max_seq_len", "model.bias",
               "model.pos_emb", "model.norm", "model.mlp", "model.mlp_hidden", "model.n_kv_head",
               "model.qkv_bias", "model.tie_embeddings")
"""Config keys a resumed run must share with its checkpoint: the model's shapes (the weights and the optimizer
state must fit) and what each rank's data stream position is made of (seed and shuffle buffer order it,
seq_len cuts it into rows, data.loss_on chose the targets: a resume that changed it went on training the old
targets, step for step, while config.json said the new ones). The shape is not among them: the model and
optimizer load on any number of ranks (trainer.checkpoint.store.load_engine), and the data stream is dealt
over other ranks and DataLoader workers (trainer.data.reshape)."""


def check_resumable(path: Path, config: dict) -> None:
    """A CheckpointError, naming each key, if checkpoint `path` was written with other RESUME_KEYS values than
    `config` (the resolved run config); also for a damaged meta.json. Run before the model and data are built.

    Example: a checkpoint of model=tiny resumed with model=small -> "cannot resume from ...: it was written
    with model.n_layer=2, model.n_head=4, ... and this run has model.n_layer=6, ...".
    """
    saved = store.read_meta(path).get("config")
    if not isinstance(saved, dict):
        return  # an older checkpoint without its config: the load itself checks what it can
    differ = [(key, a, b) for key in RESUME_KEYS
              if (a := _dotted(saved, key)) is not _ABSENT and a != (b := _dotted(config, key))]
    if differ:
        then = ", ".join(f"{key}={a}" for key, a, _ in differ)
        now = ", ".join(f"{key}={'(unset)' if b is _ABSENT else b}" for key, _, b in differ)
        raise store.CheckpointError(
            f"cannot resume from {path}: it was written with {then} and this run has {now}; resume with the "
            "checkpoint's values (the weights and each rank's data position depend on them), or start a new "
            "run (another hydra.run.dir, or train.init_from for its weights only)")


_ABSENT = object()


def _dotted(config: dict, key: str):
    for part in key.split("."):
        if not isinstance(config, dict) or part not in config:
            return _ABSENT
        config = config[part]
    return config


class Checkpointer:
    """Saves every `every` steps and after the last one; keeps the newest `keep_last`."""

    def __init__(self, run_dir: Path, info: DistInfo, every: int, keep_last: int, max_steps: int,
                 save_weights: str = "end") -> None:
        self.run_dir = run_dir
        self.info = info
        self.every = every
        self.keep_last = keep_last
        self.max_steps = max_steps
        self.save_weights = save_weights
        self.last: Path | None = None
        """The newest checkpoint this run wrote."""

    def due(self, step: int) -> bool:
        """Whether optimizer step `step` ends with a save. Example: every=50, max_steps=120 ->
        50, 100, 120."""
        return bool(self.every and step % self.every == 0) or step == self.max_steps

    def weights_due(self, step: int, engine: Engine) -> bool:
        """Whether step `step`'s save writes model.safetensors: always, except where the whole model exists on
        no rank (FSDP2, tensor parallelism: `engine.gathers_weights`) and gathering it costs each save seconds
        (its weights are in dcp/ or engine.pt): there at the run's last step, or at every save with
        train.save_weights=every."""
        return not engine.gathers_weights or self.save_weights == "every" or step >= self.max_steps

    def resume_path(self, resume: bool | str) -> Path | None:
        """Collective: the checkpoint train.resume names, verified (store.verify_checkpoint), or None: a fresh
        start. true: the run dir's newest intact checkpoint, each newer damaged one skipped with a line saying
        why; a path: that checkpoint, a damaged one refused."""
        if resume is False or resume in ("false", "False"):
            return None
        if self.info.is_main:
            for partial in store.incomplete_checkpoints(self.run_dir):
                print(f"resume: ignoring incomplete checkpoint {partial} "
                      "(its save was interrupted; never loaded)")
        if resume in (True, "true", "True"):
            path = self._newest_intact()
        else:
            path = Path(resume)
            self._verify(path)
        if path is None and self.info.is_main:
            print(f"resume: no checkpoint in {store.checkpoint_root(self.run_dir)}; starting from step 0")
        return path

    def _newest_intact(self) -> Path | None:
        """The run dir's newest checkpoint that verifies; a CheckpointError if it has some and none does."""
        candidates = store.checkpoints_after(self.run_dir, -1)[::-1]
        for path in candidates:
            try:
                self._verify(path)
                return path
            except (integrity.DamagedCheckpointError, integrity.OutsideCheckpointError) as e:
                if self.info.is_main:
                    print(f"resume: skipping {path}: {e}", flush=True)
        if candidates:
            raise store.CheckpointError(
                f"no intact checkpoint in {store.checkpoint_root(self.run_dir)}: all {len(candidates)} are "
                "damaged (the lines above say how); start a new run (another hydra.run.dir), or "
                "train.init_from for the weights of one you trust")
        return None

    def _verify(self, path: Path) -> None:
        """Collective: checkpoint `path` checked before anything of it is read; says so if it has no
        checksums."""
        if (not store.verify_checkpoint(path, self.info) and self.info.is_main
                and (path / store.META_FILE).is_file()):
            print(f"resume: {path} has no {store.CHECKSUMS_FILE} (written before packtrain recorded "
                  "checksums): its files are loaded unverified", flush=True)
        self._verified = path

    _verified: Path | None = None
    """The checkpoint `resume_path` verified (its load does not hash it again)."""

    def save(self, step: int, engine: Engine, rank_state: dict, meta: dict, conventions: dict,
             tokenizer_dir: Path, weights: bool = True) -> Path:
        """Collective: every rank writes its part of step `step`'s checkpoint (with model.safetensors:
        `weights`)."""
        self.last = store.save_checkpoint(self.run_dir, step, self.info, engine, rank_state=rank_state,
                                          meta=meta, conventions=conventions, tokenizer_dir=tokenizer_dir,
                                          keep_last=self.keep_last, weights=weights)
        return self.last

    def load(self, path: Path, engine: Engine) -> tuple[store.Record, dict[int, dict]]:
        """Collective: the engine restored from `path`; returns (its record, {rank: state}: this rank's, or on
        another number of ranks every written rank's; store.load_checkpoint)."""
        meta, states = store.load_checkpoint(path, self.info, engine, verified=path == self._verified)
        return store.Record.of(meta), states


def check_init_vocabulary(cfg: RunConfig, data: DataSource) -> None:
    """A Hugging Face train.init_from whose config.json's vocabulary cannot hold the data's tokenizer: the
    data was prepared with another tokenizer (model.vocab_size comes from that config.json: setting it is
    refused)."""
    source, rows = cfg.train.init_from, cfg.model.vocab_size
    if not source or rows is None or rows >= data.vocab_size or not hf.is_hf_dir(source) or (
            Path(source) / store.META_FILE).is_file():
        return
    raise ConfigError(f"train.init_from={source}: its {hf.CONFIG_FILE} says vocab_size {rows}, fewer than "
                      f"the {data.vocab_size} ids of the data's tokenizer ({data.tokenizer_dir}): the data "
                      "was prepared with another tokenizer; prepare it with the model's "
                      f"(python -m trainer.prepare ... --tokenizer {source})")


def init_from(model, cfg: RunConfig, data: DataSource, info: DistInfo) -> dict | None:
    """train.init_from: the checkpoint's weights into the freshly built model (before any wrapping, so ZeRO-3
    partitions the loaded weights); optimizer, schedule, step and data start fresh. A requeued run that finds
    its own checkpoint resumes from that instead (train.resume), never from init_from again. Returns the
    record conventions.json keeps of where the weights came from (None without init_from)."""
    source, add = cfg.train.init_from, cfg.tokenizer.add_tokens
    if not source:  # tokenizer.add_tokens without init_from is refused with the config (cross_section_rules)
        return None
    record = init_from_checkpoint(model, source, data.tokenizer_dir, data.tokenizer_hash, list(add))
    if info.is_main:
        grown = f"; tokenizer extended by {add} (new rows = mean of the old)" if add else ""
        origin = record.get("architecture") or f"its step {record['step']}"
        print(f"init_from: weights of {source} ({origin}){grown}; "
              "optimizer, schedule, step and data start fresh")
    return record
