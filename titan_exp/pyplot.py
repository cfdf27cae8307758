"""matplotlib's pyplot as every PNG here is drawn: headless (Agg), and quiet on first use, when
matplotlib builds its font cache and would log "generated new fontManager" into a run's console."""

import logging


def pyplot():
    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
