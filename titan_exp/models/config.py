"""The `model` section every family builds on: the shape of a decoder-only transformer (embeddings,
blocks of attention and a SwiGLU or mixture-of-experts feed-forward, a norm and the output head),
its rotary embedding and its experts (`model.moe`). A family's folder (models/<family>/) adds its
own keys in a subclass and overrides what the planner reads of its attention (the figures below);
each option of the `model` group names its family's section as its schema (models/registry.py).
Torch-free: the launching process and the planner read it."""

from dataclasses import dataclass, field
from typing import NamedTuple, Optional

from titan_exp.models.common.moe.config import MoEConfig
from titan_exp.rules import ConfigError, Section, check_positive, label, one_of

# FlexAttention's blocks of queries and keys (torch.nn.attention.flex_attention's
# _DEFAULT_SPARSE_BLOCK_SIZE, which create_block_mask takes unless told otherwise): it skips the
# blocks a mask empties and computes every other block whole.
FLEX_BLOCK = 128

# Fields that must be finite and > 0.
_POSITIVE = (
    "dim",
    "n_layers",
    "n_heads",
    "vocab_size",
    "multiple_of",
    "max_seq_len",
    "norm_eps",
    "rope_theta",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_seq_len",
)
# Deeper than any model published (Llama 3 405B: 126 layers), so a typo or a crafted config.json,
# not a model: the rules, the planner and a Hugging Face folder's check walk every layer.
MAX_LAYERS = 10_000


class Linear(NamedTuple):
    """One linear of a block, as the planner times it: its features in and out, and how tensor
    parallelism splits it (column-wise: its outputs; row-wise: its inputs; None: left whole)."""

    fan_in: int
    fan_out: int
    split: str | None

    @property
    def parameters(self) -> int:
        return self.fan_in * self.fan_out


class PointwiseWidths(NamedTuple):
    """Elements per token of an attention's pointwise work (ModelConfig.attention_pointwise_widths):
    what the rotary embedding turns, what norms inside attention normalize, what its copies before
    the kernel read and write, and its output (copied once to be contiguous)."""

    rotary: float
    inner_norms: float
    copied: float
    output: float


