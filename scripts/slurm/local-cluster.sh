#!/usr/bin/env bash
# A one-node SLURM on this machine (munged + slurmctld + slurmd on localhost), for the tests,
# CI and anyone who wants to try `jaxinfra sweep --launcher slurm --submit` without a cluster.
#
#   scripts/slurm/local-cluster.sh start    # prints the `export SLURM_CONF=...` line to use
#   scripts/slurm/local-cluster.sh status
#   scripts/slurm/local-cluster.sh stop
#
# Needs Debian/Ubuntu's slurm-wlm and munge packages (apt-get install slurm-wlm munge) and root
# (slurmd runs jobs as their user). Everything it writes (slurm.conf, the munge key and socket,
# state, logs, pid files) lives in the state dir, ${JAXINFRA_SLURM_DIR:-/tmp/jaxinfra-slurm};
# nothing goes to /etc. No cgroups (proctrack/linuxproc, task/none) so it runs in containers,
# and no slurmdbd: `sacct` is unavailable and `jaxinfra sweep --status` does without it.
# Ports: JAXINFRA_SLURM_PORT (slurmctld, default 16817) and that + 1 (slurmd).
# CPUs declared: JAXINFRA_SLURM_CPUS (default 4, even on a smaller machine: config_overrides).
set -euo pipefail

DIR=${JAXINFRA_SLURM_DIR:-/tmp/jaxinfra-slurm}
PORT=${JAXINFRA_SLURM_PORT:-16817}
CPUS=${JAXINFRA_SLURM_CPUS:-4}
NODE=$(hostname -s)
CONF=$DIR/slurm.conf

die() { echo "local-cluster: $*" >&2; exit 1; }

pid_of() { cat "$DIR/$1.pid" 2>/dev/null || true; }

running() {  # running NAME: the daemon whose pid file is DIR/NAME.pid is alive
  local pid
  pid=$(pid_of "$1")
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null
}

write_conf() {
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/munge"
  cat >"$CONF.new" <<EOF
# written by scripts/slurm/local-cluster.sh: a one-node cluster on $NODE
ClusterName=jaxinfra-local
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
JobRequeue=1
MinJobAge=3600
KillWait=30
SchedulerParameters=sched_interval=2
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.new" "$CONF"
}

start_munge() {
  running munged && return
  [ -f "$DIR/munge/munge.key" ] || {
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$DIR/munge/munge.key"
  }
  chmod 755 "$DIR/munge"  # clients of any user reach the socket; the key stays 600
  munged --force --key-file="$DIR/munge/munge.key" --socket="$DIR/munge/munge.socket" \
    --pid-file="$DIR/munged.pid" --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munge.seed"
}

idle() {
  sinfo -h -N -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'
}

start() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null ||
    die "slurmctld or munged not found; install them: apt-get install slurm-wlm munge"
  [ "$(id -u)" = 0 ] || die "run as root (slurmd starts jobs as their users)"
  export SLURM_CONF=$CONF
  if running slurmctld && running slurmd && idle; then
    echo "export SLURM_CONF=$CONF"
    return
  fi
  write_conf
  start_munge
  running slurmctld || slurmctld -f "$CONF"
  running slurmd || slurmd -f "$CONF" -N "$NODE"
  for _ in $(seq 1 100); do
    idle && break
    sleep 0.2
  done
  if ! idle; then
    # a node left DOWN by an earlier run of this script: bring it back
    scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
    sleep 1
  fi
  idle || die "the node did not come up idle; see $DIR/log/slurmctld.log and $DIR/log/slurmd.log"
  echo "export SLURM_CONF=$CONF"
}

stop() {
  local pids=() pid
  for name in slurmd slurmctld munged; do
    pid=$(pid_of "$name")
    if [ -n "$pid" ] && kill "$pid" 2>/dev/null; then pids+=("$pid"); fi
  done
  for pid in "${pids[@]}"; do
    for _ in $(seq 1 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
  done
  rm -f "$DIR"/{slurmd,slurmctld,munged}.pid
  echo "local-cluster: stopped"
}

status() {
  for name in munged slurmctld slurmd; do
    if running "$name"; then echo "$name: running (pid $(pid_of "$name"))"; else echo "$name: stopped"; fi
  done
  [ -f "$CONF" ] && SLURM_CONF=$CONF sinfo 2>/dev/null || true
  running slurmctld && running slurmd
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
