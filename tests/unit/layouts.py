"""Resolved layouts for the unit tests of the estimates: every degree given, none -1."""

from titan_exp.parallel.config import ParallelismConfig


def layout(
    *,
    dp_shard: int = 1,
    dp_replicate: int = 1,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    ep: int = 1,
    etp: int = 1,
    schedule: str = "1F1B",
    cp_impl: str = "auto",
) -> ParallelismConfig:
    """Pipeline microbatches of one sample (the section's default)."""
    return ParallelismConfig(
        data_parallel_shard_degree=dp_shard,
        data_parallel_replicate_degree=dp_replicate,
        tensor_parallel_degree=tp,
        pipeline_parallel_degree=pp,
        context_parallel_degree=cp,
        expert_parallel_degree=ep,
        expert_tensor_parallel_degree=etp,
        pipeline_parallel_schedule=schedule,
        context_parallel_impl=cp_impl,
    )
