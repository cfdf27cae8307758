"""GPU peaks live in titan_exp/conf/hardware only: the trainer's MFU peak for a CUDA device name is its
profile's bf16 peak, the profile found by the longest of the profiles' `device_names` in the name."""

import dataclasses
import os
import subprocess
import sys

import pytest
import yaml

from titan_exp.config.tree import group_options, option_schema
from titan_exp.estimate.config import GLOO_ONLY
from titan_exp.estimate.hardware_profiles import hardware_profiles, profile_for_device
from titan_exp.metrics.peak_flops import gpu_peak_flops

from conftest import REPO

# The table of dense bf16 peaks that metrics/peak_flops.py held before the profiles replaced it:
# the reference the profiles must still agree with.
OLD_GPU_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "H20": 148e12,
    "B200": 2.25e15,
    "GB200": 2.5e15,
    "A100": 312e12,
    "A10G": 125e12,
    "L40S": 362e12,
    "L4": 121e12,
    "MI300X": 1307e12,
    "MI325X": 1307e12,
}


@pytest.mark.parametrize(
    "device_name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),  # not the SXM's, though it contains "H100"
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA H200", 989e12),  # not H20's, though it contains "H20"
        ("NVIDIA H20", 148e12),
        ("NVIDIA GB200", 2.5e15),  # not B200's
        ("NVIDIA L40S", 362e12),  # not L4's
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("AMD Instinct MI300X", 1307e12),
    ],
)
def test_the_longest_device_name_in_the_cuda_name_picks_the_peak(device_name, peak):
    assert gpu_peak_flops(device_name) == pytest.approx(peak, rel=1e-12)


def test_an_unknown_gpu_raises_key_error():
    with pytest.raises(KeyError, match="no peak FLOP/s known for GPU 'NVIDIA Tesla K80'"):
        gpu_peak_flops("NVIDIA Tesla K80")
    with pytest.raises(KeyError):
        profile_for_device("cpu")  # the cpu profile stands for no CUDA device


@pytest.mark.parametrize("device_name,peak", sorted(OLD_GPU_PEAK_BF16_FLOPS.items()))
def test_each_gpu_of_the_old_table_has_a_profile_with_its_peak(device_name, peak):
    [option] = [o for o, p in hardware_profiles().items() if device_name in p.device_names]
    assert hardware_profiles()[option].peak_flops("bfloat16") == pytest.approx(peak, rel=1e-12)
    assert profile_for_device(f"NVIDIA {device_name}").name == option


def test_device_names_are_unique_and_profiles_complete():
    profiles = hardware_profiles()
    names = [name for p in profiles.values() for name in p.device_names]
    assert len(names) == len(set(names)), sorted(names)
    for option, profile in profiles.items():
        assert profile.name == option
        assert profile.device == ("cpu" if option == "cpu" else "cuda"), option
        if profile.device == "cuda":  # a GPU's profile: every figure the planner needs is given, none measured
            measured_here = [f.name for f in dataclasses.fields(profile) if getattr(profile, f.name) == -1]
            unset = [name for name in measured_here if name not in GLOO_ONLY]
            assert not unset, f"hardware/{option} leaves {unset} to be measured"


def test_the_profiles_load_without_torch():
    code = (
        "import sys; from titan_exp.estimate.hardware_profiles import profile_for_device; "
        "profile_for_device('NVIDIA H100 80GB HBM3'); print('torch' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_profile_in_the_users_config_folder_is_an_option_of_hardware(tmp_path):
    """What `titan_exp plan calibrate` writes there: `hardware=<its name>` composes it, after the
    shipped profiles, and where the folder is missing nothing is said."""
    mine = dataclasses.asdict(hardware_profiles()["h100"]) | {"name": "h100_ours", "matmul_efficiency": 0.5}
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "h100_ours.yaml").write_text(yaml.safe_dump(mine))
    show = [sys.executable, "-m", "titan_exp", "show", "hardware=h100_ours", "model=llama3_8b"]
    for folder, said in (
        (tmp_path, "hardware=h100_ours"),
        (tmp_path / "missing", "Could not find 'hardware/h100_ours'"),
    ):
        env = {**os.environ, "TITAN_EXP_CONFIG_DIR": str(folder)}
        shown = subprocess.run(show, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
        assert said in shown.stdout + shown.stderr, shown.stdout[-2000:] + shown.stderr[-2000:]
        assert "is not available" not in shown.stderr  # Hydra's warning for a missing search-path folder


def test_the_users_profiles_are_listed_as_options_of_hardware(tmp_path, monkeypatch):
    """The help page and every refusal that lists a group's options read the user's folder too."""
    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "h100_ours.yaml").write_text("name: h100_ours\n")
    monkeypatch.setenv("TITAN_EXP_CONFIG_DIR", str(tmp_path / "missing"))
    assert "h100_ours" not in group_options()["hardware"]
    monkeypatch.setenv("TITAN_EXP_CONFIG_DIR", str(tmp_path))
    assert "h100_ours" in group_options()["hardware"]
    assert "h100" in group_options()["hardware"]
    assert option_schema("hardware", "h100_ours") is None
