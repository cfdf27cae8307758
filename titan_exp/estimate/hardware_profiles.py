"""The device profiles of the `hardware` group read straight from titan_exp/conf/hardware/ (no Hydra): each
option file merged over HardwareConfig's defaults, and the profile a CUDA device name stands for
(its `device_names`). The only table of GPU peaks is those files. Torch-free."""

import copy
import functools

from omegaconf import OmegaConf

from titan_exp import CONF_DIR
from titan_exp.estimate.config import HardwareConfig

HARDWARE_DIR = CONF_DIR / "hardware"


@functools.cache
def _profiles() -> dict[str, HardwareConfig]:
    if not HARDWARE_DIR.is_dir():
        raise FileNotFoundError(f"no device profiles: {HARDWARE_DIR} is not a folder")
    schema = OmegaConf.structured(HardwareConfig)
    return {
        path.stem: OmegaConf.to_object(OmegaConf.merge(schema, OmegaConf.load(path)))
        for path in sorted(HARDWARE_DIR.glob("*.yaml"))
    }


def hardware_profiles() -> dict[str, HardwareConfig]:
    """Every profile by its option name (titan_exp/conf/hardware/<option>.yaml), as `hardware=<option>` has it."""
    return copy.deepcopy(_profiles())


def profile_for_device(device_name: str) -> HardwareConfig:
    """The profile with the longest of all `device_names` contained in `device_name` (as
    torch.cuda.get_device_name() spells it: 'NVIDIA H100 PCIe' is h100_pcie's, not h100's)."""
    matches = [
        (len(name), option)
        for option, profile in _profiles().items()
        for name in profile.device_names
        if name in device_name
    ]
    if not matches:
        raise KeyError(f"no profile in {HARDWARE_DIR} lists a device name contained in '{device_name}'")
    return copy.deepcopy(_profiles()[max(matches)[1]])
