"""Typed configuration: the composed Hydra config is converted here, once, into dataclasses.

Each component receives only its own section (`TrainConfig`, `DataConfig`, `PackingConfig`, ...);
nothing below the entry point sees the raw Hydra object.

Each section checks its own values (`__post_init__`); the rules that span sections (ZeRO-3 and compile,
on_nonfinite=skip and the engine, tokenizer.add_tokens and init_from) are checked once, in
`cross_section_rules`, when `from_container` builds the RunConfig, before any data or model is touched; and
`resolve_dtype` is the one place `train.dtype=auto` becomes the dtype a run computes in.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from trainer.data.config import DataConfig, PackingConfig
from trainer.distributed.config import (
    ALLGATHER_KERNELS,
    DistributedConfig,
    launched_world_size,
)
from trainer.distributed.context import split_chunks
from trainer.distributed.dims import dims_problem
from trainer.distributed.tensor import tensor_parallel_problems
from trainer.errors import ConfigError, require_range
from trainer.model import AttentionConfig, GPTConfig
from trainer.model.families import family_of
from trainer.model.gpt import ACTIVATION_CHECKPOINTING

DTYPES = ("auto", "fp32", "bf16")


@dataclass
class TrainConfig:
    seq_len: int = 512
    """Row length T; no document chunk is longer."""
    tokens_per_step: int = 16384
    """Positions per optimizer step over all ranks; the logical batch is tokens_per_step // seq_len rows."""
    micro_batch_tokens: int = 4096
    """Positions (padding included) per micro-batch on one rank."""
    max_steps: int = 100
    """Optimizer steps to run in total (a resumed run continues the count)."""
    grad_clip: float = 1.0
    """Max global gradient norm; 0 disables clipping."""
    dtype: str = "auto"
    """'auto' (bf16 autocast on a CUDA device that supports it, else fp32: CPU runs stay fp32), 'fp32' or
    'bf16' autocast. The dtype a run used is in its summary.json and checkpoints' conventions.json."""
    compile: bool = False
    """torch.compile each transformer block (trainer/model/compile.py); the attention kernel stays outside the
    graphs, so per-batch document boundaries never recompile. Recompilations are counted in metrics and
    summary.json."""
    checkpoint_every: int = 50
    """Save every N steps and at the end; 0 = only at the end."""
    keep_last: int = 2
    """Checkpoints kept in <run dir>/checkpoints."""
    save_weights: str = "end"
    """When a checkpoint holds model.safetensors under FSDP2 and tensor parallelism, which gather the whole
    model to write it: 'end' (the run's last checkpoint; the others hold the weights in their shards or
    engine.pt, which export, evaluate and init_from read) or 'every'. DDP and DeepSpeed checkpoints always
    hold it."""
    resume: bool | str = False
    """False, True (latest checkpoint in the run dir) or a checkpoint path."""
    overwrite: bool = False
    """A fresh run (resume false), or a resume of another run's checkpoint, in a run dir that holds a run:
    move that run's files into `<run dir>/replaced-<UTC time>/` first. False: such a start is refused
    (trainer/run/run_dir.py). With train.resume=true, or a checkpoint of the run dir's own: refused."""
    init_from: str | None = None
    """A checkpoint directory whose weights start this run (fine-tuning): weights only; the optimizer, LR
    schedule, step count and data stream start fresh. Its tokenizer must be the data's (see
    TokenizerConfig)."""
    warmup_marked_steps: int = 2
    """The first N steps are flagged warmup=true in metrics."""
    eval_every: int = 50
    """Evaluate the held-out split every N steps and at the end; 0 disables evaluation."""
    eval_docs: int | None = None
    """Evaluate only the first N held-out documents (None = all of them); with data.sources, N of each
    source."""
    eval_layout: str = "packed"
    """Layout of the eval batches: 'packed' (isolated documents, fast) or 'unpacked'; the same val_loss either
    way."""
    eval_tasks: list[str] = field(default_factory=list)
    """Downstream tasks scored in the loop (trainer.tasks): task files (.jsonl) or built-ins made from the
    held-out split (continuation4, cloze); their acc, acc_norm and bits per byte go into metrics.jsonl and W&B
    as `tasks`."""
    eval_tasks_every: int | None = None
    """Score train.eval_tasks every N steps and at the end; None: at the held-out eval's cadence
    (train.eval_every), 0: at the end only."""
    eval_tasks_layout: str = "tree"
    """How train.eval_tasks are scored (trainer.tasks.scoring.LAYOUTS): tree (an item's query once, its
    choices as branches), packed or unpacked; the same scores in every layout."""
    on_nonfinite: str = "stop"
    """A step whose loss or gradient norm is NaN/inf: 'stop' (exit with the step number, nothing applied, no
    checkpoint of it) or 'skip' (no update on any rank; optimizer and schedule untouched; counted)."""
    activation_checkpointing: str = "none"
    """Recompute activations in backward instead of storing them: 'none', 'full' (every transformer block) or
    'selective' (each block's MLP sub-block; attention's activations are kept). Same gradients, less memory,
    more compute (see trainer.model.gpt.apply_activation_checkpointing)."""

    def __post_init__(self) -> None:
        for key in ("resume", "init_from"):  # a path Hydra read as a number (train.resume=123)
            if isinstance(getattr(self, key), (int, float)) and not isinstance(getattr(self, key), bool):
                setattr(self, key, str(getattr(self, key)))
        if self.overwrite and self.resume in (True, "true", "True"):
            raise ValueError("train.overwrite=true replaces the run dir's run and train.resume=true "
                             "continues it: set only one of them (launch/slurm.sbatch adds train.resume=true "
                             "to every start; a new run there needs another hydra.run.dir)")
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ValueError(f"train.activation_checkpointing must be one of {ACTIVATION_CHECKPOINTING}, "
                             f"got {self.activation_checkpointing!r}")
        if self.on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"train.on_nonfinite must be 'stop' or 'skip', got {self.on_nonfinite!r}")
        if self.eval_layout not in ("packed", "unpacked"):
            raise ValueError(f"train.eval_layout must be 'packed' or 'unpacked', got {self.eval_layout!r}")
        if not isinstance(self.eval_tasks, list) or not all(isinstance(t, str) and t
                                                            for t in self.eval_tasks):
            raise ValueError("train.eval_tasks must be a list of task files or built-in names, "
                             f"got {self.eval_tasks!r}")
        if self.eval_tasks_layout not in ("tree", "packed", "unpacked"):
            raise ValueError("train.eval_tasks_layout must be tree, packed or unpacked, "
                             f"got {self.eval_tasks_layout!r}")
        if self.eval_tasks_every is not None and self.eval_tasks_every < 0:
            raise ValueError(f"train.eval_tasks_every must be null or >= 0, got {self.eval_tasks_every}")
        if self.eval_every < 0 or (self.eval_docs is not None and self.eval_docs < 1):
            raise ValueError(f"train.eval_every must be >= 0 and train.eval_docs null or >= 1, "
                             f"got {self.eval_every} and {self.eval_docs}")
        if self.dtype not in DTYPES:
            raise ValueError(f"train.dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.seq_len < 2:
            raise ValueError(f"train.seq_len must be >= 2, got {self.seq_len}: a row needs two positions for "
                             "one next-token target, so nothing could train (try train.seq_len=512)")
        rows, left = divmod(self.tokens_per_step, self.seq_len)
        if rows < 1 or left:
            nearest = (" or ".join(f"{n * self.seq_len} ({n} row{'s' * (n > 1)})"
                                   for n in (rows, rows + 1) if n >= 1)
                       or f"{self.seq_len} (1 row)")
            raise ValueError(
                f"train.tokens_per_step ({self.tokens_per_step}) must be a positive multiple of "
                f"train.seq_len ({self.seq_len}), since a step is a whole number of rows: use "
                f"train.tokens_per_step={nearest}"
            )
        if self.micro_batch_tokens < self.seq_len:
            raise ValueError(
                f"train.micro_batch_tokens ({self.micro_batch_tokens}) must hold one row of train.seq_len "
                f"({self.seq_len})"
            )
        for key, low in (("max_steps", 1), ("checkpoint_every", 0), ("keep_last", 1),
                         ("warmup_marked_steps", 0), ("grad_clip", 0)):
            require_range(f"train.{key}", getattr(self, key), low)
        if self.save_weights not in ("end", "every"):
            raise ValueError(f"train.save_weights must be 'end' or 'every', got {self.save_weights!r}")
        for key in ("resume", "init_from"):
            if getattr(self, key) == "":
                raise ValueError(f"train.{key} must be a checkpoint path, not an empty string")

    @property
    def rows_per_step(self) -> int:
        return self.tokens_per_step // self.seq_len


@dataclass
class OptimConfig:
    target: str = "torch.optim.AdamW"
    """Optimizer class (Hydra's `_target_`)."""
    lr: float = 3e-3
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    """Decoupled weight decay on weight matrices only."""
    warmup_steps: int = 10
    """Linear warm-up steps."""
    min_lr_ratio: float = 0.1
    """Cosine decays to lr * min_lr_ratio at train.max_steps."""
    fused: bool | str = "auto"
    """Fused optimizer kernel (`fused=True`, one kernel for all parameters): 'auto' = on CUDA when the
    optimizer class has one, else the default implementation; true = wherever torch has one (CPU included),
    else an error; false = never."""

    def __post_init__(self) -> None:
        if self.fused not in (True, False, "auto"):
            raise ValueError(f"optim.fused must be auto, true or false, got {self.fused!r}")
        require_range("optim.lr", self.lr, 0)  # 0: weights stay (a check of train.init_from)
        require_range("optim.eps", self.eps, 0, low_open=True)
        require_range("optim.weight_decay", self.weight_decay, 0)
        require_range("optim.warmup_steps", self.warmup_steps, 0)
        require_range("optim.min_lr_ratio", self.min_lr_ratio, 0, 1)
        betas = self.betas
        if not (isinstance(betas, (list, tuple)) and len(betas) == 2):
            raise ValueError(f"optim.betas must be two numbers in [0, 1), e.g. [0.9, 0.95], got {betas!r}")
        for i, beta in enumerate(betas):
            require_range(f"optim.betas[{i}]", beta, 0, 1, high_open=True)
        module, _, name = str(self.target).rpartition(".")
        try:
            found = getattr(importlib.import_module(module), name, None) if module else None
        except ImportError:
            found = None
        if not isinstance(found, type):
            raise ValueError(f"optim._target_ must name an optimizer class such as torch.optim.AdamW, "
                             f"got {self.target!r} (no such class)")


NORMALIZATIONS = ("global_tokens", "document_mean", "micro_batch_mean", "row_mean")


@dataclass
class LossConfig:
    normalization: str = "global_tokens"
    """How token losses become the step's objective (see trainer.run.step.loss_weights):
    'global_tokens' sum / valid targets of the whole step (all micro-batches, all ranks);
    'document_mean' each document's mean, averaged over the step's documents;
    'micro_batch_mean' each micro-batch's mean, averaged over micro-batches and ranks (layout-dependent);
    'row_mean' each row's mean, averaged over rows (layout-dependent)."""
    chunk_tokens: int | None = 0
    """0 or None: the plain loss (the whole (positions, vocab) fp32 logits of a micro-batch at once). N > 0:
    the output head and the loss run N flat positions at a time, their gradients made in the same pass, so the
    logits never exist whole (peak ~N x vocab instead of micro_batch_tokens x vocab); same loss and
    gradients."""

    def __post_init__(self) -> None:
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"loss.normalization must be one of {NORMALIZATIONS}, got "
                             f"{self.normalization!r}")
        if self.chunk_tokens is not None and self.chunk_tokens < 0:
            raise ValueError("loss.chunk_tokens must be >= 0 (0 or null: no chunking), got "
                             f"{self.chunk_tokens}")


