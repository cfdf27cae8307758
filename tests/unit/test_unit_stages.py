"""titan_exp/parallel/stages.py: how many stages a schedule makes, which layers each holds, which
stages each pipeline rank holds, and the splits that are refused."""

import pytest

from titan_exp.parallel.config import ParallelismConfig
from titan_exp.parallel.stages import StagePlan

ALL_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


def plan(pp: int, schedule: str, n_layers: int, layers_per_stage: int | None = None) -> StagePlan:
    cfg = ParallelismConfig(
        pipeline_parallel_degree=pp,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_layers_per_stage=layers_per_stage,
    )
    return StagePlan.from_config(cfg, n_layers)


@pytest.mark.parametrize("schedule", ["GPipe", "1F1B"])
def test_single_stage_schedules_make_one_stage_per_rank(schedule: str) -> None:
    assert plan(4, schedule, 8) == StagePlan(num_stages=4, stages_per_rank=1)


@pytest.mark.parametrize("schedule", ["Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", *V_SHAPED])
def test_multi_stage_schedules_make_two_per_rank_by_default(schedule: str) -> None:
    assert plan(4, schedule, 8) == StagePlan(num_stages=8, stages_per_rank=2)


def test_layers_per_stage_sets_the_stage_count() -> None:
    """16 layers, 2 per stage: 8 stages over pp 2 is 4 per rank."""
    assert plan(2, "Interleaved1F1B", 16, layers_per_stage=2) == StagePlan(8, 4)
    assert plan(4, "1F1B", 16, layers_per_stage=4) == StagePlan(4, 1)
    assert plan(2, "ZBVZeroBubble", 16, layers_per_stage=4) == StagePlan(4, 2)


@pytest.mark.parametrize("n_layers,num_stages", [(8, 4), (6, 4), (7, 3), (5, 5), (16, 6), (126, 16)])
def test_layers_split_evenly_and_completely(n_layers: int, num_stages: int) -> None:
    """The stages' layer ranges are contiguous, in order, cover every layer once, and differ in
    size by at most one."""
    p = StagePlan(num_stages, 1)
    ranges = [p.layers(stage, n_layers) for stage in range(num_stages)]
    assert [layer for r in ranges for layer in r] == list(range(n_layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_uneven_split_puts_the_larger_stages_last() -> None:
    """6 layers over 4 stages: floor(s·6/4) boundaries 0, 1, 3, 4, 6."""
    p = StagePlan(4, 2)
    assert [list(p.layers(s, 6)) for s in range(4)] == [[0], [1, 2], [3], [4, 5]]


def test_stage_ids_single_stage() -> None:
    p = plan(4, "1F1B", 8)
    assert [p.stage_ids(rank, 4, "1F1B") for rank in range(4)] == [[0], [1], [2], [3]]


def test_stage_ids_interleaved_loop_over_the_ranks() -> None:
    """Rank r holds r, r + pp, r + 2·pp, ..."""
    p = plan(2, "Interleaved1F1B", 16, layers_per_stage=2)
    assert [p.stage_ids(rank, 2, "Interleaved1F1B") for rank in range(2)] == [[0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("schedule", V_SHAPED)
def test_stage_ids_v_shaped_put_first_and_last_stage_on_rank_0(schedule: str) -> None:
    """Rank r holds stages r and 2·pp - 1 - r."""
    p = plan(4, schedule, 8)
    assert [p.stage_ids(rank, 4, schedule) for rank in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]


@pytest.mark.parametrize("schedule", ALL_SCHEDULES)
@pytest.mark.parametrize("pp", [2, 4])
def test_every_stage_is_on_exactly_one_rank(schedule: str, pp: int) -> None:
    p = plan(pp, schedule, 16)
    held = [stage for rank in range(pp) for stage in p.stage_ids(rank, pp, schedule)]
    assert sorted(held) == list(range(p.num_stages))
    assert all(len(p.stage_ids(rank, pp, schedule)) == p.stages_per_rank for rank in range(pp))


@pytest.mark.parametrize(
    "pp,schedule,n_layers,layers_per_stage,message",
    [
        (2, "1F1B", 6, 4, "must divide model n_layers=6"),  # 6 layers in stages of 4
        (2, "1F1B", 6, 2, "3 stages cannot be spread over 2 ranks"),  # 3 stages, 2 ranks
        (
            4,
            "Interleaved1F1B",
            6,
            None,
            "8 stages cannot be spread over 4 ranks and 6 layers",
        ),  # more stages than layers
        (8, "1F1B", 6, None, "8 stages cannot be spread over 8 ranks and 6 layers"),
        (2, "1F1B", 8, 2, "1F1B runs one stage per rank, this split gives 2"),
        (2, "GPipe", 8, 1, "GPipe runs one stage per rank, this split gives 4"),
        (2, "ZBVZeroBubble", 8, 1, "ZBVZeroBubble needs exactly 2 stages per rank, this split gives 4"),
        (2, "DualPipeV", 8, 8, "1 stages cannot be spread over 2 ranks"),
    ],
)
def test_impossible_splits_are_refused(
    pp: int, schedule: str, n_layers: int, layers_per_stage: int | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        plan(pp, schedule, n_layers, layers_per_stage)
