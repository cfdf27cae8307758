"""The rank side: what each rank process runs (entry.py), rank 0's tracked MLflow run
(tracked_run.py). The launching process names these by string (launchers/entrypoint.py) and never
imports them (tests/test_architecture.py)."""