WANDB_MODES = ("offline", "online", "disabled")


@dataclass
class WandbConfig:
    mode: str = "offline"
    """'offline' (local run files), 'online' or 'disabled'."""
    project: str = "packtrain"
    entity: str | None = None
    group: str | None = None
    tags: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.mode not in WANDB_MODES:
            raise ValueError(f"logging.wandb.mode must be one of {WANDB_MODES}, got {self.mode!r}")
        if not isinstance(self.tags, list) or not all(isinstance(t, str) and t for t in self.tags):
            raise ValueError(f"logging.wandb.tags must be a list of non-empty strings, got {self.tags!r}")
        for key in ("project", "entity", "group"):
            if getattr(self, key) == "":
                raise ValueError(f"logging.wandb.{key} must not be an empty string (null: W&B's default)")


@dataclass
class LoggingConfig:
    log_every: int = 1
    """Write metrics every N optimizer steps."""
    progress: bool = True
    """tqdm progress bar on rank 0."""
    record_doc_keys: bool = False
    """Each rank appends the keys of the documents it trained on to <run dir>/doc_keys/rank_NNNNN.jsonl
    (one line per step): an audit of what was consumed, e.g. exactly once per epoch across a resume."""
    length_buckets: list[int] = field(default_factory=lambda: [64, 256, 1024])
    """Edges of the document-length buckets whose token loss is logged per step and per eval
    (`token_loss_by_length`: <=64, <=256, <=1024, >1024 tokens by default; a chunk of a split document counts
    by its own length). Empty: not logged."""
    position_buckets: list[int] = field(default_factory=list)
    """Edges of the buckets of a target's position in its document whose token loss is logged per step and per
    eval (`token_loss_by_position`: with [64, 256, 1024] the targets at positions 1..64, 65..256, ... of their
    document; a chunk of a split document counts from its own start, as attention sees it): where
    cross-document attention or continuous positions show. Empty (the default until its cost is measured on a
    quiet machine; the isolation and positions ablations set it): not logged."""
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def __post_init__(self) -> None:
        require_range("logging.log_every", self.log_every, 1)
        for key in ("length_buckets", "position_buckets"):
            edges = getattr(self, key)
            if (not isinstance(edges, list) or not all(_fits(e, int) and e >= 1 for e in edges)
                    or edges != sorted(set(edges))):
                raise ValueError(f"logging.{key} must be increasing positive integers, e.g. [64, 256, 1024], "
                                 f"got {edges!r}")


