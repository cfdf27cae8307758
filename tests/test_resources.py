"""Before any rank starts: CPU ranks against cores, one rank's estimated memory against what it can have."""

import re

import pytest
from test_config import PUBLISHED_PARAMS

from launchers.devices import available_memory, cpu_cores
from titan_exp.config.compose import to_job_config
from titan_exp.config.resolve import resolve
from titan_exp.estimate.memory import RankMemory, rank_memory
from titan_exp.estimate.workload import model_parameters
from titan_exp.job.memory import Budget, check_memory_fit, workload
from titan_exp.rules import ConfigError
from titan_exp.units import GIB

from conftest import compose_config, mlflow_runs, run_cli


def refusal(result, db) -> str:
    """The one line a refused job prints; nothing was tracked and no rank started."""
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stdout, result.stderr
    assert not db.exists()
    return lines[0]


def test_a_model_too_big_for_this_machine_is_refused_with_its_estimate_and_fixes(tmp_path, new_store):
    uri, db = new_store
    result = run_cli(["model=llama3_8b", "parallelism=fsdp", "launcher.nproc_per_node=2", uri], tmp_path)
    line = refusal(result, db)
    assert line.startswith("titan_exp: config error: model=llama3_8b: one rank needs about "), line
    estimate = float(re.search(r"needs about ([\d.]+) GiB", line)[1])
    per_rank = float(re.search(r"each can have ([\d.]+) GiB", line)[1])
    assert estimate > 50  # 8B parameters' fp32 weights, gradients and Adam state over 2 ranks: 60 GiB
    margin = to_job_config(compose_config([])).plan.memory_margin
    assert per_rank == pytest.approx(available_memory() / GIB * (1 - margin) / 2, rel=0.1)
    params, grads, adam = map(
        float, re.search(r"parameters ([\d.]+) \+ gradients ([\d.]+) \+ optimizer state ([\d.]+)", line).groups()
    )
    assert params == grads and adam == pytest.approx(2 * params, abs=0.15)  # fp32 weights, gradients, AdamW's moments
    assert params >= 8.03e9 / 2 * 4 / GIB  # half of Llama 3 8B's parameters on each of the 2 ranks
    # More ranks on this machine share its memory: no change fits, and none is suggested.
    assert line.endswith("use devices with more memory or a smaller model"), line


def test_more_cpu_ranks_than_cores_are_refused_unless_asked_for(tmp_path, new_store):
    uri, db = new_store
    too_many = cpu_cores() + 1
    line = refusal(run_cli([f"launcher.nproc_per_node={too_many}", "launcher.device=cpu", uri], tmp_path), db)
    assert f"launcher.nproc_per_node={too_many}: more CPU ranks than the {cpu_cores()} core(s)" in line
    assert "launcher.oversubscribe=true" in line
    asked = resolve(
        to_job_config(compose_config([f"launcher.nproc_per_node={too_many}", "launcher.oversubscribe=true"]))
    )
    assert asked.placement.world_size == too_many


def resolved(overrides: list[str]):
    return resolve(to_job_config(compose_config(["launcher.device=cpu", "tracking=none", *overrides])))


def estimated_memory(job) -> RankMemory:
    return rank_memory(workload(job.config, "cpu"))


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=llama3_1b", "model.n_layers=4", "parallelism=fsdp", "launcher.nproc_per_node=2"],
        ["parallelism=single", "training.seq_len=2048", "training.local_batch_size=16"],
        ["parallelism=pp", "launcher.nproc_per_node=2", "training.seq_len=2048", "training.local_batch_size=8"],
        ["model=llama3_1b", "parallelism=fsdp_tp", "launcher.nproc_per_node=4", "launcher.oversubscribe=true",
         "training.seq_len=1024", "training.local_batch_size=2"],
    ],
)  # fmt: skip
def test_every_fix_a_refusal_names_fits_by_the_same_estimate(overrides):
    """Each fix (one override, or full AC with another where none fits alone), applied and resolved
    again, fits the same budget by the same model."""
    job = resolved(overrides)
    budget = Budget(estimated_memory(job).reserved * 0.8, False, "a test's budget")
    with pytest.raises(ConfigError) as refused:
        check_memory_fit(job, budget, "cpu")
    fixes = [re.findall(r"[\w.]+=\w+", fix) for fix in refused.value.fix.split("; try ")[1].split(" or ")]
    assert fixes and all(fixes), refused.value.fix
    for fix in fixes:
        fixed = resolved([*overrides, *fix, "launcher.oversubscribe=true"])
        assert estimated_memory(fixed).reserved <= budget.node_bytes, fix
        check_memory_fit(fixed, budget, "cpu")  # passes


