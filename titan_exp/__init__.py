"""titan_exp: compose, place, train, track and predict PyTorch-native LLM training layouts."""

from pathlib import Path

# The Hydra config tree ships inside the package, so the installed `titan_exp` command finds it too.
CONF_DIR = Path(__file__).resolve().parent / "conf"