@dataclass
class TokenizerConfig:
    add_tokens: list[str] = field(default_factory=list)
    """Special tokens appended to the tokenizer of `train.init_from`'s checkpoint (existing ids unchanged);
    the data must have been prepared with the same extension (`trainer.prepare --add-tokens`). The embedding
    and the tied head grow by one row per token, initialized to the mean of the existing rows."""

    def __post_init__(self) -> None:
        if not isinstance(self.add_tokens, list) or not all(isinstance(t, str) and t
                                                            for t in self.add_tokens):
            raise ValueError("tokenizer.add_tokens must be a list of non-empty strings, got "
                             f"{self.add_tokens!r}")
        if len(set(self.add_tokens)) != len(self.add_tokens):
            raise ValueError(f"tokenizer.add_tokens lists a token twice: {self.add_tokens}")


@dataclass
class RunConfig:
    """The whole run: what `python -m trainer.train` composes."""

    seed: int
    train: TrainConfig
    data: DataConfig
    packing: PackingConfig
    model: GPTConfig
    attention: AttentionConfig
    loss: LossConfig
    optim: OptimConfig
    distributed: DistributedConfig
    logging: LoggingConfig
    run_dir: str
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    resolved: dict[str, Any] = field(default_factory=dict)
    """The resolved config as plain containers (for W&B and the checkpoint)."""


