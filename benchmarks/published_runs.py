"""Published measured GPU training runs the planner is held against (benchmarks/bench_planner_published.py):
each with its source and the source's settings as overrides, the rest torchtitan's defaults of the
time (bf16 parameters, fp32 gradient reduction, AdamW). RUNS are the runs the profiles' figures were
set against; HELD_OUT, runs found after the model's terms were written, kept out of every fit."""

from dataclasses import dataclass, field

# torchtitan's recipe of the time: bf16 parameters, fp32 reduction, seq 8192, AC per run.
BASE = ["training.mixed_precision_param=bfloat16", "training.mixed_precision_reduce=float32", "tracking=none"]
BASE += ["plan.measure=false", "training.seq_len=8192", "model.max_seq_len=8192"]
COMPILE = ["compile.enable=true"]
# Before torchtitan compiled its loss too (spring 2025), or where a source's memory says it did not.
COMPILE_BLOCKS = ["compile.enable=true", "compile.components=[model]"]
FLOAT8 = ["quantize=float8", "quantize.recipe=tensorwise", "quantize.enable_fsdp_float8_all_gather=true"]
SAC_OP = ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=op"]
FULL_AC = ["activation_checkpoint.mode=full"]

TT_202412 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TORCHAO_FLOAT8 = "pytorch/ao torchao/float8/README.md @9e655fc7 (2025-03)"
TORCHAO_MX = "pytorch/ao torchao/prototype/mx_formats/README.md @374601de (2025-08)"
TT_ASYNC_TP = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
TT_TRAINY = "pytorch/torchtitan benchmarks/llama3-8b_h200_202506_trainy.md"
TT_DSV3_SCALING = "pytorch/torchtitan branch graph_trainer/dsv3_scaling dsv3_scaling_experiment_results.md @6b960233"
PITH_TRAIN = "mlc-ai/pith-train issue 79 (torchtitan on 8 B200, five steps)"
TT_PERFORMANCE = "pytorch/torchtitan docs/performance.md @4d88a8a4 (tables of 2024-04 and 2024-08)"


# torchtitan ran foreach AdamW until it made fused its default on 2025-02-24 (its #881); PR 355, which
# added the fused option, ran it. IBM's fms-fsdp takes torch's default (foreach).
FUSED_ADAMW_SINCE = "2025-02-24"
# torchtitan's pipelined step returned the last stage's outputs (torch's default) until its #1922 of
# 2025-10-22: every microbatch's logits stayed on the last stage through the step.
PIPELINE_OUTPUTS_DROPPED_SINCE = "2025-10-22"


@dataclass(frozen=True)
class Published:
    name: str
    family: str  # runs compared with one another for the orders
    source: str
    overrides: list[str]
    tps: float | None
    memory_gib: float | None
    notes: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def composed(self) -> list[str]:
        """The overrides a plan composes it from: the recipe of the time, then the source's settings."""
        ran = _RAN[self.source]
        fused = ran >= FUSED_ADAMW_SINCE or self.source == TT_PR.format(355, "655d834c")
        returned = ran < PIPELINE_OUTPUTS_DROPPED_SINCE
        return [
            *BASE,
            f"optimizer.implementation={'fused' if fused else 'foreach'}",
            f"plan.pipeline_returns_outputs={returned}",
            *self.overrides,
        ]


def fsdp(model: str, gpus: int, hardware: list[str], batch: int) -> list[str]:
    return [f"model={model}", "parallelism=fsdp", *_world(gpus), *hardware, f"training.local_batch_size={batch}"]


def _world(gpus: int) -> list[str]:
    return [f"launcher.nodes={max(1, gpus // 8)}", f"launcher.nproc_per_node={min(gpus, 8)}"]


# TorchTitan's Dec-2024 runs: H100s with 96 GB HBM2e, power-limited to 500 W (its footnote).
GRAND_TETON = ["hardware=h100_grand_teton"]
H100 = ["hardware=h100"]
B200 = ["hardware=b200"]
H200 = ["hardware=h200"]
A100 = ["hardware=a100"]


def layout(model: str, gpus: int, hardware: list[str], batch: int, **degrees: int) -> list[str]:
    """`model` over `gpus` GPUs, FSDP over what the other degrees leave."""
    keys = {"tp": "tensor_parallel_degree", "pp": "pipeline_parallel_degree", "cp": "context_parallel_degree"}
    overrides = [f"parallelism.{keys[name]}={degree}" for name, degree in degrees.items()]
    return [*fsdp(model, gpus, hardware, batch), "parallelism.data_parallel_shard_degree=-1", *overrides]


