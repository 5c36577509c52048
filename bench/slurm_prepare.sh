#!/usr/bin/env bash
# launch/prepare.sbatch for real, on a one-node Slurm on this CPU machine (Debian, root; not part of the tests):
#   bench/slurm_prepare.sh                          # all variants, ~3 min on 2 cores
#   VARIANTS="tok requeue" bench/slurm_prepare.sh   # some of: train tok requeue usr1 cancel
#
# 1. Starts a one-node Slurm (bench/slurm_setup.sh: apt slurm-wlm + munge, slurmctld and slurmd as root).
# 2. Writes a small deterministic corpus, JSONL in 4 files (~6 MiB of this machine's man pages and licenses),
#    and prepares it twice without Slurm, as one part: REF (trains the tokenizer) and REF_TOK (--tokenizer
#    REF/tokenizer).
# 3. Per variant, `sbatch --array=0-2 launch/prepare.sbatch ARGS` (3 parts, 1 CPU each) into its own dir:
#      train    no --tokenizer: every part trains the same tokenizer; compared with REF
#      tok      --tokenizer REF/tokenizer, and a dependent `--merge DIR` job (afterok): it finds the merge done
#      requeue  --tokenizer; `scontrol requeue J_1` once task 1 has finished 2 of its units (what preemption
#               does): it runs again, keeps those units (their results are not written again) and finishes
#      usr1     the same with `scancel --batch --signal=USR1 J_1` (the time-limit warning): the batch script
#               requeues its own task
#      cancel   --tokenizer; `scancel J_1` once task 1 has finished a unit, a dependent `--merge DIR` job
#               (afterany) that must fail naming part 1, then `sbatch --array=1 ... --parts 3` that finishes
#               the part and merges
#    and checks: every task COMPLETED with exit 0, the Slurm logs show the three tasks, manifest.json equals the
#    reference's (as JSON), every other file of the reference (shards, tokenizer/) is byte-identical (cmp) and
#    there are no other shards. Prints PASS/FAIL per variant and the times; exits 1 on a FAIL.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
export PATH=$ROOT/.venv/bin:$PATH            # `python` of the venv, for the jobs too (sbatch exports the env)
PY=$ROOT/.venv/bin/python
WORK=${WORK:-/tmp/slurm_prepare}             # corpus/, ref/, ref_tok/, one dir per variant, logs/
VARIANTS=${VARIANTS:-train tok requeue usr1 cancel}
PARTS=3
JOB_NAME=packtrain-prepare-bench
CORPUS=$WORK/corpus
REF=$WORK/ref
REF_TOK=$WORK/ref_tok
LOGS=$WORK/logs
SOURCE="jsonl:$CORPUS/*.jsonl"
# --unit-mb 0.25: ~26 units, so each part has several (a unit is the piece one worker prepares and the granule
# a restarted part keeps); the default would be 1 MB here (the corpus / 64, at least 1 MB). Units are cut only
# between blocks of --docs-per-shard records (~2 kB each here): 50 keeps blocks (~100 kB) below the unit size.
ARGS=(--source "$SOURCE" --vocab-size 2048 --docs-per-shard 50 --val-fraction 0.05 --unit-mb 0.25)

log() { echo "[$(date +%T)] $*"; }
die() { log "FAIL: $*"; exit 1; }

source "$ROOT/bench/slurm_setup.sh"

