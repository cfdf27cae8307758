"""Checkpoint failures that must reach the user as one clear line, also when DCP wraps them (it
gathers every rank's failure into one CheckpointException)."""

from typing import TypeVar

from torch.distributed.checkpoint.api import CheckpointException

REFUSED = "refusing to load it (a checkpoint from someone else is not trusted)"


class UntrustedCheckpointError(ValueError):
    """A checkpoint file holds more than DCP writes (code to run when unpickled)."""


E = TypeVar("E", bound=BaseException)


def unwrapped(err: BaseException, kind: type[E]) -> E | None:
    """`err` itself, or the first failure of that `kind` inside DCP's CheckpointException."""
    if isinstance(err, kind):
        return err
    if isinstance(err, CheckpointException):
        return next((exc for exc, _ in err.failures.values() if isinstance(exc, kind)), None)
    return None