def pipelined(schedule: str, microbatch: int) -> list[str]:
    return [
        f"parallelism.pipeline_parallel_schedule={schedule}",
        f"parallelism.pipeline_parallel_microbatch_size={microbatch}",
    ]


def seq(length: int) -> list[str]:
    return [f"training.seq_len={length}", f"model.max_seq_len={length}"]


ASYNC_TP = ["parallelism.enable_async_tensor_parallel=true"]
ROWWISE = ["quantize=float8", "quantize.recipe=rowwise"]
TT_8B_128 = fsdp("llama3_8b", 128, GRAND_TETON, 2)
TT_405B = [*layout("llama3_405b", 512, GRAND_TETON, 32, tp=8, pp=8), *FULL_AC, *COMPILE_BLOCKS, *FLOAT8, *ASYNC_TP]
TT_405B_4D = [*layout("llama3_405b", 512, GRAND_TETON, 8, tp=8, pp=8), *FULL_AC, *COMPILE_BLOCKS, *FLOAT8, *ASYNC_TP]
TT_405B_2D = [*layout("llama3_405b", 128, GRAND_TETON, 2, tp=8), *FULL_AC, *COMPILE_BLOCKS]
TT_70B_2D = [*layout("llama3_70b", 256, GRAND_TETON, 16, tp=8), *FULL_AC, *COMPILE_BLOCKS, *FLOAT8]
ATP_70B = [*layout("llama3_70b", 256, GRAND_TETON, 16, tp=8), *FULL_AC, *COMPILE]
ATP_8B = [*layout("llama3_8b", 64, GRAND_TETON, 12, tp=8), *SAC_OP, *COMPILE]