def cross_section_rules(cfg: RunConfig) -> list[str]:
    """What is wrong with a combination of sections, one message each (an empty list: nothing).

    Example: train.compile=true with distributed.zero_stage=3
    -> ["train.compile=true does not run under ZeRO-3 ..."].
    """
    problems = []
    deepspeed = cfg.distributed.engine == "deepspeed"
    if cfg.train.compile and deepspeed and cfg.distributed.zero_stage == 3:
        problems.append("train.compile=true does not run under ZeRO-3 (its per-module hooks gather the "
                        "weights inside the compiled blocks): use distributed=deepspeed_zero2, or "
                        "train.compile=false")
    if cfg.train.on_nonfinite == "skip" and deepspeed:
        problems.append("train.on_nonfinite=skip needs distributed.engine=ddp (DeepSpeed clips and applies "
                        "the update in one call, so a non-finite step cannot be dropped); use "
                        "train.on_nonfinite=stop")
    on_cpu = cfg.distributed.device == "cpu" or (cfg.distributed.device == "auto"
                                                 and not torch.cuda.is_available())
    if cfg.distributed.engine == "fsdp2" and cfg.distributed.offload and on_cpu:
        problems.append("distributed.offload=true keeps FSDP2's shards on the CPU between uses, and this "
                        "run's device is the CPU already: drop it (or run on CUDA)")
    if cfg.train.eval_tasks and cfg.train.eval_tasks_layout == "tree" and cfg.attention.backend in (
            "flash", "torch_varlen"):
        problems.append("train.eval_tasks_layout=tree scores each item as a tree (its choices must not see "
                        f"each other), which attention={cfg.attention.backend} cannot express: use "
                        "attention=auto (it scores trees on flex or sdpa_docs) or "
                        "train.eval_tasks_layout=packed")
    if cfg.model.family is not None:
        try:
            family_of(cfg.model)
        except ValueError as e:
            problems.append(str(e))
    if cfg.model.max_seq_len < cfg.train.seq_len:
        problems.append(f"model.max_seq_len ({cfg.model.max_seq_len}) must be >= train.seq_len "
                        f"({cfg.train.seq_len}): the model cannot take rows that long (set "
                        f"model.max_seq_len={cfg.train.seq_len} or more)")
    cp, strategy = cfg.distributed.context_parallel, cfg.distributed.context_parallel_strategy
    tp = cfg.distributed.tensor_parallel
    if (problem := dims_problem(launched_world_size(), cp, tp)) is not None:
        problems.insert(0, problem)
    if tp > 1:
        problems += tensor_parallel_problems(cfg.model, tp)
        if strategy == "ulysses" and cp > 1 and (cfg.model.n_head // tp) % cp:
            problems.append(f"distributed.context_parallel_strategy=ulysses splits each tensor rank's "
                            f"{cfg.model.n_head} / {tp} heads over the context group: model.n_head / "
                            "distributed.tensor_parallel must be a multiple of distributed.context_parallel "
                            f"({cp}); use the allgather strategy")
    if cp > 1:
        split = cfg.distributed.context_parallel_split
        chunks = split_chunks(split, cp)
        if cfg.train.seq_len % chunks:
            problems.append(f"distributed.context_parallel={cp} with the {split} split cuts each row into "
                            f"{chunks} equal chunks: train.seq_len ({cfg.train.seq_len}) must be a multiple "
                            f"of {chunks}")
        if strategy == "ulysses" and cfg.model.n_head % cp:
            problems.append(f"distributed.context_parallel_strategy=ulysses splits the heads over the group: "
                            f"model.n_head ({cfg.model.n_head}) must be a multiple of "
                            f"distributed.context_parallel ({cp}); use the allgather strategy "
                            "(any head count)")
        if strategy == "allgather" and cfg.attention.backend not in ("auto", *ALLGATHER_KERNELS):
            problems.append("distributed.context_parallel_strategy=allgather needs an attention backend that "
                            f"takes separate query and key lengths (auto, {', '.join(ALLGATHER_KERNELS)}), "
                            f"got attention.backend={cfg.attention.backend}; use attention=auto or the "
                            "ulysses strategy")
        if cfg.train.compile:
            problems.append("train.compile=true is not supported with distributed.context_parallel > 1 yet: "
                            "use train.compile=false")
    if cfg.train.eval_tasks and cfg.distributed.engine != "ddp":
        problems.append(f"train.eval_tasks scores through the unwrapped model, which distributed.engine="
                        f"{cfg.distributed.engine} shards: use distributed=ddp, or score the run's "
                        "checkpoints with python -m trainer.evaluate")
    if cfg.train.eval_tasks and cfg.distributed.context_parallel > 1:
        problems.append("train.eval_tasks scores whole sequences on each rank, not rows split over a "
                        "context-parallel group: drop distributed.context_parallel, or score the run's "
                        "checkpoints with python -m trainer.evaluate")
    if cfg.tokenizer.add_tokens and not cfg.train.init_from:
        problems.append(f"tokenizer.add_tokens={cfg.tokenizer.add_tokens} "
                        "extends the tokenizer of train.init_from's checkpoint: "
                        "set train.init_from=CHECKPOINT too")
    return problems


TRAINING_ONLY_MODEL_KEYS = ("dropout", "init_std")
"""Model keys a run may set over a Hugging Face config.json (how it trains, not what the weights compute)."""


def model_from_hf(path: str, section: dict[str, Any], overrides: typing.Sequence[str]) -> dict[str, Any]:
    """The model section of a run whose train.init_from is Hugging Face model directory `path`: every key from
    its config.json, except dropout and init_std, which stay the run's. A model key set in `overrides`
    (`model=NAME`: all of that preset's; `model.KEY=VALUE`: KEY) that says otherwise than config.json is a
    ConfigError naming both. model.max_seq_len of a RoPE model is a bound, not a weight: an override of it is
    taken."""
    from trainer.checkpoint import hf
    from trainer.checkpoint.weights import SHAPE_KEYS

    theirs = dataclasses.asdict(hf.read_config(path))
    rope = theirs["pos_emb"] == "rope"
    named = [o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o]
    preset = any(n == "model" or n.startswith("model@") for n in named)
    explicit = {n.removeprefix("model.") for n in named if n.startswith("model.")}
    checked = {k for k in (*SHAPE_KEYS, "vocab_size") if (preset and k in SHAPE_KEYS) or k in explicit}
    if rope:
        checked.discard("max_seq_len")
        if "max_seq_len" in explicit:
            theirs["max_seq_len"] = section["max_seq_len"]
    differ = [f"model.{k}={section.get(k)!r} (config.json: {theirs[k]!r})" for k in sorted(checked)
              if k in section and section.get(k) != theirs[k]]
    if differ:
        raise ConfigError(f"train.init_from={path} is a Hugging Face model whose {hf.CONFIG_FILE} gives the "
                          "model, and the command line says otherwise: "
                          f"{', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''}; leave model= out (or "
                          f"set only {' and '.join(f'model.{k}' for k in TRAINING_ONLY_MODEL_KEYS)})")
    return {**theirs, **{k: section[k] for k in TRAINING_ONLY_MODEL_KEYS if k in section}}


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """train.dtype as the run computes: 'auto' is bf16 autocast on a CUDA device that supports bf16, else fp32
    (so CPU runs stay fp32); 'fp32' and 'bf16' are kept. Example: resolve_dtype("auto", cpu) -> "fp32"."""
    if dtype not in DTYPES:
        raise ConfigError(f"train.dtype must be one of {DTYPES}, got {dtype!r}")
    if dtype == "auto":
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    return dtype


def _build(cls, section: dict[str, Any], name: str):
    """cls(**section); a ConfigError for an unknown key, a value of the wrong type or one cls rejects.

    Example: _build(TrainConfig, {"seq_len": "abc"}, "train") -> ConfigError "train.seq_len must be an
    integer, got 'abc'".
    """
    if not isinstance(section, dict):
        raise ConfigError(f"config section '{name}' must hold keys, got {section!r}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) in config section '{name}': {unknown}; expected some of "
                          f"{sorted(known)}")
    hints = typing.get_type_hints(cls)
    for key, value in section.items():
        if not _fits(value, hints[key]):
            raise ConfigError(f"{name}.{key} must be {_describe(hints[key])}, got {value!r}")
    try:
        return cls(**section)
    except (ValueError, TypeError) as e:  # the section's own checks (__post_init__)
        message = str(e)
        raise ConfigError(message if message.startswith(f"{name}.") else f"{name}: {message}") from e


_SCALARS = {bool: "true or false", int: "an integer", float: "a number", type(None): "null", str: "a string"}


def _fits(value: Any, hint: Any) -> bool:
    """Whether a config value has a field's numeric or Boolean type (int, float, bool, None, unions of them).

    A string field takes any scalar (Hydra reads `data.path=2024` as an int) but no list or section; container
    and nested-section fields pass, and each section checks its own choices. Example: _fits(3, float) is True
    (YAML writes 3.0 as 3), _fits(True, int) is False, _fits(["a"], str) is False.
    """
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_fits(value, h) for h in typing.get_args(hint))
    if hint is str:  # a path or a name: Hydra may read it as a number, never as a list or a section
        return not isinstance(value, (list, dict))
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint in (bool, type(None)):
        return isinstance(value, hint)
    return True


