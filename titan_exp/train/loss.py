"""The training loss, one expression for the trainer, the pipeline schedules and the dry runs."""

import torch
import torch.nn.functional as F


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy averaged over every token of the (micro)batch, computed in float32.
    Under tensor parallelism call it inside `loss_parallel()`: the logits stay sharded over the
    vocabulary and the loss comes out as a replicated DTensor."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
