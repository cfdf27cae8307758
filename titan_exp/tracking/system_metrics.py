"""MLflow's host metrics (CPU, memory, disk, network; GPU with pynvml) for a run, sampled in the
writer process (tracking.system_metrics=true)."""

from titan_exp.tracking.config import TrackingConfig


def start_system_metrics(cfg: TrackingConfig, run_id: str):
    """MLflow's system-metrics sampler for the run; None (reported) if it cannot start."""
    try:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        monitor = SystemMetricsMonitor(run_id, sampling_interval=cfg.system_metrics_interval_s, tracking_uri=cfg.uri)
        monitor.start()
        return monitor
    except Exception as err:
        print(f"titan_exp: system metrics are off: {type(err).__name__}: {err}", flush=True)
        return None


def stop_system_metrics(monitor) -> None:
    """Stop sampling, then take one last sample, so that a run shorter than the interval has one
    too (MLflow's monitor drops the sample it took when it is told to stop). Best effort: the run
    is finished whatever happens here."""
    try:
        monitor.finish()
        monitor.collect_metrics()
        monitor.publish_metrics(monitor.aggregate_metrics())
        monitor.mlflow_logger.flush()
    except Exception as err:
        print(f"titan_exp: last system metrics sample lost: {type(err).__name__}: {err}", flush=True)
