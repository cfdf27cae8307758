"""Seconds of one collective, as the library that runs it would take them (torch-free): NCCL between
GPUs, gloo between CPU ranks.

NCCL (NVIDIA/nccl src/graph/tuning.cc: ncclTopoTuneModel, ncclTopoGetAlgoTime) prices every
algorithm and protocol it may use as latency + bytes / algorithm bandwidth and runs the cheapest:
- **Ring** (every collective): a ring visits each rank once and crosses every node boundary once,
  so the bytes a rank passes on also leave its node once, spread over the NICs that its group's
  ranks on that node use. A node's NICs are shared by the groups that run at the same time (under
  TP 8 the eight FSDP groups have one rank per node each: one NIC each), so the bus bandwidth
  across nodes is min(within a node, NICs of the group × one NIC's busbw). Algorithm bandwidth is
  busbw × nRanks / steps (nRanks - 1 steps for all-gather and reduce-scatter, twice that for
  all-reduce); latency is a base plus one hop per step, the steps that cross nodes at the
  network's hop latency (one rank per node: the tree's).
- **Tree** (all-reduce): busbw × 0.92, algorithm bandwidth half that; latency
  2·((ranks per node - 1)·hop within + log2(nodes)·hop across).
- **PAT** (all-gather and reduce-scatter with one rank per node, NCCL ≥ 2.23): busbw × 0.75;
  latency log2(nodes)·hop across / 3.5 + 2.8 µs per rank.
- **Protocols**: LL sends 8 bytes of data in 16 (busbw × 0.5) at the lowest latency, LL128 120 in
  128 (× 0.92), Simple all of it at the highest latency per hop.
Left out: NVLink SHARP (NVLS) all-reduce inside a node, CollNet, and NCCL's per-channel caps
(what the LL protocols reach on few channels): they change small all-reduces, not FSDP's
all-gathers and reduce-scatters. An all-to-all (expert parallelism) is NCCL's grouped
point-to-point sends: each rank's rows for its node's ranks over NVLink at the same time as those
for other nodes over its share of the NICs.

gloo (CPU ranks): a ring, at the per-call cost and bandwidth measured on this machine
(plan/measure.py).

Where the profile names kernel tables with figures for the collective (estimate/kernel_tables.py:
measured by `plan probe`, or published nccl-tests results), those price it instead.
"""

import math
from dataclasses import dataclass
from typing import Literal

from titan_exp.estimate.config import HardwareConfig

Kind = Literal["all_gather", "reduce_scatter", "all_reduce", "all_to_all"]

# tuning.cc's ncclTunerConstantsDefaults, µs: base latency by algorithm and protocol, and latency
# per hop by link (NVLink, PCI, network).
_PROTOCOLS = ("LL", "LL128", "Simple")
_BASE_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "pat": (None, None, 8.0)}
_HOP_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "pat": (None, None, 4.0)},
    "pci": {"tree": (1.0, 1.9, 4.0), "ring": (1.0, 2.5, 5.7), "pat": (None, None, 4.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "pat": (None, None, 14.0)},
}
# The share of the bus bandwidth each protocol carries data at (LL: 8 of 16 bytes; LL128: 120 of 128).
_PROTOCOL_BANDWIDTH = (0.5, 0.92, 1.0)
_TREE_BANDWIDTH, _PAT_BANDWIDTH = 0.92, 0.75
_PAT_PER_RANK_US = 2.8


