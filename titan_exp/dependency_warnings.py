"""The warnings a dependency gives on our runs that the project cannot avoid, each ignored narrowly
(its message and the module it is reported from) with the reason; every other warning still shows,
and is a cause to fix where it arises, not one to add here. The code that triggers one installs the
filters just before (installing them again changes nothing)."""

import logging
import warnings

# message (regex), module reported from (regex), and why it cannot be avoided.
_UNAVOIDABLE = (
    (
        r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to (save|load) "
        r"in a single process",
        r"torch\.distributed\.checkpoint\.utils",
        # A process alone (a seed checkpoint, parallelism=single) saves and loads without a process
        # group, as DCP allows; torch 2.13 warns then even when no_dist=True says so.
    ),
    (
        r"FSDP2-wrapped module \(FSDPEmbedding\) returned a view tensor",
        r"torch\.distributed\.fsdp\._fully_shard\._fsdp_state",
        # Under TP the embeddings' output is DTensor.to_local()'s, a view; torch warns that an in-place
        # op on it would skip the unit's pre-backward all-gather. Moot here: the blocks only read it
        # (h = x + ...) and the embeddings' unit does not all-gather in backward. Avoiding it would
        # copy every step's embeddings; torch means to clone there itself (pytorch PR 181850).
    ),
)


def ignore_unavoidable_warnings() -> None:
    for message, module in _UNAVOIDABLE:
        warnings.filterwarnings("ignore", message=message, category=UserWarning, module=module)


class _SequentialRedistribute(logging.Filter):
    """Drops DTensor's log line that a reduction over a 2D mesh takes one all-reduce per dim.

    Expert-parallel experts are sharded over FSDP's ranks and EP's, two dims of the mesh; their
    gradient norm (a scalar, once a step) is reduced over both, one after the other. Torch suggests
    flattening the dims, which would need a third mesh for one scalar."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_reduce operations will be performed" not in record.getMessage()


def ignore_sequential_redistribute_log() -> None:
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _SequentialRedistribute) for f in logger.filters):
        logger.addFilter(_SequentialRedistribute())
