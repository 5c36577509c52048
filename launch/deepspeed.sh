#!/usr/bin/env bash
# The deepspeed launcher: one node with NPROC processes, or several nodes listed in a hostfile
# (launch/hostfile.example; passwordless ssh and pdsh between the nodes). Arguments are Hydra overrides:
#   launch/deepspeed.sh data.path=data/demo train.max_steps=1000
#   launch/deepspeed.sh distributed=deepspeed_zero3 model=gpt2-124m          # a later distributed= wins
#   HOSTFILE=launch/hostfile launch/deepspeed.sh data.path=/shared/data      # several nodes
# Needs deepspeed: pip install -e '.[deepspeed]' (on a CPU-only machine: DS_BUILD_OPS=0, see the Makefile).
set -euo pipefail

NPROC=${NPROC:-8}                    # <- processes per node: the number of GPUs (edit here or set NPROC)
HOSTFILE=${HOSTFILE:-}               # empty: this node only
MASTER_PORT=${MASTER_PORT:-29500}    # the rendezvous port on the first node; pick another if it is taken

# The deepspeed launcher does not set it (torchrun does): without it every process starts one OpenMP
# thread per core and CPU steps ran ~25x slower. On multi-node runs put it in .deepspeed_env as well.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

if [[ -n "$HOSTFILE" ]]; then
    where=(--hostfile "$HOSTFILE")   # nodes and slots from the file; rank 0 on its first line
else
    where=(--num_gpus "$NPROC")      # also the CPU way: DeepSpeed's CPU accelerator takes any count
fi
# The launcher appends --local_rank=N to each process; trainer.train moves it into LOCAL_RANK.
exec deepspeed "${where[@]}" --master_port "$MASTER_PORT" --module trainer.train distributed=deepspeed_zero2 "$@"
