"""titan_exp: compose, place, train, track and predict PyTorch-native LLM training layouts."""

import os
import time
from pathlib import Path

# When this interpreter reached titan_exp's first line, and the CPU time it had used by then: what
# its start-up clock starts from (metrics/startup.py). Taken first, before anything of ours loads.
REACHED = (time.time(), time.process_time())

# The Hydra config tree ships inside the package, so the installed `titan_exp` command finds it too.
CONF_DIR = Path(__file__).resolve().parent / "conf"


def user_conf_dir() -> Path:
    """The user's own config options, searched after CONF_DIR (hydra_plugins/titan_exp_user_conf):
    e.g. hardware/<name>.yaml written by `titan_exp plan calibrate`. $TITAN_EXP_CONFIG_DIR, else
    $XDG_CONFIG_HOME/titan_exp, else ~/.config/titan_exp."""
    if os.environ.get("TITAN_EXP_CONFIG_DIR"):
        return Path(os.environ["TITAN_EXP_CONFIG_DIR"]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "titan_exp"
