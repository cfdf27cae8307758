"""The user's own config options (titan_exp.user_conf_dir(), e.g. a profile written by `titan_exp plan
calibrate`) on Hydra's search path, after the packaged tree: `hardware=<name>` finds them (the
profiles read as data, the rest as Hydra configs). Hydra finds search-path plugins and config
sources in the hydra_plugins namespace package only, hence this small package."""