# ---------------------------------------------------------------- 2. corpus and the one-part references
make_corpus() {
    rm -rf "$CORPUS"
    mkdir -p "$CORPUS"
    "$PY" - "$CORPUS" <<'PY'
import gzip, json, sys
from pathlib import Path

out, files, budget = Path(sys.argv[1]), 4, 6 << 20
paths = sorted(Path("/usr/share/common-licenses").iterdir())
for section in ("man1", "man5", "man7", "man8"):
    paths += sorted(Path("/usr/share/man", section).glob("*.gz"))
docs, size = [], 0
for p in paths:
    if not p.is_file() or p.is_symlink():
        continue
    data = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    text = data.decode("utf-8", errors="replace")
    if not text.strip():
        continue
    docs.append({"path": str(p), "text": text})
    size += len(text.encode())
    if size >= budget:
        break
handles = [open(out / f"part-{i}.jsonl", "w") for i in range(files)]
done = 0
for d in docs:  # in order, about the same bytes per file
    handles[min(files - 1, done * files // size)].write(json.dumps(d) + "\n")
    done += len(d["text"].encode())
for f in handles:
    f.close()
print(f"{len(docs)} documents, {size / 2**20:.1f} MiB of text in {files} files")
PY
}

references() {
    local t0
    rm -rf "$REF" "$REF_TOK"
    t0=$(date +%s)
    "$PY" -m trainer.prepare "${ARGS[@]}" --out "$REF" --workers 2 > "$WORK/ref.log" 2>&1 ||
        { tail -20 "$WORK/ref.log"; die "reference prepare"; }
    log "reference (one part, trains the tokenizer) -> $REF: $(( $(date +%s) - t0 )) s"
    t0=$(date +%s)
    "$PY" -m trainer.prepare "${ARGS[@]}" --out "$REF_TOK" --tokenizer "$REF/tokenizer" --workers 2 \
        > "$WORK/ref_tok.log" 2>&1 || { tail -20 "$WORK/ref_tok.log"; die "reference prepare --tokenizer"; }
    log "reference (one part, --tokenizer $REF/tokenizer) -> $REF_TOK: $(( $(date +%s) - t0 )) s"
}

# ---------------------------------------------------------------- 3. the Slurm variants
job_state() { scontrol show job "$1" 2>/dev/null | grep -o 'JobState=[A-Z_]*' | head -1 | cut -d= -f2; }

# Wait until no task of these jobs is pending or running (at most $2 s).
wait_jobs() {
    local jobs=$1 limit=$2 t0 left
    t0=$(date +%s)
    while :; do
        left=$(squeue -h -j "$jobs" -o %i 2>/dev/null | wc -l)
        [ "$left" = 0 ] && return 0
        [ $(( $(date +%s) - t0 )) -lt "$limit" ] || { squeue; return 1; }
        sleep 1
    done
}

# The units of part $2 (of $3) of the prepare staged in $1 (DIR/.prepare/<plan id>/plan.json; a part has every
# parts-th unit), and which are done (u<index>.json). `units OUT PART PARTS count`: "<done> <total>";
# `units OUT PART PARTS watch FILE`: from now until the merge, whether the units done now are left alone (a
# restarted part keeps them) or written again; the verdict as JSON in FILE.
units() {
    "$PY" - "$@" <<'PY'
import json, sys, time
from pathlib import Path

out, part, parts, mode = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

def state():
    plans = sorted((out / ".prepare").glob("*/plan.json"))
    if len(plans) != 1:
        return None, {}
    stage = plans[0].parent
    indices = [u["index"] for u in json.loads(plans[0].read_text())["units"] if u["index"] % parts == part]
    done = {}
    for i in indices:
        try:
            done[i] = (stage / f"u{i:06d}.json").stat().st_mtime_ns
        except OSError:
            pass
    return indices, done

if mode == "count":
    indices, done = state()
    print(len(done), len(indices or ()))
    sys.exit(0)
indices, before = state()
changed, deadline = set(), time.monotonic() + 900
while not (out / "manifest.json").exists() and time.monotonic() < deadline:
    _, now = state()
    changed |= {i for i, t in now.items() if i in before and t != before[i]}
    time.sleep(0.1)
Path(sys.argv[5]).write_text(json.dumps({"units": indices, "done_at_requeue": sorted(before),
                                         "written_again": sorted(changed)}))
PY
}

# Wait until part $3 of the prepare in $2 has finished at least $4 of its units, its task ($1) still running.
wait_units() {
    local task=$1 out=$2 part=$3 want=$4 t0 done total state
    t0=$(date +%s)
    while :; do
        read -r done total <<< "$(units "$out" "$part" $PARTS count)"
        [ "$done" -ge "$want" ] && break
        [ $(( $(date +%s) - t0 )) -lt 300 ] || die "$task: $done of its units done after 300 s"
        state=$(job_state "$task")
        case $state in RUNNING|PENDING|CONFIGURING) ;; *) die "$task is $state ($done of $total units done)";; esac
        sleep 0.1
    done
    [ "$done" -lt "$total" ] || die "$task: all $total units done already: the interruption came too late"
    log "$task: $done of its $total units done"
}

