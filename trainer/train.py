"""`python -m trainer.train [overrides]`: the Hydra entry point (single process, torchrun or deepspeed).

    python -m trainer.train data.path=data/demo packing=unpacked train.max_steps=50
    torchrun --nproc_per_node=2 -m trainer.train data.path=data/demo

A user's mistake (a bad override or config value, a missing data directory, a bad shard or tokenizer, an
attention backend this machine cannot run) ends the run as trainer/errors.py says: one `error: ...` line, exit
status 2. HYDRA_FULL_ERROR=1 shows the traceback of every error.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import logging
import os
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException, OverrideParseException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.config import RunConfig, from_container, resolve_dtype
from trainer.distributed.config import missing_engine_package
from trainer.distributed.groups import DistInfo, init_distributed, shutdown_distributed
from trainer.errors import PREEMPTION_SIGNALS, ConfigError, UserError, one_line, original_message, run_command
from trainer.model import compute_dtype, resolve_backend
from trainer.run.loop import Trainer, shared_run_dir, write_summary
from trainer.run.preemption import PreemptedAtStart, end_with_launcher
from trainer.run.run_dir import unlock_run_dir

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")
JOB_DIR_MAX = 120
"""The longest sweep job dir name (`job_dir`); longer ones keep their start and a hash of the whole."""


def job_dir(overrides: str) -> str:
    """A sweep job's dir name from its overrides (hydra.job.override_dirname), always ONE path component: a
    "/" in a value (a path in data.sources, data.urls, train.init_from) becomes "_", and a name longer than
    JOB_DIR_MAX keeps its start and a hash of the whole. So job dirs stay one level below the sweep dir, where
    trainer.report looks. Example: "data.sources=[{name:a,path:/d/x}]" ->
    "data.sources=[{name:a,path:_d_x}]"."""
    name = overrides.replace("/", "_").replace("\0", "")
    if name in (".", ".."):
        name = name.replace(".", "_")
    if len(name) > JOB_DIR_MAX:
        name = f"{name[:JOB_DIR_MAX - 17]}-{hashlib.sha256(overrides.encode()).hexdigest()[:16]}"
    return name


OmegaConf.register_new_resolver("job_dir", job_dir, replace=True)
JOB_LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"
"""The job log's lines (as Hydra's default job logging writes them;
configs/hydra/job_logging/console.yaml)."""

HYDRA_ERRORS = (CompactHydraException,)
"""Hydra's own override and composition errors: the user's mistakes too, though not UserError subclasses."""

SAME_ON_EVERY_RANK = (ConfigError, *HYDRA_ERRORS)
"""Mistakes every rank of a launch makes alike (the config, an override, a refusal rank 0 decided and
broadcast): rank 0 alone prints them (trainer.errors.run_command)."""

_GROUP_ONLY = ("{key} exists only with {engines}, which the chosen distributed= option is not: choose "
               "{options}, then override {key}")
GROUP_ONLY_KEYS = {
    "distributed.zero_stage": _GROUP_ONLY.format(key="distributed.zero_stage",
                                                 engines="distributed.engine=deepspeed",
                                                 options="distributed=deepspeed_zero1, deepspeed_zero2 or "
                                                         "deepspeed_zero3"),
    "distributed.offload": _GROUP_ONLY.format(key="distributed.offload",
                                              engines="distributed.engine=deepspeed or fsdp2",
                                              options="distributed=deepspeed_zero1, deepspeed_zero2, "
                                                      "deepspeed_zero3 or fsdp2"),
    "distributed.reshard_after_forward": _GROUP_ONLY.format(key="distributed.reshard_after_forward",
                                                            engines="distributed.engine=fsdp2",
                                                            options="distributed=fsdp2"),
}
"""Keys that only some options of a config group set: an override of one under another option says so."""

_user_full_error: bool | None = None
"""HYDRA_FULL_ERROR=1 as the user set it; cli() sets the variable itself for Hydra (see there)."""
_job_started = False
"""Whether Hydra has reached a job: an OSError before that is about the run directory Hydra creates."""


class RunDirError(UserError):
    """Hydra cannot create the run (or sweep) directory, or write its files into it."""


def _hydra_main() -> None:
    """main() as Hydra runs it; an OSError raised before any job (making hydra.run.dir) becomes a
    RunDirError."""
    try:
        main()
    except OSError as e:
        if _job_started:
            raise
        raise RunDirError(f"cannot create the run directory or write Hydra's files into it ({e}): "
                          "hydra.run.dir (or hydra.sweep.dir under -m) must name a directory that can be "
                          "written") from e


def strip_launcher_args(argv: list[str]) -> list[str]:
    """Drop `--local_rank=N` / `--local_rank N` (the deepspeed launcher appends it), keeping it in LOCAL_RANK.

    Example: ["train", "model=tiny", "--local_rank=1"] -> ["train", "model=tiny"], LOCAL_RANK=1.
    """
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg.startswith("--local_rank=") or arg.startswith("--local-rank="):
            os.environ.setdefault("LOCAL_RANK", arg.split("=", 1)[1])
        elif arg in ("--local_rank", "--local-rank") and i + 1 < len(argv):
            os.environ.setdefault("LOCAL_RANK", argv[i + 1])
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


@hydra.main(config_path=CONFIG_DIR, config_name="config", version_base="1.3")
def main(raw: DictConfig) -> None:
    """One training run (one job of a sweep under -m)."""
    global _job_started
    _job_started = True
    # Caught inside the job, so Hydra prints no "Error executing job ..." line above ours.
    status = run_command(lambda: run(raw), extra_user_errors=HYDRA_ERRORS, message=user_message,
                         tracebacks=_tracebacks_wanted(), same_on_every_rank=SAME_ON_EVERY_RANK)
    if status:
        raise SystemExit(status)  # passes through Hydra: under -m it ends the sweep


def _task_overrides() -> list[str]:
    """The command line's overrides (Hydra's task overrides), or none outside a Hydra job (tests compose
    configs)."""
    try:
        return list(HydraConfig.get().overrides.task)
    except ValueError:  # HydraConfig is not set
        return []


def build_config(raw: DictConfig, run_dir: str) -> RunConfig:
    """The composed Hydra config -> the typed RunConfig, every value and rule checked, and the engine's
    package installed (a ConfigError if not)."""
    try:
        container = OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as e:  # e.g. an override `model.n_layer=${oops}`
        raise ConfigError(f"cannot resolve {e.full_key}: {str(e).splitlines()[0]}") from e
    cfg = from_container(container, run_dir, overrides=_task_overrides())
    missing = missing_engine_package(cfg.distributed)
    if missing:
        raise ConfigError(missing)
    return cfg


def run(raw: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    cfg = build_config(raw, run_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN and cfg.logging.wandb.group is None:
        cfg.logging.wandb.group = Path(hydra_cfg.sweep.dir).name  # every run of one sweep in one W&B group
    info = init_distributed(cfg.distributed)
    check_attention_backend(cfg, info)
    cfg.run_dir = shared_run_dir(run_dir, info)
    accepted = (lambda: write_hydra_record(raw, Path(cfg.run_dir))) if info.is_main else None
    try:
        trainer = Trainer(cfg, info, accepted=accepted)
    except PreemptedAtStart as e:  # a preemption is not a failure: the next start does it all again
        if info.is_main:
            print(str(e), flush=True)
        shutdown_distributed()
        return
    summary = trainer.fit()
    if info.is_main:
        write_summary(Path(cfg.run_dir), summary)
        print(_format_summary(summary), flush=True)
    unlock_run_dir(Path(cfg.run_dir))
    shutdown_distributed()


def write_hydra_record(raw: DictConfig, run_dir: Path) -> None:
    """Rank 0, once the run dir is this run's (trainer.run.run_dir.claim_run_dir): what Hydra writes into a
    run dir before its job (.hydra/config.yaml, hydra.yaml, overrides.yaml) and the job log, `<job name>.log`,
    from here on. Hydra itself writes nothing there (hydra.output_subdir=null, console-only job logging:
    configs/config.yaml), so a run refused at the claim leaves an earlier run's files as they were."""
    hydra_cfg = HydraConfig.get()
    record = run_dir / ".hydra"
    record.mkdir(exist_ok=True)
    OmegaConf.save(raw, record / "config.yaml")
    OmegaConf.save(OmegaConf.create({"hydra": OmegaConf.to_container(hydra_cfg, resolve=False)}),
                   record / "hydra.yaml")
    OmegaConf.save(OmegaConf.create(list(hydra_cfg.overrides.task)), record / "overrides.yaml")
    global _job_log
    root = logging.getLogger()
    # the previous job of a sweep (-m runs its jobs in this process): its log is closed
    if _job_log is not None:
        root.removeHandler(_job_log)
        _job_log.close()
    _job_log = logging.FileHandler(run_dir / f"{hydra_cfg.job.name}.log")
    _job_log.setFormatter(logging.Formatter(JOB_LOG_FORMAT))
    root.addHandler(_job_log)


