"""Reading a checkpoint without running code from it. DCP unpickles a checkpoint's `.metadata` with
plain pickle and its non-tensor values with torch.load(weights_only=False): a crafted file would run
its payload on load. Here `.metadata` is read by an unpickler that admits only the classes DCP
writes there, and the values as plain data (tensors are read weights_only by DCP already). Only
regular files of the folder are read (staging.py): a .metadata that is a FIFO, or one naming a file
elsewhere, is refused before DCP opens anything."""

import io
import pickle
import re
from pathlib import Path
from typing import IO

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from titan_exp.checkpoint.errors import REFUSED, UntrustedCheckpointError, unwrapped
from titan_exp.checkpoint.staging import open_own, own_file
from titan_exp.dependency_warnings import ignore_unavoidable_warnings

# What DCP's .metadata refers to (listed from real saves with pickletools); torch dtypes too, below.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # how a torch.layout pickles: a lookup by name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath"},  # StorageMeta.checkpoint_id
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes only: any other global (os.system, builtins.exec, ...) is refused
    before it is looked up, so nothing of the file's choosing can run."""

    def __init__(self, file: IO[bytes], path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> object:
        if name in _ALLOWED.get(module, ()) or _is_torch_constant(module, name):
            return super().find_class(module, name)
        raise UntrustedCheckpointError(
            f"checkpoint {self.path} refers to {module}.{name}, which a DCP checkpoint never does; {REFUSED}"
        )


def _is_torch_constant(module: str, name: str) -> bool:
    """torch.float32 and its kind: dtypes (layouts, memory formats) pickle as torch attributes.
    vars(), not getattr: torch's lazy __getattr__ would import whatever module was named."""
    constant = vars(torch).get(name) if module == "torch" else None
    return isinstance(constant, torch.dtype | torch.layout | torch.memory_format)


class TrustedReader(FileSystemReader):
    """DCP's FileSystemReader with `.metadata` read by the restricted unpickler, once, when made: a
    refusal comes before DCP's collectives, the same on every rank, and DCP never unpickles it."""

    def __init__(self, path: str):
        super().__init__(path)
        metadata_path = Path(self._get_metadata_path())
        with open_own(metadata_path) as stream:
            metadata = _MetadataUnpickler(stream, metadata_path).load()
        if not isinstance(metadata, Metadata):
            raise ValueError(f"{metadata_path} holds a {type(metadata).__name__}, not DCP's Metadata")
        self.metadata: Metadata = metadata
        for name in {getattr(info, "relative_path", None) for info in (metadata.storage_data or {}).values()}:
            _shard_file(Path(path), name, metadata_path)

    def read_metadata(self) -> Metadata:
        """As FileSystemReader.read_metadata, from what was read when made. Without its `rank`
        argument: DCP then never falls back to per-rank metadata files (this project writes none)."""
        if getattr(self.metadata, "storage_meta", None) is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


def _shard_file(folder: Path, name: object, metadata_path: Path) -> None:
    """A file .metadata names for tensors: one of its own folder's, a regular file (never a path
    elsewhere nor a FIFO, which DCP would open and wait on)."""
    if not isinstance(name, str) or name in ("", ".", "..") or Path(name).name != name:
        raise UntrustedCheckpointError(f"{metadata_path} names {name!r} as a file of its folder; {REFUSED}")
    own_file(folder / name)


class _PlainDataPlanner(DefaultLoadPlanner):
    """DCP's load planner with non-tensor values (an lr, the LR schedule's state) unpickled as plain
    data: DefaultLoadPlanner.load_bytes uses torch.load(weights_only=False)."""

    def __init__(self, path: Path):
        super().__init__()
        self.path = path

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            found = re.search(r"GLOBAL (\S+)", str(err))
            what = found.group(1) if found else "more than plain data"
            raise UntrustedCheckpointError(
                f"checkpoint {self.path}: {fqn} refers to {what}, which a DCP checkpoint never does; {REFUSED}"
            ) from None
        # As DefaultLoadPlanner.load_bytes (flatten_state_dict is on: DCP's default).
        set_element(self.original_state_dict, self.mappings[fqn], loaded)


def open_checkpoint(path: str) -> TrustedReader:
    """A reader for the checkpoint folder `path`; UntrustedCheckpointError if its .metadata holds
    more than DCP writes, ValueError if it is no checkpoint (missing, cut short, another format)."""
    try:
        return TrustedReader(path)
    except UntrustedCheckpointError:
        raise
    except Exception as err:
        raise ValueError(f"{path} is not a readable checkpoint: {type(err).__name__}: {err}") from err


def load_trusted(state: dict, reader: TrustedReader) -> None:
    """dcp.load of `state` (in place, as dcp.load) through `reader`, values read as plain data. A
    refusal on any rank comes out as itself, not inside DCP's CheckpointException."""
    try:
        ignore_unavoidable_warnings()  # DCP's in a process alone (parallelism=single)
        dcp.load(state, storage_reader=reader, planner=_PlainDataPlanner(reader.path))
    except CheckpointException as err:
        refused = unwrapped(err, UntrustedCheckpointError)
        if refused is None:
            raise
        raise refused from err
