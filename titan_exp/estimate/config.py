"""The `hardware` group (a device profile the planner predicts for) and the `plan` section (what
`python -m titan_exp plan` and a sweep's pruning do with the predictions). Torch-free."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class HardwareConfig:
    """One device and its links. Figures are dense (no sparsity), per device; a value of -1 is
    measured on this machine (the `cpu` profile: plan/measure.py, cached under outputs/cache)."""

    name: str = "cpu"
    # Peak FLOP/s by the dtype the matmuls run in (float8: torchao's scaled matmuls).
    peak_tflops_float32: float = -1.0
    peak_tflops_bfloat16: float = -1.0
    peak_tflops_float8: float = -1.0
    # The fraction of peak a transformer's step reaches (the rest: kernels' shapes, elementwise
    # work, launches); MFU of well-tuned runs. Not used where compute is measured (cpu).
    compute_efficiency: float = -1.0
    memory_gib: float = -1.0
    # Memory bandwidth (GB/s): what the optimizer step, bandwidth-bound, runs at.
    memory_gbps: float = -1.0
    # Bus bandwidth of one device in a collective (GB/s, nccl-tests' "busbw"): within a node
    # (NVLink / shared memory) and across nodes (InfiniBand, RoCE); and the fixed cost of one call.
    intra_node_gbps: float = -1.0
    inter_node_gbps: float = -1.0
    collective_latency_us: float = -1.0
    # The same for a reducing collective (reduce-scatter, all-reduce): gloo's cost far more.
    reduce_latency_us: float = -1.0
    devices_per_node: int = 8
    # Whether FSDP/DDP's collectives run beside compute (nccl's streams) or block it (gloo on CPU).
    overlaps_communication: bool = True

    def peak_flops(self, dtype: str) -> float:
        return {"float32": self.peak_tflops_float32, "bfloat16": self.peak_tflops_bfloat16}.get(
            dtype, self.peak_tflops_float8
        ) * 1e12


@dataclass
class PlanConfig:
    # GiB a rank may use; None: the device's memory less `memory_margin`.
    memory_budget_gib: Optional[float] = None
    # Kept free of the device's memory for the allocator's fragmentation, the CUDA context, NCCL.
    memory_margin: float = 0.1
    # A training sweep (-m) skips the points predicted not to fit and records each as pruned.
    prune: bool = False
    # Measure rank 0's memory with the dry run's pass (fake process group, fake tensors: any size,
    # a few seconds) rather than model it; false: model everything (instant).
    measure: bool = True