_job_log: logging.FileHandler | None = None
"""The job log write_hydra_record opened last."""


def _format_summary(s: dict) -> str:
    def num(x, fmt):
        return format(x, fmt) if x is not None else "n/a"

    return "\n".join([
        f"done: step {s['final_step']}, loss {num(s['final_loss'], '.4f')}",
        f"  token utilization (mean) {num(s['mean_token_utilization'], '.2%')}, "
        f"valid tokens/s (mean) {num(s['mean_valid_tokens_per_s'], ',.0f')}",
        f"  valid tokens {s['total_valid_tokens']:,} of {s['total_allocated_tokens']:,} allocated positions",
        f"  skipped samples: {s['skipped_samples'] or 'none'}",
        f"  run dir: {s['run_dir']}",
        f"  checkpoint: {s['checkpoint']}",
    ])


def check_attention_backend(cfg: RunConfig, info: DistInfo) -> None:
    """Refuse, before data and model are built, an attention backend that cannot train on this device and
    dtype.

    Raises BackendUnavailable naming why and what to use; the model would raise the same at its first forward.
    """
    dtype = compute_dtype(resolve_dtype(cfg.train.dtype, info.device))
    resolve_backend(cfg.attention.backend, info.device, dtype, requires_grad=True)


def user_message(error: BaseException) -> str:
    """The message shown (on one line) for a user error: its own, without torch's DataLoader-worker wrapping
    or Hydra's config search path.

    Example: Hydra's "In 'config': Could not find 'attention/x'\n\nAvailable options in 'attention':\n\tauto
    ..." -> "In 'config': Could not find 'attention/x'; Available options in 'attention': auto; ...".
    """
    if not isinstance(error, CompactHydraException):
        return original_message(error)
    cause = error.__cause__
    if isinstance(cause, OmegaConfBaseException) and "not in struct" in str(cause) and cause.full_key:
        if cause.full_key in GROUP_ONLY_KEYS:  # a real key that the chosen group option does not set
            return GROUP_ONLY_KEYS[cause.full_key]
        return (f"unknown config key {cause.full_key!r}: check its spelling "
                "(`python -m trainer.train --cfg job` prints every key)")
    text = str(error).split("Config search path:")[0]
    if isinstance(error, OverrideParseException) and error.override not in text:
        text = f"cannot parse the override {error.override!r}: {text}"
    if isinstance(error, OverrideParseException) and "=" in error.override.partition("=")[2]:
        key, _, value = error.override.partition("=")
        text += f" (a value holding '=' or other special characters must be quoted: \"{key}='{value}'\")"
    if isinstance(cause, OmegaConfBaseException):
        text += "\n" + str(cause).splitlines()[0]
    return one_line(text)