submit() {  # submit ARRAY OUT [ARGS...]: prints the job id
    local array=$1 out=$2
    shift 2
    sbatch --parsable --job-name=$JOB_NAME --array="$array" --cpus-per-task=1 --time=00:20:00 \
        --output="$LOGS/slurm-%A_%a.out" launch/prepare.sbatch "${ARGS[@]}" --out "$out" "$@"
}

run_variant() {
    local v=$1 out=$WORK/$1 ref job merge= again= t0 extra=() expect_merge= watcher=
    rm -rf "$out" "$WORK/requeue-units.json"
    mkdir -p "$LOGS"
    [ "$v" = train ] && ref=$REF || { ref=$REF_TOK; extra=(--tokenizer "$REF/tokenizer"); }
    t0=$(date +%s)
    job=$(submit "0-$((PARTS - 1))" "$out" "${extra[@]}")
    log "[$v] submitted array job $job: sbatch --array=0-$((PARTS - 1)) launch/prepare.sbatch ${ARGS[*]}" \
        "--out $out ${extra[*]}"
    case $v in
        tok)
            merge=$(sbatch --parsable --job-name=$JOB_NAME --dependency=afterok:"$job" --cpus-per-task=1 \
                    --output="$LOGS/slurm-%j.out" launch/prepare.sbatch --merge "$out")
            expect_merge=0
            log "[$v] submitted merge job $merge (--dependency=afterok:$job)" ;;
        requeue|usr1)
            wait_units "${job}_1" "$out" 1 2
            units "$out" 1 $PARTS watch "$WORK/requeue-units.json" &
            watcher=$!
            if [ "$v" = requeue ]; then
                scontrol requeue "${job}_1"
                log "[$v] scontrol requeue ${job}_1"
            else
                scancel --batch --signal=USR1 "${job}_1"
                log "[$v] scancel --batch --signal=USR1 ${job}_1 (the time-limit warning)"
            fi ;;
        cancel)
            merge=$(sbatch --parsable --job-name=$JOB_NAME --dependency=afterany:"$job" --cpus-per-task=1 \
                    --output="$LOGS/slurm-%j.out" launch/prepare.sbatch --merge "$out")
            expect_merge=2
            log "[$v] submitted merge job $merge (--dependency=afterany:$job)"
            wait_units "${job}_1" "$out" 1 1
            scancel "${job}_1"
            log "[$v] scancel ${job}_1" ;;
    esac
    wait_jobs "$job${merge:+,$merge}" 600 || die "[$v] jobs $job $merge not done after 600 s"
    if [ "$v" = cancel ]; then
        again=$(submit 1 "$out" "${extra[@]}" --parts $PARTS)
        log "[$v] resubmitted the cancelled part: job $again (sbatch --array=1 ... --parts $PARTS)"
        wait_jobs "$again" 600 || die "[$v] job $again not done after 600 s"
    fi
    [ -z "$watcher" ] || wait "$watcher" || die "[$v] the unit watcher failed"
    log "[$v] done in $(( $(date +%s) - t0 )) s; checking"
    "$PY" - "$v" "$job" "$out" "$ref" "$LOGS" "$PARTS" "${merge:--}" "${expect_merge:--}" "${again:--}" \
        "$(scontrol show job "$job" 2>/dev/null)" "$( [ -n "$again" ] && scontrol show job "$again" 2>/dev/null)" <<'PY'
import json, re, subprocess, sys
from pathlib import Path

v, job, out, ref, logs, parts, merge, expect_merge, again, show, show_again = sys.argv[1:]
out, ref, logs, parts = Path(out), Path(ref), Path(logs), int(parts)
fails = []

