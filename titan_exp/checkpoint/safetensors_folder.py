"""A Hugging Face folder's tensors, read a box at a time: each rank asks for the slice of a tensor
that its shard holds and reads only those bytes (safetensors' lazy slices over a memory map).
Float8 weights with block scales (DeepSeek-V3's published checkpoints: e4m3 and one float32
`weight_scale_inv` per block of 128 × 128) come out dequantized, box by box. DCP's safetensors
reader does not take float8 (its dtype table stops at 16 bits), hence this one. MXFP4 tensors
(GPT-OSS's published experts: models/hf_tensors.py) come out dequantized the same way. What is read
must be finite: a NaN or inf weight would train until the loss stops being finite, an inf row of
the embedding to the end; it is refused naming the tensor, before the first step (checking every
byte before the ranks start would read the whole model twice)."""

import math
from pathlib import Path

import torch

from titan_exp.models.hf_tensors import (
    DEFAULT_FLOAT8_BLOCK,
    FLOAT8_SCALE,
    MXFP4_BLOCK,
    MXFP4_BLOCKS,
    MXFP4_SCALES,
    float8_block,
)
from titan_exp.untrusted import read_json, safetensors_header

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
        self.block = float8_block(config, self._refused) or DEFAULT_FLOAT8_BLOCK
        self._open: dict[Path, object] = {}

    def _refused(self, why: str) -> ValueError:  # checked before the ranks started (models/hf_tensors.py)
        return ValueError(f"{self.folder}: its config.json has {why}")

    def names(self) -> set[str]:
        return set(self.files)

    def read(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """The part `box` of tensor `name`, in float32 where it is stored in float8 (dequantized)."""
        part = self._slice(name, box)
        if self.dtypes[name] in _FLOAT8:
            part = part.float() * self._scales(name, box)
        return self._finite(name, part, box)

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
        return self._finite(name, values[..., start : start + cols.stop - cols.start], box)

    def _finite(self, name: str, part: torch.Tensor, box: tuple[slice, ...]) -> torch.Tensor:
        """`part` (the box `box` of tensor `name`), refused where a value is NaN or inf, naming the
        first. Its least and greatest values are finite exactly when every value is (a NaN makes
        both NaN), and finding them takes no memory beside the part."""
        if not part.numel() or all(math.isfinite(end) for end in torch.aminmax(part)):
            return part
        first = torch.nonzero(~part.isfinite())[0].tolist()
        at = [n + (piece.start or 0) for n, piece in zip(first, box)] + first[len(box) :]
        raise ValueError(
            f"{self.folder}: {name} holds {part[tuple(first)].item()} at {at}; weights must be finite "
            "(the file is damaged: fetch it again)"
        )

    def _slice(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files[name]
        if path not in self._open:
            self._open[path] = safe_open(str(path), framework="pt")
        return self._open[path].get_slice(name)[box]

    def _scales(self, name: str, box: tuple[slice, ...]) -> torch.Tensor:
        """Each element's scale of a float8 matrix's `box` (its block's scale_inv), gathered by
        index: no larger than the box, whatever the block."""
        scales = f"{name}{FLOAT8_SCALE}"
        if scales not in self.files or len(box) != 2:
            raise ValueError(f"{name} is float8 without a 2-D {scales} beside it; dequantize the checkpoint first")
        (rows, cols), (block_rows, block_cols) = box, self.block
        first_row, first_col = rows.start // block_rows, cols.start // block_cols
        spanned = (slice(first_row, -(-rows.stop // block_rows)), slice(first_col, -(-cols.stop // block_cols)))
        blocks = self._slice(scales, spanned).float()
        row_of = torch.arange(rows.start, rows.stop) // block_rows - first_row
        col_of = torch.arange(cols.start, cols.stop) // block_cols - first_col
        return blocks[row_of][:, col_of]
