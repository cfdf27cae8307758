"""How metrics read on the console: one line per logged step, one line of name=value facts."""

from titan_exp import metric_names as names


def format_line(step: int, steps: int, metrics: dict[str, float], left: str) -> str:
    """`step N/steps  loss ...`, ending with `left` (progress.py's time left; "" for none)."""
    mem = (
        f"mem(active) {metrics[names.MAX_ACTIVE_GIB]:.2f}GiB"
        if names.MAX_ACTIVE_GIB in metrics
        else f"mem(cpu rss peak) {metrics[names.CPU_RSS_PEAK_GIB]:.2f}GiB"
    )
    mfu = f"mfu {metrics[names.MFU]:.2f}%" if names.MFU in metrics else "mfu n/a"
    return (
        f"step {step:5d}/{steps}  loss {metrics[names.LOSS]:7.4f}  grad_norm {metrics[names.GRAD_NORM]:7.4f}  "
        f"lr {metrics[names.LR]:.2e}  tps/dev {metrics[names.TPS]:,.0f}  "
        f"tflops {metrics[names.TFLOPS]:.3f}  {mfu}  {mem}  "
        f"step {metrics[names.STEP_SECONDS]:.3f}s  data {metrics[names.DATA_PCT]:.1f}%"
        + (f"  experts max/mean {metrics[names.LOAD_IMBALANCE]:.2f}" if names.LOAD_IMBALANCE in metrics else "")
        + (f"  {left}" if left else "")
    )


def format_summary(values: dict[str, object]) -> str:
    """'name=value' pairs of 'group/name' keys, numbers with thousands separators."""

    def show(value: object) -> str:
        if isinstance(value, float):
            return f"{value:,.4g}"
        return f"{value:,}" if isinstance(value, int) else str(value)

    return "  ".join(f"{key.rsplit('/', 1)[-1]}={show(value)}" for key, value in values.items())