def _describe(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    return _SCALARS.get(hint, getattr(hint, "__name__", str(hint)))


def from_container(cfg: dict[str, Any], run_dir: str, overrides: typing.Sequence[str] = ()) -> RunConfig:
    """Plain dict (OmegaConf.to_container(resolve=True)) -> RunConfig; a ConfigError for unknown keys and bad
    values.

    `overrides`: the command line's (Hydra's task overrides), to tell which model keys the user set: a
    train.init_from that is a Hugging Face model directory gives the model section (`model_from_hf`), and an
    override that contradicts its config.json is refused."""
    init_from = (cfg.get("train") or {}).get("init_from")
    if isinstance(init_from, str) and init_from and isinstance(cfg.get("model"), dict):
        from trainer.checkpoint import hf
        from trainer.checkpoint.store import META_FILE

        if hf.is_hf_dir(init_from) and not (Path(init_from) / META_FILE).is_file():
            cfg["model"] = model_from_hf(init_from, cfg["model"], overrides)
    if not _fits(cfg.get("seed"), int):
        raise ConfigError(f"seed must be an integer, got {cfg.get('seed')!r}")
    require_range("seed", cfg["seed"], 0, 2**32 - 1)  # numpy's seeds
    optim = dict(cfg["optim"])
    optim["target"] = optim.pop("_target_", OptimConfig.target)
    betas = optim.get("betas", OptimConfig.betas)
    optim["betas"] = tuple(betas) if isinstance(betas, (list, tuple)) else betas
    logging_cfg = dict(cfg["logging"])
    logging_cfg["wandb"] = _build(WandbConfig, logging_cfg.get("wandb", {}), "logging.wandb")
    run = RunConfig(
        seed=int(cfg["seed"]),
        train=_build(TrainConfig, cfg["train"], "train"),
        data=_build(DataConfig, cfg["data"], "data"),
        packing=_build(PackingConfig, cfg["packing"], "packing"),
        model=_build(GPTConfig, cfg["model"], "model"),
        attention=_build(AttentionConfig, cfg["attention"], "attention"),
        loss=_build(LossConfig, cfg.get("loss", {}), "loss"),
        optim=_build(OptimConfig, optim, "optim"),
        distributed=_build(DistributedConfig, cfg["distributed"], "distributed"),
        logging=_build(LoggingConfig, logging_cfg, "logging"),
        run_dir=run_dir,
        tokenizer=_build(TokenizerConfig, cfg.get("tokenizer", {}), "tokenizer"),
        resolved=cfg,
    )
    problems = cross_section_rules(run)
    if problems:
        raise ConfigError("; ".join(problems))
    return run