RUNS: list[Published] = [
    # TorchTitan's Dec-2024 tables (Grand Teton H100s; its torch.compile compiled the blocks only;
    # pipeline microbatches: as many as PP ranks; its default then was as many as stages, 16 under
    # Interleaved1F1B, but Table 5's 1.28x of Interleaved1F1B over 1F1B is what 8 give, 1.29x, where 16
    # give 1.47x: the tables state only the local batch). Table 1: 8B, 8 GPUs, local batch 2, selective AC.
    Published("T1 8b fsdp8 eager", "tt-8b-8", TT_202412, [*fsdp("llama3_8b", 8, GRAND_TETON, 2), *SAC_OP], 5762, 82.4),
    Published("T1 8b fsdp8 compile", "tt-8b-8", TT_202412,
              [*fsdp("llama3_8b", 8, GRAND_TETON, 2), *SAC_OP, *COMPILE_BLOCKS], 6667, 77.0),
    Published("T1 8b fsdp8 compile f8", "tt-8b-8", TT_202412,
              [*fsdp("llama3_8b", 8, GRAND_TETON, 2), *SAC_OP, *COMPILE_BLOCKS, *FLOAT8], 8532, 76.8),
    # Table 2: 8B, 8 GPUs, FSDP × CP, compile, float8, local batch 1, full AC.
    *(Published(f"T2 8b fsdp{8 // cp} cp{cp} seq{length // 1024}k", "tt-8b-cp", TT_202412,
                [*layout("llama3_8b", 8, GRAND_TETON, 1, cp=cp), *seq(length), *FULL_AC, *COMPILE_BLOCKS, *FLOAT8],
                tps, memory)
      for cp, length, tps, memory in ((1, 32768, 3890, 83.9), (2, 65536, 2540, 84.2), (4, 131072, 1071, 84.0),
                                      (8, 262144, 548, 84.5))),
    # Table 3: 8B, 128 GPUs, local batch 2, selective AC.
    Published("T3 8b fsdp128 eager", "tt-8b-128", TT_202412, [*TT_8B_128, *SAC_OP], 5605, 67.0),
    Published("T3 8b fsdp128 compile", "tt-8b-128", TT_202412, [*TT_8B_128, *SAC_OP, *COMPILE_BLOCKS], 6514, 62.0),
    Published("T3 8b fsdp128 compile f8", "tt-8b-128", TT_202412,
              [*TT_8B_128, *SAC_OP, *COMPILE_BLOCKS, *FLOAT8], 8380, 61.8),
    # Table 4: 70B, FSDP 32 × TP 8, compile, float8, local batch 16, full AC.
    Published("T4 70b fsdp32 tp8", "tt-70b-2d", TT_202412, TT_70B_2D, 829, 71.9),
    Published("T4 70b fsdp32 tp8 async", "tt-70b-2d", TT_202412, [*TT_70B_2D, *ASYNC_TP], 876, 67.6),
    # Table 5: 405B, FSDP 8 × TP 8 × PP 8, compile, float8, async TP, local batch 32, full AC.
    Published("T5 405b 3d 1F1B", "tt-405b-pp", TT_202412, [*TT_405B, *pipelined("1F1B", 4)], 100, 82.5),
    Published("T5 405b 3d Interleaved1F1B", "tt-405b-pp", TT_202412,
              [*TT_405B, *pipelined("Interleaved1F1B", 4)], 128, 72.7),
    # Table 6: 405B, TP 8 × PP 8 × (FSDP × CP = 8), 1F1B, local batch 8, full AC.
    *(Published(f"T6 405b 4d cp{cp} seq{length // 1024}k", "tt-405b-cp", TT_202412,
                [*TT_405B_4D, *pipelined("1F1B", 1), f"parallelism.context_parallel_degree={cp}", *seq(length)],
                tps, memory)
      for cp, length, tps, memory in ((1, 32768, 76, 75.3), (2, 65536, 47, 75.9), (4, 131072, 31, 77.1),
                                      (8, 262144, 16, 84.9))),
    # TorchTitan's async TP runs (June 2025, Grand Teton H100s; TPS from the table's image, no memory).
    Published("ATP 70b tp8 bf16", "atp-70b-bf16", TT_ASYNC_TP, ATP_70B, 597.3, None),
    Published("ATP 70b tp8 bf16 async", "atp-70b-bf16", TT_ASYNC_TP, [*ATP_70B, *ASYNC_TP], 652.4, None),
    Published("ATP 70b tp8 f8", "atp-70b-f8", TT_ASYNC_TP, [*ATP_70B, *FLOAT8[:2]], 809.8, None),
    Published("ATP 70b tp8 f8 async", "atp-70b-f8", TT_ASYNC_TP, [*ATP_70B, *FLOAT8[:2], *ASYNC_TP], 942.4, None),
    Published("ATP 8b tp8 bf16", "atp-8b-bf16", TT_ASYNC_TP, ATP_8B, 4378, None),
    Published("ATP 8b tp8 bf16 async", "atp-8b-bf16", TT_ASYNC_TP, [*ATP_8B, *ASYNC_TP], 4809.4, None),
    Published("ATP 8b tp8 f8", "atp-8b-f8", TT_ASYNC_TP, [*ATP_8B, *FLOAT8[:2]], 5078.1, None),
    Published("ATP 8b tp8 f8 async", "atp-8b-f8", TT_ASYNC_TP, [*ATP_8B, *FLOAT8[:2], *ASYNC_TP], 5570.1, None),
    # torchao float8 README: Llama 3 8B, 8 H100, FSDP 8, local batch 1, seq 8192, SAC op, compile (the
    # blocks: its memory is 14 GiB above the same recipe's B200 run, with the loss compiled, below).
    # The H100s are not named: Meta's, as torchtitan's own runs (assumed).
    Published("8b fsdp8 lbs1 compile bf16", "torchao-float8", TORCHAO_FLOAT8,
              [*fsdp("llama3_8b", 8, GRAND_TETON, 1), *SAC_OP, *COMPILE_BLOCKS], 6150, 47.65),
    Published("8b fsdp8 lbs1 compile f8 tensorwise", "torchao-float8", TORCHAO_FLOAT8,
              [*fsdp("llama3_8b", 8, GRAND_TETON, 1), *SAC_OP, *COMPILE_BLOCKS, *FLOAT8], 7689.5, 47.77),
    Published("8b fsdp8 lbs1 compile f8 rowwise", "torchao-float8", TORCHAO_FLOAT8,
              [*fsdp("llama3_8b", 8, GRAND_TETON, 1), *SAC_OP, *COMPILE_BLOCKS, "quantize=float8",
               "quantize.recipe=rowwise"], 6768, 47.79),
    # torchao mx_formats README: the same on 8 B200 (750 W).
    Published("8b fsdp8 lbs1 compile bf16 b200", "torchao-mx", TORCHAO_MX,
              [*fsdp("llama3_8b", 8, B200, 1), *SAC_OP, *COMPILE], 8307.5, 33.71),
    Published("8b fsdp8 lbs1 compile f8 tensorwise b200", "torchao-mx", TORCHAO_MX,
              [*fsdp("llama3_8b", 8, B200, 1), *SAC_OP, *COMPILE, *FLOAT8[:2]], 10417, 33.38),
    Published("8b fsdp8 lbs1 compile mxfp8 b200", "torchao-mx", TORCHAO_MX,
              [*fsdp("llama3_8b", 8, B200, 1), *SAC_OP, *COMPILE, "quantize=mxfp8"], 9969, 33.88),
    Published("8b fsdp8 lbs1 compile f8 rowwise b200", "torchao-mx", TORCHAO_MX,
              [*fsdp("llama3_8b", 8, B200, 1), *SAC_OP, *COMPILE, *ROWWISE], 8640.5, 33.72),
    # TorchTitan's older performance page: 405B on 128 H100s (94 GB: Grand Teton's), FSDP 16 × TP 8,
    # local batch 2, full AC (compiled: its toml of the time); Llama 3 on 64 A100s, FSDP, local batch 1.
    Published("405b fsdp16 tp8 bf16", "tt-405b-2d", TT_PERFORMANCE, TT_405B_2D, 109, None),
    Published("405b fsdp16 tp8 f8", "tt-405b-2d", TT_PERFORMANCE, [*TT_405B_2D, *FLOAT8], 177, None),
    Published("405b fsdp16 tp8 f8 async", "tt-405b-2d", TT_PERFORMANCE, [*TT_405B_2D, *FLOAT8, *ASYNC_TP], 185, None),
    Published("a100 8b fsdp64 sac every 2", "tt-a100-8b", TT_PERFORMANCE,
              [*fsdp("llama3_8b", 64, A100, 1), "activation_checkpoint.mode=selective",
               "activation_checkpoint.selective_ac_option=2"], 2904, None),
    Published("a100 8b fsdp64 sac op", "tt-a100-8b", TT_PERFORMANCE,
              [*fsdp("llama3_8b", 64, A100, 1), *SAC_OP], 2973, None),
    Published("a100 70b fsdp64 full ac", "tt-a100-70b", TT_PERFORMANCE,
              [*fsdp("llama3_70b", 64, A100, 1), *FULL_AC], 331, None),
    # TorchTitan + Trainy on H200: 8B, FSDP 32 / 64, local batch 2, seq 8192, compile, float8 all-gather, SAC op.
    Published("8b fsdp32 h200 compile f8", "trainy", TT_TRAINY,
              [*fsdp("llama3_8b", 32, H200, 2), *SAC_OP, *COMPILE, *FLOAT8], 10938, 47.96,
              notes="torchtitan compiled the loss too (titan_exp compiles the blocks)"),
    Published("8b fsdp64 h200 compile f8", "trainy", TT_TRAINY,
              [*fsdp("llama3_8b", 64, H200, 2), *SAC_OP, *COMPILE, *FLOAT8], 10753, 46.97),
    # Mixture of experts. DeepSeek-V3 16B on 8 H100s of 95 GiB (Grand Teton's), FSDP 8 with EP 4, local
    # batch 16, seq 4096, full AC, the loss compiled; eager, torch's all-to-all (Run 8 of torchtitan's
    # DeepSeek-V3 scaling notes, unmerged branch; its attention is FlexAttention).
    Published("dsv3-16b fsdp8 ep4 full ac", "moe-dsv3-16b", TT_DSV3_SCALING,
              [*fsdp("deepseek_v3_16b", 8, GRAND_TETON, 16), "parallelism.expert_parallel_degree=4", *seq(4096),
               *FULL_AC, "compile.enable=true", "compile.components=[loss]"], 10160, 66.98),
    # Qwen3-30B-A3B on 8 B200s through torchtitan: FSDP 8, no EP, local batch 8, seq 8192, SAC, blocks and
    # loss compiled. Its loss runs in 8 chunks (titan_exp's does not): memory not compared.
    Published("qwen3-30b-a3b fsdp8 b200 compile", "moe-qwen3-30b", PITH_TRAIN,
              [*fsdp("qwen3_30b_a3b", 8, B200, 8), *seq(8192), *SAC_OP, *COMPILE], 19500, None,
              notes="loss in 8 chunks there: its 141.79 GiB not compared"),
]  # fmt: skip