# Slurm: every task of the array (and the resubmitted one) COMPLETED with exit 0, one log per task.
def tasks(text):  # {task id: (state, exit code, restarts)}
    found = {}
    for rec in re.split(r"\n\s*\n", text.strip()):
        t = re.search(r"ArrayTaskId=(\d+)", rec)
        if t:
            found[int(t.group(1))] = (re.search(r"JobState=(\w+)", rec).group(1),
                                      re.search(r"ExitCode=(\S+)", rec).group(1),
                                      int(re.search(r"Restarts=(\d+)", rec).group(1)))
    return found

got = tasks(show)
want_done = {i: "COMPLETED" for i in range(parts)}
if v == "cancel":
    want_done[1] = "CANCELLED"
if {i: s for i, (s, _, _) in got.items()} != want_done:
    fails.append(f"array job {job}: tasks {got}, expected states {want_done}")
for i, (state, code, restarts) in got.items():
    if state == "COMPLETED" and code != "0:0":
        fails.append(f"task {job}_{i}: ExitCode={code}")
if v in ("requeue", "usr1"):
    if got.get(1, (0, 0, 0))[2] != 1:
        fails.append(f"task {job}_1: Restarts={got.get(1, (0, 0, 0))[2]}, expected 1 after the requeue")
    said = f"USR1: time limit in 120 s: scontrol requeue {job}_1"
    if v == "usr1" and said not in (logs / f"slurm-{job}_1.out").read_text():
        fails.append(f"slurm-{job}_1.out: the batch script did not requeue its task after USR1")
    w = json.loads((logs.parent / "requeue-units.json").read_text())
    print(f"[{v}] part 1: units {w['units']}; done at the requeue {w['done_at_requeue']}, written again by the "
          f"restarted task {w['written_again'] or 'none'}")
    if not w["done_at_requeue"] or w["written_again"]:
        fails.append(f"the restarted part 1 did not keep the units it had finished: {w}")
logs_seen = {}
for i in range(parts):
    path = logs / f"slurm-{job}_{i}.out"
    text = path.read_text() if path.exists() else ""
    starts = re.findall(rf"^\S+ job {job}_{i} \(restart (\d+)\) on \S+: prepare (.*)$", text, re.M)
    exits = re.findall(rf"^\S+ job {job}_{i}: exit (\d+)$", text, re.M)
    logs_seen[i] = (len(starts), exits)
    if not starts or f"--part {i}" not in starts[0][1] or f"--parts {parts}" not in starts[0][1]:
        fails.append(f"{path}: no start line of part {i} of {parts} ({starts})")
    want_exits = {"requeue": ["143", "0"], "usr1": ["143", "0"], "cancel": ["143"]}.get(v, ["0"]) if i == 1 else ["0"]
    if exits != want_exits:
        fails.append(f"{path}: exits {exits}, expected {want_exits}")
if again != "-":
    a = tasks(show_again)
    if a != {1: ("COMPLETED", "0:0", 0)}:
        fails.append(f"resubmitted job {again}: {a}, expected task 1 COMPLETED 0:0")
    text = (logs / f"slurm-{again}_1.out").read_text()
    started = re.search(rf"job {again}_1 \(restart 0\) on \S+: prepare .*--part 1", text)
    if not started or f"job {again}_1: exit 0" not in text:
        fails.append(f"slurm-{again}_1.out: no start line of part 1 or no exit 0:\n{text[-2000:]}")
if merge != "-":
    m = re.search(r"JobState=(\w+).*?ExitCode=(\S+)", subprocess.run(["scontrol", "show", "job", merge],
                  capture_output=True, text=True).stdout, re.S)
    text = (logs / f"slurm-{merge}.out").read_text()
    exits = re.findall(rf"^\S+ job {merge}: exit (\d+)$", text, re.M)
    if exits != [expect_merge]:
        fails.append(f"merge job {merge} ({m and m.groups()}): exits {exits}, expected [{expect_merge}]:\n"
                     f"{text[-2000:]}")
    if expect_merge == "2":
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        if len(errors) != 1 or not re.search(r"\b1\b", errors[0]):
            fails.append(f"merge job {merge}: expected one 'error: ...' line naming part 1, got {errors}")
        else:
            print(f"[{v}] merge job {merge} before the resubmission: {errors[0]}")

