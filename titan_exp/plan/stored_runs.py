"""A tracked run as `plan calibrate` reads it from a store: someone else's data. Its measured
figures must be finite, > 0 and within what a device reaches; its overrides (OVERRIDES_ARTIFACT,
as Hydra logged them) a small YAML list, each a plain `key=value` of the config's own keys and
groups: no Hydra keys, no group added (+) or anything removed (~), moved (@) or swept, no
interpolation (${...}), so that nothing in a store steers the composition elsewhere. Each refusal
is a ValueError of one line naming the run. Torch-free."""

import posixpath
import tempfile
from pathlib import Path
from urllib.parse import urlparse

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException

from titan_exp.config.compose import schema_keys
from titan_exp.config.tree import group_options
from titan_exp.estimate.config import FIGURE_RANGES
from titan_exp.untrusted import plain_yaml, read_text

OVERRIDES_ARTIFACT = "config/hydra/overrides.yaml"
# A run's command line holds tens of overrides; a store's file of more, or larger, is not one.
MAX_OVERRIDES, MAX_OVERRIDES_BYTES = 1000, 256 << 10
# Tokens a second on one device: a thousandfold beyond a small model's on the fastest GPU. MLflow
# keeps an infinity as the largest float, 1.8e308, which only such a bound tells from a measure.
MAX_TPS_PER_DEVICE = 1e9
MAX_MEMORY_GIB = FIGURE_RANGES["memory_gib"][1]


def measured(run, metric: str, high: float) -> float | None:
    """A run's figure (a rate, a size) in (0, high], or refused; None where it logged none."""
    value = run.data.metrics.get(metric)
    if value is not None and not 0 < value <= high:  # also refuses nan
        raise ValueError(f"run {run.info.run_id}: {metric}={value:g}, not in (0, {high:g}]; it cannot be fitted")
    return value


def run_label(run) -> str:
    """The run's name where it is a short line of plain characters, else its id (a name from a store
    could hold a terminal's escape codes)."""
    name = run.info.run_name or ""
    return name if name.isprintable() and 0 < len(name) <= 100 else run.info.run_id


def run_overrides(mlflow_client, run) -> list[str]:
    """The overrides the run's job was composed from, each checked."""
    run_id = run.info.run_id
    try:
        overrides = plain_yaml(_artifact_text(mlflow_client, run), OVERRIDES_ARTIFACT, max_depth=1) or []
    except ValueError as err:
        raise ValueError(f"run {run_id}: {err}") from None
    if not isinstance(overrides, list) or not all(type(o) is str for o in overrides):
        raise ValueError(f"run {run_id}: {OVERRIDES_ARTIFACT} is not a list of overrides")
    if len(overrides) > MAX_OVERRIDES:
        raise ValueError(
            f"run {run_id}: {OVERRIDES_ARTIFACT} holds {len(overrides):,} overrides, more than {MAX_OVERRIDES:,}"
        )
    keys, groups = schema_keys(), group_options()
    for override in overrides:
        if why := _not_plain(override, keys, groups):
            raise ValueError(f"run {run_id}: override {override[:200]!r} {why}; a store's overrides are read as data")
    return overrides


def _not_plain(text: str, keys: list[str], groups: dict) -> str | None:
    """Why `text` is not a plain `key=value` of the config's `keys` or `groups` (None if it is)."""
    if "${" in text:
        return "interpolates (${...})"
    try:
        override = OverridesParser.create().parse_override(text)
    except (HydraException, RecursionError):
        return "is not an override"
    key = override.key_or_group
    in_table = any(key.startswith(f"{known}.") for known in keys)  # launcher.additional_parameters.NAME
    if override.type == OverrideType.ADD and in_table:
        return None  # a key added to a free-form table: the form Hydra needs there
    if override.type != OverrideType.CHANGE or override.package is not None or override.is_sweep_override():
        return "adds, removes, moves or sweeps"
    if key not in groups and key not in keys and not in_table:
        return f"sets {key}, which is not a key or group of titan_exp's config"
    return None


def _artifact_text(mlflow_client, run) -> str:
    """OVERRIDES_ARTIFACT's text: read where it lies in a store on this file system (never copied
    first: a FIFO or a link to a device would hang the copy), else downloaded once the store says
    it is small enough."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.file_utils import local_file_uri_to_path

    uri, run_id = run.info.artifact_uri, run.info.run_id
    if urlparse(uri).scheme in ("", "file"):
        return read_text(Path(local_file_uri_to_path(uri)) / OVERRIDES_ARTIFACT, MAX_OVERRIDES_BYTES)
    try:
        listed = mlflow_client.list_artifacts(run_id, posixpath.dirname(OVERRIDES_ARTIFACT))
        size = next((f.file_size for f in listed if f.path == OVERRIDES_ARTIFACT and not f.is_dir), None)
        if size is None:
            raise ValueError(f"no {OVERRIDES_ARTIFACT} in the store (not a titan_exp training run?)")
        if size > MAX_OVERRIDES_BYTES:
            raise ValueError(f"{OVERRIDES_ARTIFACT} is {size:,} bytes, more than the {MAX_OVERRIDES_BYTES:,} it may be")
        with tempfile.TemporaryDirectory() as folder:
            return read_text(
                Path(mlflow_client.download_artifacts(run_id, OVERRIDES_ARTIFACT, folder)), MAX_OVERRIDES_BYTES
            )
    except (MlflowException, OSError) as err:
        raise ValueError(f"{OVERRIDES_ARTIFACT} cannot be read ({str(err).splitlines()[0]})") from None
