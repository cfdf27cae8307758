"""model.attn_mask_type=block_causal: packed documents that do not attend to each other. The property
itself, in each family: a token's logits do not change when the document before it in its window
is replaced (and do under the causal mask). Then real ranks: FSDP, tensor and pipeline parallelism train
the same curve on packed documents as one device, which differs from the causal one; context
parallelism and synthetic data are refused in one line."""

import json

import pytest
import torch

from titan_exp.config.compose import compose_job_config
from titan_exp.config.resolve import resolve
from titan_exp.data.text import train_tokenizer
from titan_exp.models.common.rotary import document_ids
from titan_exp.models.registry import build_model
from titan_exp.rules import ConfigError

from conftest import loss_curve, mlflow_runs, run_cli, store_in

END = 7  # the end-of-document id of the property test


@pytest.mark.parametrize("flavor", ["llama3_debug", "qwen3_moe_debug", "deepseek_v3_debug", "gpt_oss_debug"])
def test_a_tokens_logits_do_not_see_the_document_before_it(flavor):
    model = build_model(compose_job_config([f"model={flavor}"]).model)
    model.init_weights(seed=0)
    generator = torch.Generator().manual_seed(0)
    window = torch.randint(10, 200, (2, 64), generator=generator)
    window[:, 20] = window[:, 45] = END  # three documents: 0-20, 21-45, 46-63
    replaced = window.clone()
    replaced[:, :20] = torch.randint(10, 200, (2, 20), generator=generator)
    with torch.no_grad():
        masked = [model(tokens, document_ids(tokens, END)) for tokens in (window, replaced)]
        causal = [model(tokens) for tokens in (window, replaced)]
    assert torch.equal(masked[0][:, 21:], masked[1][:, 21:])
    assert not torch.allclose(causal[0][:, 21:], causal[1][:, 21:])
    torch.testing.assert_close(masked[0][:, :21], causal[0][:, :21], rtol=0, atol=0)  # the first document alone


def test_document_ids_start_a_document_after_each_end():
    tokens = torch.tensor([[1, 2, END, 3, END, END, 4]])
    assert document_ids(tokens, END).tolist() == [[0, 0, 0, 1, 1, 2, 3]]


@pytest.mark.parametrize(
    "overrides,fix",
    [
        (["data=synthetic"], "synthetic data is one stream, not documents"),
        (
            ["parallelism=cp", "launcher.nproc_per_node=2"],
            "context parallelism's attention here is causal over the whole sequence, not per document",
        ),
    ],
)
def test_what_has_no_documents_or_splits_them_is_refused(overrides, fix):
    cfg = compose_job_config(["model.attn_mask_type=block_causal", "launcher.device=cpu", *overrides])
    with pytest.raises(ConfigError, match=f"^model.attn_mask_type=block_causal: {fix}"):
        resolve(cfg)


LAYOUTS = {
    "single": ["parallelism=single", "activation_checkpoint.mode=full"],  # the documents reach recomputation too
    "pp2": ["parallelism=pp", "launcher.nproc_per_node=2", "parallelism.pipeline_parallel_microbatch_size=1"],
    "fsdp2": ["parallelism=fsdp", "launcher.nproc_per_node=2", "training.local_batch_size=1"],
    "tp2": ["parallelism=tp", "launcher.nproc_per_node=2"],
}
# The default suite runs one device (the mask reaches the rank, through recomputation too); the
# layouts' runs (PP: a schedule keyword split per microbatch; TP: the attention's keyword under its
# plan; FSDP) are marked slow, to keep the default suite under 10 minutes on 2 cores.
SLOW = ("pp2", "fsdp2", "tp2")


@pytest.fixture(scope="module")
def packed(tmp_path_factory, migrated_store):
    """(the common overrides of a packed-documents run, its store (uri, db), the folder)."""
    tmp = tmp_path_factory.mktemp("packed")
    docs = [" ".join(["some words of document", str(i)] * (1 + i % 7)) for i in range(80)]
    (tmp / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp / "tokenizer.json").write_text(train_tokenizer(docs, 300).to_str())
    common = [
        "data=files",
        f"data.paths=[{tmp}/docs.jsonl]",
        f"data.tokenizer_path={tmp}/tokenizer.json",
        "model.attn_mask_type=block_causal",
        "training.seq_len=64",
        "training.local_batch_size=2",
        "training.global_batch_size=2",
        "training.steps=2",
        "metrics.log_freq=1",
        "launcher.device=cpu",
    ]
    return common, store_in(tmp, migrated_store), tmp


@pytest.fixture(scope="module")
def curves(packed) -> dict[str, list[float]]:
    """Each layout's loss curve, run once when first asked for."""
    common, (uri, db), tmp = packed
    found: dict[str, list[float]] = {}

    def curve(name: str) -> list[float]:
        if name not in found:
            done = run_cli([*common, *LAYOUTS[name], uri], tmp / name)
            assert done.returncode == 0, done.stderr[-3000:]
            found[name] = loss_curve(db, mlflow_runs(db)[-1].info.run_id)
        return found[name]

    return curve


def test_the_first_loss_is_the_seeded_models_with_its_documents_masked(packed, curves):
    """The mask reaches the ranks: one device's first loss is the seeded model's on the first batch
    with the documents masked, not the causal one's."""
    from titan_exp.data.loader import BatchLoader, BatchPlan, build_source

    cfg = compose_job_config(packed[0])
    loader = BatchLoader(build_source(cfg.data, 64, seed=0), BatchPlan(2, 64, 1, 0, 1))
    inputs, labels = loader.get(0, 0)
    model = build_model(cfg.model)
    model.init_weights(cfg.debug.seed)
    with torch.no_grad():
        masked, causal = (
            torch.nn.functional.cross_entropy(model(inputs, documents).flatten(0, 1), labels.flatten()).item()
            for documents in (document_ids(inputs, loader.document_end), None)
        )
    assert curves("single")[0] == pytest.approx(masked, rel=1e-5) and masked != pytest.approx(causal, rel=1e-4)


@pytest.mark.parametrize(
    "layout", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS if n != "single"]
)
def test_each_layout_trains_the_one_device_curve_on_packed_documents(layout, curves):
    torch.testing.assert_close(curves(layout), curves("single"), rtol=1e-5, atol=0)
