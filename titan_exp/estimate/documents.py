"""How many keys attention's kernel computes a query, on average, when documents are packed into
windows under a document mask (model.attn_mask_type=block_causal): a query attends only to the
earlier tokens of its own document within the window, and FlexAttention (the kernel titan_exp
and torchtitan run such a mask with on CUDA) skips the 128 × 128 blocks the mask empties and
computes every other block whole (torch's create_block_mask). So the work of attention's two
matmuls falls with the documents' lengths, to a block or two a query block for short documents
(512-token documents in 8,192-token windows: 320 keys a query against causal's 4,096).
Counted exactly by packing the documents as the data does: back to back, cut at window edges."""

from collections.abc import Sequence

import numpy as np

from titan_exp.models.config import FLEX_BLOCK

# Windows packed to take the mean over (enough for a steady mean; a cap on the work).
_WINDOWS = 64


def _segment_starts(lengths: Sequence[int], seq_len: int) -> np.ndarray | None:
    """(windows, seq_len): where each token's document begins within its window, for documents of
    `lengths` packed back to back (in order, repeated) and cut at window edges; None without any."""
    lengths = np.asarray([length for length in lengths if length > 0], dtype=np.int64)
    if lengths.size == 0:
        return None
    tokens = _WINDOWS * seq_len
    repeats = -(-tokens // int(lengths.sum()))
    starts = np.concatenate([[0], np.cumsum(np.tile(lengths, repeats))[:-1]])
    stream = np.arange(tokens)
    document_start = starts[np.searchsorted(starts, stream, side="right") - 1]
    window_start = stream - stream % seq_len
    return (np.maximum(document_start, window_start) - window_start).reshape(_WINDOWS, seq_len)


def flex_causal_keys(seq_len: int) -> float:
    """The mean keys FlexAttention computes a query under a causal mask (one document a window):
    query block b computes key blocks 0..b whole, so a query computes half the window and half a
    block more (flash's kernels skip the masked part of the diagonal block; FlexAttention's compute
    it)."""
    starts = np.arange(0, seq_len, FLEX_BLOCK)
    ends = np.minimum(starts + FLEX_BLOCK, seq_len)
    return float(((ends - starts) * ends).sum() / seq_len)


def flex_keys(lengths: Sequence[int], seq_len: int) -> float:
    """The mean keys FlexAttention computes a query over windows of `seq_len` tokens packed with
    documents of `lengths`, each query attending within its document: per query block, every key
    block up to the diagonal that holds a token of a document the query block holds (a window's
    documents are consecutive: the one holding the key block's last token and the query block's
    first), each whole."""
    segment_starts = _segment_starts(lengths, seq_len)
    if segment_starts is None:  # no documents given: causal
        return flex_causal_keys(seq_len)
    blocks = np.arange(0, seq_len, FLEX_BLOCK)
    widths = np.minimum(blocks + FLEX_BLOCK, seq_len) - blocks  # the last block may be partial
    first = segment_starts[:, blocks]  # where each query block's first token's document begins
    last = segment_starts[:, blocks + widths - 1]  # and each key block's last token's
    earlier = np.tril(np.ones((blocks.size, blocks.size), dtype=bool), k=-1)
    computed = ((last[:, None, :] == first[:, :, None]) & earlier) | np.eye(blocks.size, dtype=bool)
    keys = (computed * widths).sum(axis=-1)  # per window and query block
    return float((keys * widths).sum() / (_WINDOWS * seq_len))


def flex_keys_of_mean(document_tokens: float, seq_len: int) -> float:
    """As flex_keys, for documents all of the mean length given (plan.document_tokens)."""
    return flex_keys([max(1, round(document_tokens))], seq_len)
