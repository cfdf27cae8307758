"""The batch script launcher=slurm submits, checked without a cluster: launcher.submit=false prints
it (submitting nothing), and a 2-node × 8-GPU job's script matches the golden text word for word."""

import sys
from pathlib import Path

from conftest import run_cli

GOLDEN = Path(__file__).with_name("golden") / "sbatch_2_nodes_8_gpus.sh"
TWO_NODES_OF_8_GPUS = [
    "launcher=slurm", "launcher.submit=false", "launcher.nodes=2", "launcher.nproc_per_node=8", "launcher.device=cuda",
    "launcher.partition=gpu", "launcher.account=llm", "launcher.qos=high", "launcher.constraint=h100",
    "launcher.cpus_per_task=12", "launcher.mem_gb=480", "launcher.timeout_min=240", "launcher.signal_delay_s=300",
    'launcher.setup=["module load cuda/12.4","source .venv/bin/activate"]', 'launcher.srun_args=["--cpu-bind=none"]',
    "+launcher.additional_parameters.exclusive=true", "model=llama3_8b", "parallelism=fsdp_tp",
    "parallelism.tensor_parallel_degree=8", "training.mixed_precision_param=bfloat16",
]  # fmt: skip


def test_two_nodes_of_eight_gpus_render_the_golden_script_and_submit_nothing(tmp_path, new_store):
    uri, db = new_store
    result = run_cli([*TWO_NODES_OF_8_GPUS, uri], tmp_path, env={"SLURM_CONF": "/nonexistent"})
    assert result.returncode == 0, result.stderr[-3000:]
    script = result.stdout.replace(str(tmp_path / "run"), "<job_dir>").replace(sys.executable, "<python>")
    assert script == GOLDEN.read_text()
    # Nothing was submitted, nothing tracked: no job folder, no store.
    assert not (tmp_path / "run" / "slurm").exists() and not db.exists()


def test_a_cpu_job_asks_for_no_gpus_and_one_core_per_thread(tmp_path):
    args = ["launcher=slurm", "launcher.submit=false", "launcher.device=cpu", "launcher.nproc_per_node=4"]
    result = run_cli([*args, "launcher.cpus_per_task=2", "tracking=none"], tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "--gpus-per-node" not in result.stdout
    assert "#SBATCH --ntasks-per-node=4" in result.stdout and "#SBATCH --cpus-per-task=2" in result.stdout
