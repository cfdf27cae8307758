"""A Hugging Face folder's tensors, read a box at a time: each rank asks for the slice of a tensor
that its shard holds and reads only those bytes (safetensors' lazy slices over a memory map).
Float8 weights with block scales (DeepSeek-V3's published checkpoints: e4m3 and one float32
`weight_scale_inv` per block of 128 × 128) come out dequantized, box by box. DCP's safetensors
reader does not take float8 (its dtype table stops at 16 bits), hence this one. MXFP4 tensors
(GPT-OSS's published experts: models/hf.py) come out dequantized the same way."""

import math
from pathlib import Path

import torch

from titan_exp.models.hf import MXFP4_BLOCK, MXFP4_BLOCKS, MXFP4_SCALES
from titan_exp.untrusted import read_json, safetensors_header

# Published DeepSeek-V3's block; config.json's quantization_config.weight_block_size says otherwise.
DEFAULT_BLOCK = (128, 128)
_FLOAT8 = ("F8_E4M3", "F8_E5M2")
# The values of a 4-bit e2m1 code (sign, two exponent bits, one mantissa bit), by code.
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_BIAS = 127


class SafetensorsFolder:
    def __init__(self, folder: str):
        self.folder = Path(folder)
        self.files: dict[str, Path] = {}
        self.dtypes: dict[str, str] = {}
        for path in sorted(self.folder.glob("*.safetensors")):
            for name, entry in safetensors_header(path).items():
                self.files[name], self.dtypes[name] = path, entry["dtype"]
        config = read_json(self.folder / "config.json") if (self.folder / "config.json").is_file() else {}
        quantization = config.get("quantization_config") if isinstance(config, dict) else None
        block = quantization.get("weight_block_size") if isinstance(quantization, dict) else None
        self.block = tuple(block) if block else DEFAULT_BLOCK
        self._open: dict[Path, object] = {}

    def names(self) -> set[str]:
        return set(self.files)

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The part `box` of tensor `name`, in float32 where it is stored in float8 (dequantized)."""
        part = self._slice(name, box)
        if self.dtypes[name] not in _FLOAT8:
            return part
        return part.float() * self._scales(name, box, part.shape)

    def has_mxfp4(self, name: str) -> bool:
        return f"{name}{MXFP4_BLOCKS}" in self.files

    def read_mxfp4(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The part `box` of the float32 tensor that `name`'s MXFP4 blocks and scales encode: the
        blocks along its last dim that the box spans, each byte two values (the low nibble first),
        each block's times 2^(scale − 127)."""
        *outer, cols = box
        first, last = cols.start // MXFP4_BLOCK, -(-cols.stop // MXFP4_BLOCK)
        spanned = (*outer, slice(first, last))
        codes = self._slice(f"{name}{MXFP4_BLOCKS}", spanned).to(torch.int64)
        exponents = self._slice(f"{name}{MXFP4_SCALES}", spanned).to(torch.int32) - _SCALE_BIAS
        values = torch.tensor(_FP4)[torch.stack([codes & 0x0F, codes >> 4], dim=-1)].flatten(-2)
        values = torch.ldexp(values, exponents.unsqueeze(-1)).flatten(-2)
        start = cols.start - first * MXFP4_BLOCK
        return values[..., start : start + cols.stop - cols.start]

    def _slice(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_slice(name)[box]

    def _scales(self, name: str, box: tuple[slice, ...], shape: torch.Size) -> torch.Tensor:
        """Each element's scale of a float8 matrix's `box` (a block's scale_inv over its elements)."""
        scales = name.removesuffix("weight") + "weight_scale_inv"
        if scales not in self.files or len(box) != 2:
            raise ValueError(f"{name} is float8 without a 2-D {scales} beside it; dequantize the checkpoint first")
        (rows, cols), (block_rows, block_cols) = box, self.block
        first = (rows.start // block_rows, cols.start // block_cols)
        last = (math.ceil(rows.stop / block_rows), math.ceil(cols.stop / block_cols))
        blocks = self._slice(scales, (slice(first[0], last[0]), slice(first[1], last[1]))).float()
        each = blocks.repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
        top, left = rows.start - first[0] * block_rows, cols.start - first[1] * block_cols
        return each[top : top + shape[0], left : left + shape[1]]
