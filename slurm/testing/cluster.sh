#!/usr/bin/env bash
# A two-node SLURM on this host, for the slurm/ templates' tests:  slurm/testing/cluster.sh up|down|status
#
# Everything lives under one state folder ($DLO_SLURM_DIR, default /tmp/dlo-slurm-test): slurm.conf, its
# own munge key, socket, pid and log files. A system munge or slurm on the same host is left alone: munged
# gets its own socket (slurm.conf's AuthInfo points the clients at it) and the daemons their own ports.
# Debian's slurm-wlm is built with MULTIPLE_SLURMD, so two slurmd (-N n1, -N n2) on the loopback make a
# two-node partition `debug`. Needs root (slurmd runs jobs as their users) and `slurm-wlm munge`.
# Each node has $DLO_SLURM_GPUS GPUs (default 4) as SLURM sees them (GRES gpu: see write_gres), so that
# --gres=gpu:N, --gpus-per-task and each task's CUDA_VISIBLE_DEVICES are real; torch sees no CUDA behind them.
# Use it from a shell with:  export SLURM_CONF=$DLO_SLURM_DIR/slurm.conf   (what `up` prints)
#
# Every daemon is started with DLO_SLURM_CLUSTER=<state folder> in its environment (so a recycled pid in
# a pid file is never taken for ours). `down` cancels the jobs, stops the daemons by their pid files, then
# any process still marked or holding a file of the state folder open (a slurmstepd keeps its node's log
# open and runs in the log folder; slurmd clears its environment): exactly what `up` started, nothing else.
set -euo pipefail
shopt -s nullglob

DIR=${DLO_SLURM_DIR:-/tmp/dlo-slurm-test}
CONF=$DIR/slurm.conf
CTLD_PORT=${DLO_SLURM_CTLD_PORT:-16817}
NODE_PORTS=(${DLO_SLURM_NODE_PORTS:-17001 17002})
NODES=(n1 n2)
GPUS=${DLO_SLURM_GPUS:-4}
export SLURM_CONF=$CONF

die() { echo "cluster.sh: $*" >&2; exit 1; }

