"""Context parallelism: every rank of the cp mesh dimension holds a slice of each sequence, and
attention runs as ring attention across them (torch.distributed.tensor.experimental.context_parallel).

torch 2.13 implements it for the CUDA attention kernels only (flash, memory-efficient, cuDNN); the
CPU kernel (aten._scaled_dot_product_flash_attention_for_cpu) has no sharding strategy, so
config/check.py (check_cuda_only_features) refuses CP on CPU before anything starts.
"""

import contextlib

import torch
from torch import nn
from torch.distributed.tensor.experimental import context_parallel
from torch.distributed.tensor.experimental._attention import set_rotate_method
from torch.nn.attention import SDPBackend, sdpa_kernel


class ContextParallel:
    def __init__(self, model: nn.Module, cp_mesh, seq_len: int):
        """`model` keeps its rotary table in the buffer `freqs_cis` (positions along dim 0)."""
        self.cp_mesh = cp_mesh
        # The rotary table is sharded with the tokens, so it must cover exactly the trained length.
        model.freqs_cis = model.freqs_cis[:seq_len].clone()
        self.model = model
        set_rotate_method("allgather")

    @contextlib.contextmanager
    def __call__(self, inputs: torch.Tensor, labels: torch.Tensor):
        """Shard inputs, labels and the rotary table along the sequence (load-balanced) for one
        forward + backward."""
        buffers = [inputs, labels, self.model.freqs_cis]
        with (
            context_parallel(
                self.cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 0], no_restore_buffers={inputs, labels}
            ),
            sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]),
        ):
            yield
