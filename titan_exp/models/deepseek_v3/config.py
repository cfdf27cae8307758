"""DeepSeek-V3's `model` section: the shared one with multi-head latent attention (`model.mla`,
models/deepseek_v3/attention.py), and the figures the planner reads of it. Its other choices (YaRN,
MoE layers after dense ones, shared experts, grouped sigmoid routing) are the shared section's keys."""

from dataclasses import dataclass, field

from titan_exp.models.config import Linear, ModelConfig, PointwiseWidths, output_copies
from titan_exp.rules import Section, check_at_least, check_positive


@dataclass
class MLAConfig(Section):
    # Keys and values go through a compressed latent of this width.
    kv_lora_rank: int = 512
    # Queries go through a latent of this width too; 0: projected directly (the 16B model).
    q_lora_rank: int = 0
    # Each head's query/key width without and with the rotary embedding, and its value width.
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    # YaRN's attention-scale coefficient: softmax scale × (0.1 · mscale · ln(rope factor) + 1)².
    mscale: float = 1.0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def check(self, key: str) -> None:
        super().check(key)
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mscale"):
            check_positive(f"{key}.{name}", getattr(self, name))
        check_at_least(f"{key}.q_lora_rank", self.q_lora_rank, 0)


@dataclass
class DeepSeekV3Config(ModelConfig):
    mla: MLAConfig = field(default_factory=MLAConfig)

    def check(self, key: str) -> None:
        self.mla.check(f"{key}.mla")
        super().check(key)

    @property
    def rope_dim(self) -> int:
        return self.mla.qk_rope_head_dim

    @property
    def rope_dim_set_by(self) -> tuple[str, object]:
        return "mla.qk_rope_head_dim", self.mla.qk_rope_head_dim

    @property
    def attention_flops_dim(self) -> float:
        """The query-key width and the value width differ: their mean."""
        return (self.mla.qk_head_dim + self.mla.v_head_dim) / 2

    @property
    def value_width_differs(self) -> bool:
        return self.mla.qk_head_dim != self.mla.v_head_dim

    def attention_linears(self) -> dict[str, Linear]:
        """The query path (one projection, or a down-projection left whole by TP and an up one),
        the key-value latent with the rotary key (whole), the heads' keys and values from it, the
        output."""
        mla, dim, heads = self.mla, self.dim, self.n_heads
        query = {"wq": Linear(dim, heads * mla.qk_head_dim, "column")}
        if mla.q_lora_rank:
            query = {
                "wq_a": Linear(dim, mla.q_lora_rank, None),
                "wq_b": Linear(mla.q_lora_rank, heads * mla.qk_head_dim, "column"),
            }
        return query | {
            "wkv_a": Linear(dim, mla.kv_lora_rank + mla.qk_rope_head_dim, None),
            "wkv_b": Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), "column"),
            "wo": Linear(heads * mla.v_head_dim, dim, "row"),
        }

    def attention_parameters(self) -> int:
        """The linears', and the norms of the latents (q's where it has one)."""
        return super().attention_parameters() + self.mla.kv_lora_rank + self.mla.q_lora_rank

    def attention_pointwise_widths(self) -> PointwiseWidths:
        """Latent attention's (models/deepseek_v3/attention.py): the rotary embedding turns each
        head's rope channels of q and the one rope key all heads share; its norms run over the
        latents (q's where there is one); q is joined from its parts and scaled, k joined from
        its part and the shared rope key (each a read and a write of every head's q·k width), and
        k and v copied once more by the attention's repeat to every head (one each here); the
        output is each head's values."""
        mla, heads = self.mla, self.n_heads
        return PointwiseWidths(
            rotary=(heads + 1) * mla.qk_rope_head_dim,
            inner_norms=mla.q_lora_rank + mla.kv_lora_rank,
            copied=3 * 2 * heads * mla.qk_head_dim + 2 * heads * (mla.qk_head_dim + mla.v_head_dim),
            output=heads * mla.v_head_dim,
        )

    def attention_kept_per_token(self, norm_kept: int, cpu: bool, seq_len: int) -> tuple[float, float]:
        """The latents (normed, read by wq_b and wkv_b: whole, as TP does not split their
        projections), then per head q and k as attention takes them, the values inside wkv_b's
        output and the output. On a CPU, where q·k and v differ in width, SDPA takes its math path
        (the flash kernel wants one head width): it keeps its own q, k and v, every head's
        attention probabilities (a row of seq_len per token), and wo reads a copy of its output."""
        mla, heads = self.mla, self.n_heads
        latents = (norm_kept + 1) * (mla.kv_lora_rank + mla.q_lora_rank)
        if cpu and mla.qk_head_dim != mla.v_head_dim:
            return latents, heads * (2 * mla.qk_head_dim + 2 * mla.v_head_dim + seq_len)
        keys_values = heads * (2 * mla.qk_head_dim + mla.qk_nope_head_dim + mla.v_head_dim)
        return latents, keys_values + output_copies(cpu) * heads * mla.v_head_dim
