"""Resolved parallel degrees: sizes and the names people and tables use for a layout. Built once per
job, from the `parallelism` section and the world size, and checked as it is built (as torchtitan's
ParallelDims is). Torch-free, so that checking a config, naming a run and placing a job stay fast;
the device mesh built from these degrees is in parallel/mesh.py."""

import math
from dataclasses import dataclass

from titan_exp.parallel.config import MESH_DIMS, ParallelismConfig
from titan_exp.rules import ConfigError

# The dims expert parallelism spans, in the words its errors use.
_DIM_WORDS = {"cp": "context", "tp": "tensor parallel"}


@dataclass(frozen=True)
class ParallelDims:
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    # Expert parallel: borrowed from dp_shard × cp (× tp where etp is 1), not a factor of the world size.
    ep: int = 1
    # Tensor parallel inside the experts under expert parallelism: 1 (each expert whole on its
    # rank) or tp (each expert's hidden dim split over the tp ranks). See experts_tp.
    etp: int = 1

    def __post_init__(self) -> None:
        for name in (*MESH_DIMS.values(), "ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(f"ParallelDims.{name}={getattr(self, name)}: degrees are >= 1 once resolved")

    @classmethod
    def resolve(cls, parallelism: ParallelismConfig, world_size: int) -> "ParallelDims":
        """The degrees of `parallelism` for `world_size` ranks: each positive or -1 (at most one),
        the -1 taking what the others leave, their product the world size. Raises ConfigError."""
        degrees = parallelism.degrees()
        for key, degree in degrees.items():
            if degree == 0 or degree < -1:
                raise ConfigError(
                    f"parallelism.{key}", degree, "must be a positive degree or -1 (the rest of the world)"
                )
        inferred = [key for key, degree in degrees.items() if degree == -1]
        if len(inferred) > 1:
            raise ConfigError(f"parallelism.{inferred[1]}", -1, f"only one degree may be -1 ({inferred[0]} already is)")
        fixed = math.prod(d for d in degrees.values() if d != -1)
        if inferred and world_size % fixed:
            raise ConfigError(
                f"parallelism.{inferred[0]}",
                -1,
                f"the other degrees multiply to {fixed}, which does not divide the world size {world_size}",
            )
        if not inferred and fixed != world_size:
            layout = " × ".join(f"{MESH_DIMS[k]}={d}" for k, d in degrees.items() if d > 1) or "1"
            raise ConfigError(
                "parallelism",
                layout,
                f"the degrees multiply to {fixed} but the world size is {world_size} "
                f"(launcher.nproc_per_node × launcher.nodes); make them equal or set one degree to -1",
            )
        resolved = {MESH_DIMS[key]: world_size // fixed if d == -1 else d for key, d in degrees.items()}
        ep, etp = parallelism.expert_parallel_degree, parallelism.expert_tensor_parallel_degree
        if etp not in (1, resolved["tp"]):
            raise ConfigError(
                "parallelism.expert_tensor_parallel_degree",
                etp,
                f"must be 1 (experts whole) or the tensor-parallel degree {resolved['tp']} (experts split by TP)",
            )
        dims = cls(**resolved, ep=ep, etp=etp)
        dims._check_expert_parallel()
        return dims

    def degrees(self) -> dict[str, int]:
        """Every degree keyed by its config key (parallelism.*), outermost first."""
        return {key: getattr(self, name) for key, name in MESH_DIMS.items()}

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many different batches one step sees."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        """Ranks that share one batch; tokens/s per device divides by this (torchtitan's definition)."""
        return self.tp * self.pp * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1 or self.cp > 1

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_replicate > 1 and not self.fsdp_enabled

    @property
    def experts_tp(self) -> int:
        """The tp ranks each expert's hidden dim is split over: etp under expert parallelism, all of
        tp without it (torchtitan's rule: then the experts split as the dense weights do)."""
        return self.etp if self.ep > 1 else self.tp

    @property
    def ep_spans(self) -> tuple[str, ...]:
        """The dims expert parallelism takes whole, beside part of dp_shard: cp, and tp unless TP
        splits the experts themselves."""
        return ("cp",) if self.etp > 1 else ("cp", "tp")

    @property
    def dp_shard_in_ep(self) -> int:
        """The part of dp_shard that expert parallelism borrows (beside ep_spans)."""
        return self.ep // math.prod(getattr(self, dim) for dim in self.ep_spans) if self.ep > 1 else 1

    @property
    def dp_shard_mod_ep(self) -> int:
        """The part of dp_shard EP leaves: the ranks each expert is FSDP-sharded over."""
        return self.dp_shard // self.dp_shard_in_ep

    def mesh_shape(self) -> dict[str, int]:
        """Mesh dims of size > 1, outermost first."""
        return {name: getattr(self, name) for name in MESH_DIMS.values() if getattr(self, name) > 1}

    def device_mesh_shape(self) -> dict[str, int]:
        """The device mesh's dims, outermost first: those of size > 1 and, under expert parallelism,
        dp_shard split into the part EP leaves (kept at size 1 too: the experts' FSDP mesh) and the
        part it borrows."""
        shape = {}
        for name in MESH_DIMS.values():
            if name == "dp_shard" and self.ep > 1:
                shape["dp_shard_mod_ep"] = self.dp_shard_mod_ep
                if self.dp_shard_in_ep > 1:
                    shape["dp_shard_in_ep"] = self.dp_shard_in_ep
            elif getattr(self, name) > 1:
                shape[name] = getattr(self, name)
        return shape

    def _check_expert_parallel(self) -> None:
        """EP takes its spans whole (all of cp, and of tp unless TP splits the experts) and part of
        dp_shard (torchtitan's rule). Raises ConfigError."""
        if self.ep == 1:
            return
        key, spanned = "parallelism.expert_parallel_degree", math.prod(getattr(self, d) for d in self.ep_spans)
        names = " × ".join(_DIM_WORDS[dim] for dim in self.ep_spans)
        degrees = "×".join(str(getattr(self, dim)) for dim in self.ep_spans)
        if self.ep % spanned:
            raise ConfigError(key, self.ep, f"must be a multiple of {names} ({degrees}): EP spans those ranks whole")
        if (self.dp_shard * spanned) % self.ep:
            raise ConfigError(
                key,
                self.ep,
                f"must divide data_parallel_shard × {names} ({self.dp_shard}×{degrees}), the ranks it borrows",
            )

    def describe(self) -> str:
        """Compact layout string such as 'dp_replicate2·dp_shard2' ('single' for one device)."""
        parts = [f"{name}{size}" for name, size in self.mesh_shape().items()]
        return "·".join(parts + self._expert_parts()) or "single"

    def _expert_parts(self) -> list[str]:
        """EP's degree, and ETP's beside it (without EP the experts' TP is the layout's)."""
        return [f"ep{self.ep}", *([f"etp{self.etp}"] if self.etp > 1 else [])] if self.ep > 1 else []

    def label(self) -> str:
        """Layout in the words people use: 'fsdp8', 'hsdp2x4', 'ddp2', 'fsdp8·tp2' ('single' for one device)."""
        if self.dp_replicate > 1 and self.dp_shard > 1:
            parts = [f"hsdp{self.dp_replicate}x{self.dp_shard}"]
        elif self.dp_shard > 1:
            parts = [f"fsdp{self.dp_shard}"]
        elif self.dp_replicate > 1:
            parts = [f"ddp{self.dp_replicate}"]
        else:
            parts = []
        parts += [f"{name}{getattr(self, name)}" for name in ("tp", "pp", "cp") if getattr(self, name) > 1]
        return "·".join(parts + self._expert_parts()) or "single"
