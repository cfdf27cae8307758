"""How a model is cut into pipeline stages and which stages each pp rank holds (torch-free: the
launching process checks configs with it)."""

from dataclasses import dataclass

from titan_exp.parallel.config import SINGLE_STAGE_SCHEDULES, V_SHAPED_SCHEDULES, ParallelismConfig


@dataclass(frozen=True)
class StagePlan:
    num_stages: int
    stages_per_rank: int

    @classmethod
    def from_config(cls, cfg: ParallelismConfig, n_layers: int) -> "StagePlan":
        """Raises ValueError (turned into a config error by config/check.py) when the split is impossible."""
        pp = cfg.pipeline_parallel_degree
        single = cfg.pipeline_parallel_schedule in SINGLE_STAGE_SCHEDULES
        if cfg.pipeline_parallel_layers_per_stage is None:
            num_stages = pp * (1 if single else 2)
        else:
            if n_layers % cfg.pipeline_parallel_layers_per_stage:
                raise ValueError(f"must divide model n_layers={n_layers}")
            num_stages = n_layers // cfg.pipeline_parallel_layers_per_stage
        if num_stages % pp or num_stages > n_layers:
            raise ValueError(f"{num_stages} stages cannot be spread over {pp} ranks and {n_layers} layers")
        stages_per_rank = num_stages // pp
        if single and stages_per_rank != 1:
            raise ValueError(
                f"{cfg.pipeline_parallel_schedule} runs one stage per rank, this split gives {stages_per_rank}"
            )
        if cfg.pipeline_parallel_schedule in V_SHAPED_SCHEDULES and stages_per_rank != 2:
            raise ValueError(
                f"{cfg.pipeline_parallel_schedule} needs exactly 2 stages per rank, this split gives {stages_per_rank}"
            )
        return cls(num_stages, stages_per_rank)

    def layers(self, stage: int, n_layers: int) -> range:
        """The layers of a stage: as even a split as the counts allow (stage sizes differ by at most one)."""
        return range(stage * n_layers // self.num_stages, (stage + 1) * n_layers // self.num_stages)

    def stage_ids(self, pp_rank: int, pp: int, schedule: str) -> list[int]:
        if schedule in V_SHAPED_SCHEDULES:
            return [pp_rank, self.num_stages - 1 - pp_rank]
        return [pp_rank + k * pp for k in range(self.stages_per_rank)]
