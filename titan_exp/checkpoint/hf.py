"""Weights in Hugging Face's format (the family's HFFormat names the differences: models/hf.py): each
rank reads only the box of each tensor its shard holds and the experts it holds
(safetensors_folder.py), and writes only them through DCP's safetensors storage (merged into whole
tensors once written). Our experts are stacked (experts × ...), HF's one tensor each. Rows that HF
orders differently within each head (q/k for its rotate-half rotary embedding) are read for the
whole heads a box spans and put in our order; written, such a matrix is gathered whole first."""

import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_exp.checkpoint.hf_export import ExportSources, write_beside_weights
from titan_exp.checkpoint.safetensors_folder import SafetensorsFolder
from titan_exp.dependency_warnings import ignore_unavoidable_warnings
from titan_exp.models.config import ModelConfig
from titan_exp.models.hf import HFFormat
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
    checkpoint in `folder` (single or sharded safetensors, float8 with block scales dequantized);
    its shape was checked before the ranks started (job/preflight.py). Each rank reads only the
    box its shard holds of each tensor, and of a MoE layer's experts only those it holds (one
    tensor per expert, or the part of the layer's fused tensor)."""
    hf = family_of(cfg).hf
    tensors = SafetensorsFolder(folder)
    fused = hf.is_fused(tensors.names())
    state = get_model_state_dict(part)
    with torch.no_grad():
        for name, tensor in state.items():
            if hf.is_tied_output(name, cfg):
                continue
            local, offset = _local_box(tensor)
            box = tuple(slice(o, o + n) for o, n in zip(offset, local.shape))
            local.copy_(_read(hf, tensors, name, tensor.shape, box, cfg, fused))
    set_model_state_dict(part, state)


def _read(
    hf: HFFormat,
    tensors: SafetensorsFolder,
    name: str,
    shape: torch.Size,
    box: tuple[slice, ...],
    cfg: ModelConfig,
    fused: bool,
) -> torch.Tensor:
    """The part `box` of our tensor `name` (of the whole `shape`), from HF's tensor(s) of it."""
    if hf.is_experts(name):
        experts = range(box[0].start, box[0].stop)
        if not fused:
            return torch.stack([tensors.read(hf.expert_key(name, j), box[1:]) for j in experts])
        return _read_fused(hf, tensors, name, shape, box)
    if (heads := hf.permuted_heads(name, cfg)) is None:
        return tensors.read(hf.hf_key(name), box)
    # Rows permuted within each head: the whole heads the box spans, put back in our order.
    per_head = shape[0] // heads
    first, last = box[0].start // per_head, -(-box[0].stop // per_head)
    spanned = tensors.read(hf.hf_key(name), (slice(first * per_head, last * per_head), *box[1:]))
    ours = _rotary_from_hf(spanned, last - first)
    return ours[box[0].start - first * per_head : box[0].stop - first * per_head]


def _read_fused(
    hf: HFFormat, tensors: SafetensorsFolder, name: str, shape: torch.Size, box: tuple[slice, ...]
) -> torch.Tensor:
    """The part `box` of our stacked `name` from the layer's fused tensor that holds it with its
    sibling parts (one after the other, or interleaved row by row; stored transposed, or as MXFP4,
    which keeps our orientation)."""
    key, index, parts = hf.fused_key(name)
    experts, rows, *cols = box
    if hf.fused_interleaved:
        span = slice(rows.start * parts, rows.stop * parts)
    else:
        span = slice(index * shape[1] + rows.start, index * shape[1] + rows.stop)
    if tensors.has_mxfp4(key):
        fused = tensors.read_mxfp4(key, (experts, span, *cols))
    elif hf.fused_transposed and cols:
        fused = tensors.read(key, (experts, *cols, span)).transpose(1, 2)
    else:
        fused = tensors.read(key, (experts, span, *cols))
    return fused[:, index::parts] if hf.fused_interleaved else fused


