"""The profiling group on CPU ranks: traces that parse and hold the profiled steps, memory audits whose
categories add up to MemTracker's peak, everything in the MLflow run, the audit page offline in
Chromium."""

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import chromium, mlflow_client, mlflow_runs, run_cli, store_in

RUN = ["data=synthetic", "training.seq_len=64", "training.local_batch_size=2", "launcher.device=cpu"]


def _run(tmp_path, store, overrides: list[str]):
    uri, db = store
    result = run_cli([*RUN, "tracking=mlflow", uri, *overrides], tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    [run] = mlflow_runs(db)
    # Its last word says where everything went: the folder, the run and how to see it, the profiling.
    said = result.stderr.strip().splitlines()[-1]
    assert said.startswith(f"titan_exp: done: outputs in {tmp_path / 'run'}; MLflow run {run.info.run_id} in "), said
    assert "python -m titan_exp ui --uri sqlite:///" in said and f"profiling in {tmp_path / 'run'}/" in said, said
    return run, mlflow_client(db)


def _artifact_paths(client, run_id: str, path: str = "profiling") -> list[str]:
    found = []
    for entry in client.list_artifacts(run_id, path):
        found += _artifact_paths(client, run_id, entry.path) if entry.is_dir else [entry.path]
    return found


def _profiler_steps(trace_file) -> set[int]:
    events = json.loads(trace_file.read_text())["traceEvents"]
    return {int(m[1]) for e in events if (m := re.fullmatch(r"ProfilerStep#(\d+)", e.get("name", "")))}


# Every profiled period's last 2 steps traced (4 steps a period, 1 of warm-up), every fourth step
# audited: steps 4 and 8 both.
PERIOD = ["profiling.profile_freq=4", "profiling.profiler_warmup=1", "profiling.profiler_active=2"]
AUDITED = {"single": (2, 4), "fsdp": (4, 8)}


@pytest.fixture(scope="module")
def profiled(tmp_path_factory, migrated_store):
    """A run audited at steps AUDITED[layout] per layout, made once: (its run folder, the run, a
    client). The fsdp one is profiling=full, traced too: the profiler and the memory tracker watch
    its steps 4 and 8 together."""
    made = {}

    def run(layout: str) -> tuple[Path, object, object]:
        if layout not in made:
            tmp = tmp_path_factory.mktemp(layout)
            store = store_in(tmp, migrated_store)
            if layout == "single":
                overrides = ["profiling=memory", "profiling.memory_snapshot_freq=2", "training.steps=4"]
            else:
                overrides = ["profiling=full", *PERIOD, "profiling.memory_snapshot_freq=4", "training.steps=8"]
            ranks = 1 if layout == "single" else 2
            made[layout] = (
                tmp / "run",
                *_run(tmp, store, [*overrides, f"parallelism={layout}", f"launcher.nproc_per_node={ranks}"]),
            )
        return made[layout]

    return run


def test_trace_records_the_last_active_steps_of_every_period_on_every_rank(profiled, tmp_path):
    run_dir, run, client = profiled("fsdp")
    traces = run_dir / "profile_traces"
    for iteration, steps in ((4, {3, 4}), (8, {7, 8})):
        for rank in (0, 1):
            trace = traces / f"iteration_{iteration}" / f"rank{rank}_trace.json"
            assert _profiler_steps(trace) == steps, trace
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_4", "iteration_8"]
    stored = _artifact_paths(client, run.info.run_id)
    assert "profiling/traces/iteration_8/rank1_trace.json" in stored, stored
    downloaded = client.download_artifacts(run.info.run_id, "profiling/traces/iteration_4/rank0_trace.json", tmp_path)
    assert _profiler_steps(Path(downloaded)) == {3, 4}


@pytest.mark.parametrize("layout,ranks", [("single", 1), ("fsdp", 2)])
def test_memory_audits_account_for_the_model_and_add_up_to_the_tracked_peak(profiled, layout, ranks):
    run_dir, run, client = profiled(layout)
    audits = run_dir / "memory_snapshot"
    for iteration in AUDITED[layout]:
        for rank in range(ranks):
            timeline = json.loads((audits / f"iteration_{iteration}" / f"rank{rank}_memory_timeline.json").read_text())
            assert len(timeline) > 100 and {"PARAM", "ACT", "OPT"} <= set(timeline[0][1])
            assert (audits / f"iteration_{iteration}" / f"rank{rank}_memory.html").stat().st_size > 10_000
    metrics = ("peak", "memtracker_peak", "parameters", "optimizer_state", "activations", "gradients")
    audit = {
        name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, f"memory/audit_{name}_gib")}
        for name in metrics
    }
    assert set(audit["peak"]) == set(AUDITED[layout])
    params_gib = float(run.data.params["derived/num_params"]) * 4 / 2**30 / ranks  # fp32, sharded by FSDP
    for step in AUDITED[layout]:
        assert audit["peak"][step] == pytest.approx(audit["memtracker_peak"][step], rel=0.02)
        # At the peak: at least this rank's parameters (FSDP adds the layers it has gathered) and
        # AdamW's moments (its step adds temporaries); after the step, exactly what stays.
        assert audit["parameters"][step] >= params_gib * 0.98
        assert audit["optimizer_state"][step] >= 2 * params_gib * 0.98
        end_of_step = json.loads((audits / f"iteration_{step}" / "rank0_memory_timeline.json").read_text())[-1][1]
        assert end_of_step["PARAM"] / 2**30 == pytest.approx(params_gib, rel=0.02)
        assert end_of_step["OPT"] / 2**30 == pytest.approx(2 * params_gib, rel=0.02)
        assert audit["peak"][step] < run.data.metrics["memory/cpu_rss_peak_gib"]  # tensors within the process
    last = AUDITED[layout][-1]
    stored = _artifact_paths(client, run.info.run_id)
    assert f"profiling/memory/iteration_{last}/rank{ranks - 1}_memory.html" in stored, stored
    page = (audits / f"iteration_{last}" / "rank0_memory.html").read_text()
    assert "Per module (MemTracker)" in page and "layers.0" in page and "<script" not in page


