"""Strategy comparison over tracked runs: `python -m titan_exp.compare` (or `titan_exp compare`)."""