def _tracebacks_wanted() -> bool:
    if _user_full_error is not None:
        return _user_full_error
    return os.environ.get("HYDRA_FULL_ERROR") == "1"


def cli() -> int:
    """`python -m trainer.train`: the exit status (a user's mistake in a job exits 2 from inside it)."""
    global _user_full_error, _job_started
    _job_started = False
    # A run that seems hung: `kill -QUIT <pid>` prints every thread's stack to stderr, and the run goes on.
    # no real stderr (an embedding, a test's capture)
    with contextlib.suppress(AttributeError, ValueError, OSError):
        faulthandler.register(signal.SIGQUIT, file=sys.__stderr__, all_threads=True)
    # Signals a launcher left blocked (the mask survives fork and exec) would never reach the run: Ctrl-C and
    # the preemption signals must.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {*PREEMPTION_SIGNALS, signal.SIGINT, signal.SIGQUIT})
    end_with_launcher()  # under torchrun: a rank whose agent dies is preempted, not orphaned
    sys.argv = strip_launcher_args(sys.argv)
    if int(os.environ.get("RANK", "0")) > 0:  # only rank 0 writes Hydra's files and logs
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    # Without HYDRA_FULL_ERROR=1 Hydra prints any error itself, as a trimmed traceback and a hint, and
    # exits 1. Set it so its override and composition errors reach us; the user's own setting still decides
    # below.
    _user_full_error = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:  # Hydra's own errors are raised here, before any job
        return run_command(_hydra_main, extra_user_errors=HYDRA_ERRORS, message=user_message,
                           tracebacks=_user_full_error, same_on_every_rank=SAME_ON_EVERY_RANK)
    finally:
        if not _user_full_error:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        _user_full_error = None


if __name__ == "__main__":
    sys.exit(cli())