@dataclass
class ModelConfig(Section):
    # Labels of the model option (conf/model/<name>_<flavor>.yaml), in run names and tables; the
    # name is the family (models/registry.py), or hf until the folder's config.json says which.
    name: str = label("llama3", chosen_by="model=<option>")
    flavor: str = label("debug", chosen_by="model=<option>")
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 16
    # None means multi-head attention (as many kv heads as heads).
    n_kv_heads: Optional[int] = 4
    # Each head's width; None: dim / n_heads (Llama 3). Qwen3's heads are 128 wide at every size.
    attention_head_dim: Optional[int] = None
    vocab_size: int = 2048
    # SwiGLU hidden size = multiple_of-rounded(ffn_dim_multiplier * 8/3 * dim), as in Meta's reference code.
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    # The SwiGLU hidden size given outright (HF's intermediate_size); None: from the two keys above.
    intermediate_size: Optional[int] = None
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Frequency scaling by this factor; None disables it. llama3: Llama 3.1's (the two factors and
    # the original length below); yarn: YaRN's (DeepSeek-V3: beta_fast, beta_slow, the original length).
    rope_scaling_factor: Optional[float] = None
    rope_scaling_type: str = one_of("llama3", "yarn")
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    # YaRN's ramp ends rounded to whole dimensions (transformers' `truncate`, true but for GPT-OSS).
    rope_yarn_truncate: bool = True
    max_seq_len: int = 2048
    tie_word_embeddings: bool = False
    # What a token attends to (torchtitan's key): every earlier token of its window (causal), or
    # only those of its own document in a window of packed documents (block_causal: documents end
    # at the data's end-of-document id).
    attn_mask_type: str = one_of("causal", "block_causal")
    # model=hf: a Hugging Face model folder whose config.json gives every field above (config/resolve.py).
    hf_path: Optional[str] = None
    moe: MoEConfig = field(default_factory=MoEConfig)

    def check(self, key: str) -> None:
        """Shapes that would fail inside the ranks, or silently build a different model (an attention
        width that is not `dim`, a kv-head count of 0 read as "as many as heads")."""
        for name in _POSITIVE:
            check_positive(f"{key}.{name}", getattr(self, name))
        if self.n_layers > MAX_LAYERS:
            raise ConfigError(f"{key}.n_layers", self.n_layers, f"more than {MAX_LAYERS:,} layers; no model is so deep")
        super().check(key)
        self.moe.check(f"{key}.moe")
        if self.moe.enabled and self.moe.n_dense_layers >= self.n_layers:
            raise ConfigError(
                f"{key}.moe.n_dense_layers", self.moe.n_dense_layers, f"leaves none of the {self.n_layers} layers MoE"
            )
        for name in ("ffn_dim_multiplier", "intermediate_size", "attention_head_dim", "rope_scaling_factor"):
            if getattr(self, name) is not None:
                check_positive(f"{key}.{name}", getattr(self, name))
        if self.attention_head_dim is None and self.dim % self.n_heads:
            raise ConfigError(
                f"{key}.n_heads", self.n_heads, f"must divide model dim={self.dim} (each head takes dim / n_heads)"
            )
        if self.rope_dim % 2:
            name, value = self.rope_dim_set_by
            raise ConfigError(
                f"{key}.{name}", value, f"leaves an odd rotary dim {self.rope_dim}; rotary embeddings need it even"
            )
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise ConfigError(
                f"{key}.n_kv_heads",
                self.n_kv_heads,
                f"must divide n_heads={self.n_heads} (null: as many as heads, multi-head attention)",
            )
        llama3_scaling = self.rope_scaling_factor is not None and self.rope_scaling_type == "llama3"
        if llama3_scaling and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ConfigError(
                f"{key}.rope_high_freq_factor",
                self.rope_high_freq_factor,
                f"must exceed rope_low_freq_factor={self.rope_low_freq_factor} when rope_scaling_factor is set",
            )

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim or self.dim // self.n_heads

    @property
    def rope_dim(self) -> int:
        """The channels of each head the rotary embedding turns."""
        return self.head_dim

    @property
    def rope_dim_set_by(self) -> tuple[str, object]:
        """The key (under `model.`) and value that set rope_dim, for a refusal."""
        return ("attention_head_dim", self.attention_head_dim) if self.attention_head_dim else ("n_heads", self.n_heads)

    # What the planner reads of a family's attention (estimate/, metrics/flops.py): grouped-query
    # attention's figures here; a family whose attention differs overrides them in its section.

    @property
    def attention_flops_dim(self) -> float:
        """Each head's width in attention's two matmuls, on average (q·k, then the values)."""
        return self.head_dim

    @property
    def value_width_differs(self) -> bool:
        """Whether a head's values are narrower or wider than its queries and keys."""
        return False

    def cuda_attention_kernel(self, document_mask: bool) -> str:
        """The kernel the family's attention runs on a GPU (models/common/rotary.causal_attention):
        under a document mask FlexAttention; else SDPA's flash kernel, which needs q, k and v of one
        head width (aten's sdp_utils.cpp, check_head_dim_size_flash), or where the values' width
        differs its memory-efficient kernel (cuDNN's refuses latent attention's 192-wide heads too:
        torchtitan PR 1610)."""
        if document_mask:
            return "flex"
        return "efficient" if self.value_width_differs else "flash"

    def attention_linears(self) -> dict[str, Linear]:
        """The attention's linears in the order a block runs them: q, k and v column-wise over
        n_heads (kv_heads) × head_dim, the output row-wise."""
        q, kv = self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        return {
            "wq": Linear(self.dim, q, "column"),
            "wk": Linear(self.dim, kv, "column"),
            "wv": Linear(self.dim, kv, "column"),
            "wo": Linear(q, self.dim, "row"),
        }

    def attention_pointwise_widths(self) -> PointwiseWidths:
        """Per token, the widths of attention's pointwise work (the planner's bandwidth-bound
        traffic, estimate/gpu_compute.py): grouped-query attention turns q's and k's channels,
        normalizes none inside, repeats K and V to every query head (each read at its width and
        written at q's) and makes its output contiguous."""
        q, kv = self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        return PointwiseWidths(rotary=q + kv, inner_norms=0, copied=2 * (kv + q), output=q)

    def attention_parameters(self) -> int:
        """One layer's attention weights: its linears' (a family adds its norms' weights)."""
        return sum(linear.parameters for linear in self.attention_linears().values())

    def attention_kept_per_token(self, norm_kept: int, cpu: bool, seq_len: int) -> tuple[float, float]:
        """(elements per token attention keeps for its backward whole on every tp rank, and split
        over the heads): q, k and v as attention takes them (k and v repeated to every head) and
        its output's copies. `norm_kept`: what an RMSNorm keeps per element of its input (1 fused,
        2 composed of pointwise ops on a CPU); `seq_len`: the keys each query attends to."""
        return 0.0, (3 + output_copies(cpu)) * self.n_heads * self.head_dim

    @property
    def context_parallel_refusal(self) -> str | None:
        """Why context parallelism cannot split this family's attention (None: it can)."""
        return None

    def keys_per_query(self, keys: float, seq_len: int, cuda: bool) -> float:
        """The keys attention's kernel computes per query, on average over the layers, where each
        would compute `keys` of its window of `seq_len` (estimate/workload.py): the same in every
        layer here; a family whose layers attend differently says so."""
        return keys

    def whole_under_tensor_parallel_parameters(self) -> int:
        """One layer's weights that tensor parallelism leaves whole on every tp rank, whose
        matmuls each rank then runs over the gathered sequence (grouped-query attention: none)."""
        return sum(linear.parameters for linear in self.attention_linears().values() if linear.split is None)

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe.enabled and layer >= self.moe.n_dense_layers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(layer) for layer in range(self.n_layers))

    @property
    def active_ffn_hidden_dim(self) -> int:
        """The SwiGLU hidden width a token's feed-forward computes through: its routed and shared
        experts' in a MoE layer (the FLOPs and activations per token), else ffn_hidden_dim."""
        if not self.moe.enabled:
            return self.ffn_hidden_dim
        return (self.moe.top_k + self.moe.num_shared_experts) * self.moe.hidden_dim

    @property
    def ffn_hidden_dim(self) -> int:
        if self.intermediate_size is not None:
            return self.intermediate_size
        hidden = int(2 * 4 * self.dim / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


def output_copies(cpu: bool) -> int:
    """Copies of attention's output kept for backward: SDPA's, and on a GPU the contiguous one wo
    reads (the CPU's flash kernel writes that layout)."""
    return 1 if cpu else 2
