#!/usr/bin/env bash
# A one-node Slurm on this machine (Debian, root; CPU only, loopback only), for the bench scripts that run
# launch/*.sbatch for real (bench/slurm_preemption.sh, bench/slurm_prepare.sh). Idempotent:
#   bench/slurm_setup.sh                 # install (apt: slurm-wlm, munge) and start munged, slurmctld, slurmd
#   source bench/slurm_setup.sh; setup_slurm   # the same from a script (defines log and die unless defined)
#
# AuthInfo=cred_expire=30 and a 5 s scheduler interval: a requeued job starts again after ~30-40 s (with Slurm's
# defaults, 120 s and 60 s, that is ~2.5 min).

declare -F log >/dev/null || log() { echo "[$(date +%T)] $*"; }
declare -F die >/dev/null || die() { log "FAIL: $*"; exit 1; }

setup_slurm() {
    local node conf=/etc/slurm/slurm.conf want changed=0 d pid
    node=$(hostname -s)
    if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
        log "installing slurm-wlm and munge (apt)"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null
    fi
    if [ ! -s /etc/munge/munge.key ]; then
        log "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        chown munge:munge /etc/munge/munge.key
        chmod 400 /etc/munge/munge.key
    fi
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        log "starting munged"
        mkdir -p /run/munge /var/log/munge /var/lib/munge
        chown munge:munge /run/munge /var/log/munge /var/lib/munge
        chmod 755 /run/munge
        runuser -u munge -- /usr/sbin/munged
        sleep 1
        munge -n | unmunge >/dev/null || die "munge does not work"
    fi

    mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm
    # Loopback only: the controller and the node are this machine at 127.0.0.1.
    want=$(cat <<CONF
# One-node Slurm written by bench/slurm_setup.sh (CPU only, loopback only).
ClusterName=packtrain
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=cred_expire=30
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
JobRequeue=1
ReturnToService=2
KillWait=30
MinJobAge=600
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$node NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
CONF
)
    if [ "$(cat "$conf" 2>/dev/null)" != "$want" ]; then
        log "writing $conf"
        printf '%s\n' "$want" > "$conf"
        changed=1
    fi
    for d in slurmctld slurmd; do
        pid=$(cat "/run/$d.pid" 2>/dev/null || true)
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
            [ "$changed" = 1 ] || continue
            log "restarting $d (new config)"
            kill "$pid"
            for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        fi
        log "starting $d"
        "$d"    # daemonizes; runs as root (SlurmUser/SlurmdUser=root)
    done
    for i in $(seq 60); do
        case $(sinfo -h -n "$node" -o %T 2>/dev/null || true) in
            idle|mixed|allocated) break ;;
            down*|drain*) [ "$i" = 10 ] && scontrol update nodename="$node" state=resume || true ;;
        esac
        sleep 1
    done
    sinfo
    [ "$(sinfo -h -n "$node" -o %T)" = idle ] || { squeue; die "node $node is not idle"; }
}

# Run directly (not sourced): set up and show the node.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -euo pipefail
    setup_slurm
fi
