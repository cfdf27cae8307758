"""How metrics read on the console: one line per logged step, one line of name=value facts."""

from titan_exp.models.moe.config import LOAD_IMBALANCE_KEY


def format_line(step: int, metrics: dict[str, float]) -> str:
    mem = (
        f"mem(active) {metrics['memory/max_active_gib']:.2f}GiB"
        if "memory/max_active_gib" in metrics
        else f"mem(cpu rss peak) {metrics['memory/cpu_rss_peak_gib']:.2f}GiB"
    )
    mfu = f"mfu {metrics['throughput/mfu_pct']:.2f}%" if "throughput/mfu_pct" in metrics else "mfu n/a"
    return (
        f"step {step:5d}  loss {metrics['loss/global_avg']:7.4f}  grad_norm {metrics['grad_norm']:7.4f}  "
        f"lr {metrics['lr']:.2e}  tps/dev {metrics['throughput/tps_per_device']:,.0f}  "
        f"tflops {metrics['throughput/tflops']:.3f}  {mfu}  {mem}  "
        f"step {metrics['time/step_s']:.3f}s  data {metrics['time/data_loading_pct']:.1f}%"
        + (f"  experts max/mean {metrics[LOAD_IMBALANCE_KEY]:.2f}" if LOAD_IMBALANCE_KEY in metrics else "")
    )


def format_summary(values: dict[str, object]) -> str:
    """'name=value' pairs of 'group/name' keys, numbers with thousands separators."""

    def show(value: object) -> str:
        if isinstance(value, float):
            return f"{value:,.4g}"
        return f"{value:,}" if isinstance(value, int) else str(value)

    return "  ".join(f"{key.rsplit('/', 1)[-1]}={show(value)}" for key, value in values.items())
