"""The `hardware` group: a device profile the planner predicts for. Torch-free."""

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from titan_exp.rules import ConfigError, Section, one_of

if TYPE_CHECKING:
    from titan_exp.estimate.kernel_tables import KernelTables

# The figures only gloo's collectives read (estimate/collectives.py): a GPU profile leaves them out.
GLOO_ONLY = ("collective_latency_us", "reduce_latency_us")
# Where each other figure lies on any device, with room of a thousandfold around today's (a CPU
# core's 0.01 TFLOP/s to a GB200's 2,500; a NIC's 1 GB/s to NVLink 5's 900; 8 to 1,024 devices a
# node): beyond, a figure is a typo or a slip of units, and a plan with it overflows or divides by
# almost nothing. The efficiencies and the allocator's slack are fractions (HardwareConfig.check).
FIGURE_RANGES: dict[str, tuple[float, float]] = {
    "peak_tflops_float32": (1e-5, 1e7),
    "peak_tflops_bfloat16": (1e-5, 1e7),
    "peak_tflops_float8": (1e-5, 1e7),
    "sm_count": (1, 100_000),
    "memory_gib": (1e-3, 1e7),
    "memory_gbps": (1e-2, 1e7),
    "intra_node_gbps": (1e-3, 1e6),
    "inter_node_gbps": (1e-3, 1e6),
    "nics_per_node": (1, 1024),
    "collective_latency_us": (1e-3, 1e7),
    "reduce_latency_us": (1e-3, 1e7),
    "devices_per_node": (1, 65_536),
    "time_sharing_cost": (1, 100),
}


@dataclass
class HardwareConfig(Section):
    """One device and its links. Figures are dense (no sparsity), per device; a value of -1 is
    measured on this machine (the `cpu` profile: plan/measure.py, cached under outputs/cache)."""

    name: str = "cpu"
    # What the ranks run on: this machine's CPU cores (gloo; compute and links measured here, the
    # memory model's CPU allocator) or GPUs (nccl; every figure from the profile). The kind, not
    # the name, decides: a calibrated copy of `cpu` keeps device=cpu under a name of its own.
    device: str = one_of("cpu", "cuda")
    # The GPUs this profile stands for: substrings of torch.cuda.get_device_name(), the longest one
    # contained in the name wins ('H100 PCIe' over 'H100'); the trainer's MFU takes the peak from it
    # (estimate/hardware_profiles.py).
    device_names: list[str] = field(default_factory=list)
    # Peak FLOP/s by the dtype the matmuls run in (float8: torchao's scaled matmuls).
    peak_tflops_float32: float = -1.0
    peak_tflops_bfloat16: float = -1.0
    peak_tflops_float8: float = -1.0
    # Fractions of a peak that a training step's kernels sustain (estimate/gpu_compute.py; not used
    # where compute is measured, cpu): large GEMMs in the param dtype and in float8 (the best
    # shape's reachable FLOP/s, less the clocks a sustained load runs at and the SMs NCCL's
    # overlapped kernels take), causal flash attention's forward, and elementwise kernels' share
    # of the memory bandwidth.
    matmul_efficiency: float = -1.0
    float8_matmul_efficiency: float = -1.0
    attention_efficiency: float = -1.0
    memory_efficiency: float = -1.0
    # Streaming multiprocessors (CUs on AMD): a GEMM's tiles run in waves of this many.
    sm_count: int = -1
    # MX block-scaled float8 matmuls (Blackwell's tensor cores), what quantize=mxfp8 needs.
    mxfp8: bool = False
    memory_gib: float = -1.0
    # Memory bandwidth (GB/s): what the optimizer step, bandwidth-bound, runs at.
    memory_gbps: float = -1.0
    # Bus bandwidth (GB/s, nccl-tests' "busbw") of one device within a node (NVLink, PCI, shared
    # memory), and of one network card (InfiniBand, RoCE) across nodes; a node's cards serve all of
    # its devices (estimate/collectives.py).
    intra_node_gbps: float = -1.0
    inter_node_gbps: float = -1.0
    nics_per_node: int = 8
    # What joins a node's devices: nvlink (NVSwitch, Infinity Fabric) or pci; NCCL's latency per hop
    # differs (estimate/collectives.py).
    intra_node_link: str = one_of("nvlink", "pci")
    # gloo (CPU ranks): the fixed cost of one call, and of a reducing one (reduce-scatter,
    # all-reduce), which costs far more. NCCL's come from its own latency model (GLOO_ONLY).
    collective_latency_us: float = -1.0
    reduce_latency_us: float = -1.0
    devices_per_node: int = 8
    # Whether FSDP/DDP's collectives run beside compute (nccl's streams) or block it (gloo on CPU).
    overlaps_communication: bool = True
    # The share of a rank's live tensors at its peak that its allocator keeps reserved beyond what
    # the memory model counts (estimate/memory.py: the caching allocator's largest transient
    # blocks, glibc's freed memory on a CPU): fragmentation in a steady state. 0 unless fitted to
    # measured runs (`titan_exp plan calibrate`).
    allocator_slack: float = 0.0
    # Kernel rates measured by shape (estimate/kernel_tables.py: a file `plan probe` writes beside its
    # profile, or a path): where set, the GEMMs, collectives and elementwise kernels it has figures
    # for are priced from them rather than from the efficiencies above. '': none.
    kernel_tables: str = ""
    # CPU ranks wanting more threads than there are cores run slower than their share of the cores
    # alone would make them (context switches, caches refilled, collectives waiting on a peer that
    # is not running): the factor beyond that share.
    time_sharing_cost: float = 1.0

    def check(self, key: str) -> None:
        """Each figure in its FIGURE_RANGES or -1 (measured on this machine); the efficiencies fractions."""
        super().check(key)
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "kernel_tables" and value:
                try:
                    self.tables()
                except ValueError as err:
                    fix = f"must name a readable kernel table ({err})"
                    raise ConfigError(f"{key}.kernel_tables", value, fix) from None
            if type(value) not in (int, float) or value == -1:
                continue
            if f.name.endswith("_efficiency"):
                if not 0 < value <= 1:  # also refuses nan
                    raise ConfigError(f"{key}.{f.name}", value, "must lie in (0, 1] (a fraction of the peak) or be -1")
            elif f.name == "allocator_slack":
                if not 0 <= value < 1:  # also refuses nan
                    raise ConfigError(f"{key}.{f.name}", value, "must lie in [0, 1) (a share of the live tensors)")
            else:
                low, high = FIGURE_RANGES[f.name]
                if not low <= value <= high:  # also refuses nan
                    fix = f"must lie in [{low:g}, {high:g}] or be -1 (measured here)"
                    raise ConfigError(f"{key}.{f.name}", value, fix)

    def memory_bytes_per_second(self) -> float:
        """What bandwidth-bound kernels (elementwise, copies, the optimizer step) sustain: as the
        kernel tables measured it, else the datasheet's bandwidth times the profile's efficiency."""
        tables = self.tables()
        if tables is not None and tables.elementwise_gbps is not None:
            return tables.elementwise_gbps * 1e9
        return self.memory_gbps * 1e9 * self.memory_efficiency

    def tables(self) -> "KernelTables | None":
        """The kernel tables the profile names (`kernel_tables`), None without."""
        from titan_exp.estimate.kernel_tables import tables_of

        return tables_of(self.kernel_tables)

    def peak_flops(self, dtype: str) -> float:
        return {"float32": self.peak_tflops_float32, "bfloat16": self.peak_tflops_bfloat16}.get(
            dtype, self.peak_tflops_float8
        ) * 1e12