# The dataset: manifest.json equal as JSON; every other file of the reference byte-identical; no other shards.
def files(d):
    return sorted(p.relative_to(d).as_posix() for p in d.rglob("*")
                  if p.is_file() and ".prepare" not in p.relative_to(d).parts)

if not (out / "manifest.json").is_file():
    fails.append(f"{out}/manifest.json is missing")
else:
    a, b = json.loads((ref / "manifest.json").read_text()), json.loads((out / "manifest.json").read_text())
    if a != b:
        def diff(x, y, path=""):
            if isinstance(x, dict) and isinstance(y, dict):
                return [d for k in sorted(set(x) | set(y)) for d in diff(x.get(k), y.get(k), f"{path}.{k}")]
            return [] if x == y else [f"{path or '.'}: {json.dumps(x)[:120]} != {json.dumps(y)[:120]}"]
        fails.append("manifest.json differs from the reference's:\n    " + "\n    ".join(diff(a, b)[:20]))
    shards = [s["name"] for split in b["splits"].values() for s in split["shards"]]
    print(f"[{v}] manifest: " + ", ".join(f"{n} {s['docs']} docs {s['tokens']} tokens {len(s['shards'])} shards"
                                         for n, s in b["splits"].items()))
ref_files, out_files = files(ref), files(out)
same = 0
for name in ref_files:
    if name == "manifest.json":
        continue
    if name not in out_files:
        fails.append(f"{name}: in the reference, not in {out}")
    elif subprocess.run(["cmp", "-s", ref / name, out / name]).returncode != 0:
        fails.append(f"{name}: differs from the reference's (cmp)")
    else:
        same += 1
extra = [n for n in out_files if n not in ref_files]
if extra:
    fails.append(f"files not in the reference: {extra[:10]}")
stage = out / ".prepare"
left = sorted(p.name for p in stage.iterdir()) if stage.is_dir() else []
tars = sum(n.endswith(".tar") for n in ref_files)
print(f"[{v}] {same} of {len(ref_files) - 1} files byte-identical to {ref.name}/ ({tars} shards, "
      f"{len(ref_files) - 1 - tars} others: {', '.join(n for n in ref_files if not n.endswith('.tar') and n != 'manifest.json')}); "
      f"task logs: {', '.join(f'{i}: {n} start(s), exits {e}' for i, (n, e) in logs_seen.items())}; "
      f"{stage.name}/ after the merge: {left[:6] if left else 'gone'}")
for f in fails:
    print(f"[{v}] FAIL: {f}")
print(f"[{v}] {'PASS' if not fails else 'FAIL'}")
sys.exit(1 if fails else 0)
PY
}

# Jobs of this bench still queued (an earlier run that failed or was stopped): cancelled, and waited for.
cancel_ours() {
    local jobs t0
    jobs=$(squeue -h -n "$JOB_NAME" -o %A 2>/dev/null | sort -u | paste -sd,)
    [ -n "$jobs" ] || return 0
    log "cancelling jobs $jobs"
    scancel -n "$JOB_NAME"
    wait_jobs "$jobs" 90 || die "jobs $jobs still there 90 s after scancel"
}

command -v squeue >/dev/null && cancel_ours
setup_slurm
mkdir -p "$WORK"
rm -rf "$LOGS"
log "corpus: $(make_corpus) -> $CORPUS"
references
results=()
rc=0
for v in $VARIANTS; do
    t0=$(date +%s)
    if ( run_variant "$v" ); then results+=("$v PASS ($(( $(date +%s) - t0 )) s)"); else results+=("$v FAIL"); rc=1; fi
    cancel_ours
done
log "slurm $(sinfo -V | cut -d' ' -f2), $(nproc) cores, $PARTS parts: ${results[*]}"
[ "$rc" = 0 ] && log "PASS" || log "FAIL"
exit "$rc"
