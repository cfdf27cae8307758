"""titan_exp's Hydra launcher (hydra/launcher=titan_exp, the default in titan_exp/conf/config.yaml): the points
of a multirun as jobs of their own, side by side (titan_exp/job/sweep_points.py). Hydra finds
launchers in the hydra_plugins namespace package only, hence this small package."""
