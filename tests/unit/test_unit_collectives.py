"""titan_exp/estimate/collectives.py: one collective's seconds as NCCL's cost model (tuning.cc) and
gloo's ring price it, worked by hand on a made-up node of round figures."""

import dataclasses

import pytest

from titan_exp.estimate.collectives import collective_seconds, point_to_point_seconds
from titan_exp.estimate.config import HardwareConfig

# 8 devices a node on 100 GB/s of NVLink busbw, 8 NICs of 10 GB/s each.
NCCL = HardwareConfig(
    name="test",
    device="cuda",
    intra_node_gbps=100.0,
    inter_node_gbps=10.0,
    nics_per_node=8,
    devices_per_node=8,
    overlaps_communication=True,
)
GLOO = dataclasses.replace(NCCL, overlaps_communication=False, collective_latency_us=10.0, reduce_latency_us=20.0)
GB = 1e9


def test_gloo_ring_by_hand() -> None:
    """(g-1)/g of the buffer through each link, twice for an all-reduce; latency per call."""
    assert collective_seconds(GLOO, GB, 1, 1, "all_gather") == 0.0
    # 1 GB over 4 ranks on 100 GB/s: 0.75 GB → 7.5 ms, + 10 µs.
    assert collective_seconds(GLOO, GB, 4, 1, "all_gather") == pytest.approx(10e-6 + 7.5e-3)
    assert collective_seconds(GLOO, GB, 4, 1, "reduce_scatter") == pytest.approx(20e-6 + 7.5e-3)
    assert collective_seconds(GLOO, GB, 4, 1, "all_reduce") == pytest.approx(20e-6 + 15e-3)
    # Beyond a node (4 ranks 4 apart: 16 > 8): the network's 10 GB/s.
    assert collective_seconds(GLOO, GB, 4, 4, "all_gather") == pytest.approx(10e-6 + 75e-3)


def test_a_large_all_gather_in_a_node_is_a_simple_ring() -> None:
    """8 ranks, Simple protocol: 8.4 µs + 7 NVLink hops of 3.4 µs; 7/8 GB at 100 GB/s."""
    expected = (8.4 + 7 * 3.4) * 1e-6 + GB * 7 / 8 / (100 * GB)
    assert collective_seconds(NCCL, GB, 8, 1, "all_gather") == pytest.approx(expected)


def test_a_small_all_gather_takes_the_low_latency_protocol() -> None:
    """1 KB: LL's 6.6 µs + 7 × 0.6 µs beats Simple's 32.2 µs, at half the bandwidth."""
    expected = (6.6 + 7 * 0.6) * 1e-6 + 1e3 * 7 / 8 / (50 * GB)
    assert collective_seconds(NCCL, 1e3, 8, 1, "all_gather") == pytest.approx(expected)


def test_a_ring_over_nodes_uses_all_of_a_nodes_nics() -> None:
    """64 ranks, 8 a node: the ring leaves each node once, over its 8 NICs (80 GB/s, not one
    NIC's 10); 7 of the 63 steps cross nodes at the network's 14 µs."""
    expected = (8.4 + 56 * 3.4 + 7 * 14.0) * 1e-6 + GB * 63 / 64 / (80 * GB)
    assert collective_seconds(NCCL, GB, 64, 1, "all_gather") == pytest.approx(expected)
    # Twice the NICs: the NVLink becomes the bound.
    more_nics = dataclasses.replace(NCCL, nics_per_node=16)
    assert collective_seconds(more_nics, GB, 64, 1, "all_gather") == pytest.approx(
        (8.4 + 56 * 3.4 + 7 * 14.0) * 1e-6 + GB * 63 / 64 / (100 * GB)
    )


def test_one_rank_a_node_gets_one_nic_and_pat() -> None:
    """8 ranks 8 apart (under TP 8): one rank a node, one NIC each (the other 7 groups use the
    rest). PAT (busbw × 0.75, log latency) against the ring; the ring wins for a large buffer."""
    ring = (8.4 + 7 * 14.0) * 1e-6 + GB * 7 / 8 / (10 * GB)  # every hop crosses: tree's net latency
    pat = (8.0 + 3 * 14.0 / 3.5 + 8 * 2.8) * 1e-6 + GB * 7 / 8 / (7.5 * GB)
    assert collective_seconds(NCCL, GB, 8, 8, "reduce_scatter") == pytest.approx(min(ring, pat)) == pytest.approx(ring)
    # A small buffer: PAT's latency (42.4 µs) beats the ring's Simple (106 µs) and LL's (6.6 + 7 × 5 µs
    # at half the bandwidth).
    small = 1e5
    pat_small = (8.0 + 3 * 14.0 / 3.5 + 8 * 2.8) * 1e-6 + small * 7 / 8 / (7.5 * GB)
    ll_small = (6.6 + 7 * 5.0) * 1e-6 + small * 7 / 8 / (5 * GB)
    assert collective_seconds(NCCL, small, 8, 8, "all_gather") == pytest.approx(min(pat_small, ll_small))


def test_all_reduce_takes_the_tree_across_many_nodes() -> None:
    """A small all-reduce over 64 nodes (one rank each): the tree's 2·log2(64) network hops beat
    the ring's 126 steps."""
    tree = (8.4 + 2 * 6 * 14.0) * 1e-6 + 1e6 / (10 * GB * 0.92 * 0.5)
    ring = (8.4 + 126 * 14.0) * 1e-6 + 1e6 * 126 / 64 / (10 * GB)
    seconds = collective_seconds(NCCL, 1e6, 64, 8, "all_reduce")
    assert seconds <= tree < ring


def test_pci_hops_cost_more_than_nvlink() -> None:
    pci = dataclasses.replace(NCCL, intra_node_link="pci")
    assert collective_seconds(pci, GB, 8, 1, "all_gather") - collective_seconds(NCCL, GB, 8, 1, "all_gather") == (
        pytest.approx(7 * (5.7 - 3.4) * 1e-6)
    )


def test_all_to_all_sends_off_node_rows_through_the_nics() -> None:
    """16 ranks, 8 a node, 1.6 GB of rows a rank: 0.7 GB to its node's 7 others at 100 GB/s, 0.8
    GB to the other node through its NIC (10 GB/s): the network bounds it."""
    expected = (8.4 + 14.0) * 1e-6 + 1.6 * GB * 8 / 16 / (10 * GB)
    assert collective_seconds(NCCL, 1.6 * GB, 16, 1, "all_to_all") == pytest.approx(expected)
    within = (8.4 + 3.4) * 1e-6 + 1.6 * GB * 7 / 8 / (100 * GB)
    assert collective_seconds(NCCL, 1.6 * GB, 8, 1, "all_to_all") == pytest.approx(within)


def test_a_send_across_nodes_takes_one_nics_share() -> None:
    assert point_to_point_seconds(NCCL, GB, across_nodes=True) == pytest.approx((8.4 + 14.0) * 1e-6 + 0.1)
    assert point_to_point_seconds(NCCL, GB, across_nodes=False) == pytest.approx((8.4 + 3.4) * 1e-6 + 0.01)
    assert point_to_point_seconds(GLOO, GB, across_nodes=False) == pytest.approx(10e-6 + 0.01)