def test_activations_scale_with_tokens_and_pipeline_schedules_keep_microbatches_in_flight():
    short, long = resolved(["training.seq_len=512"]), resolved(["training.seq_len=1024"])
    assert estimated_memory(long).activations == pytest.approx(2 * estimated_memory(short).activations, rel=1e-6)
    pp = ["parallelism=pp", "launcher.nproc_per_node=2", "training.local_batch_size=8"]
    gpipe = resolved([*pp, "parallelism.pipeline_parallel_schedule=GPipe"])
    one_f_one_b = resolved([*pp, "parallelism.pipeline_parallel_schedule=1F1B"])
    # 8 microbatches of 1: GPipe holds all 8 on the first rank, 1F1B one per stage from it on (2).
    assert estimated_memory(gpipe).activations > 3 * estimated_memory(one_f_one_b).activations


def test_the_estimate_is_within_the_margin_of_a_measured_run(tmp_path, store):
    """Within plan.memory_margin (10%), which the budget keeps free for what the model misses."""
    uri, db = store
    shape = ["parallelism=single", "training.seq_len=1024", "training.local_batch_size=8", "data=synthetic"]
    result = run_cli([*shape, "training.steps=2", "metrics.log_freq=1", "launcher.device=cpu", uri], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    [run] = mlflow_runs(db)
    measured = run.data.metrics["memory/cpu_rss_peak_gib"]
    estimate = estimated_memory(resolved(shape)).reserved / GIB
    assert abs(estimate - measured) <= 0.1 * measured, (measured, estimate)


@pytest.mark.slow
def test_both_gradient_syncs_peak_where_the_estimate_says_on_real_ranks(tmp_path, store):
    """FSDP over 2 CPU ranks, 4 microbatches a step, a model of 0.1 B parameters (0.4 GiB in float32)
    that holds little else: reducing after the last microbatch only, each rank keeps every unit's
    unsharded gradient between microbatches instead of its half of them. Each run's measured peak
    (the process's resident set) lies within plan.memory_margin of the estimate, and the second's
    lies above the first's by at least half of what the estimate puts between them."""
    uri, db = store
    shape = [
        "parallelism=fsdp",
        "launcher.nproc_per_node=2",
        "model.dim=1024",
        "model.n_layers=8",
        "model.n_heads=8",
        "model.n_kv_heads=8",
        "training.seq_len=16",
        "training.local_batch_size=1",
        "training.global_batch_size=8",
        "data=synthetic",
    ]
    measured, estimated = {}, {}
    for sync in ("every_microbatch", "last_microbatch"):
        overrides = [*shape, f"training.gradient_sync={sync}"]
        result = run_cli([*overrides, "training.steps=2", "metrics.log_freq=1", "launcher.device=cpu", uri], tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        measured[sync] = mlflow_runs(db)[-1].data.metrics["memory/cpu_rss_peak_gib"]
        estimated[sync] = estimated_memory(resolved(overrides)).reserved / GIB
        assert abs(estimated[sync] - measured[sync]) <= 0.1 * measured[sync], (sync, measured, estimated)
    predicted = estimated["last_microbatch"] - estimated["every_microbatch"]
    assert predicted > 0.05, estimated  # half the float32 gradients (0.2 GiB) less what the end of backward holds
    assert measured["last_microbatch"] - measured["every_microbatch"] >= predicted / 2, (measured, estimated)


@pytest.mark.parametrize("flavor,count", sorted(PUBLISHED_PARAMS.items()))
def test_the_estimate_counts_every_parameter_of_each_model(flavor: str, count: int):
    assert model_parameters(to_job_config(compose_config([f"model={flavor}"])).model) == count
