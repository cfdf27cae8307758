"""Weights in Hugging Face's format (the family's HFFormat names the differences: models/hf.py), read and
written through DCP's safetensors storage: each rank reads only the slices of its own shards and
the experts it holds, and writes only them (merged into whole tensors once written). Our experts
are stacked (experts × ...), HF's one tensor each. The q/k weights are the exception: their
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
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_exp.dependency_warnings import ignore_unavoidable_warnings
from titan_exp.models.config import ModelConfig
from titan_exp.models.hf import CONFIG_FILE, HFFormat
from titan_exp.models.registry import family_of

# Where DCP's writer puts each rank's slices before merging them into whole tensors beside it.
_SLICES_DIR = "sharded"


def _rotary_to_hf(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Meta's interleaved (even, odd) channel pairs → HF's halves, within each head's rows (a norm's
    weight, 1-D, as one column)."""
    rows = weight.shape[0]
    cols = weight.shape[1] if weight.dim() == 2 else 1
    halves = weight.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2)
    return halves.reshape(weight.shape)


def _rotary_from_hf(weight: torch.Tensor, heads: int) -> torch.Tensor:
    rows = weight.shape[0]
    cols = weight.shape[1] if weight.dim() == 2 else 1
    return weight.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(weight.shape)


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """This rank's part of `t` and where it starts in the whole tensor (a plain tensor: all of it, at 0)."""
    if not isinstance(t, DTensor):
        return t, (0,) * t.dim()
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), tuple(offset)


def load_hf(part: torch.nn.Module, folder: str, cfg: ModelConfig) -> None:
    """The weights of `part` (a whole model or a pipeline stage, in any layout) from the HF
    checkpoint in `folder` (single or sharded safetensors); its shape was checked before the ranks
    started (job/preflight.py). Each rank reads only the slices of its own shards, and of the
    experts only those it holds (expert parallelism, FSDP over experts): one tensor per expert,
    or the layer's fused tensor where the checkpoint has transformers' fused layout."""
    hf = family_of(cfg).hf
    state = get_model_state_dict(part)
    reader = HuggingFaceStorageReader(folder)
    fused = hf.is_fused(reader.read_metadata().state_dict_metadata)
    named: dict[str, torch.Tensor] = {}
    fills: list[tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]] = []  # (local part, whole, offset)
    for name, tensor in state.items():
        if hf.is_tied_output(name, cfg):
            continue
        if not hf.is_experts(name):
            named[hf.hf_key(name)] = tensor
            continue
        local, offset = _local_box(tensor)
        experts = range(offset[0], offset[0] + local.shape[0])
        if fused:
            key, index, parts = hf.fused_key(name)
            whole = named.setdefault(key, torch.empty(_fused_shape(tensor.shape, parts), dtype=tensor.dtype))
            rows = tensor.shape[1]
            for i, expert in enumerate(experts):
                fills.append((local[i], whole[expert, index * rows : (index + 1) * rows], offset[1:]))
        else:
            for i, expert in enumerate(experts):
                whole = named[hf.expert_key(name, expert)] = torch.empty(tensor.shape[1:], dtype=tensor.dtype)
                fills.append((local[i], whole, offset[1:]))
    ignore_unavoidable_warnings()
    dcp.load(named, storage_reader=reader)
    with torch.no_grad():
        for local, whole, offset in fills:
            local.copy_(whole[tuple(slice(o, o + n) for o, n in zip(offset, local.shape))])
    for name, tensor in state.items():
        if (heads := hf.permuted_heads(name, cfg)) is None:
            continue
        ours = _rotary_from_hf(_whole(tensor), heads)
        if isinstance(tensor, DTensor):
            ours = distribute_tensor(ours, tensor.device_mesh, tensor.placements, src_data_rank=None)
        state[name] = ours
    set_model_state_dict(part, state)


def _fused_shape(stacked: torch.Size, parts: int) -> tuple[int, ...]:
    experts, rows, width = stacked
    return experts, rows * parts, width


def _expert_matrices(hf: HFFormat, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF's tensor of each expert of our stacked `name` that this rank writes: the experts it holds
    whole where only the experts are split among the ranks (each written by its rank), else every
    expert of the gathered whole (DCP writes each once)."""
    local, offset = _local_box(tensor)
    if tuple(local.shape[1:]) == tuple(tensor.shape[1:]):
        return {hf.expert_key(name, offset[0] + i): local[i] for i in range(local.shape[0])}
    whole = _whole(tensor)
    return {hf.expert_key(name, expert): whole[expert] for expert in range(whole.shape[0])}


def save_hf(
    parts: list[torch.nn.Module],
    folder: Path,
    cfg: ModelConfig,
    is_writer: bool,
    dtype: torch.dtype = torch.float32,
    tokenizer: str | None = None,
) -> None:
    """The weights of every rank's `parts` into `folder` as `model-0000N-of-0000M.safetensors` in
    `dtype`, their index, the config.json that `transformers`' from_pretrained opens and the files
    of the run's `tokenizer` (a tokenizer.json; the tokenizer_config.json and special_tokens_map.json
    beside it), so the folder is a model others can use as it is (every rank takes part)."""
    hf = family_of(cfg).hf
    named: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in get_model_state_dict(part).items():
            if hf.is_tied_output(name, cfg):
                continue
            if hf.is_experts(name):
                named |= _expert_matrices(hf, name, tensor)
                continue
            if (heads := hf.permuted_heads(name, cfg)) is not None:
                tensor = _rotary_to_hf(_whole(tensor), heads)  # whole on every rank: DCP writes it once
            named[hf.hf_key(name)] = tensor
    named = {name: tensor.to(dtype) for name, tensor in named.items()}
    writer = HuggingFaceStorageWriter(str(folder), save_distributed=True, enable_consolidation=True)
    ignore_unavoidable_warnings()
    dcp.save(named, storage_writer=writer)
    if is_writer:
        shutil.rmtree(folder / _SLICES_DIR, ignore_errors=True)
        config = hf.hf_config(cfg, str(dtype).removeprefix("torch."))
        (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if tokenizer is not None:
            _copy_tokenizer(Path(tokenizer), folder)


# Beside a tokenizer.json, what transformers' AutoTokenizer reads with it.
_TOKENIZER_COMPANIONS = ("tokenizer_config.json", "special_tokens_map.json")


def _copy_tokenizer(tokenizer: Path, folder: Path) -> None:
    shutil.copyfile(tokenizer, folder / "tokenizer.json")
    for name in _TOKENIZER_COMPANIONS:
        if (companion := tokenizer.with_name(name)).is_file():
            shutil.copyfile(companion, folder / name)
