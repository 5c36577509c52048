#!/usr/bin/env bash
# The Slurm preemption loop for real, on this one CPU machine (Debian, root; not part of the test suite):
#   bench/slurm_preemption.sh                      # both variants, ~5 min on 2 cores
#   VARIANTS=usr1 bench/slurm_preemption.sh        # one of: requeue usr1
#   bench/slurm_preemption.sh setup                # only install and start Slurm (then: sinfo, sbatch ...)
#   EXTRA_OVERRIDES="distributed=fsdp2" VARIANTS=requeue bench/slurm_preemption.sh   # another engine, unchanged
#
# 1. Installs and starts a one-node Slurm (slurm-wlm, munge) unless it is running: idempotent.
# 2. Trains a reference run (torchrun, no Slurm) and, per variant, `sbatch launch/slurm.sbatch` of the same
#    config (2 CPU processes under torchrun), interrupted at ~step AT_STEP:
#      requeue  `scontrol requeue JOB`: what preemption does; Slurm sends SIGTERM and requeues the job
#      usr1     `scancel --batch --signal=USR1 JOB`: the time-limit warning; the script requeues the job itself
#    then waits for the requeued job to resume and finish.
# 3. Checks from the files: metrics.jsonl has steps 1..MAX_STEPS once each, the Slurm log has "preempted" then
#    "resumed from", and every step's loss equals the reference run's to 1e-6. Prints PASS/FAIL per variant and
#    the timeline (signal, step preempted at, checkpoint, requeue delay, resumed step); exits 1 on a FAIL.
#
# The Slurm comes from bench/slurm_setup.sh: AuthInfo=cred_expire=30 and a 5 s scheduler interval, so that a
# requeued job starts again after ~30-40 s; with Slurm's defaults (120 s, 60 s) that is ~2.5 min.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PATH=$ROOT/.venv/bin:$PATH            # torchrun and python3 of the venv, for the job too (sbatch --export=ALL)
PY=$ROOT/.venv/bin/python
DATA=${DATA:-/tmp/slurm_demo}
RUN_ROOT=${RUN_ROOT:-/tmp/slurm_run}          # one run dir per variant below it, and the Slurm logs
REF=${REF:-/tmp/slurm_ref}
VARIANTS=${VARIANTS:-requeue usr1}
AT_STEP=${AT_STEP:-15}
MAX_STEPS=60
JOB_NAME=packtrain-preempt
OVERRIDES=(data.path="$DATA" model=tiny attention=sdpa_docs train.seq_len=128 train.tokens_per_step=1024
           train.micro_batch_tokens=512 train.max_steps=$MAX_STEPS train.checkpoint_every=10
           logging.wandb.mode=disabled logging.progress=false distributed.device=cpu train.eval_every=0)
read -r -a EXTRA <<< "${EXTRA_OVERRIDES:-}"      # e.g. distributed=fsdp2: the reference and the Slurm job alike
OVERRIDES+=("${EXTRA[@]}")

log() { echo "[$(date +%T)] $*"; }
die() { log "FAIL: $*"; exit 1; }

# ---------------------------------------------------------------- 1. Slurm on this node (bench/slurm_setup.sh)
source "$ROOT/bench/slurm_setup.sh"

# ---------------------------------------------------------------- 2. data and the reference run
prepare() {
    if [ ! -f "$DATA/manifest.json" ]; then
        log "preparing $DATA"
        "$PY" -m trainer.prepare --source demo --out "$DATA" --vocab-size 512 --max-docs 400 --docs-per-shard 40 \
            > /dev/null
    fi
    log "reference run: torchrun, 2 processes, no Slurm -> $REF"
    rm -rf "$REF"
    OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node=2 -m trainer.train \
        "${OVERRIDES[@]}" hydra.run.dir="$REF" > "$REF.log" 2>&1 || { tail -20 "$REF.log"; die "reference run"; }
}

job_state() { scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }

# ---------------------------------------------------------------- 3. one interrupted Slurm run, checked
run_variant() {
    local variant=$1 run=$RUN_ROOT/$1 job out steps t0 t_signal deadline state
    rm -rf "$run"
    mkdir -p "$RUN_ROOT"
    job=$(GPUS_PER_NODE=2 sbatch --parsable --job-name=$JOB_NAME --nodes=1 --cpus-per-task=2 --gpus-per-node=0 \
          --time=00:15:00 --output="$RUN_ROOT/slurm-%j.out" launch/slurm.sbatch "${OVERRIDES[@]}" \
          hydra.run.dir="$run")
    out=$RUN_ROOT/slurm-$job.out
    log "[$variant] submitted job $job (log $out)"
    t0=$(date +%s)
    steps=0
    until [ "$steps" -ge "$AT_STEP" ]; do
        [ -f "$run/metrics.jsonl" ] && steps=$(wc -l < "$run/metrics.jsonl")
        [ $(( $(date +%s) - t0 )) -lt 180 ] || die "[$variant] job $job: no step $AT_STEP after 180 s"
        case $(job_state "$job") in PENDING|RUNNING|CONFIGURING) ;; *) cat "$out"; die "[$variant] job ended early";; esac
        sleep 0.05
    done
    t_signal=$(date +%s.%N)
    if [ "$variant" = requeue ]; then
        scontrol requeue "$job"
        log "[$variant] metrics at step $steps: scontrol requeue $job"
    else
        scancel --batch --signal=USR1 "$job"
        log "[$variant] metrics at step $steps: scancel --batch --signal=USR1 $job"
    fi
    deadline=$(( $(date +%s) + 300 ))
    while :; do
        state=$(job_state "$job")
        if [ "$state" = COMPLETED ]; then
            grep -q 'resumed from' "$out" && break
            cat "$out"; die "[$variant] job $job completed without a restart (the signal came too late?)"
        fi
        case $state in FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) cat "$out"; die "[$variant] job $job $state";; esac
        [ "$(date +%s)" -lt "$deadline" ] || { cat "$out"; die "[$variant] job $job not done 300 s after the signal"; }
        sleep 1
    done
    log "[$variant] job $job COMPLETED after a requeue; checking the files"
    "$PY" - "$variant" "$job" "$run" "$REF" "$out" "$t_signal" "$MAX_STEPS" \
        "$(scontrol show job "$job" | grep -o 'Restarts=[0-9]*')" <<'PY'
