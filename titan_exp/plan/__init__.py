"""The planner (`python -m titan_exp plan`): a layout's memory and speed predicted before it runs,
from the estimates (estimate/) and what torch can measure here, and the pruning of sweeps."""
