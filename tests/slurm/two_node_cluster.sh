#!/usr/bin/env bash
# A real two-node Slurm cluster on one machine (Debian's slurm-wlm + munge) for the multi-node tests.
# Each node is a network namespace with a hostname of its own (a UTS namespace), tn1 and tn2, on a
# bridge of the root namespace, and a mount namespace where DIR/hosts is bind-mounted over /etc/hosts:
# inside a node both names resolve to the nodes' addresses, and nothing system-wide is edited (/sys
# stays mounted as it is, with its cgroups, which slurmd wants). One slurmd runs in each node;
# slurmctld and munged run in the root namespace, reached on the bridge.
#
#   two_node_cluster.sh start DIR          start it; DIR/slurm.conf is the config to export as SLURM_CONF
#   two_node_cluster.sh stop DIR           stop it and remove everything it made
#   two_node_cluster.sh on NODE DIR CMD..  run CMD on a node (its network, hostname and hosts file)
#   two_node_cluster.sh kill NODE DIR      the node dies: its link goes down (its peers get no word),
#                                          then every process on it is SIGKILLed
#   two_node_cluster.sh revive NODE DIR    its link up again and its slurmd restarted
#   two_node_cluster.sh ps NODE DIR        the processes on a node: a pid and a command line each
#
# Needs root. Read by start: SLURMCTLD_PORT and SLURMD_PORT (defaults 16827, 16828), so that a test
# cluster avoids a real one, and SLURMD_TIMEOUT (30 s: how long a dead node takes to be DOWN). The
# names of our namespaces and links, and the subnet, derive from the controller's port: clusters on
# different ports coexist. What start creates is listed in DIR/created as it goes; stop (and a start
# that fails) removes exactly that, newest first.
set -euo pipefail
action=$1
if [ "$action" = on ] || [ "$action" = kill ] || [ "$action" = revive ] || [ "$action" = ps ]; then
  node=$2
  shift
fi
dir=$(realpath -m "$2")
shift 2

nodes=(tn1 tn2)
# A started cluster's own port, from its config: the other actions need no environment.
if [ "$action" != start ] && [ -f "$dir/slurm.conf" ]; then
  ctld_port=$(sed -n 's/^SlurmctldPort=//p' "$dir/slurm.conf")
else
  ctld_port=${SLURMCTLD_PORT:-16827}
fi
tag=te$ctld_port                          # at most 7 characters: link names stop at 15
subnet=10.213.$((ctld_port % 250 + 1))    # .1 the controller (the bridge), .11 and .12 the nodes
namespace() { echo "$tag-$1"; }
address() { echo "$subnet.$((10 + ${1#tn}))"; }
# CMD on NODE: in its network namespace, with its hostname and hosts file.
inside() {
  nsenter --net="/var/run/netns/$(namespace "$1")" unshare --mount --uts \
    bash -c 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"' "$dir/hosts" "$@"
}

# Remove what DIR/created lists, newest first; each line: a kind and a name.
remove_created() {
  [ -f "$dir/created" ] || return 0
  tac "$dir/created" | while read -r kind name; do
    case $kind in
      daemon) [ -f "$name" ] && kill "$(cat "$name")" 2>/dev/null || true ;;
      netns)
        # Everything still running on the node goes with it (slurmd, its steps, their tasks).
        for pid in $(ip netns pids "$name" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns delete "$name" 2>/dev/null || true ;;
      link) ip link delete "$name" 2>/dev/null || true ;;
    esac
  done
  rm -f "$dir/created"
  # The daemons leave within a second of SIGTERM; wait for them so that none outlives stop.
  for _ in $(seq 1 50); do
    pgrep -f -- "$dir/slurm.conf|$dir/munge/" >/dev/null || return 0
    sleep 0.2
  done
  echo "daemons of $dir still running after stop" >&2
  return 1
}

created() { echo "$1 $2" >> "$dir/created"; }

start_slurmd() {
  local node=$1
  inside "$node" slurmd -f "$dir/slurm.conf" -N "$node"
}

