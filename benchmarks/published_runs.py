"""Published measured GPU training runs the planner is held against (benchmarks/bench_planner_published.py):
each with its source (benchmarks/published_sources.py) and the source's settings as overrides, the rest
torchtitan's defaults of the time (bf16 parameters, fp32 gradient reduction, AdamW). RUNS are the runs
the profiles' figures were set against; HELD_OUT (benchmarks/published_held_out.py), runs found after
the model's terms were written, kept out of every fit."""

from dataclasses import dataclass, field

from published_sources import (
    FUSED_ADAMW_SINCE,
    PIPELINE_OUTPUTS_DROPPED_SINCE,
    PITH_TRAIN,
    RAN,
    TORCHAO_FLOAT8,
    TORCHAO_MX,
    TT_202412,
    TT_ASYNC_TP,
    TT_DSV3_SCALING,
    TT_PERFORMANCE,
    TT_PR,
    TT_TRAINY,
)

# torchtitan's recipe of the time: bf16 parameters, fp32 reduction, seq 8192, AC per run.
BASE = ["training.mixed_precision_param=bfloat16", "training.mixed_precision_reduce=float32", "tracking=none"]
BASE += ["plan.measure=false", "training.seq_len=8192", "model.max_seq_len=8192"]
COMPILE = ["compile.enable=true"]
# Before torchtitan compiled its loss too (spring 2025), or where a source's memory says it did not.
COMPILE_BLOCKS = ["compile.enable=true", "compile.components=[model]"]
FLOAT8 = ["quantize=float8", "quantize.recipe=tensorwise", "quantize.enable_fsdp_float8_all_gather=true"]
SAC_OP = ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=op"]
FULL_AC = ["activation_checkpoint.mode=full"]
# torchtitan's FlexAttention within each document (attn_mask_type block_causal: its DeepSeek-V3 from
# 2025-08-22, every language model from 2026) over C4 (c4 or c4_test): 427 tokens a document (C4.EN,
# 156B tokens in 365M documents: Dodge et al. 2021, Table 1).
C4_DOCUMENTS = ["model.attn_mask_type=block_causal", "plan.document_tokens=427"]
# The same over DCLM-baseline: 1,333 tokens a document (4T tokens in 3B documents, its dataset card).
DCLM_DOCUMENTS = ["model.attn_mask_type=block_causal", "plan.document_tokens=1333"]


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
        ran = RAN[self.source]
        fused = ran >= FUSED_ADAMW_SINCE or self.source == TT_PR.format(355, "655d834c")
        returned = ran < PIPELINE_OUTPUTS_DROPPED_SINCE
        return [
            *BASE,
            f"optimizer.implementation={'fused' if fused else 'foreach'}",
            f"plan.pipeline_returns_outputs={returned}",
            *self.overrides,
        ]


def fsdp(model: str | list[str], gpus: int, hardware: list[str], batch: int) -> list[str]:
    """`model` (a config name, or the overrides that reshape one) under FSDP over `gpus` GPUs."""
    shape = [f"model={model}"] if isinstance(model, str) else model
    return [*shape, "parallelism=fsdp", *world(gpus), *hardware, f"training.local_batch_size={batch}"]


def world(gpus: int) -> list[str]:
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
    # DeepSeek-V3 scaling notes, unmerged branch; its attention is FlexAttention, within documents).
    Published("dsv3-16b fsdp8 ep4 full ac", "moe-dsv3-16b", TT_DSV3_SCALING,
              [*fsdp("deepseek_v3_16b", 8, GRAND_TETON, 16), "parallelism.expert_parallel_degree=4", *seq(4096),
               *FULL_AC, *C4_DOCUMENTS, "compile.enable=true", "compile.components=[loss]"], 10160, 66.98),
    # Qwen3-30B-A3B on 8 B200s through torchtitan (2026-07): FSDP 8, no EP, local batch 8, seq 8192, SAC,
    # blocks and loss compiled, over DCLM; FlexAttention within documents, the only attention torchtitan's
    # language models ran since its PR 3571 (2026-06-09: "text dataloader ... always output positions").
    # Its loss runs in 8 chunks (titan_exp's does not): memory not compared.
    Published("qwen3-30b-a3b fsdp8 b200 compile", "moe-qwen3-30b", PITH_TRAIN,
              [*fsdp("qwen3_30b_a3b", 8, B200, 8), *seq(8192), *SAC_OP, *COMPILE, *DCLM_DOCUMENTS], 19500, None,
              notes="loss in 8 chunks there: its 141.79 GiB not compared"),
]  # fmt: skip
