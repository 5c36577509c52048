#!/usr/bin/env bash
# One node, NPROC processes under torchrun (one per GPU; on CPU, a few). Every argument is a Hydra override:
#   launch/torchrun.sh data.path=data/demo train.max_steps=1000
#   NPROC=2 launch/torchrun.sh distributed=deepspeed_zero2 model=small      # ZeRO under torchrun works too
#   NPROC=2 launch/torchrun.sh distributed=fsdp2 model=small                # FSDP2 (fully_shard) likewise
# Several nodes: launch/slurm.sbatch (or torchrun --nnodes with a c10d rendezvous, as it does).
set -euo pipefail

NPROC=${NPROC:-8}   # <- processes on this node: the number of GPUs (edit here or set NPROC)

# torchrun sets OMP_NUM_THREADS=1 itself when NPROC > 1; kept explicit so the rule is visible.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# --standalone: a rendezvous on a free local port, so two jobs on one machine do not fight over 29500.
# trainer.launcher is torchrun (the same options) ending as its ranks end: a rank's mistake is its one line
# `error: ...` and exit status 2, not torchrun's ChildFailedError traceback and status 1 (launch/README.md).
exec python -m trainer.launcher --standalone --nproc_per_node="$NPROC" -m trainer.train "$@"
