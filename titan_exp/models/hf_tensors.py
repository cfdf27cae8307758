"""A Hugging Face checkpoint's tensors checked against the model that loads them before any rank
starts, torch-free: every tensor the model needs, in its shape, held once and in a form the ranks'
reader (checkpoint/safetensors_folder.py) reads as the folder means it, from the safetensors
headers (untrusted.py) and, of MXFP4, the scale bytes. The quantized forms are the published
checkpoints': float8 with a scale per block (DeepSeek-V3's) and MXFP4 (GPT-OSS's experts)."""

import math
from operator import attrgetter
from pathlib import Path
from typing import NamedTuple

from titan_exp.models.config import ModelConfig
from titan_exp.models.hf import HFFormat, hf_value, read_hf_config, refusing
from titan_exp.rules import ConfigError
from titan_exp.untrusted import BLOCK_SCALED_DTYPE, FLOATING_DTYPES, safetensors_header

# Float8: an e4m3 matrix `name` and beside it `name_scale_inv`, one floating-point scale per block
# of rows × columns (the blocks at the edges partial). config.json's
# quantization_config.weight_block_size gives the block; where it names none, DeepSeek-V3's.
FLOAT8_SCALE = "_scale_inv"
DEFAULT_FLOAT8_BLOCK = (128, 128)
# Published blocks are 128 × 128; a side past this is a crafted config.json, not a format.
MAX_FLOAT8_BLOCK = 1 << 16

# MXFP4 (the OCP microscaling format, GPT-OSS's published experts): a tensor `name` stored as
# `name_blocks`, 16 bytes of two 4-bit (e2m1) values per block of 32, and `name_scales`, one
# power-of-two exponent byte (E8M0, bias 127) per block, both uint8, along the matrix's last dim.
MXFP4_BLOCKS, MXFP4_SCALES = "_blocks", "_scales"
MXFP4_BLOCK = 32
# The E8M0 byte the format reserves for NaN (read as an exponent, 2^128: every value of its block inf).
MXFP4_NAN_SCALE = 255
# How much of a scales tensor is read at a time to look for that byte.
_SCAN_BYTES = 1 << 20


class Held(NamedTuple):
    """A tensor as a safetensors header gives it: its dtype, shape, and bytes [start, end) in `path`."""

    dtype: str
    shape: tuple[int, ...]
    path: Path
    start: int
    end: int


def safetensors_tensors(folder: str, key: str) -> dict[str, Held]:
    """Each tensor of the folder's *.safetensors files, from their headers alone, each checked
    against its file (untrusted.py); a tensor in two files is refused (which would load?)."""
    tensors: dict[str, Held] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            header = safetensors_header(path)
        except ValueError as err:
            raise ConfigError(key, folder, str(err)) from None
        with open(path, "rb") as file:  # the data follow the 8-byte length and the header
            data = 8 + int.from_bytes(file.read(8), "little")
        for name, entry in header.items():
            if name in tensors:
                raise ConfigError(
                    key, folder, f"holds {name} twice, in {tensors[name].path.name} and {path.name}; keep one"
                )
            start, end = entry["data_offsets"]
            tensors[name] = Held(entry["dtype"], tuple(entry["shape"]), path, data + start, data + end)
    return tensors


def float8_block(hf: dict, refuse) -> tuple[int, int] | None:
    """The (rows, columns) of a float8 weight's block that config.json's
    quantization_config.weight_block_size gives, or None where it gives none."""
    within = "quantization_config"
    block = hf_value(hf_value(hf, within, dict, refuse, {}), "weight_block_size", list, refuse, None, within)
    if block is None:
        return None
    if len(block) != 2 or not all(type(n) is int and 1 <= n <= MAX_FLOAT8_BLOCK for n in block):
        raise refuse(
            f"{within}.weight_block_size={str(block)[:60]}, not two integers from 1 to {MAX_FLOAT8_BLOCK:,} "
            "(a block's rows and columns)"
        )
    return block[0], block[1]


def check_hf_checkpoint(cfg: ModelConfig, theirs: ModelConfig, hf: HFFormat, folder: str, key: str) -> None:
    """A HF checkpoint that `cfg`'s model can load: its config.json (read as `theirs`) describes the
    same model (else the differing field is named, with the fix) and its safetensors hold every
    tensor in its shape, as plain floating point, float8 with its block scales or MXFP4."""
    for name in hf.compared:
        ours_value, their_value = attrgetter(name)(cfg), attrgetter(name)(theirs)
        if ours_value != their_value and not _close(ours_value, their_value):
            raise ConfigError(
                f"model.{hf.compared_keys.get(name, name)}",
                ours_value,
                f"the checkpoint in {folder} has {their_value}; add model=hf model.hf_path={folder} "
                "to take the model's shape from it",
            )
    found = safetensors_tensors(folder, key)
    if not found:
        raise ConfigError(key, folder, "holds no *.safetensors files; point it at a Hugging Face model folder")

    def bad(why: str) -> ConfigError:
        return ConfigError(key, folder, why)

    float8 = any(held.dtype == BLOCK_SCALED_DTYPE for held in found.values())
    block = float8_block(read_hf_config(folder, key), refusing(key, folder)) if float8 else None
    for name, shape in hf.expected_shapes(cfg, fused=hf.is_fused(found)).items():
        if f"{name}{MXFP4_BLOCKS}" in found or f"{name}{MXFP4_SCALES}" in found:
            _check_mxfp4(found, name, hf.stored(shape), name.endswith(tuple(hf.fused_expert_keys)), bad)
            continue
        if name not in found:
            raise bad(f"has no tensor {name}, which the model needs")
        held = found[name]
        if held.shape != shape:
            raise bad(f"holds {name} of shape {list(held.shape)}, the model's is {list(shape)}")
        if held.dtype == BLOCK_SCALED_DTYPE or f"{name}{FLOAT8_SCALE}" in found:
            _check_float8(found, name, block, bad)
        elif held.dtype not in FLOATING_DTYPES:
            raise bad(f"holds {name} as {held.dtype}; weights are floating point ({', '.join(FLOATING_DTYPES)})")