write_conf() {
    # the CPUs this host gives us; nproc alone honours OMP_NUM_THREADS: a cluster brought up from a shell with
    # OMP_NUM_THREADS=1 (the house rule for hand runs) had 1 CPU a node, and a third 1-CPU job waited (issue 38)
    local host cpus; host=$(hostname -s); cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    cat > "$CONF" <<EOF
# Written by slurm/testing/cluster.sh: a two-node test cluster on 127.0.0.1 (state in $DIR).
ClusterName=dlotest
# host(address): clients reach slurmctld at the address, so the host name need not resolve.
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$CTLD_PORT
AuthType=auth/munge
# cred_expire is also how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket=$DIR/munge-socket/munge.socket,cred_expire=20
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
StateSaveLocation=$DIR/state
SlurmctldLogFile=$DIR/log/ctld.log
SlurmctldPidFile=$DIR/pid/ctld.pid
SlurmdPidFile=$DIR/pid/d-%n.pid
SlurmdSpoolDir=$DIR/spool-%n
SlurmdLogFile=$DIR/log/d-%n.log
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
# Ended jobs stay in scontrol for an hour (no accounting database here: that is where tests read their state).
MinJobAge=3600
KillWait=5
SchedulerParameters=bf_interval=2
JobRequeue=1
GresTypes=gpu
NodeName=${NODES[0]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${NODE_PORTS[0]} CPUs=$cpus RealMemory=4000 Gres=gpu:$GPUS
NodeName=${NODES[1]} NodeHostname=$host NodeAddr=127.0.0.1 Port=${NODE_PORTS[1]} CPUs=$cpus RealMemory=4000 Gres=gpu:$GPUS
PartitionName=debug Nodes=${NODES[0]},${NODES[1]} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
}

# GPUs as SLURM sees them: a gres.conf whose File= entries are files of the state folder named as a
# node's device files are (nvidia0...; the same names on both nodes, as on real ones). SLURM 22.05 takes
# only character or block devices there ("not a valid character or block device": no GPU in any job's
# environment), so each is a character device with /dev/null's numbers: nothing behind it to open.
# Without task/cgroup nothing is confined: --gres=gpu:N, --gpus-per-task and each task's
# CUDA_VISIBLE_DEVICES are SLURM's own.
write_gres() {
    mkdir -p "$DIR/gpu"
    local i
    for i in $(seq 0 $((GPUS - 1))); do
        [ -c "$DIR/gpu/nvidia$i" ] || { rm -f "$DIR/gpu/nvidia$i"; mknod -m 600 "$DIR/gpu/nvidia$i" c 1 3; }
    done
    cat > "$DIR/gres.conf" <<EOF
# Written by slurm/testing/cluster.sh: $GPUS GPU(s) per node, device files with nothing behind them.
AutoDetect=off
Name=gpu File=$DIR/gpu/nvidia[0-$((GPUS - 1))]
EOF
}

# start NAME CMD...: run a daemon marked as ours; it forks and writes its own pid file.
start() {
    local name=$1; shift
    DLO_SLURM_CLUSTER=$DIR "$@" || die "$name did not start; see $DIR/log/"
}

wait_idle() {
    local i
    for i in $(seq 1 60); do
        if [ "$(sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" = "${#NODES[@]}" ]; then
            sinfo; return 0
        fi
        sleep 1
    done
    sinfo || true
    die "nodes not idle after 60 s; logs in $DIR/log/"
}

up() {
    [ "$(id -u)" = 0 ] || die "needs root (slurmd runs jobs as their users)"
    for cmd in munged slurmctld slurmd sinfo; do
        command -v "$cmd" >/dev/null || die "$cmd not found: apt-get install -y slurm-wlm munge"
    done
    if [ -f "$DIR/pid/ctld.pid" ] && pid_alive "$DIR/pid/ctld.pid"; then
        echo "cluster.sh: already up ($DIR)"; wait_idle; return 0
    fi
    mkdir -p "$DIR"/{state,log,pid,munge,munge-socket}
    # the key private; the socket in a folder every user may enter: a student's sbatch/squeue talks to munged
    # too (issue 38: with the socket beside the key, every SLURM command of a non-root user was refused)
    chmod 700 "$DIR/munge"
    chmod 755 "$DIR" "$DIR/munge-socket"
    [ -f "$DIR/munge/munge.key" ] || { dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
                                         chmod 400 "$DIR/munge/munge.key"; }
    write_conf
    write_gres
    # munged refuses a world-writable parent without --force; ours are root-owned (key 700, socket 755).
    start munged munged --force --socket="$DIR/munge-socket/munge.socket" --key-file="$DIR/munge/munge.key" \
        --pid-file="$DIR/pid/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/seed"
    start slurmctld slurmctld -f "$CONF"
    local n
    for n in "${NODES[@]}"; do start "slurmd $n" slurmd -f "$CONF" -N "$n"; done
    wait_idle
    echo "export SLURM_CONF=$CONF"
}

# pid_alive FILE: the pid in FILE is running and carries our mark (a recycled pid is not ours).
pid_alive() {
    local pid; pid=$(cat "$1" 2>/dev/null) || return 1
    [ -n "$pid" ] && marked "$pid"
}

marked() {
    { tr '\0' '\n' < "/proc/$1/environ"; } 2>/dev/null | grep -qxF "DLO_SLURM_CLUSTER=$DIR"
}

# ours PID: marked, or running in or holding open a file of the state folder (slurmstepd).
ours() {
    marked "$1" && return 0
    local f
    for f in "/proc/$1/cwd" "/proc/$1"/fd/*; do
        case $(readlink "$f" 2>/dev/null) in "$DIR"|"$DIR"/*) return 0 ;; esac
    done
    return 1
}

# Every process of this cluster (the daemons, slurmstepd), except this script and its subshells.
our_pids() {
    local p
    for p in /proc/[0-9]*; do
        p=${p#/proc/}
        [ "$p" = $$ ] || [ "$p" = "$BASHPID" ] || [ "$(cut -d' ' -f4 "/proc/$p/stat" 2>/dev/null)" = $$ ] && continue
        ours "$p" && echo "$p"
    done
    return 0
}

# stop PID...: TERM, up to 10 s, then KILL.
stop() {
    [ $# -gt 0 ] || return 0
    kill -TERM "$@" 2>/dev/null || true
    local i p left
    for i in $(seq 1 20); do
        left=(); for p in "$@"; do [ -d "/proc/$p" ] && ours "$p" && left+=("$p"); done
        [ ${#left[@]} = 0 ] && return 0
        sleep 0.5
    done
    echo "cluster.sh: killing ${left[*]} (no exit 10 s after TERM)" >&2
    kill -KILL "${left[@]}" 2>/dev/null || true
}

down() {
    [ -f "$CONF" ] || { echo "cluster.sh: nothing to stop ($CONF missing)"; return 0; }
    # Jobs first, while slurmctld can still tell the nodes to end them.
    if pid_alive "$DIR/pid/ctld.pid"; then scancel --full --quiet -p debug 2>/dev/null || true; fi
    local f pid
    for f in "$DIR"/pid/d-*.pid "$DIR/pid/ctld.pid" "$DIR/pid/munged.pid"; do
        [ -f "$f" ] || continue
        pid=$(cat "$f"); if marked "$pid"; then stop "$pid"; fi
        rm -f "$f"
    done
    # What the daemons left behind (a slurmstepd of a job that did not end).
    local rest
    mapfile -t rest < <(our_pids)
    if [ ${#rest[@]} -gt 0 ]; then
        echo "cluster.sh: stopping ${#rest[@]} leftover process(es): ${rest[*]}" >&2
        stop "${rest[@]}"
    fi
    echo "cluster.sh: down ($DIR kept: logs and state)"
}

status() {
    [ -f "$CONF" ] || { echo "down (no $CONF)"; return 1; }
    local f up=0
    for f in "$DIR/pid/munged.pid" "$DIR/pid/ctld.pid" "$DIR"/pid/d-*.pid; do
        if [ -f "$f" ] && pid_alive "$f"; then echo "$(basename "$f" .pid): running, pid $(cat "$f")"; up=$((up + 1))
        else echo "$(basename "$f" .pid): stopped"; fi
    done
    [ $up -ge 4 ] && sinfo && echo "export SLURM_CONF=$CONF"
}

case ${1:-} in
    up) up ;;
    down) down ;;
    status) status ;;
    pids) our_pids ;;  # for the tests: what `down` must leave at nothing
    *) die "usage: $0 up|down|status   (state in \$DLO_SLURM_DIR, default /tmp/dlo-slurm-test)" ;;
esac
