"""Issue 68: a device profile in the user's config folder is data under `hardware`, never a Hydra
config of its own. Each crafted profile is refused in one line naming the file (and the key), within
a bound of memory, before anything is composed: a `# @package _global_` that would move the run
folder, a billion-laughs YAML, a Python tag, bytes that are not UTF-8, a FIFO or a device, values of
the wrong type or out of any device's range, a name a shipped profile has."""

import os
import resource
import subprocess
import sys

import pytest
from hydra.errors import HydraException

from titan_exp.config.compose import compose_job_config
from titan_exp.estimate.user_profiles import read_profile

from conftest import REPO

# A billion values from ten lines, each a list of nine of the line before.
LAUGHS = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
    f"{n}: &{n} [{', '.join(['*' + p] * 9)}]\n" for p, n in zip("abcdefghi", "bcdefghij")
)
GLOBAL = "# @package _global_\nhydra:\n  run:\n    dir: {evil}\n"

# (file name, contents, what the refusal says): contents None is a FIFO, a str starting "->" a link.
CRAFTED = {
    "@package _global_": ("mine.yaml", GLOBAL, "a `# @package` line; a profile sets hardware's keys only"),
    "billion laughs": ("mine.yaml", LAUGHS, "uses YAML anchors or aliases (& and *)"),
    "a Python tag": (
        "mine.yaml",
        "name: !!python/object/apply:os.system ['touch {evil}']\n",
        "could not determine a constructor for the tag 'tag:yaml.org,2002:python/object/apply:os.system'",
    ),
    "not UTF-8": ("mine.yaml", b"name: caf\xe9\n", "mine.yaml is not UTF-8 text"),
    "a FIFO": ("mine.yaml", None, "mine.yaml is a FIFO, not a regular file"),
    "a link to /dev/zero": ("mine.yaml", "->/dev/zero", "mine.yaml is a character device, not a regular file"),
    "peak 'lots'": (
        "mine.yaml",
        "peak_tflops_bfloat16: lots\n",
        "hardware.peak_tflops_bfloat16='lots': must be a number",
    ),
    "peak 1e308": ("mine.yaml", "peak_tflops_bfloat16: 1e308\n", "hardware.peak_tflops_bfloat16=1e+308: must lie in"),
    "memory 1e-300": ("mine.yaml", "memory_gib: 1e-300\n", "hardware.memory_gib=1e-300: must lie in [0.001, 1e+07]"),
    "nics 10**12": ("mine.yaml", "nics_per_node: 10**12\n", "hardware.nics_per_node='10**12': must be a whole number"),
    "nics 10^12": ("mine.yaml", "nics_per_node: 1000000000000\n", "nics_per_node=1000000000000: must lie in [1, 1024]"),
    "devices 0": ("mine.yaml", "devices_per_node: 0\n", "hardware.devices_per_node=0: must lie in [1, 65536]"),
    "devices 8.0": ("mine.yaml", "devices_per_node: 8.0\n", "hardware.devices_per_node=8.0: must be a whole number"),
    "mxfp8 'yes'": ("mine.yaml", "mxfp8: 'yes'\n", "hardware.mxfp8='yes': must be true or false"),
    "an unknown key": ("mine.yaml", "launcher: {nodes: 64}\n", "hardware.launcher={'nodes': 64}: is not a key"),
    "a defaults list": ("mine.yaml", "defaults: [h100]\n", "hardware.defaults=['h100']: is not a key"),
    "an interpolation": (
        "mine.yaml",
        "device_names: ['${oc.env:HOME}']\n",
        "hardware.device_names=['${oc.env:HOME}']: must be plain text",
    ),
    "a missing value": ("mine.yaml", "device_names: ['???']\n", "hardware.device_names=['???']: must be plain text"),
    "another name inside": ("mine.yaml", "name: h100\n", "hardware.name=h100: must be the file's name, mine"),
    "a list": ("mine.yaml", "- 1\n- 2\n", "mine.yaml holds a list, not a table of hardware's keys"),
    "a shipped name": ("h100.yaml", "name: h100\n", "titan_exp ships a profile named h100"),
    "a name with a space": ("my gpu.yaml", "name: my gpu\n", "'my gpu' cannot be an option of hardware"),
    "a key given twice": ("mine.yaml", "sm_count: 1\nsm_count: 2\n", "found duplicate key sm_count"),
    "nested deep": ("mine.yaml", "device_names: [[[[[x]]]]]\n", "is nested more than 2 deep"),
    "too large": ("mine.yaml", "# padding\n" * 10_000, "more than the 65,536 such a file may be"),
}


