"""Every local expert's SwiGLU in three kernels: torch's grouped GEMM (`torch._grouped_mm`), which
multiplies each expert's rows by its own matrices in one launch. It exists for bfloat16 on CUDA
GPUs of compute capability 9.0 and up (Hopper, Blackwell); GroupedExperts runs one matmul per
expert everywhere else. Each expert's rows are padded to a multiple of 16, the alignment the kernel
asks of its group offsets (torchtitan pads the same way)."""

import itertools
from collections.abc import Callable

import torch

_ALIGN_ROWS = 16


def grouped_mm_applies(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the grouped GEMM runs these rows: bfloat16 rows and weights on a CUDA GPU that has it."""
    return (
        rows.is_cuda
        and rows.dtype == weight.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and torch.cuda.get_device_capability(rows.device) >= (9, 0)
    )


def grouped_swiglu(
    rows: torch.Tensor,
    counts: list[int],
    w1: torch.Tensor,
    w2: torch.Tensor,
    w3: torch.Tensor,
    activation: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`rows` sorted by expert, `counts[e]` of them for expert e; w1, w3 (experts, hidden, dim),
    w2 (experts, dim, hidden); `activation(gate, up)` the hidden one; `biases` (of w1, w2, w3:
    experts × their outputs) where the experts have them. Returns each row's expert output, in
    the rows' order."""
    padded = [-(-count // _ALIGN_ROWS) * _ALIGN_ROWS for count in counts]
    starts = [0, *itertools.accumulate(padded)][:-1]
    # Where each row sits in the padded buffer: its expert's start plus its place among that expert's rows.
    place = torch.cat([torch.arange(start, start + count) for start, count in zip(starts, counts)]).to(rows.device)
    # Written into the fresh zeros in place: out of place, index_copy would clone them first.
    x = rows.new_zeros(sum(padded), rows.shape[1]).index_copy_(0, place, rows)
    offsets = torch.tensor(list(itertools.accumulate(padded)), dtype=torch.int32, device=rows.device)
    gate = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offsets)
    up = torch._grouped_mm(x, w3.transpose(-2, -1), offs=offsets)
    if biases is not None:  # each padded row takes its expert's bias (the padding's outputs are dropped)
        expert_of_row = torch.arange(len(counts), device=rows.device).repeat_interleave(
            torch.tensor(padded, device=rows.device),
            output_size=sum(padded),  # the size known: no host sync
        )
        gate, up = gate + biases[0][expert_of_row], up + biases[2][expert_of_row]
    out = torch._grouped_mm(activation(gate, up), w2.transpose(-2, -1), offs=offsets)
    if biases is not None:
        out = out + biases[1][expert_of_row]
    return out[place]