def _check_float8(found: dict[str, Held], name: str, block: tuple[int, int] | None, bad) -> None:
    """`name` a float8 matrix with a scale for each of its blocks beside it, and nothing else scaled:
    a scale of another block (16-blocks read as 128-blocks) would read every weight wrong."""
    weight, scale = found[name], found.get(f"{name}{FLOAT8_SCALE}")
    if weight.dtype != BLOCK_SCALED_DTYPE:
        raise bad(
            f"holds {name}{FLOAT8_SCALE} beside {name}, which is {weight.dtype}: block scales go with "
            f"{BLOCK_SCALED_DTYPE} weights only; drop it"
        )
    if len(weight.shape) != 2 or scale is None:
        raise bad(
            f"holds {name} as {BLOCK_SCALED_DTYPE} {list(weight.shape)}; float8 is read only as a matrix "
            f"with its {name}{FLOAT8_SCALE} beside it"
        )
    (rows, cols), (block_rows, block_cols) = weight.shape, block or DEFAULT_FLOAT8_BLOCK
    want = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
    if scale.dtype not in FLOATING_DTYPES or scale.shape != want:
        given = "quantization_config.weight_block_size" if block else "DeepSeek-V3's: no weight_block_size"
        raise bad(
            f"holds {name}{FLOAT8_SCALE} as {scale.dtype} {list(scale.shape)}; one scale per {block_rows}×"
            f"{block_cols} block ({given}) of its {rows}×{cols} matrix is a floating-point {list(want)}"
        )


def _check_mxfp4(found: dict[str, Held], name: str, shape: tuple[int, ...], readable: bool, bad) -> None:
    """`name` held as MXFP4 alone (`readable`: where the reader reads it, the experts' fused
    matrices), blocks and scales that dequantize to `shape` (experts × rows × cols), no scale NaN."""
    if name in found:
        raise bad(
            f"holds {name} twice: as {found[name].dtype} and as MXFP4 ({name}{MXFP4_BLOCKS}, "
            f"{name}{MXFP4_SCALES}); keep one"
        )
    if not readable:
        raise bad(f"holds {name} as MXFP4 ({name}{MXFP4_BLOCKS}); only the experts' fused matrices are read from MXFP4")
    *outer, cols = shape
    if cols % MXFP4_BLOCK:
        raise bad(f"holds {name} as MXFP4, whose blocks of {MXFP4_BLOCK} do not divide {cols}")
    expected = {
        MXFP4_BLOCKS: (*outer, cols // MXFP4_BLOCK, MXFP4_BLOCK // 2),
        MXFP4_SCALES: (*outer, cols // MXFP4_BLOCK),
    }
    for suffix, want in expected.items():
        held = found.get(f"{name}{suffix}")
        if held is None or held.dtype != "U8" or held.shape != want:
            shown = f"{held.dtype} {list(held.shape)}" if held else "nothing"
            raise bad(f"holds {name}{suffix} as {shown}; MXFP4 of the model's is U8 {list(want)}")
    if (at := _first_nan_scale(found[f"{name}{MXFP4_SCALES}"])) is not None:
        raise bad(
            f"holds {name}{MXFP4_SCALES} with a scale of {MXFP4_NAN_SCALE} at element {at:,}: NaN in MXFP4 "
            "(its block would read as inf); the file is damaged, fetch it again"
        )


def _first_nan_scale(scales: Held) -> int | None:
    """Where the first scale byte of NaN is, a piece of the tensor at a time (None: nowhere).
    The scales are a 16th of the blocks' bytes: read in full, they cost little beside the load."""
    with open(scales.path, "rb") as file:
        file.seek(scales.start)
        done = 0
        while done < scales.end - scales.start:
            piece = file.read(min(_SCAN_BYTES, scales.end - scales.start - done))
            if not piece:  # the file got shorter since its header was checked
                return None
            if (at := piece.find(MXFP4_NAN_SCALE.to_bytes())) >= 0:
                return done + at
            done += len(piece)
    return None


def _close(a: object, b: object) -> bool:
    return isinstance(a, float) and isinstance(b, float) and math.isclose(a, b, rel_tol=1e-6)
