"""The held-out loss during training (the `validation` section): every `freq` steps and at the last
step, `steps` global batches of the validation split run forward in the training layout, and their
mean loss over every data-parallel rank is logged as loss/validation. The same batches on every
layout, so the loss is a layout's check as much as the training loss is."""

from titan_exp.config.sections import ValidationConfig
from titan_exp.data.loader import BatchLoader
from titan_exp.parallel.mesh import ParallelMesh
from titan_exp.train.step import ForwardBackward, global_loss


class Validator:
    def __init__(
        self, cfg: ValidationConfig, last_step: int, forward: ForwardBackward, loader: BatchLoader, mesh: ParallelMesh
    ):
        self.cfg, self.last_step, self.forward, self.loader, self.mesh = cfg, last_step, forward, loader, mesh

    def due(self, step: int) -> bool:
        return step % self.cfg.freq == 0 or step == self.last_step

    def loss(self) -> float:
        """The held-out loss (collectives: every rank calls it at the same step). The model stays in
        training mode: it has no dropout or batch statistics, and a compiled model would recompile."""
        total = 0.0
        for index in range(self.cfg.steps):
            loss = self.forward.loss_only(self.loader, index)
            total += global_loss(loss, self.mesh)[0]
        return total / self.cfg.steps
