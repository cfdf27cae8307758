"""Where the published runs of benchmarks/published_runs.py and published_held_out.py come from, and
when each ran: the torchtitan of the time decides settings its logs do not print (which AdamW, whether a
pipelined step kept its outputs)."""

TT_202412 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TORCHAO_FLOAT8 = "pytorch/ao torchao/float8/README.md @9e655fc7 (2025-03)"
TORCHAO_MX = "pytorch/ao torchao/prototype/mx_formats/README.md @374601de (2025-08)"
TT_ASYNC_TP = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TT_TRAINY = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy.md"
TT_DSV3_SCALING = "pytorch/torchtitan branch graph_trainer/dsv3_scaling dsv3_scaling_experiment_results.md @6b960233"
PITH_TRAIN = "mlc-ai/pith-train issue 79 (torchtitan on 8 B200, five steps)"
TT_PERFORMANCE = "pytorch/torchtitan docs/performance.md @4d88a8a4 (tables of 2024-04 and 2024-08)"

TT_PR = "pytorch/torchtitan PR {} (commit {}, log in the commit message)"
IBM_FSDP = "pytorch.org/blog/maximizing-training (IBM, 2024-03) and foundation-model-stack/fms-fsdp README @4ffb9bd"
IBM_COMPILE = "foundation-model-stack/fms-fsdp README @5a296af (torch.compile)"
TT_ISSUE_929 = "pytorch/torchtitan issue 929 (a comment's log, 2025-03-06)"
NEMO_AUTOMODEL = "NVIDIA-NeMo/Automodel docs/performance-summary.md @2013a4dd6 (FSDP2 backend, TE kernels)"
AWS_SAGEMAKER = (
    "aws.amazon.com/blogs/machine-learning/"
    "efficient-pre-training-of-llama-3-like-model-architectures-using-torchtitan-on-amazon-sagemaker"
)

# torchtitan ran foreach AdamW until it made fused its default on 2025-02-24 (its #881); PR 355, which
# added the fused option, ran it. IBM's fms-fsdp takes torch's default (foreach).
FUSED_ADAMW_SINCE = "2025-02-24"
# torchtitan's pipelined step returned the last stage's outputs (torch's default) until its #1922 of
# 2025-10-22: every microbatch's logits stayed on the last stage through the step.
PIPELINE_OUTPUTS_DROPPED_SINCE = "2025-10-22"

# When each source's runs ran (as precise as the source says): which AdamW torchtitan ran then.
RAN = {
    TT_202412: "2024-12",
    TORCHAO_FLOAT8: "2025-03",
    TORCHAO_MX: "2025-08",
    TT_ASYNC_TP: "2025-06",
    TT_TRAINY: "2025-06",
    TT_DSV3_SCALING: "2026-08",
    PITH_TRAIN: "2025-10",
    TT_PERFORMANCE: "2024-08",
    TT_PR.format(1690, "00c95c0f"): "2025-09-17",
    TT_PR.format(355, "655d834c"): "2024-06-06",
    TT_PR.format(467, "9dc418a8"): "2024-07",
    TT_PR.format("822/996/1287", "b4087730"): "2025-03",  # five dates, February to July 2025
    TT_PR.format(642, "6b2f6731"): "2024-10",
    TT_PR.format(165, "02923f02"): "2024-03-28",
    TT_PR.format(1504, "decfd3fe"): "2025-08-01",
    IBM_FSDP: "2024-03",
    IBM_COMPILE: "2024-05",
    AWS_SAGEMAKER: "2024-10",
    TT_PR.format(808, "069bae286"): "2025-02-27",
    TT_PR.format(812, "2271b6386"): "2025-01-31",
    TT_PR.format(615, "466586975"): "2024-10-21",
    TT_PR.format(382, "baad09c3b"): "2024-07-11",
    TT_PR.format(533, "e0634d9dc"): "2024-08-19",
    TT_ISSUE_929: "2025-03-06",
    TT_PR.format(1610, "f738a03bf"): "2025-08-22",
    TT_PR.format(1616, "8a749c618"): "2025-08-22",
    TT_PR.format(2107, "36a4b6942"): "2025-12-17",
    NEMO_AUTOMODEL: "2026-04",
}