def write(folder, name: str, contents) -> None:
    path = folder / "hardware" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if contents is None:
        os.mkfifo(path)
    elif isinstance(contents, bytes):
        path.write_bytes(contents)
    elif contents.startswith("->"):
        path.symlink_to(contents[2:])
    else:
        path.write_text(contents.replace("{evil}", str(folder / "evil")))


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("case", CRAFTED, ids=list(CRAFTED))
def test_a_crafted_profile_is_refused_naming_its_file_before_anything_is_composed(case, tmp_path, monkeypatch):
    name, contents, says = CRAFTED[case]
    write(tmp_path, name, contents)
    monkeypatch.setenv("TITAN_EXP_CONFIG_DIR", str(tmp_path))
    before = peak_rss()
    with pytest.raises(ValueError) as refused:
        read_profile(tmp_path / "hardware" / name)
    said = str(refused.value)
    assert says in said and str(tmp_path / "hardware" / name) in said and "\n" not in said
    # Any composition, whichever profile it chooses, is refused the same way (the plugin reads them all).
    with pytest.raises(HydraException) as composed:
        compose_job_config(["hardware=h100"])
    assert str(composed.value) == said
    assert peak_rss() - before < 1 << 30
    assert not (tmp_path / "evil").exists()


def test_a_good_profile_composes_as_hardware_and_leaves_when_its_file_does(tmp_path, monkeypatch):
    write(tmp_path, "mine.yaml", "# our cluster's cards\ndevice: cuda\npeak_tflops_bfloat16: 900\nmemory_gib: 1e2\n")
    monkeypatch.setenv("TITAN_EXP_CONFIG_DIR", str(tmp_path))
    hardware = compose_job_config(["hardware=mine"]).hardware
    assert (hardware.name, hardware.device, hardware.peak_tflops_bfloat16, hardware.memory_gib) == (
        "mine",
        "cuda",
        900,
        100.0,
    )
    (tmp_path / "hardware" / "mine.yaml").unlink()
    with pytest.raises(HydraException, match="Could not find 'hardware/mine'"):
        compose_job_config(["hardware=mine"])


def test_a_folder_inside_the_profiles_is_no_group_of_hydras(tmp_path, monkeypatch):
    """hardware/sub/x.yaml would be `hardware/sub=x` to Hydra, with its own `# @package`: Hydra
    never sees the profiles' folder, only the profiles read as data."""
    (tmp_path / "hardware" / "sub").mkdir(parents=True)
    (tmp_path / "hardware" / "sub" / "x.yaml").write_text(GLOBAL.replace("{evil}", str(tmp_path / "evil")))
    monkeypatch.setenv("TITAN_EXP_CONFIG_DIR", str(tmp_path))
    with pytest.raises(HydraException, match="hardware/sub"):
        compose_job_config(["hardware/sub=x"])


def test_the_users_own_experiments_are_still_configs_of_hydras(tmp_path, monkeypatch):
    """Only the profiles are data: an experiment in the same folder keeps its `# @package _global_`."""
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\ntraining:\n  steps: 7\n")
    write(tmp_path, "mine.yaml", "device: cuda\n")
    monkeypatch.setenv("TITAN_EXP_CONFIG_DIR", str(tmp_path))
    cfg = compose_job_config(["experiment=mine", "hardware=mine"])
    assert (cfg.training.steps, cfg.hardware.name) == (7, "mine")


@pytest.mark.parametrize("case", ["@package _global_", "a FIFO"])
def test_the_command_refuses_a_crafted_profile_in_one_line_leaving_nothing(case, tmp_path):
    """As a command: exit 2, one line, no run folder (the `_global_` profile would have moved it
    to tmp/evil), and a FIFO read by nobody, so nothing waits for a writer."""
    name, contents, says = CRAFTED[case]
    write(tmp_path, name, contents)
    env = {**os.environ, "TITAN_EXP_CONFIG_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "titan_exp", "hardware=mine", "training.steps=1"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO)},  # run from the folder, so that a run folder would land there
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr[-2000:]
    [line] = done.stderr.splitlines()
    assert line.startswith(f"titan_exp: config error: {tmp_path / 'hardware' / name}") and says in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hardware"]
