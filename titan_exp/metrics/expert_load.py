"""One MoE run's expert load as a picture (expert_load.png, a run artifact): for every MoE layer, the
tokens each expert received over the run over the mean expert's, so an expert the router starves or
floods stands out, with each layer's max/mean beside it."""

from pathlib import Path

from titan_exp.pyplot import pyplot

EXPERT_LOAD_ARTIFACT = "expert_load.png"


def plot_expert_load(load: dict[int, list[float]], steps: tuple[int, int], path: Path) -> None:
    """`load`: routed rows per expert, summed over the steps from `steps[0]` to `steps[1]`, by layer."""
    import matplotlib
    import numpy as np

    plt = pyplot()

    layers = sorted(load)
    counts = np.array([load[layer] for layer in layers], dtype=float)
    relative = counts / counts.mean(axis=1, keepdims=True)
    num_experts = counts.shape[1]
    figure, axis = plt.subplots(
        figsize=(min(16, max(8, 4 + 0.12 * num_experts)), 2.1 + 0.3 * len(layers)), layout="constrained"
    )
    # Centred on 1.0 (the mean load): blue below, red above, on a log scale so halves and doubles match.
    spread = max(2.0, float(relative.max()), 1 / max(float(relative.min()), 1e-3))
    image = axis.imshow(
        relative, aspect="auto", cmap="RdBu_r", norm=matplotlib.colors.LogNorm(vmin=1 / spread, vmax=spread)
    )
    axis.set_yticks(
        range(len(layers)), [f"layer {layer}  (max/mean {row.max():.2f})" for layer, row in zip(layers, relative)]
    )
    # Summed over the steps, where one step's busy experts are another's idle ones: flatter than a
    # step's load, which the strategy table's "experts max/mean" gives (the last logged step's).
    axis.set(
        xlabel="expert",
        title=f"tokens per expert over the mean expert's, summed over steps {steps[0]}-{steps[1]}\n"
        "(one step's spread is wider: the strategy table's experts max/mean, at the last step)",
    )
    bar = figure.colorbar(image, ax=axis, label="load / mean")
    ticks = [t for t in (0.25, 0.5, 0.8, 1.0, 1.25, 2.0, 4.0, 8.0) if 1 / spread <= t <= spread]
    bar.set_ticks(ticks, labels=[f"{t:g}" for t in ticks])
    bar.minorticks_off()
    figure.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.1)
    plt.close(figure)