import datetime as dt, json, re, sys
from pathlib import Path

variant, job, run, ref, out, t_signal, max_steps, restarts = sys.argv[1:]
run, ref, max_steps = Path(run), Path(ref), int(max_steps)
text = Path(out).read_text()
fails = []

def rows(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]

got, want = rows(run), {r["step"]: r["loss"] for r in rows(ref)}
steps = [r["step"] for r in got]
if steps != list(range(1, max_steps + 1)):
    fails.append(f"metrics.jsonl steps are not 1..{max_steps} once each: {len(steps)} rows, "
                 f"duplicates {sorted({s for s in steps if steps.count(s) > 1})}")
pre = re.search(r"preempted \((\w+)\) after step (\d+); checkpoint: ([^;\s]+)", text)
res = re.search(r"resumed from (\S+) at step (\d+)", text)
if not pre:
    fails.append("no 'preempted (...) after step N' in the Slurm log")
if not res:
    fails.append("no 'resumed from ... at step N' in the Slurm log")
if pre and res and (text.index(pre.group(0)) > text.index(res.group(0)) or pre.group(3) != res.group(1)):
    fails.append("the run did not resume from the checkpoint written at the preemption")
want_signal = {"requeue": "SIGTERM", "usr1": "SIGUSR1"}[variant]
if pre and pre.group(1) != want_signal:
    fails.append(f"preempted by {pre.group(1)}, expected {want_signal}")
exits = re.findall(r"^\S+ job \d+: exit (\d+)$", text, re.M)
if len(exits) != 2 or set(exits) != {"0"}:
    fails.append(f"the batch script's exit statuses (preempted run, resumed run): {exits}, expected ['0', '0']")
if variant == "usr1" and "scontrol requeue" not in text:
    fails.append("the batch script did not requeue the job after USR1")
summary = json.loads((run / "summary.json").read_text())
if summary.get("preempted") is not None or summary.get("final_step") != max_steps:
    fails.append(f"summary.json: final_step {summary.get('final_step')}, preempted {summary.get('preempted')}")
if restarts != "Restarts=1":
    fails.append(f"scontrol show job: {restarts}, expected Restarts=1")
resumed_at = int(res.group(2)) if res else 0
diffs = {r["step"]: abs(r["loss"] - want[r["step"]]) for r in got if r["step"] in want}
after = [d for s, d in diffs.items() if s > resumed_at]
max_all, max_after = max(diffs.values(), default=float("inf")), max(after, default=float("inf"))
if len(diffs) != max_steps or max_all > 1e-6:
    fails.append(f"losses differ from the uninterrupted run: max |diff| {max_all:.3g} (after the resume {max_after:.3g})")

# Timeline from the batch script's own lines (date -Is) and the trainer's.
starts = [dt.datetime.fromisoformat(m) for m in re.findall(r"^(\S+) job \d+ \(restart \d+\)", text, re.M)]
signal_at = dt.datetime.fromtimestamp(float(t_signal)).astimezone()
delay = (starts[1] - signal_at).total_seconds() if len(starts) > 1 else float("nan")
print(f"[{variant}] job {job}: signal at {signal_at:%H:%M:%S}; "
      f"preempted ({pre.group(1) if pre else '?'}) after step {pre.group(2) if pre else '?'}, "
      f"checkpoint {pre.group(3) if pre else '?'}; restarted {delay:.0f} s after the signal; "
      f"resumed at step {resumed_at}; steps 1..{max(steps)} once each: {steps == list(range(1, max_steps + 1))}; "
      f"max |loss - reference| {max_all:.2e} (steps after the resume {max_after:.2e}); batch script exits {exits}; "
      f"{restarts}")
for f in fails:
    print(f"[{variant}] FAIL: {f}")
print(f"[{variant}] {'PASS' if not fails else 'FAIL'}")
sys.exit(1 if fails else 0)
PY
}

setup_slurm
[ "${1:-}" = setup ] && exit 0
for j in $(squeue -h -n "$JOB_NAME" -o %i); do log "cancelling leftover job $j"; scancel "$j"; done
prepare
results=()
rc=0
for v in $VARIANTS; do
    if ( run_variant "$v" ); then results+=("$v PASS"); else results+=("$v FAIL"); rc=1; fi
done
log "slurm $(sinfo -V | cut -d' ' -f2), $(nproc) cores: ${results[*]}"
[ "$rc" = 0 ] && log "PASS" || log "FAIL"
exit "$rc"