def _fused_tensors(hf: HFFormat, experts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's fused expert tensors of each layer, from our stacked ones (`experts`, by name)."""
    layers = sorted({name.split(".moe.")[0] for name in experts})
    return {
        f"model.{layer}.{theirs}": _fused(hf, [experts[f"{layer}.{part}"] for part in parts])
        for layer in layers
        for theirs, parts in hf.fused_expert_keys.items()
    }


def _fused(hf: HFFormat, ours: list[torch.Tensor]) -> torch.Tensor:
    """One fused tensor of our stacked `ours`: joined shard by shard where each rank's shards make
    its shard of the fused tensor (split by expert, or along the rows in even parts), so that each
    rank writes its own part and none holds the whole; else joined whole on every rank (DCP writes
    it once)."""
    first = ours[0]
    placements = _fused_placements(hf, first, len(ours)) if isinstance(first, DTensor) else None
    if placements is None:
        return _join(hf, [_whole(t) for t in ours])
    local = _join(hf, [t.to_local() for t in ours])
    experts, rows, *cols = first.shape
    shape = hf.stored((experts, rows * len(ours), *cols))
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local, first.device_mesh, placements, run_check=False, shape=shape, stride=stride)


def _join(hf: HFFormat, ours: list[torch.Tensor]) -> torch.Tensor:
    joined = torch.stack(ours, dim=2).flatten(1, 2) if hf.fused_interleaved else torch.cat(ours, dim=1)
    return joined.transpose(1, 2).contiguous() if hf.fused_transposed and joined.dim() == 3 else joined


def _fused_placements(hf: HFFormat, first: DTensor, parts: int) -> list | None:
    """The fused tensor's placements where its shards are joins of ours (None: they are not). Our
    rows (dim 1) join into the fused rows; split among ranks they still line up where the parts
    interleave and the split is even. A transposed matrix swaps rows and columns."""
    placements = []
    for mesh_dim, placement in enumerate(first.placements):
        if isinstance(placement, Replicate) or (isinstance(placement, Shard) and placement.dim == 0):
            placements.append(placement)
            continue
        if not isinstance(placement, Shard):
            return None
        if placement.dim == 1 and parts > 1:
            even = first.shape[1] % first.device_mesh.size(mesh_dim) == 0
            if not (hf.fused_interleaved and even):
                return None
        swapped = {1: 2, 2: 1} if hf.fused_transposed and first.dim() == 3 else {}
        placements.append(Shard(swapped.get(placement.dim, placement.dim)))
    return placements


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
    dtype: torch.dtype,
    sources: ExportSources,
) -> None:
    """The weights of every rank's `parts` into `folder` as `model-0000N-of-0000M.safetensors` in
    `dtype`, their index, and what goes beside them from `sources` (hf_export.py: the config.json
    that `transformers`' from_pretrained opens, the generation config, the tokenizer's files), so
    the folder is a model others can use as it is (every rank takes part)."""
    hf = family_of(cfg).hf
    named: dict[str, torch.Tensor] = {}
    experts_fused: dict[str, torch.Tensor] = {}  # of a format that has only fused experts
    for part in parts:
        for name, tensor in get_model_state_dict(part).items():
            if hf.is_tied_output(name, cfg):
                continue
            if hf.is_experts(name) and hf.expert_keys:
                named |= _expert_matrices(hf, name, tensor)
                continue
            if hf.is_experts(name):
                experts_fused[name] = tensor
                continue
            if (heads := hf.permuted_heads(name, cfg)) is not None:
                tensor = _rotary_to_hf(_whole(tensor), heads)  # whole on every rank: DCP writes it once
            named[hf.hf_key(name)] = tensor
    named |= _fused_tensors(hf, experts_fused)
    named = {name: tensor.to(dtype) for name, tensor in named.items()}
    writer = HuggingFaceStorageWriter(str(folder), save_distributed=True, enable_consolidation=True)
    ignore_unavoidable_warnings()
    dcp.save(named, storage_writer=writer)
    if is_writer:
        shutil.rmtree(folder / _SLICES_DIR, ignore_errors=True)
        for note in write_beside_weights(folder, cfg, str(dtype).removeprefix("torch."), sources):
            print(f"titan_exp: {folder}: {note}", flush=True)