def collective_seconds(hw: HardwareConfig, size: float, group: int, inner: int, kind: Kind) -> float:
    """One collective over `group` ranks whose consecutive members lie `inner` ranks apart (the
    mesh dimensions inside it); `size`: bytes of the whole buffer (an all-gather's output, a
    reduce-scatter's input, an all-reduce's buffer), or of the rows a rank sends in an all-to-all."""
    if group <= 1:
        return 0.0
    tables = hw.tables()
    if tables is not None:
        measured = tables.collective_seconds(kind, size, group, across_nodes=inner * group > hw.devices_per_node)
        if measured is not None:
            return measured
    if not hw.overlaps_communication:
        return _gloo(hw, size, group, kind, across_nodes=inner * group > hw.devices_per_node)
    per_node = max(1, min(group, hw.devices_per_node // inner))  # the group's ranks on one node
    nodes = math.ceil(group / per_node)
    # The node's NICs, shared by the devices_per_node / per_node groups that run alongside.
    nics = hw.nics_per_node * per_node / hw.devices_per_node
    across = nics * hw.inter_node_gbps * 1e9
    within = hw.intra_node_gbps * 1e9
    if kind == "all_to_all":
        return _all_to_all(hw, size, group, per_node, nodes, within, across)
    ring = _Ring(group, per_node, nodes, busbw=within if nodes == 1 else min(within, across))
    return min(
        time
        for algorithm in ("ring", "tree", "pat")
        for protocol in range(len(_PROTOCOLS))
        if (time := _algorithm_seconds(hw, algorithm, protocol, size, ring, kind)) is not None
    )


def point_to_point_seconds(hw: HardwareConfig, size: float, across_nodes: bool) -> float:
    """One send of `size` bytes to a peer (a pipeline stage's boundary): on its own node over NVLink
    (or PCI), or to another node over the sender's share of its node's NICs (every rank of the node
    sends at once)."""
    if not hw.overlaps_communication:  # gloo: its per-call cost, then the link's bandwidth
        gbps = hw.inter_node_gbps if across_nodes else hw.intra_node_gbps
        return hw.collective_latency_us * 1e-6 + size / (gbps * 1e9)
    nic_share = hw.nics_per_node / hw.devices_per_node
    gbps = nic_share * hw.inter_node_gbps if across_nodes else hw.intra_node_gbps
    return _send_latency_us(hw, across_nodes) * 1e-6 + size / (gbps * 1e9)


def _send_latency_us(hw: HardwareConfig, across_nodes: bool) -> float:
    """A point-to-point send's: the Simple protocol's base and one hop, on the node's link or the network."""
    link = "net" if across_nodes else hw.intra_node_link
    return _BASE_US["ring"][2] + _HOP_US[link]["ring"][2]


@dataclass(frozen=True)
class _Ring:
    """A communicator's shape: its ranks, how many share a node, over how many nodes, and the bus
    bandwidth (bytes/s) a rank reaches in it."""

    ranks: int
    per_node: int
    nodes: int
    busbw: float


def _algorithm_seconds(
    hw: HardwareConfig, algorithm: str, protocol: int, size: float, ring: _Ring, kind: Kind
) -> float | None:
    """latency + size / algorithm bandwidth of one (algorithm, protocol), None where NCCL has none."""
    ranks, per_node, nodes = ring.ranks, ring.per_node, ring.nodes
    base = _BASE_US[algorithm][protocol]
    if base is None or (algorithm == "tree" and kind != "all_reduce"):
        return None
    if algorithm == "pat" and (kind == "all_reduce" or per_node != 1):
        return None
    within = _HOP_US[hw.intra_node_link][algorithm][protocol]
    # With one rank per node every hop is exposed: NCCL takes the tree's network latency.
    across = _HOP_US["net"]["tree" if per_node == 1 else algorithm][protocol]
    busbw = ring.busbw * _PROTOCOL_BANDWIDTH[protocol]
    if algorithm == "ring":
        steps = (ranks - 1) * (2 if kind == "all_reduce" else 1)
        crossing = (nodes - 1) * (2 if kind == "all_reduce" else 1)
        latency = base + (steps - crossing) * within + crossing * across
        algbw = busbw * ranks / steps
    elif algorithm == "tree":
        latency = base + 2 * ((per_node - 1) * within + math.floor(math.log2(nodes)) * across)
        algbw = busbw * _TREE_BANDWIDTH * 0.5
    else:  # pat
        latency = base + math.floor(math.log2(nodes)) * across / 3.5 + ranks * _PAT_PER_RANK_US
        algbw = busbw * _PAT_BANDWIDTH * ranks / (ranks - 1)
    return latency * 1e-6 + size / algbw


def _all_to_all(
    hw: HardwareConfig, size: float, group: int, per_node: int, nodes: int, within: float, across: float
) -> float:
    """Each rank sends size / group bytes to every other rank, all at once: its node's share over
    NVLink, the rest through its share of the NICs."""
    local = size * (per_node - 1) / group / within
    remote = size * (group - per_node) / group / (across / per_node)  # none within one node
    return _send_latency_us(hw, nodes > 1) * 1e-6 + max(local, remote)


def _gloo(hw: HardwareConfig, size: float, group: int, kind: Kind, across_nodes: bool) -> float:
    """gloo's ring: (g-1)/g of the buffer through each rank's link (an all-reduce twice that), the
    network's once the group leaves a node, after its measured per-call cost (a reducing call's is
    higher)."""
    traffic = size * (group - 1) / group * (2 if kind == "all_reduce" else 1)
    latency = hw.collective_latency_us if kind in ("all_gather", "all_to_all") else hw.reduce_latency_us
    return latency * 1e-6 + traffic / ((hw.inter_node_gbps if across_nodes else hw.intra_node_gbps) * 1e9)
