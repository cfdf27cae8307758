#!/usr/bin/env bash
# A real one-node Slurm cluster (Debian's slurm-wlm + munge) for the tests, all state under one
# folder. Usage: cluster.sh start DIR | cluster.sh stop DIR. After start, DIR/slurm.conf is the
# config to export as SLURM_CONF. Needs root (the daemons run as root). The daemons' ports come from
# SLURMCTLD_PORT and SLURMD_PORT (defaults 16817, 16818), so a test cluster can avoid a real one.
set -euo pipefail
action=$1
dir=$(realpath -m "$2")

stop() {
  for pidfile in "$dir"/slurmd.pid "$dir"/slurmctld.pid "$dir"/munged.pid; do
    [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
  done
  sleep 1
}

if [ "$action" = stop ]; then
  stop
  exit 0
fi

command -v slurmctld >/dev/null || { echo "slurm-wlm is not installed: apt-get install -y slurm-wlm munge" >&2; exit 1; }
mkdir -p "$dir"/state "$dir"/spool "$dir"/munge
host=$(hostname -s)
memory_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))

# munge: its own key and socket, so nothing system-wide is touched.
[ -f "$dir/munge/munge.key" ] || dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 700 "$dir/munge"; chmod 400 "$dir/munge/munge.key"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
  --pid-file="$dir/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"

cat > "$dir/slurm.conf" <<CONF
ClusterName=titanexp
SlurmctldHost=$host
Include $(dirname "$(realpath "$0")")/common.conf
# cred_expire: a requeued job may start again cred_expire + 1 s later (Slurm default 120 s).
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
SlurmctldPort=${SLURMCTLD_PORT:-16817}
SlurmdPort=${SLURMD_PORT:-16818}
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
NodeName=$host CPUs=$(getconf _NPROCESSORS_ONLN) RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF

export SLURM_CONF=$dir/slurm.conf
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 1 60); do
  if sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
    exit 0
  fi
  sleep 0.5
done
echo "slurm did not come up; logs in $dir" >&2
exit 1
