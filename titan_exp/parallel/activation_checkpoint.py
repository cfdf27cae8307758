"""Activation checkpointing of transformer blocks: full, every N-th block, or per op (SAC)."""

from collections import defaultdict

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from titan_exp.parallel.config import ActivationCheckpointConfig

# Outputs worth keeping under per-op SAC: expensive to recompute, cheap to store (torchtitan's list:
# attention's kernels, TP's reduce-scatters, float8's amax).
_SAVE_OPS = {
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops.aten.max.default,
}


def _op_sac_policy():
    # Keep every other matmul output, from the first (wq, wv, w1, w2 of a Llama block): half the
    # matmuls are recomputed, half are stored, as torchtitan's policy does (estimate/memory.py and
    # estimate/gpu_compute.py model exactly these).
    mm_seen: dict[str, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if op == torch.ops.aten.mm.default:
            mm_seen[mode] += 1
            keep = mm_seen[mode] % 2 == 1
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _wrap(block: nn.Module, cfg: ActivationCheckpointConfig) -> nn.Module:
    if cfg.mode == "selective" and cfg.selective_ac_option == "op":
        return checkpoint_wrapper(
            block,
            context_fn=lambda: create_selective_checkpoint_contexts(_op_sac_policy()),
            preserve_rng_state=False,
        )
    return checkpoint_wrapper(block, preserve_rng_state=False)


def apply_activation_checkpointing(layers: nn.ModuleDict, cfg: ActivationCheckpointConfig) -> None:
    """Wrap blocks of `layers` in place according to cfg.mode (validated by ActivationCheckpointConfig.check)."""
    if cfg.mode == "none":
        return
    every = int(cfg.selective_ac_option) if cfg.mode == "selective" and cfg.selective_ac_option != "op" else 1
    for index, (name, block) in enumerate(list(layers.items())):
        if index % every == 0:
            layers[name] = _wrap(block, cfg)
