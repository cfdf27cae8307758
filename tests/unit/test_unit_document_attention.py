"""The planner under a document mask (estimate/documents.py): the mean keys a query attends to when
documents are packed into windows, held to a count over the mask itself, and the attention work a
step's prediction saves by it."""

import dataclasses

import pytest
import torch

from titan_exp.config.compose import compose_job_config
from titan_exp.estimate.documents import attended_keys, attended_keys_of_mean
from titan_exp.estimate.gpu_compute import _attention
from titan_exp.estimate.hardware_profiles import hardware_profiles
from titan_exp.job.memory import workload
from titan_exp.models.common.rotary import document_ids


@pytest.mark.parametrize("lengths,seq_len", [([5, 3, 9], 8), ([40], 16), ([1, 2, 3, 4, 30], 32), ([64], 64)])
def test_the_mean_keys_per_query_is_the_masks_own_count(lengths, seq_len):
    """Pack the documents as the data does (back to back, ended by their last token, cut at each
    window's edge) and count the keys each query's row of the block-causal mask lets through."""
    end = 0
    stream = torch.cat([torch.tensor([1] * (n - 1) + [end]) for n in lengths * 64])[: 64 * seq_len]
    windows = stream.view(-1, seq_len)
    documents = document_ids(windows, end)
    same = documents.unsqueeze(2) == documents.unsqueeze(1)
    allowed = same & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    assert attended_keys(lengths, seq_len) == pytest.approx(allowed.sum(-1).float().mean().item())


def test_causal_attention_over_a_window_sees_half_of_it_and_short_documents_far_less():
    assert attended_keys_of_mean(8192, 8192) == pytest.approx(8193 / 2)
    assert attended_keys_of_mean(512, 8192) == pytest.approx(513 / 2)


def test_the_planned_attention_falls_with_the_documents_length():
    """Llama 3 8B, 8,192-token windows of 512-token documents: attention's forward and backward
    take 513/8192 of the causal window's time; the rest of the block is unchanged."""
    base = ["model=llama3_8b", "hardware=h100", "training.seq_len=8192", "training.local_batch_size=1"]
    causal = compose_job_config(base)
    masked = compose_job_config([*base, "model.attn_mask_type=block_causal", "data=files", "data.paths=[x]",
                                 "data.tokenizer_path=t.json", "plan.document_tokens=512"])  # fmt: skip
    hw = hardware_profiles()["h100"]
    (causal_forward, causal_backward), (forward, backward) = (
        _attention(hw, workload(cfg, "cuda")) for cfg in (causal, masked)
    )
    assert forward / causal_forward == pytest.approx(513 / 8192, rel=1e-3)
    assert backward / causal_backward == pytest.approx(513 / 8192, rel=1e-3)
    assert dataclasses.replace(workload(masked, "cuda"), attended_keys=None).keys_per_query == 4096
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
                              f"data.tokenizer_path={tmp_path}/tokenizer.json", "training.seq_len=128"])  # fmt: skip
    lengths = [len(load_tokenizer(str(tmp_path / "tokenizer.json")).encode(d)) for d in docs]
    assert workload(cfg, "cuda").keys_per_query == pytest.approx(attended_keys(lengths, 128))
    assert workload(cfg, "cuda").keys_per_query < 128 / 4
