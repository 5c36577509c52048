"""`python -m trainer.certify [--steps N] [--rows N] [--out DIR] [overrides]`: prove on your own model, data and
hardware that packing leaves the objective unchanged (trainer.run.certify says how).

    python -m trainer.certify data.path=data/demo                                   # the one-process cells
    torchrun --nproc_per_node=2 -m trainer.certify data.path=data/demo model=small
        # + DDP, FSDP2, ZeRO-2, TP, CP

The overrides are trainer.train's (the same Hydra config). A few steps (--steps, default 5) of --rows packer
rows each (default: the config's rows per step, at most 8) run in every cell against the unpacked one-process
fp32 reference; the table is printed, and certificate.md and certificate.json are written into --out (default
runs/certify/<UTC time>). Exit status 0 only if every cell that ran passed; 1 if any failed (named, with what
differs); 2 for a user's mistake (a bad override, data that cannot be read).
"""  # noqa: E501 (line 1 is the --help description: __doc__.split("\n")[0])

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from trainer.config import from_container
from trainer.distributed.groups import DistInfo, local_device, shutdown_distributed
from trainer.errors import ConfigError, run_command
from trainer.outputs import check_not_inside_input, check_out_file, write_json_output, written_by
from trainer.run.certify import as_json, as_markdown, certify, draw_steps, facts, table
from trainer.run.inputs import build_data
from trainer.train import CONFIG_DIR, HYDRA_ERRORS, SAME_ON_EVERY_RANK, user_message

COMMAND = "trainer.certify"
JSON_FILE, MARKDOWN_FILE = "certificate.json", "certificate.md"
MAX_ROWS = 8
"""--rows' default: the config's rows per step, at most this many (a certificate runs every cell twice)."""


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python -m trainer.certify", description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per pass of each cell (default 5)")
    p.add_argument("--rows", type=int, default=None,
                   help=f"packer rows per step (default: the config's rows per step, at most {MAX_ROWS})")
    p.add_argument("--out", type=Path, default=None, help="directory of certificate.md and certificate.json "
                                                          "(default runs/certify/<UTC time>)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a certificate.json this command did not write")
    args, overrides = p.parse_known_args(argv)
    unknown = [o for o in overrides if o.startswith("-")]
    if unknown:
        p.error(f"unrecognized arguments: {' '.join(unknown)} (the rest are Hydra overrides: key=value)")
    return args, overrides


def load_config(overrides: list[str], out: Path):
    """The composed and typed config of trainer.train for `overrides`."""
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3", job_name="certify"):
        raw = compose(config_name="config", overrides=overrides)
    try:
        container = OmegaConf.to_container(raw, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"cannot resolve {e.full_key}: {str(e).splitlines()[0]}") from e
    container.pop("hydra", None)
    return from_container(container, str(out), overrides=overrides)


def run(argv: list[str] | None) -> int:
    args, overrides = parse_args(argv)
    if args.steps < 1 or (args.rows is not None and args.rows < 1):
        raise ConfigError(f"--steps and --rows must be >= 1, got {args.steps} and {args.rows}")
    out = args.out or Path("runs") / "certify" / time.strftime("%Y-%m-%d_%H-%M-%S", time.gmtime())
    check_not_inside_input(out)
    check_out_file(out / JSON_FILE, COMMAND, written_by(COMMAND), args.overwrite)
    cfg = load_config(overrides, out)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = local_device(cfg.distributed.device)  # the group, if any, is joined after the one-process cells
    alone = DistInfo(0, 1, 0, device)
    data = build_data(cfg, alone)  # one reader on every rank: every rank certifies the same documents
    try:
        steps = draw_steps(data, args.steps, args.rows or min(cfg.train.rows_per_step, MAX_ROWS))
    finally:
        data.rows.close()
    main = int(os.environ.get("RANK", "0")) == 0
    say = print if main else (lambda _: None)
    say(f"certify: {args.steps} steps x {len(steps[0])} rows of {cfg.train.seq_len} "
        f"from {cfg.data.path or 'the data'}, on {device} ({world} rank(s))")
    try:
        cert = certify(cfg, data, steps, device, world, progress=lambda line: say(line) or sys.stdout.flush())
    finally:
        shutdown_distributed()
    if main:
        about = facts(cfg, device, steps, world)
        print(table(cert))
        out.mkdir(parents=True, exist_ok=True)
        (out / MARKDOWN_FILE).write_text(as_markdown(cert, about))
        write_json_output(out / JSON_FILE, as_json(cert, about), COMMAND)
        verdict = "passed" if cert.passed else "FAILED: " + "; ".join(
            f"{v.cell.name}: {v.problems[0]}" for v in cert.verdicts if v.status == "FAIL")
        print(f"certificate {verdict}\n  {out / MARKDOWN_FILE}\n  {out / JSON_FILE}")
    return 0 if cert.passed else 1


def main(argv: list[str] | None = None) -> int:
    return run_command(lambda: run(argv), extra_user_errors=(*HYDRA_ERRORS, OSError), message=user_message,
                       same_on_every_rank=SAME_ON_EVERY_RANK)


if __name__ == "__main__":
    sys.exit(main())
