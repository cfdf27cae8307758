"""The training loss, one expression for the trainer, the pipeline schedules and the dry runs."""

import torch
import torch.nn.functional as F

from titan_exp.config.job import ResolvedJob


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over every token of the (micro)batch, computed in float32.
    Under tensor parallelism call it inside `loss_parallel()`: the logits stay sharded over the
    vocabulary and the loss comes out as a replicated DTensor."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def compiled_loss(job: ResolvedJob):
    """The loss compiled (compile.enable, "loss" in compile.components), as torchtitan does: one fused kernel
    computes the log-sum-exp from the low-precision logits, so no float32 copy of them is kept
    (estimate/memory.py); None where it stays eager: under TP (loss_parallel's sharded logits) and
    pipelining (the schedule calls it per microbatch)."""
    compile_cfg, dims = job.config.compile, job.dims
    if not compile_cfg.compiles("loss") or dims.tp > 1 or dims.pp > 1:
        return None
    return torch.compile(cross_entropy_loss, backend=compile_cfg.backend)
