"""Weights in Hugging Face's format (the family's HFFormat names the differences: models/hf.py), read and
written through DCP's safetensors storage: each rank reads only the slices of its own shards, and
writes only them (merged into whole tensors once written). The q/k weights are the exception: their
rows are permuted within each head, so each is gathered whole (one matrix at a time), permuted and
sliced again, as the seeded init does."""

import json
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from titan_exp.dependency_warnings import ignore_unavoidable_warnings
from titan_exp.models.config import ModelConfig
from titan_exp.models.hf import CONFIG_FILE
from titan_exp.models.registry import family_of

# Where DCP's writer puts each rank's slices before merging them into whole tensors beside it.
_SLICES_DIR = "sharded"


def _rotary_to_hf(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta's interleaved (even, odd) channel pairs → HF's halves, within each head's rows."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def _rotary_from_hf(weight: torch.Tensor, heads: int) -> torch.Tensor:
    rows, cols = weight.shape
    return weight.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def load_hf(part: torch.nn.Module, folder: str, cfg: ModelConfig) -> None:
    """The weights of `part` (a whole model or a pipeline stage, in any layout) from the HF
    checkpoint in `folder` (single or sharded safetensors); its shape was checked before the ranks
    started (job/preflight.py)."""
    hf = family_of(cfg).hf
    state = get_model_state_dict(part)
    named = {hf.hf_key(name): tensor for name, tensor in state.items() if not hf.is_tied_output(name, cfg)}
    ignore_unavoidable_warnings()
    dcp.load(named, storage_reader=HuggingFaceStorageReader(folder))
    for name, tensor in state.items():
        if (heads := hf.permuted_heads(name, cfg)) is None:
            continue
        ours = _rotary_from_hf(_whole(tensor), heads)
        if isinstance(tensor, DTensor):
            ours = distribute_tensor(ours, tensor.device_mesh, tensor.placements, src_data_rank=None)
        state[name] = ours
    set_model_state_dict(part, state)


def save_hf(parts: list[torch.nn.Module], folder: Path, cfg: ModelConfig, is_writer: bool) -> None:
    """The weights of every rank's `parts` into `folder` as `model-0000N-of-0000M.safetensors`, their
    index and the config.json that `transformers`' from_pretrained opens (every rank takes part)."""
    hf = family_of(cfg).hf
    named: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in get_model_state_dict(part).items():
            if hf.is_tied_output(name, cfg):
                continue
            if (heads := hf.permuted_heads(name, cfg)) is not None:
                tensor = _rotary_to_hf(_whole(tensor), heads)  # whole on every rank: DCP writes it once
            named[hf.hf_key(name)] = tensor
    dtype = str(next(iter(named.values())).dtype).removeprefix("torch.")
    writer = HuggingFaceStorageWriter(str(folder), save_distributed=True, enable_consolidation=True)
    ignore_unavoidable_warnings()
    dcp.save(named, storage_writer=writer)
    if is_writer:
        shutil.rmtree(folder / _SLICES_DIR, ignore_errors=True)
        (folder / CONFIG_FILE).write_text(json.dumps(hf.hf_config(cfg, dtype), indent=2) + "\n")