def test_the_audit_page_shows_its_plot_offline_in_chromium(profiled, tmp_path):
    run_dir, _, _ = profiled("single")
    page = run_dir / "memory_snapshot" / "iteration_2" / "rank0_memory.html"
    screenshot = tmp_path / "page.png"
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is needed to take the network away from Chromium")
    chromium(f"--screenshot={screenshot}", page.as_uri(), prefix=["unshare", "--net"])  # no network at all
    import matplotlib.image

    pixels = matplotlib.image.imread(screenshot)[..., :3]
    red = ((pixels[..., 0] > 0.9) & (pixels[..., 1] < 0.1) & (pixels[..., 2] < 0.1)).sum()  # activations
    green = ((pixels[..., 0] < 0.1) & (abs(pixels[..., 1] - 0.39) < 0.05) & (pixels[..., 2] < 0.1)).sum()  # params
    assert red > 500 and green > 500, (red, green)


def test_full_profiles_and_audits_the_same_step(profiled):
    run_dir, run, client = profiled("fsdp")
    # The profiled steps are also audited ones: the profiler and the memory tracker watch them together.
    for iteration, steps in ((4, {3, 4}), (8, {7, 8})):
        assert _profiler_steps(run_dir / "profile_traces" / f"iteration_{iteration}" / "rank0_trace.json") == steps
        assert (run_dir / "memory_snapshot" / f"iteration_{iteration}" / "rank0_memory.html").exists()
    assert {"profiling/traces/iteration_8/rank0_trace.json", "profiling/memory/iteration_8/rank0_memory.html"} <= set(
        _artifact_paths(client, run.info.run_id)
    )


def test_profiling_is_refused_where_its_keys_disagree(tmp_path):
    result = run_cli([*RUN, "profiling=trace", "profiling.profile_freq=3", "tracking=none"], tmp_path)
    assert result.returncode == 2
    assert "profiling.profile_freq=3: must be >= profiling.profiler_warmup + profiling.profiler_active" in result.stderr
    assert not (tmp_path / "run" / "ranks").exists()
