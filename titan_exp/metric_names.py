"""The names of the metrics a run logs to MLflow, said once: the ranks write them, the console,
comparisons, the UI's view, sweeps' objectives and the parity check read them. Torch-free."""

# The step's loss over every data-parallel (and context-parallel) rank: mean and max.
LOSS = "loss/global_avg"
LOSS_MAX = "loss/global_max"
# The held-out loss (validation.enable).
VALIDATION_LOSS = "loss/validation"
GRAD_NORM = "grad_norm"
LR = "lr"

# Throughput over the last log interval, and its steady-state mean over the run after its first
# interval (the _mean figures: start-up and compilation left out).
TPS = "throughput/tps_per_device"
TPS_MEAN = "throughput/tps_per_device_mean"
TFLOPS = "throughput/tflops"
MFU = "throughput/mfu_pct"
MFU_MEAN = "throughput/mfu_pct_mean"
STEP_SECONDS = "time/step_s"
DATA_SECONDS = "time/data_loading_s"
DATA_PCT = "time/data_loading_pct"
TOKENS_SEEN = "tokens_seen"

# Peak memory per log interval: CUDA's allocator (active, reserved), or the CPU's resident set.
MAX_ACTIVE_GIB = "memory/max_active_gib"
MAX_ACTIVE_PCT = "memory/max_active_pct"
MAX_RESERVED_GIB = "memory/max_reserved_gib"
MAX_RESERVED_PCT = "memory/max_reserved_pct"
ALLOC_RETRIES = "memory/num_alloc_retries"
CPU_RSS_PEAK_GIB = "memory/cpu_rss_peak_gib"
CPU_RSS_PEAK_PCT = "memory/cpu_rss_peak_pct"

# A MoE model's step: its worst layer's busiest expert's routed tokens over the mean expert's
# (1.0: balanced; `<LOAD_IMBALANCE>/layer_<i>` per layer), and the auxiliary loss.
LOAD_IMBALANCE = "moe/load_imbalance"
AUX_LOSS = "moe/aux_loss"
# The all-to-all exchanges' time per profiled step.
ALL_TO_ALL_MS = "moe/all_to_all_ms_per_step"
