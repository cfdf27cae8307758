"""The placement layer: starts N rank processes of a callable (on this machine today; Slurm next)
from plain parameters, and tells a rank where it stands. Imports nothing from titan_exp: titan_exp
decides what to place, this package only places it (a test guards the rule)."""
