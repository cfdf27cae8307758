"""From Hydra's composed config to the typed one: keys the schema does not know are refused rather
than dropped (config/check.py), then the DictConfig becomes a JobConfig."""

from omegaconf import DictConfig, OmegaConf

from titan_exp.config.check import check_known_keys
from titan_exp.config.schema import JobConfig


def to_job_config(composed: DictConfig) -> JobConfig:
    """`composed`: the task's config (Hydra's own `hydra` node left out)."""
    check_known_keys(OmegaConf.to_container(composed, resolve=True), JobConfig)
    return OmegaConf.to_object(composed)
