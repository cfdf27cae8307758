"""How many keys a query attends to, on average, when documents are packed into windows: causal
attention over a window of S tokens sees (S + 1) / 2 (the planner has always counted S / 2); a
document mask (model.attn_mask_type=block_causal) only the earlier tokens of the query's own
document within the window, so the work of attention's two matmuls falls with the documents'
lengths (e.g. 512-token documents in 8,192-token windows: 256 keys against 4,096, 1/16 of the work).
Counted exactly by packing the documents as the data does: back to back, cut at window edges."""

from collections.abc import Sequence

import numpy as np

# Windows packed to take the mean over (enough for a steady mean; a cap on the work).
_WINDOWS = 64


def attended_keys(lengths: Sequence[int], seq_len: int) -> float:
    """The mean keys per query over windows of `seq_len` tokens packed with documents of `lengths`
    (in order, repeated), each query attending within its document."""
    lengths = np.asarray([length for length in lengths if length > 0], dtype=np.int64)
    if lengths.size == 0:
        return seq_len / 2
    tokens = _WINDOWS * seq_len
    repeats = -(-tokens // int(lengths.sum()))
    starts = np.concatenate([[0], np.cumsum(np.tile(lengths, repeats))[:-1]])
    stream = np.arange(tokens)
    document_start = starts[np.searchsorted(starts, stream, side="right") - 1]
    window_start = stream - stream % seq_len
    return float(np.mean(stream - np.maximum(document_start, window_start))) + 1  # itself too


def attended_keys_of_mean(document_tokens: float, seq_len: int) -> float:
    """As attended_keys, for documents all of the mean length given (plan.document_tokens)."""
    return attended_keys([max(1, round(document_tokens))], seq_len)
