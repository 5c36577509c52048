"""`python -m trainer.train [overrides]`: the Hydra entry point (single process, torchrun or deepspeed).

    python -m trainer.train data.path=data/demo packing=unpacked train.max_steps=50
    torchrun --nproc_per_node=2 -m trainer.train data.path=data/demo
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from trainer.config import from_container
from trainer.distributed import init_distributed
from trainer.loop import Trainer, shared_run_dir, write_summary

CONFIG_DIR = str(Path(__file__).resolve().parent.parent / "configs")


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
    container = OmegaConf.to_container(raw, resolve=True)
    hydra_cfg = HydraConfig.get()
    run_dir = hydra_cfg.runtime.output_dir
    cfg = from_container(container, run_dir)
    if hydra_cfg.mode == RunMode.MULTIRUN and cfg.logging.wandb.group is None:
        cfg.logging.wandb.group = Path(hydra_cfg.sweep.dir).name  # every run of one sweep in one W&B group
    info = init_distributed(cfg.distributed)
    cfg.run_dir = shared_run_dir(run_dir, info)
    summary = Trainer(cfg, info).fit()
    if info.is_main:
        write_summary(Path(cfg.run_dir), summary)
        print(_format_summary(summary))


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


def cli() -> None:
    sys.argv = strip_launcher_args(sys.argv)
    if int(os.environ.get("RANK", "0")) > 0:  # only rank 0 writes Hydra's files and logs
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    main()


if __name__ == "__main__":
    cli()