# Runs no figure of the planner was ever set against (issue 45): kept out of every fit, reported
# apart. Their sources, found after the model's terms were written:
TT_PR = "pytorch/torchtitan PR {} (commit {}, log in the commit message)"
IBM_FSDP = "pytorch.org/blog/maximizing-training (IBM, 2024-03) and foundation-model-stack/fms-fsdp README @4ffb9bd"
IBM_COMPILE = "foundation-model-stack/fms-fsdp README @5a296af (torch.compile)"
TT_ISSUE_929 = "pytorch/torchtitan issue 929 (a comment's log, 2025-03-06)"
NEMO_AUTOMODEL = "NVIDIA-NeMo/Automodel docs/performance-summary.md @2013a4dd6 (FSDP2 backend, TE kernels)"
AWS_SAGEMAKER = (
    "aws.amazon.com/blogs/machine-learning/"
    "efficient-pre-training-of-llama-3-like-model-architectures-using-torchtitan-on-amazon-sagemaker"
)
# Llama 2's shapes on the Llama 3 model (vocabulary 32,000; multi-head attention at 7B and 13B).
LLAMA2 = {
    "7b": [
        "model=llama3_8b",
        "model.vocab_size=32000",
        "model.n_kv_heads=32",
        "model.multiple_of=256",
        "model.ffn_dim_multiplier=null",
    ],
    "13b": [
        "model=llama3_8b",
        "model.vocab_size=32000",
        "model.dim=5120",
        "model.n_layers=40",
        "model.n_heads=40",
        "model.n_kv_heads=40",
        "model.multiple_of=256",
        "model.ffn_dim_multiplier=null",
    ],
    "34b": [
        "model=llama3_70b",
        "model.vocab_size=32000",
        "model.n_layers=48",
        "model.multiple_of=256",
        "model.ffn_dim_multiplier=1.0",
    ],
    "70b": ["model=llama3_70b", "model.vocab_size=32000"],
}
# torchtitan's "gpt2" flavour of 2024: the Llama 3 block at GPT-2 small's width and depth (multi-head
# attention), with Llama 3's 128,256-entry vocabulary.
LLAMA3_GPT2 = [
    "model=llama3_8b",
    "model.dim=768",
    "model.n_layers=12",
    "model.n_heads=12",
    "model.n_kv_heads=12",
    "model.multiple_of=256",
    "model.ffn_dim_multiplier=null",
]
QWEN3_32B = [
    "model=qwen3_8b",
    "model.dim=5120",
    "model.n_layers=64",
    "model.n_heads=64",
    "model.n_kv_heads=8",
    "model.intermediate_size=25600",
]


