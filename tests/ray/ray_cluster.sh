#!/usr/bin/env bash
# A real Ray cluster on one machine for the launcher=ray tests: a head and two workers, each a network
# namespace of this machine (rh, rw1, rw2) on a bridge of the root namespace, which takes the part of
# the user's machine (the bridge's address .1). Every node runs Ray's own daemons (`ray start`). The
# file system is shared, except DIR/private: each worker has its own there (a disk not shared).
#
#   ray_cluster.sh start DIR           start it; prints nothing; DIR/address holds the head's job API URL
#   ray_cluster.sh stop DIR            stop it and remove everything it made
#   ray_cluster.sh on NODE DIR CMD..   run CMD on a node (its network)
#   ray_cluster.sh kill NODE DIR       the node dies: its link goes down, then every process on it is SIGKILLed
#   ray_cluster.sh revive NODE DIR     its link up and its Ray daemons started again
#   ray_cluster.sh ps NODE DIR         the processes on a node: a pid and a command line each
#
# Needs root. RAY_TEST_TAG (default 1) names the namespaces, links and subnet: clusters of different
# tags coexist. What start creates is listed in DIR/created; stop (and a failed start) removes it.
set -euo pipefail
action=$1
if [ "$action" = on ] || [ "$action" = kill ] || [ "$action" = revive ] || [ "$action" = ps ]; then
  node=$2
  shift
fi
dir=$(realpath -m "$2")
shift 2

if [ "$action" != start ] && [ -f "$dir/tag" ]; then tag=$(cat "$dir/tag"); else tag=${RAY_TEST_TAG:-1}; fi
prefix=tr$tag                                # link names stop at 15 characters
subnet=10.214.$((tag % 250 + 1))             # .1 the user's machine (the bridge), .10 head, .11/.12 workers
nodes=(rh rw1 rw2)
namespace() { echo "$prefix-$1"; }
address() { case $1 in rh) echo "$subnet.10" ;; rw1) echo "$subnet.11" ;; rw2) echo "$subnet.12" ;; esac; }
# CMD on NODE: in its network namespace, under its own hostname (a UTS namespace).
# Ray's folder of a node: short, its sockets' paths may not pass 107 bytes.
temp_dir() { echo "/tmp/$prefix-$1"; }
inside() { ip netns exec "$(namespace "$1")" unshare --uts bash -c 'hostname "$0" && exec "$@"' "$1" "${@:2}"; }
GCS_PORT=6379
DASHBOARD_PORT=8265

# The node's Ray daemons; each node has its own temp folder (Ray's sockets and logs live there).
start_ray() {
  # The head takes no rank (as on KubeRay, where the head pod usually has num-cpus 0): the ranks go
  # to the workers, two CPUs each; a small object store (the jobs pass little through it).
  local node=$1 cpus=2
  [ "$node" = rh ] && cpus=0
  local common=(--disable-usage-stats --num-cpus "$cpus" --object-store-memory 100000000
    --temp-dir "$(temp_dir "$1")" --node-ip-address "$(address "$1")")
  if [ "$node" = rh ]; then
    # The head's GCS declares a node dead after 3 missed health checks a second apart, each
    # allowed a second (docs/ray.md gives Ray's defaults), so a dead worker's end comes quickly.
    inside rh env RAY_health_check_period_ms=1000 RAY_health_check_timeout_ms=1000 \
      RAY_health_check_failure_threshold=3 ray start --head \
      --port "$GCS_PORT" --dashboard-host 0.0.0.0 --dashboard-port "$DASHBOARD_PORT" --include-dashboard true \
      "${common[@]}" >"$dir/start-$node.log" 2>&1
  else
    # DIR/private is the node's own (a tmpfs in its mount namespace, which `ip netns exec` makes):
    # a folder of the launching machine that the workers do not see, as a disk not shared.
    inside "$node" bash -c 'mount -t tmpfs tmpfs "$0" && exec "$@"' "$dir/private" \
      ray start --address "$(address rh):$GCS_PORT" "${common[@]}" >"$dir/start-$node.log" 2>&1
  fi || { echo "ray start failed on $node: $(tail -3 "$dir/start-$node.log")" >&2; return 1; }
}

# Every process of network namespace $1, killed until none is left (a raylet may start a worker
# between two passes); after 10 s, says which survive (the removals after it then go on as they can).
kill_namespace() {
  local pids
  for _ in $(seq 100); do
    pids=$(ip netns pids "$1" 2>/dev/null) || return 0
    [ -n "$pids" ] || return 0
    kill -9 $pids 2>/dev/null || true
    sleep 0.1
  done
  echo "ray_cluster.sh: processes $(echo $pids) of $1 survived SIGKILL for 10 s" >&2
}

remove_created() {
  [ -f "$dir/created" ] || return 0
  # The nodes' processes first: they write into their folders, which are removed before the
  # namespaces (the reverse of their making).
  { grep '^netns ' "$dir/created" || true; } | while read -r _ name; do kill_namespace "$name"; done
  tac "$dir/created" | while read -r kind name; do
    case $kind in
      netns) ip netns delete "$name" 2>/dev/null || true ;;
      link) ip link delete "$name" 2>/dev/null || true ;;
      dir) rm -rf "$name" || echo "ray_cluster.sh: $name not wholly removed" >&2 ;;
    esac
  done
  rm -f "$dir/created"
}
created() { echo "$1 $2" >> "$dir/created"; }

case $action in
  stop) remove_created; exit ;;
  on) inside "$node" "$@"; exit ;;
  kill)
    inside "$node" ip link set "${prefix}${node}n" down
    kill_namespace "$(namespace "$node")"
    exit ;;
  revive)
    inside "$node" ip link set "${prefix}${node}n" up
    start_ray "$node"
    exit ;;
  ps)
    for pid in $(ip netns pids "$(namespace "$node")"); do
      echo "$pid $(tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null)"
    done
    exit ;;
  start) ;;
  *) echo "usage: $0 start|stop DIR | on|kill|revive|ps NODE DIR [CMD...]" >&2; exit 2 ;;
esac

command -v ray >/dev/null || { echo "ray is not installed: pip install 'ray[default]'" >&2; exit 1; }
[ ! -f "$dir/created" ] || { echo "a cluster runs in $dir already (stop it first)" >&2; exit 1; }
mkdir -p "$dir/private"
echo "$tag" > "$dir/tag"
trap 'status=$?; if [ $status -ne 0 ]; then remove_created || true; fi; exit $status' EXIT

ip link add "${prefix}br" type bridge
created link "${prefix}br"
ip addr add "$subnet.1/24" dev "${prefix}br"
ip link set "${prefix}br" up
for node in "${nodes[@]}"; do
  ns=$(namespace "$node")
  ip netns add "$ns"
  created netns "$ns"
  ip link add "${prefix}${node}h" type veth peer name "${prefix}${node}n"
  created link "${prefix}${node}h"
  ip link set "${prefix}${node}n" netns "$ns"
  ip link set "${prefix}${node}h" master "${prefix}br" up
  inside "$node" ip addr add "$(address "$node")/24" dev "${prefix}${node}n"
  inside "$node" ip link set "${prefix}${node}n" up
  inside "$node" ip link set lo up
done
for node in "${nodes[@]}"; do
  created dir "$(temp_dir "$node")"
  start_ray "$node"
done
echo "http://$(address rh):$DASHBOARD_PORT" > "$dir/address"