case $action in
  stop) remove_created; exit ;;
  on) inside "$node" "$@"; exit ;;
  kill)
    ns=$(namespace "$node")
    ip netns exec "$ns" ip link set "$tag${node#tn}n" down
    for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
    exit ;;
  ps)
    for pid in $(ip netns pids "$(namespace "$node")"); do
      echo "$pid $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)"
    done
    exit ;;
  revive)
    ip netns exec "$(namespace "$node")" ip link set "$tag${node#tn}n" up
    start_slurmd "$node"
    exit ;;
  start) ;;
  *) echo "usage: $0 start|stop DIR | on|kill|revive|ps NODE DIR [CMD...]" >&2; exit 2 ;;
esac

command -v slurmctld >/dev/null || { echo "slurm-wlm is not installed: apt-get install -y slurm-wlm munge" >&2; exit 1; }
[ ! -f "$dir/created" ] || { echo "a cluster runs in $dir already (stop it first)" >&2; exit 1; }
mkdir -p "$dir"/state "$dir"/spool "$dir"/munge
trap 'status=$?; if [ $status -ne 0 ]; then remove_created || true; fi; exit $status' EXIT

# The network: a bridge with the controller's address; per node a namespace, a veth pair from the
# bridge into it and an address. The nodes' hosts file names them all.
ip link add "${tag}br" type bridge
created link "${tag}br"
ip addr add "$subnet.1/24" dev "${tag}br"
ip link set "${tag}br" up
controller=$(hostname -s)
hosts="127.0.0.1 localhost
$subnet.1 $controller"
for node in "${nodes[@]}"; do hosts+=$'\n'"$(address "$node") $node"; done
echo "$hosts" > "$dir/hosts"
for node in "${nodes[@]}"; do
  ns=$(namespace "$node") host_end=$tag${node#tn}h node_end=$tag${node#tn}n
  ip netns add "$ns"
  created netns "$ns"
  ip link add "$host_end" type veth peer name "$node_end"
  created link "$host_end"
  ip link set "$node_end" netns "$ns"
  ip link set "$host_end" master "${tag}br" up
  ip netns exec "$ns" ip addr add "$(address "$node")/24" dev "$node_end"
  ip netns exec "$ns" ip link set "$node_end" up
  ip netns exec "$ns" ip link set lo up
  mkdir -p "$dir/spool/$node"
done

# munge: its own key and socket (a path, seen from every namespace), so nothing system-wide is touched.
[ -f "$dir/munge/munge.key" ] || dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 700 "$dir/munge"; chmod 400 "$dir/munge/munge.key"
created daemon "$dir/munged.pid"
munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
  --pid-file="$dir/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"

# Each node gets half the machine's memory; both claim every core (the tests oversubscribe them).
memory_mb=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 - 512 ))
cores=$(getconf _NPROCESSORS_ONLN)
cat > "$dir/slurm.conf" <<CONF
ClusterName=titanexp2
SlurmctldHost=$controller($subnet.1)
Include $(dirname "$(realpath "$0")")/common.conf
# cred_expire: a requeued job may start again cred_expire + 1 s later (Slurm default 120 s).
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=5
# A node that stops answering is DOWN after SlurmdTimeout; a job still on it ends NODE_FAIL.
SlurmdTimeout=${SLURMD_TIMEOUT:-30}
SlurmctldPort=$ctld_port
SlurmdPort=${SLURMD_PORT:-16828}
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.%n.log
NodeName=tn1 NodeAddr=$(address tn1) CPUs=$cores RealMemory=$memory_mb State=UNKNOWN
NodeName=tn2 NodeAddr=$(address tn2) CPUs=$cores RealMemory=$memory_mb State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF

export SLURM_CONF=$dir/slurm.conf
created daemon "$dir/slurmctld.pid"
slurmctld -f "$SLURM_CONF"
for node in "${nodes[@]}"; do
  created daemon "$dir/slurmd.$node.pid"
  start_slurmd "$node"
done
for _ in $(seq 1 60); do
  if [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cE '^(idle|mixed|allocated)$')" = 2 ]; then
    exit 0
  fi
  sleep 0.5
done
echo "the two nodes did not come up; logs in $dir; sinfo: $(sinfo -N 2>&1)" >&2
exit 1