def _dp(model: list[str], gpus: int, hardware: list[str], batch: int, *more: str) -> list[str]:
    return [*model, "parallelism=fsdp", *_world(gpus), *hardware, f"training.local_batch_size={batch}", *more]


def _qwen3_32b(gpus: int, batch: int, tp: int = 1, *more: str) -> list[str]:
    return [
        *_dp(QWEN3_32B, gpus, GRAND_TETON, batch, f"parallelism.tensor_parallel_degree={tp}"),
        *seq(4096),
        *FULL_AC,
        *more,
    ]


# IBM's nodes: 400 Gb/s a node (A100s), 800 Gb/s (H100s); HSDP within a node for 7B; fms-fsdp's
# mixed precision ("bfSixteen") reduces the gradients in bf16.
IBM_BF16_REDUCE = "training.mixed_precision_reduce=bfloat16"
IBM_A100 = [*A100, "hardware.nics_per_node=1", IBM_BF16_REDUCE]
IBM_H100 = [*H100, "hardware.nics_per_node=2", IBM_BF16_REDUCE]
HSDP_NODE = [
    "parallelism=hsdp",
    "parallelism.data_parallel_shard_degree=8",
    "parallelism.data_parallel_replicate_degree=-1",
]
IBM_AC = {
    "7b": [],
    "13b": ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=2"],
    "34b": FULL_AC,
    "70b": FULL_AC,
}

