"""The decoder every family here shares: token embeddings, blocks of (RMSNorm, attention, RMSNorm,
SwiGLU or mixture-of-experts feed-forward) with residuals, a final norm and the output head; its
seeded initialization and its cut into pipeline stages. A family subclasses it to bring its own
attention (`attention_class`, which also says how tensor parallelism splits it; `build_attention`
where its layers' attention differs by layer).

Layers live in a ModuleDict keyed by their index so that a pipeline stage can drop the layers it does
not own and keep the original names (and checkpoint keys).
"""

import copy
import zlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_exp.models.common.moe.layer import AuxLossPool, MoE
from titan_exp.models.common.rotary import precompute_freqs_cis
from titan_exp.models.common.swiglu import SwiGLU
from titan_exp.models.config import ModelConfig
from titan_exp.parallel.stages import StagePlan

# Name parts that wrappers insert (activation checkpointing, torch.compile); not part of the model.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.")


def canonical_name(name: str) -> str:
    """The parameter's name in the unwrapped model: seeds and checkpoints must not depend on wrappers."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, cfg: ModelConfig, attention: nn.Module):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = attention
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        # A MoE layer's feed-forward is `moe`, a dense one's `feed_forward` (their parameters' names differ).
        moe = cfg.is_moe_layer(layer_id)
        self.feed_forward = None if moe else SwiGLU(cfg.dim, cfg.ffn_hidden_dim)
        self.moe = MoE(cfg.dim, cfg.moe, layer_id) if moe else None

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, documents=documents)
        ffn = self.moe if self.moe is not None else self.feed_forward
        return h + ffn(self.ffn_norm(h))


class Transformer(nn.Module):
    # The family's attention: built from the model section; forward(x, freqs_cis) on (batch, seq,
    # dim), an `attend` function context parallelism can swap, and tensor_parallel_plan(tp) (the
    # split parallel/tensor_parallel.py applies).
    attention_class: type[nn.Module]

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, cfg, self.build_attention(cfg, i)) for i in range(cfg.n_layers)}
        )
        pool = AuxLossPool()  # the pooled auxiliary loss's (moe/layer.py)
        for block in self.layers.values():
            if block.moe is not None:
                block.moe.aux_pool = pool
        self.norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.register_buffer("freqs_cis", precompute_freqs_cis(cfg, cfg.max_seq_len), persistent=False)

    @classmethod
    def build_attention(cls, cfg: ModelConfig, layer: int) -> nn.Module:
        """Layer `layer`'s attention: every layer's alike unless the family's differ by layer."""
        return cls.attention_class(cfg)

    def forward(self, tokens: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """`documents` (batch, seq): each token's document, which alone it attends to
        (model.attn_mask_type=block_causal; rotary.document_ids); None: causal over the window.
        A pipeline stage lacks the parts other stages own: it then takes or returns hidden states."""
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis, documents) if documents is not None else layer(h, self.freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    def pipeline_stages(self, plan: StagePlan, stage_ids: list[int]) -> list["Transformer"]:
        """Pipeline parallelism's cut of this (meta) model: a copy per stage keeping only that
        stage's layers; layer names are kept, so initialization and checkpoints address parameters
        exactly as in the whole model."""
        parts = []
        for stage in stage_ids:
            part = copy.deepcopy(self)
            keep = {str(i) for i in plan.layers(stage, len(self.layers))}
            for name in list(part.layers):
                if name not in keep:
                    del part.layers[name]
            if stage != 0:
                part.tok_embeddings = None
            if stage != plan.num_stages - 1:
                part.norm = None
                part.output = None
            parts.append(part)
        return parts

    def num_params(self) -> int:
        # parameters() yields a tied weight once, so tied models count it once too.
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """Deterministic init that does not depend on the layout.

        Each parameter is drawn in full from a generator seeded by (seed, parameter name) and each rank
        keeps its own shard, so single-device, DDP and FSDP runs start from the same weights.
        """
        self.freqs_cis = precompute_freqs_cis(self.cfg, self.cfg.max_seq_len).to(self.freqs_cis.device)
        for name, buffer in self.named_buffers():
            # The routers' state starts at zero.
            if name.endswith(("expert_bias", "tokens_per_expert", "aux_loss_total")):
                buffer.zero_()
        for wrapped_name, param in self.named_parameters():
            name = canonical_name(wrapped_name)
            full = torch.empty(param.shape, dtype=param.dtype, device=param.device)
            gen = torch.Generator(device=param.device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            self._init_one(name, full, gen)
            if isinstance(param, DTensor):
                # Every rank drew the same full tensor: slice locally, no communication.
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.copy_(full)

    def _init_one(self, name: str, t: torch.Tensor, gen: torch.Generator) -> None:
        """torchtitan's init; GPT-OSS's biases as transformers starts them (zeros, but the router's,
        drawn as its weight). A tied embedding (named tok_embeddings.weight, where it is registered
        first) is the output projection too and is initialised as one: N(0, 1) there would give
        logits a spread of about √dim at step 0."""
        if name.endswith("norm.weight"):
            t.fill_(1.0)
        elif name.endswith("bias") and ".router." not in name:
            t.zero_()
        elif name == "tok_embeddings.weight" and not self.cfg.tie_word_embeddings:
            nn.init.normal_(t, std=1.0, generator=gen)
        elif name in ("output.weight", "tok_embeddings.weight"):
            std = self.cfg.dim**-0.5
            nn.init.trunc_normal_(t, std=std, a=-3 * std, b=3 * std, generator=gen)
        else:
            # Output projections of each block are scaled down with depth (torchtitan's depth init),
            # an expert's as a dense layer's (experts.w2 stacks them).
            layer_id = int(name.split(".")[1])
            is_out_proj = name.removesuffix(".weight").endswith(("wo", "w2", "w3"))
            std = 0.02 / (2 * (layer_id + 1)) ** 0.5 if is_out_proj else 0.02
            # trunc_normal_'s default bounds, ±2 absolute (torchtitan's): no truncation at these stds.
            nn.init.trunc_normal_(t, std=std, generator=gen)
