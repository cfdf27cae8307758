"""A device's kernel rates as tables, measured rather than fitted (torch-free): GEMM throughput by
shape and dtype, collective time by operation, size, ranks and whether the group leaves a node,
and the bandwidth elementwise kernels reach. The planner's hardware side reads them where a profile
names a table (`hardware.kernel_tables`), in place of its scalar efficiencies; the layout side
(FLOPs, bytes, overlap, memory) stays its own.

Every table says where its figures come from (`source`: a measurement's host and date, or a
published microbenchmark's title) and how far they are to be trusted (`provenance`): measured on
the user's own nodes (`titan_exp plan probe`), published, or unmeasured (a datasheet's figures).
No figure here is fitted to a training run's step time.

Lookups between measured points: a GEMM's rate by inverse-distance weighting of its nearest
measured shapes of the same dtype in log2(m, n, k) (an exact shape returns its own); a
collective's time interpolated linearly in bytes between the two measured sizes around it (its
latency and bandwidth between them), the nearest rank count of the same operation and placement,
beyond the largest size at that size's bus bandwidth.
"""

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from titan_exp.untrusted import read_json

PROVENANCES = ("measured", "published", "unmeasured")
COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all", "send_recv")
# A table is a few hundred points (a probe's: the planned models' GEMM shapes and 4-6 sizes per
# collective): 4 MiB is far beyond any, and bounds what a crafted file can make the planner read.
MAX_TABLE_BYTES = 4 << 20
_NEAREST = 4


@dataclass(frozen=True)
class GemmPoint:
    """One (m×k)·(k×n) GEMM in `dtype`: the FLOP/s it sustained (2·m·n·k a call)."""

    m: int
    n: int
    k: int
    dtype: str
    tflops: float


@dataclass(frozen=True)
class CollectivePoint:
    """One collective over `ranks` ranks on `bytes` (an all-gather's output, a reduce-scatter's input,
    an all-reduce's buffer, the rows a rank sends in an all-to-all, one send): its seconds."""

    op: str
    bytes: float
    ranks: int
    across_nodes: bool
    seconds: float


@dataclass(frozen=True)
class KernelTables:
    source: str
    provenance: str
    gemm: tuple[GemmPoint, ...] = ()
    collectives: tuple[CollectivePoint, ...] = ()
    # What a large copy reads plus writes per second (GB/s): elementwise kernels' and the optimizer's rate.
    elementwise_gbps: float | None = None
    # Seconds of host work per eager op (dispatch, launch): a small layer's floor. None: not measured.
    op_overhead_us: float | None = None
    notes: list[str] = field(default_factory=list)

    def gemm_tflops(self, m: float, n: float, k: float, dtype: str) -> float | None:
        """The rate of an (m×k)·(k×n) GEMM from the measured shapes nearest it; None where the
        table has none in `dtype`."""
        points = [p for p in self.gemm if p.dtype == dtype]
        if not points:
            return None
        where = (math.log2(max(m, 1)), math.log2(max(n, 1)), math.log2(max(k, 1)))

        def distance(p: GemmPoint) -> float:
            return math.dist(where, (math.log2(p.m), math.log2(p.n), math.log2(p.k)))

        nearest = sorted(points, key=distance)[:_NEAREST]
        if distance(nearest[0]) < 1e-9:
            return nearest[0].tflops
        weights = [1 / distance(p) ** 2 for p in nearest]
        return sum(w * p.tflops for w, p in zip(weights, nearest)) / sum(weights)

    def collective_seconds(self, op: str, size: float, ranks: int, across_nodes: bool) -> float | None:
        """One collective's seconds from the measured sizes around `size`, at the nearest measured
        rank count of `op` and this placement; None where the table has no such collective."""
        points = [p for p in self.collectives if p.op == op and p.across_nodes == across_nodes]
        if not points:
            return None
        nearest_ranks = min({p.ranks for p in points}, key=lambda r: (abs(math.log2(r) - math.log2(ranks)), r))
        line = sorted((p for p in points if p.ranks == nearest_ranks), key=lambda p: p.bytes)
        if size <= line[0].bytes:
            return line[0].seconds  # below the smallest measured size: its latency
        for low, high in zip(line, line[1:]):
            if size <= high.bytes:
                share = (size - low.bytes) / (high.bytes - low.bytes)
                return low.seconds + share * (high.seconds - low.seconds)
        last = line[-1]
        return last.seconds * size / last.bytes

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)