# When each source's runs ran (as precise as the source says): which AdamW torchtitan ran then.
_RAN = {
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

HELD_OUT: list[Published] = [
    # Qwen3-32B on Grand Teton H100s, seq 4096, full AC, eager (PR 1690: "no compile applied").
    *(Published(f"qwen3-32b fsdp{gpus // tp}" + (f" tp{tp}" if tp > 1 else "") + f" lbs{batch} eager",
                "ho-qwen3-32b", TT_PR.format(1690, "00c95c0f"), _qwen3_32b(gpus, batch, tp), tps, memory)
      for gpus, batch, tp, tps, memory in ((8, 1, 1, 1444, 81.47), (8, 2, 1, 1614, 89.33), (16, 4, 1, 1518, 78.48),
                                           (32, 16, 8, 876, 43.45), (32, 32, 8, 883, 70.79), (64, 32, 8, 873, 63.27),
                                           (32, 16, 4, 1139, 70.20))),
    Published("qwen3-32b fsdp8 lbs2 compile", "ho-qwen3-32b", TT_PR.format(1690, "00c95c0f"),
              _qwen3_32b(8, 2, 1, *COMPILE), 1874, 81.85),
    # Llama 3 8B on 8 GPUs, seq 8192, eager: A100s (PR 355, selective op AC, fused AdamW); Grand Teton
    # H100s without AC (PR 467) and with op SAC at local batch 1 (PR 822's default, five dates: mean).
    Published("a100 8b fsdp8 lbs1 sac op", "ho-8b-8", TT_PR.format(355, "655d834c"),
              [*fsdp("llama3_8b", 8, A100, 1), *SAC_OP], 2718, 59.48),
    Published("8b fsdp8 lbs1 no ac", "ho-8b-8-gt", TT_PR.format(467, "9dc418a8"),
              fsdp("llama3_8b", 8, GRAND_TETON, 1), 6341, 78.38),
    Published("8b fsdp8 lbs1 sac op", "ho-8b-8-gt", TT_PR.format("822/996/1287", "b4087730"),
              [*fsdp("llama3_8b", 8, GRAND_TETON, 1), *SAC_OP], 5674, 49.59),
    # Llama 3 8B, FSDP 4 × TP 2, compiled, op SAC, local batch 1 (PR 642).
    Published("8b fsdp4 tp2 compile", "ho-8b-tp", TT_PR.format(642, "6b2f6731"),
              [*layout("llama3_8b", 8, GRAND_TETON, 1, tp=2), *SAC_OP, *COMPILE_BLOCKS], 5800, 44.53),
    # Llama 2 7B (torchtitan's "7B" of 2024-03) on 8 Grand Teton H100s, seq 2048, local batch 8
    # (FSDP2 rows of PR 165; "SAC" was every second layer then; midpoints of the ranges).
    *(Published(f"llama2-7b fsdp8 {name}", "ho-llama2-7b", TT_PR.format(165, "02923f02"),
                [*_dp(LLAMA2["7b"], 8, GRAND_TETON, batch), *seq(2048), *ac, *compiled], tps, memory)
      for name, batch, ac, compiled, tps, memory in (
          ("full ac eager", 8, FULL_AC, [], 6200, 31.0),
          ("sac2 eager", 8, IBM_AC["13b"], [], 6700, 59.4),
          ("full ac compile", 8, FULL_AC, COMPILE_BLOCKS, 7350, 28.7),
          ("sac2 compile", 8, IBM_AC["13b"], COMPILE_BLOCKS, 8250, 53.8),
          ("no ac compile", 8, [], COMPILE_BLOCKS, 9200, 90.3))),
    Published("llama2-7b fsdp4 tp2 full ac eager", "ho-llama2-7b", TT_PR.format(165, "02923f02"),
              [*_dp(LLAMA2["7b"], 8, GRAND_TETON, 16, "parallelism.tensor_parallel_degree=2"), *seq(2048), *FULL_AC],
              5850, 57.9),
    # DeepSeek-V3 16B on 8 Grand Teton H100s, seq 4096: FSDP 4 × CP 2, full AC, eager (PR 1504), with
    # DeepSeek-V3's tokenizer: its log builds the model with vocab_size=129280 (15,816,584,704
    # parameters; the flavour's 102,400 give 15,706,484,224).
    Published("dsv3-16b fsdp4 cp2 full ac", "ho-dsv3", TT_PR.format(1504, "decfd3fe"),
              [*layout("deepseek_v3_16b", 8, GRAND_TETON, 8, cp=2), *seq(4096), *FULL_AC, "model.vocab_size=129280"],
              6037, 71.08),
    # IBM's Llama 2 runs, FSDP (HSDP within a node for 7B), local batch 2, seq 4096, eager, on 128
    # A100s and 96 H100s; then compiled.
    *(Published(f"ibm llama2-{size} {gpu}", f"ho-ibm-{gpu}", IBM_FSDP,
                [*_dp(LLAMA2[size], gpus, hw, 2), *(HSDP_NODE if size == "7b" else []), *seq(4096), *IBM_AC[size]],
                tps, None)
      for gpu, gpus, hw, figures in (("a100", 128, IBM_A100, (3700, 1800, 700, 370)),
                                     ("h100", 96, IBM_H100, (7500, 3800, 1550, 800)))
      for size, tps in zip(("7b", "13b", "34b", "70b"), figures)),
    Published("ibm llama2-7b a100 compile", "ho-ibm-a100", IBM_COMPILE,
              [*_dp(LLAMA2["7b"], 128, IBM_A100, 2), *HSDP_NODE, *seq(4096), *COMPILE_BLOCKS], 4550, None),
    Published("ibm llama2-7b h100 compile", "ho-ibm-h100", IBM_COMPILE,
              [*_dp(LLAMA2["7b"], 96, IBM_H100, 2), *HSDP_NODE, *seq(4096), *COMPILE_BLOCKS], 9600, None),
    # torchtitan on 4 AWS p5 nodes (32 H100s, EFA): Llama 3 8B, the default of late 2024 (FSDP 32,
    # local batch 1, seq 8192, op SAC), eager, then compiled, then float8.
    Published("aws 8b fsdp32 eager", "ho-aws", AWS_SAGEMAKER, [*fsdp("llama3_8b", 32, H100, 1), *SAC_OP], 6475, None),
    Published("aws 8b fsdp32 compile", "ho-aws", AWS_SAGEMAKER,
              [*fsdp("llama3_8b", 32, H100, 1), *SAC_OP, *COMPILE_BLOCKS], 7166, None),
    Published("aws 8b fsdp32 compile f8", "ho-aws", AWS_SAGEMAKER,
              [*fsdp("llama3_8b", 32, H100, 1), *SAC_OP, *COMPILE_BLOCKS, *FLOAT8], 8950, None),
    # Found on 2026-12-06, after every term above was written (a second search of torchtitan's PRs and
    # issues and of other stacks' published tables); mapped from their logs and configs as they are.
    # Llama 3 8B on 8 Grand Teton H100s, FSDP 8, local batch 1, seq 8192, op SAC, the blocks compiled:
    # bf16, float8 rowwise, float8 tensorwise with float8 all-gathers (PR 808).
    Published("pr808 8b fsdp8 compile bf16", "ho-8b-808", TT_PR.format(808, "069bae286"),
              [*fsdp("llama3_8b", 8, GRAND_TETON, 1), *SAC_OP, *COMPILE_BLOCKS], 5760, 47.65),
    Published("pr808 8b fsdp8 compile f8 rowwise", "ho-8b-808", TT_PR.format(808, "069bae286"),
              [*fsdp("llama3_8b", 8, GRAND_TETON, 1), *SAC_OP, *COMPILE_BLOCKS, *ROWWISE], 6468, 47.77),
    Published("pr808 8b fsdp8 compile f8 tensorwise", "ho-8b-808", TT_PR.format(808, "069bae286"),
              [*fsdp("llama3_8b", 8, GRAND_TETON, 1), *SAC_OP, *COMPILE_BLOCKS, *FLOAT8], 7186, 47.32),
    # The same, float8 tensorwise without float8 all-gathers, eager and compiled (PR 812; a 5-step
    # run, step 5's figures).
    Published("pr812 8b fsdp8 eager f8", "ho-8b-812", TT_PR.format(812, "2271b6386"),
              [*fsdp("llama3_8b", 8, GRAND_TETON, 1), *SAC_OP, *FLOAT8[:2]], 3985, 81.77),
    Published("pr812 8b fsdp8 compile f8", "ho-8b-812", TT_PR.format(812, "2271b6386"),
              [*fsdp("llama3_8b", 8, GRAND_TETON, 1), *SAC_OP, *COMPILE_BLOCKS, *FLOAT8[:2]], 7448, 47.77),
    # Without AC, compiled, expandable segments set by hand (PR 615, October 2024; steps 3-13).
    Published("pr615 8b fsdp8 lbs1 no ac compile", "ho-8b-8-gt", TT_PR.format(615, "466586975"),
              [*fsdp("llama3_8b", 8, GRAND_TETON, 1), *COMPILE_BLOCKS], 7265, 70.96),
    # Local batch 2, op SAC, eager (PR 382's baseline, July 2024).
    Published("pr382 8b fsdp8 lbs2 sac op eager", "ho-8b-382", TT_PR.format(382, "baad09c3b"),
              [*fsdp("llama3_8b", 8, GRAND_TETON, 2), *SAC_OP], 6398, 69.04),
    # torchtitan's "gpt2" flavour on 4 Grand Teton H100s, FSDP 4, local batch 5, seq 8192, no AC, fused
    # AdamW (its toml): compiled blocks, then eager (PR 533's baselines, August 2024; steps 10-100).
    Published("gpt2-shape fsdp4 lbs5 compile", "ho-gpt2", TT_PR.format(533, "e0634d9dc"),
              [*_dp(LLAMA3_GPT2, 4, GRAND_TETON, 5), *COMPILE_BLOCKS, "optimizer.implementation=fused"],
              112000, 81.67),
    Published("gpt2-shape fsdp4 lbs5 eager", "ho-gpt2", TT_PR.format(533, "e0634d9dc"),
              [*_dp(LLAMA3_GPT2, 4, GRAND_TETON, 5), "optimizer.implementation=fused"], 98800, 86.48),
    # Llama 3 8B on 8 A100s of 80 GB, FSDP 8, local batch 1, seq 8192, op SAC, compiled (steps 20-40).
    Published("a100 8b fsdp8 lbs1 sac op compile", "ho-a100-8b-8", TT_ISSUE_929,
              [*fsdp("llama3_8b", 8, A100, 1), *SAC_OP, *COMPILE_BLOCKS], 2910, 47.61),
    # DeepSeek-V3 16B on 8 Grand Teton H100s, seq 4096, local batch 8, the loss compiled: FSDP 8 with EP 8,
    # op SAC, SDPA (PR 1610); FSDP 2 x PP 4, Interleaved1F1B of 8 microbatches, full AC (PR 1616: its
    # log's memory is one rank's, not compared).
    Published("dsv3-16b fsdp8 ep8 sac op", "ho-dsv3-1610", TT_PR.format(1610, "f738a03bf"),
              [*fsdp("deepseek_v3_16b", 8, GRAND_TETON, 8), "parallelism.expert_parallel_degree=8", *seq(4096),
               *SAC_OP, "compile.enable=true", "compile.components=[loss]"], 6721, 78.14),
    Published("dsv3-16b fsdp2 pp4 interleaved", "ho-dsv3-1616", TT_PR.format(1616, "8a749c618"),
              [*layout("deepseek_v3_16b", 8, GRAND_TETON, 8, pp=4), *pipelined("Interleaved1F1B", 1), *seq(4096),
               *FULL_AC, "compile.enable=true", "compile.components=[loss]"], 4900, None),
    # DeepSeek-V3 671B on 512 H100s of 80 GB: FSDP 64 x PP 8 with EP 32, Interleaved1F1B of 16
    # microbatches of 1, seq 4096, full AC, compiled, torch's all-to-all (PR 2107's baseline; load
    # balance forced there).
    Published("dsv3-671b fsdp64 pp8 ep32", "ho-dsv3-671b", TT_PR.format(2107, "36a4b6942"),
              [*layout("deepseek_v3_671b", 512, H100, 16, pp=8), "parallelism.expert_parallel_degree=32",
               *pipelined("Interleaved1F1B", 1), *seq(4096), *FULL_AC, *COMPILE], 346, None),
    # Llama 3.1 70B on 64 H100s through NeMo AutoModel's FSDP2 backend: FSDP 32 x CP 2, local batch 1,
    # 4 microbatches accumulated, seq 8192, AC, compiled (TransformerEngine's kernels there).
    Published("nemo 70b fsdp32 cp2", "ho-nemo", NEMO_AUTOMODEL,
              [*layout("llama3_70b", 64, H100, 1, cp=2), "training.global_batch_size=128", *FULL_AC, *COMPILE],
              866.77, None),
]  # fmt: skip
