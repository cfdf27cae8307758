"""The planner under a document mask (estimate/documents.py): the mean keys FlexAttention computes a
query when documents are packed into windows, held to a count over the mask's own blocks, and the
attention work a step's prediction saves by it."""

import dataclasses

import pytest
import torch

from titan_exp.config.compose import compose_job_config
from titan_exp.estimate.documents import flex_causal_keys, flex_keys, flex_keys_of_mean
from titan_exp.estimate.gpu_compute import _attention
from titan_exp.estimate.hardware_profiles import hardware_profiles
from titan_exp.job.memory import workload
from titan_exp.models.common.rotary import document_ids
from titan_exp.models.config import FLEX_BLOCK


@pytest.mark.parametrize(
    "lengths,seq_len", [([5, 3, 9], 8), ([40], 16), ([1, 2, 3, 4, 30], 32), ([64], 64), ([300, 20, 700], 1024)]
)
def test_the_mean_keys_per_query_is_the_masks_own_count(lengths, seq_len):
    """Pack the documents as the data does (back to back, ended by their last token, cut at each
    window's edge), cut the block-causal mask into FlexAttention's blocks, and count the keys of
    every block that lets any pair through, for each query."""
    end = 0
    repeats = 64 * seq_len // sum(lengths) + 1
    stream = torch.cat([torch.tensor([1] * (n - 1) + [end]) for n in lengths * repeats])[: 64 * seq_len]
    windows = stream.view(-1, seq_len)
    documents = document_ids(windows, end)
    same = documents.unsqueeze(2) == documents.unsqueeze(1)
    allowed = same & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    blocks = -(-seq_len // FLEX_BLOCK)
    padded = torch.nn.functional.pad(allowed, (0, blocks * FLEX_BLOCK - seq_len, 0, blocks * FLEX_BLOCK - seq_len))
    computed = padded.view(-1, blocks, FLEX_BLOCK, blocks, FLEX_BLOCK).any(dim=(2, 4))  # (window, q block, k block)
    widths = torch.tensor([min(FLEX_BLOCK, seq_len - b * FLEX_BLOCK) for b in range(blocks)])
    keys_per_query = (computed * widths).sum(-1).repeat_interleave(widths, dim=1)
    assert flex_keys(lengths, seq_len) == pytest.approx(keys_per_query.float().mean().item())


def test_causal_attention_over_a_window_computes_half_of_it_in_whole_blocks_and_short_documents_far_less():
    assert flex_keys_of_mean(8192, 8192) == pytest.approx((64 + 1) / 2 * FLEX_BLOCK)
    # 512-token documents, 4 blocks each: a query block computes 1 to 4 of them.
    assert flex_keys_of_mean(512, 8192) == pytest.approx(2.5 * FLEX_BLOCK)


@pytest.mark.parametrize("seq_len", [8192, 1000])
def test_flexattention_without_documents_computes_whole_diagonal_blocks(seq_len):
    """GPT-OSS runs FlexAttention on every layer (its sinks): causal, the keys of whole blocks up to
    the diagonal, half a block a query more than flash's half window; the count of one document a
    window, partial last block included."""
    assert flex_causal_keys(seq_len) == pytest.approx(flex_keys([seq_len], seq_len))
    gpt_oss = compose_job_config(["model=gpt_oss_20b", f"training.seq_len={seq_len}", "hardware=h100"])
    full_layers = gpt_oss.model.keys_per_query(flex_causal_keys(seq_len), seq_len, cuda=True)
    assert workload(gpt_oss, "cuda").keys_per_query == pytest.approx(full_layers)
    if seq_len == 8192:
        assert flex_causal_keys(seq_len) == seq_len / 2 + FLEX_BLOCK / 2


def test_the_planned_attention_falls_with_the_documents_length():
    """Llama 3 8B, 8,192-token windows of 512-token documents: FlexAttention computes 320 keys a
    query against causal flash's 4,096, a little slower a FLOP; the rest of the block is unchanged."""
    base = ["model=llama3_8b", "hardware=h100", "training.seq_len=8192", "training.local_batch_size=1",
            "training.mixed_precision_param=bfloat16"]  # fmt: skip
    causal = compose_job_config(base)
    masked = compose_job_config([*base, "model.attn_mask_type=block_causal", "data=files", "data.paths=[x]",
                                 "data.tokenizer_path=t.json", "plan.document_tokens=512"])  # fmt: skip
    hw = hardware_profiles()["h100"]
    (causal_forward, causal_backward), (forward, backward) = (
        _attention(hw, workload(cfg, "cuda")) for cfg in (causal, masked)
    )
    assert 320 / 4096 < forward / causal_forward < 1.2 * 320 / 4096
    assert 320 / 4096 < backward / causal_backward < 1.2 * 320 / 4096
    assert dataclasses.replace(workload(masked, "cuda"), masked_keys=None).keys_per_query == 4096
    # On CPU ranks SDPA takes the mask dense: every key of the window is computed.
    assert workload(masked, "cpu").keys_per_query == 8192


def test_without_a_given_length_the_documents_of_data_paths_are_measured(tmp_path):
    import json

    from titan_exp.data.text import train_tokenizer
    from titan_exp.data.tokenizer import load_tokenizer

    docs = [" ".join(["word"] * (3 + 11 * (i % 5))) for i in range(50)]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "tokenizer.json").write_text(train_tokenizer(docs, 300).to_str())
    cfg = compose_job_config(["model.attn_mask_type=block_causal", "data=files", f"data.paths=[{tmp_path}/docs.jsonl]",
                              f"data.tokenizer_path={tmp_path}/tokenizer.json", "training.seq_len=2048"])  # fmt: skip
    lengths = [len(load_tokenizer(str(tmp_path / "tokenizer.json")).encode(d)) for d in docs]
    assert workload(cfg, "cuda").keys_per_query == pytest.approx(flex_keys(lengths, 2048))
    assert workload(cfg, "cuda").keys_per_query < 2048 / 4
