"""The `checkpoint` config group (torchtitan's key names)."""

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from titan_exp.rules import ConfigError, Section, check_positive, one_of

# checkpoint.folder's default: the job's own folder, own_folder(job_dir) (config/resolve.py fills it in).
OWN_FOLDER = ""


def own_folder(job_dir: Path | None = None) -> str:
    """Where a job keeps its checkpoints unless checkpoint.folder names a folder (`job_dir` None: a
    job that is not run, shown as `<job folder>/checkpoints`)."""
    if job_dir is None:
        return "<job folder>/checkpoints"
    return str((job_dir / "checkpoints").resolve())


@dataclass
class CheckpointConfig(Section):
    # Save every `interval` steps and at the last step, and resume from the newest step in `folder`:
    # by default the job's own (<job folder>/checkpoints: a requeued Slurm job finds it again); name
    # a folder to share it, e.g. to go on from another run's checkpoints (its model checked first).
    enable: bool = False
    folder: str = OWN_FOLDER
    interval: int = 100
    # Keep only the newest k step folders (0 keeps all).
    keep_latest_k: int = 0
    # Write the initialized weights as step-0 in `folder` and stop (one rank: parallelism=single).
    create_seed_checkpoint: bool = False
    # Weights to start from (a step folder, e.g. a seed checkpoint), resharded to this layout.
    initial_load_path: Optional[str] = None
    # initial_load_path is a Hugging Face model folder (config.json + safetensors), e.g. Llama 3's.
    initial_load_in_hf: bool = False
    # The last step's folder holds the weights in Hugging Face's format too (safetensors and
    # config.json), which transformers' from_pretrained opens as it is.
    last_save_in_hf: bool = False
    # The dtype of that export's weights (torchtitan's key): the float32 master weights, or halved.
    export_dtype: str = one_of("float32", "bfloat16", "float16")

    def check(self, key: str) -> None:
        check_positive(f"{key}.interval", self.interval)
        if self.initial_load_in_hf and not self.initial_load_path:
            raise ConfigError(
                f"{key}.initial_load_in_hf", True, f"says how to read {key}.initial_load_path, which is not set"
            )
        if self.last_save_in_hf and not self.enable:
            raise ConfigError(
                f"{key}.last_save_in_hf", True, f"needs {key}.enable=true (add checkpoint=periodic) to save at all"
            )
        if self.keep_latest_k < 0:
            raise ConfigError(f"{key}.keep_latest_k", self.keep_latest_k, "must be >= 0 (0 keeps every checkpoint)")