def _number(value: object, where: str, low: float, high: float) -> float:
    if type(value) not in (int, float) or not low <= value <= high:  # also refuses nan
        raise ValueError(f"{where}: {value!r} must be a number in [{low:g}, {high:g}]")
    return float(value)


def _text(value: object, where: str, choices: tuple[str, ...] | None = None, limit: int = 500) -> str:
    if type(value) is not str or len(value) > limit or not value.isprintable():
        raise ValueError(f"{where}: {value!r} must be one line of plain text (at most {limit} characters)")
    if choices is not None and value not in choices:
        raise ValueError(f"{where}: {value!r} must be one of {', '.join(choices)}")
    return value


def _fields(entry: object, where: str, names: set[str], optional: set[str] = frozenset()) -> dict:
    if not isinstance(entry, dict) or not names <= entry.keys() <= names | optional:
        raise ValueError(f"{where}: must be a table of exactly {', '.join(sorted(names))}")
    return entry


def read_tables(path: Path) -> KernelTables:
    """A kernel table file (what `plan probe` writes, or a published one), each figure checked:
    refused in one line naming the file and the entry."""
    where = str(path)
    data = _fields(
        read_json(path, MAX_TABLE_BYTES),
        where,
        {"source", "provenance"},
        {"gemm", "collectives", "elementwise_gbps", "op_overhead_us", "notes"},
    )
    gemm = []
    for i, entry in enumerate(data.get("gemm") or []):
        at = f"{where}: gemm[{i}]"
        e = _fields(entry, at, {"m", "n", "k", "dtype", "tflops"})
        dims = [int(_number(e[d], f"{at}.{d}", 1, 1 << 24)) for d in ("m", "n", "k")]
        dtype = _text(e["dtype"], f"{at}.dtype", ("float32", "bfloat16", "float16", "float8"))
        gemm.append(GemmPoint(*dims, dtype, _number(e["tflops"], f"{at}.tflops", 1e-6, 1e5)))
    collectives = []
    for i, entry in enumerate(data.get("collectives") or []):
        at = f"{where}: collectives[{i}]"
        e = _fields(entry, at, {"op", "bytes", "ranks", "across_nodes", "seconds"})
        if type(e["across_nodes"]) is not bool:
            raise ValueError(f"{at}.across_nodes: {e['across_nodes']!r} must be true or false")
        collectives.append(
            CollectivePoint(
                _text(e["op"], f"{at}.op", COLLECTIVES),
                _number(e["bytes"], f"{at}.bytes", 1, 1 << 40),
                int(_number(e["ranks"], f"{at}.ranks", 2, 1 << 20)),
                e["across_nodes"],
                _number(e["seconds"], f"{at}.seconds", 1e-9, 1e4),
            )
        )
    optional = {
        name: None if data.get(name) is None else _number(data[name], f"{where}: {name}", low, high)
        for name, (low, high) in {"elementwise_gbps": (1e-2, 1e6), "op_overhead_us": (1e-3, 1e6)}.items()
    }
    notes = [_text(note, f"{where}: notes") for note in data.get("notes") or []]
    return KernelTables(
        _text(data["source"], f"{where}: source"),
        _text(data["provenance"], f"{where}: provenance", PROVENANCES),
        tuple(gemm),
        tuple(collectives),
        **optional,
        notes=notes,
    )


def table_path(name: str) -> Path:
    """Where `hardware.kernel_tables` points: a path as given, or a file name in the user's profile
    folder (where `plan probe` writes one beside its profile), else among the tables titan_exp ships."""
    from titan_exp.estimate.hardware_profiles import HARDWARE_DIR
    from titan_exp.estimate.user_profiles import profiles_folder

    given = Path(name).expanduser()
    if given.is_absolute():
        return given
    user = profiles_folder() / given
    return user if user.exists() else HARDWARE_DIR / "kernels" / given


_READ: dict[tuple[str, float], KernelTables] = {}


def tables_of(kernel_tables: str) -> KernelTables | None:
    """The tables a profile names (`hardware.kernel_tables`), read once per file version; None for ''."""
    if not kernel_tables:
        return None
    path = table_path(kernel_tables)
    try:
        version = (str(path), path.stat().st_mtime)
    except OSError as err:
        raise ValueError(f"{path} cannot be read ({err.strerror})") from None
    if version not in _READ:
        _READ[version] = read_tables(path)
    return _READ[version]
