"""The training loss, one expression for the trainer, the pipeline schedules and the dry runs."""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from titan_exp.config.job import ResolvedJob


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over every token of the (micro)batch, computed in float32.
    Under tensor parallelism call it inside `loss_parallel()`: the logits stay sharded over the
    vocabulary and the loss comes out as a replicated DTensor."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def compiled_loss(job: ResolvedJob) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
    """The loss compiled (compile.enable, "loss" in compile.components), as torchtitan does: one fused
    kernel computes the log-sum-exp from the low-precision logits, so no float32 copy of them is kept
    (estimate/memory.py); under TP on the vocabulary shards, inside loss_parallel. None where it
    stays eager: under pipelining (the schedule calls it per microbatch)."""
    compile_cfg, dims = job.config.compile, job.dims
    if not compile_cfg.compiles("loss") or dims.pp > 1:
        return None
    compiled = torch.compile(cross_entropy_loss, backend=compile_cfg.backend)
    if dims.tp == 1:
        return compiled

    def on_shards(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # Compiled afresh, never from AOTAutograd's cache: in torch 2.13 a cached graph of the
        # sharded loss returned a wrong loss (4 CPU runs: 5.01 and 3.86 where eager gives 4.53;
        # tests/test_parity.py::test_a_compiled_loss_on_vocabulary_shards_matches_eager).
        with torch._functorch.config.patch(enable_autograd_cache=False):
            return compiled(logits, labels)

    return on_shards
