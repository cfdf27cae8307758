"""Issue 47's crafted inputs (tests/crafted.py), each refused by the checks a job runs before any
rank starts (config/resolve.py, job/preflight.py) with one line naming the key, in this process,
within a bound of memory: a FIFO that would hang the reader, a header that claims a terabyte, a line
without end, a config.json value of the wrong type. (As commands, with exit status and folders:
benchmarks/probe_bad_inputs.py.)"""

import resource
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for crafted.py

from titan_exp.config.compose import compose_job_config  # noqa: E402
from titan_exp.config.resolve import resolve  # noqa: E402
from titan_exp.data.documents import MAX_RECORD_CHARS  # noqa: E402
from titan_exp.data.files import FilesSource  # noqa: E402
from titan_exp.job.preflight import preflight  # noqa: E402
from titan_exp.rules import ConfigError  # noqa: E402

from crafted import CASES, files_data, hf_load, tiny_deepseek_float8, tiny_gpt_oss_mxfp4, tiny_llama  # noqa: E402

# What reading a refused input may add to this process's peak memory.
MEMORY_BOUND = 1 << 30


def checked(overrides: list[str], tmp_path: Path) -> None:
    cfg = compose_job_config([*overrides, "launcher.device=cpu", f"tracking.uri=sqlite:///{tmp_path}/m.db"])
    preflight(resolve(cfg, job_dir=tmp_path / "job"))


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# What each refusal says (a fragment): the file and what it is, or the config.json key and its value.
SAYS = {
    "data file: a link to /dev/zero": "x.jsonl is a character device, not a regular file",
    "data file: a FIFO": "x.jsonl is a FIFO, not a regular file",
    "data file: a .txt link to /dev/random": "x.txt is a character device, not a regular file",
    "data file: the first record's text is null": "data.text_field=text: ",
    "data file: the first record's text is a number": "first record holds no text there",
    "data file: the first record's text is a table": "first record holds no text there",
    "data file: the first record's text is a list": "first record holds no text there",
    "tokenizer_config.json is a list": "tokenizer_config.json holds a list, not a table of settings",
    "tokenizer_config.json: eos_token 5": "has eos_token=5, not a token's text",
    "tokenizer.json is a FIFO": "tokenizer.json is a FIFO, not a regular file",
    "config.json is []": "its config.json holds a list, not a table of settings",
    "config.json is null": "its config.json holds a null, not a table of settings",
    "config.json nested 200k deep": "is JSON nested too deeply to read",
    "config.json without num_attention_heads": "has no num_attention_heads, which the model needs",
    "config.json without hidden_size": "has no hidden_size, which the model needs",
    "rope_parameters is text": "has rope_parameters='llama3', not a table",
    "rope_parameters is a list": "has rope_parameters=a list, not a table",
    "rope_type llama3 without factor": "has no rope_parameters.factor, which the model needs",
    "rms_norm_eps is text": "has rms_norm_eps='1e-5', not a finite number",
    "num_hidden_layers: true": "has num_hidden_layers=True, not an integer",
    "num_hidden_layers: 1e9": "has num_hidden_layers=1000000000.0, not an integer",
    "num_hidden_layers: 10^9": "makes model.n_layers=1000000000: more than 10,000 layers",
    "model_type is a list": "has model_type=a list, not text",
    "config.json is a FIFO": "config.json is a FIFO, not a regular file",
    "safetensors of 4 bytes": "is 4 bytes, too short for a safetensors file",
    "safetensors header not JSON": "model.safetensors's header is not JSON",
    "safetensors header a list": "header is a list, not a table of tensors",
    "safetensors entry without shape": "tensor w has shape None",
    "safetensors: a link to /etc/passwd": "more than the file holds; not safetensors",
    "safetensors: a link to /dev/zero": "model.safetensors is a character device, not a regular file",
    "safetensors: a FIFO": "model.safetensors is a FIFO, not a regular file",
    "safetensors header length 2^40": "says its header is 1,099,511,627,776 bytes, more than the file holds",
    "safetensors header length 2^33": "says its header is 8,589,934,592 bytes, more than the file holds",
    "safetensors cut short": "tensor w claims bytes 0..8 for 2 F32 values in a file of 4 data bytes",
    "safetensors claims a 1 TB tensor": "claims bytes 0..1099511627776 for 274,877,906,944 F32 values",
    "safetensors all int8": "holds model.embed_tokens.weight as I8; weights are floating point",
    "a tensor in two files": "holds model.norm.weight twice, in model-1.safetensors and model-2.safetensors",
    "tie_word_embeddings: 'yes'": "has tie_word_embeddings='yes', not true or false",
    "model.moe.num_experts=-4": "model.moe.num_experts=-4: must be >= 0",
    **{
        f"float8 weight_block_size {block!r}": f"has quantization_config.weight_block_size={block}, not two integers"
        for block in ([0, 16], [-16, 16], [16.5, 16], [16], [10**12, 16])
    },
    "float8 weight_block_size '16'": "has quantization_config.weight_block_size='16', not a list",
    "float8 weight_scale_inv too small": "holds model.layers.0.self_attn.o_proj.weight_scale_inv as F32 [1, 2]; "
    "one scale per 16×16 block (quantization_config.weight_block_size) of its 32×32 matrix is a floating-point [2, 2]",
    "float8 16-blocks without quantization_config": "holds model.layers.0.self_attn.q_proj.weight_scale_inv as F32 "
    "[3, 2]; one scale per 128×128 block (DeepSeek-V3's: no weight_block_size) of its 48×32 matrix",
    "float8 norm weight with a scale": "holds model.layers.0.input_layernorm.weight as F8_E4M3 [32]; float8 is read "
    "only as a matrix",
    "a scale beside an F32 weight": "holds model.layers.0.self_attn.o_proj.weight_scale_inv beside "
    "model.layers.0.self_attn.o_proj.weight, which is F32: block scales go with F8_E4M3 weights only",
    "GPT-OSS float8 sinks with a scale": "holds model.layers.0.self_attn.sinks as F8_E4M3 [2]; float8 is read only",
    "MXFP4 and F32 experts both": "holds model.layers.1.mlp.experts.gate_up_proj twice: as F32 and as MXFP4 "
    "(model.layers.1.mlp.experts.gate_up_proj_blocks, model.layers.1.mlp.experts.gate_up_proj_scales); keep one",
    "MXFP4 scale 255": "holds model.layers.1.mlp.experts.gate_up_proj_scales with a scale of 255 at element 127",
    "GPT-OSS sliding_window: 10^30": f"makes model.sliding_window={10**30}: is wider than model.max_seq_len=64",
    "GPT-OSS num_hidden_layers: 10^9": "makes model.n_layers=1000000000: more than 10,000 layers",
    "GPT-OSS num_hidden_layers: 1e9": "has num_hidden_layers=1000000000.0, not an integer",
    "checkpoint step a link": "ck/step-3 is a link to ../elsewhere, not a folder a save wrote; remove it",
    "checkpoint step-4.saving a link": "ck/step-4.saving is a link to ../elsewhere, not a folder a save wrote",
    "checkpoint step-4.saving not a save's": "ck/step-4.saving is not a folder a save of this project left",
    "checkpoint .metadata a FIFO": "step-3/.metadata is a FIFO, not a regular file; point checkpoint.folder",
    "checkpoint shard a link to /dev/zero": "step-3/__0_0.distcp is a link to /dev/zero, not a regular file",
    "checkpoint model.json a FIFO": "its model.json cannot be read (",
    "checkpoint without model.json": "ck/step-3: has no model.json, which says which model it holds",
    "checkpoint without model.json as initial_load_path": "checkpoint.initial_load_path=",
    "checkpoint mlflow_run_id a FIFO": "ck/mlflow_run_id is a FIFO, not a regular file; remove it",
    "checkpoint mlflow_run_id a link to /dev/zero": "ck/mlflow_run_id is a link to /dev/zero",
    "checkpoint mlflow_run_id a terminal escape": r"ck/mlflow_run_id holds '\x1b]0;owned\x07', not an MLflow run id",
    "tokenizer: a normalizer writing 1,000 a for each a": "its normalizer (Replace) makes up to 1,001 characters",
    "tokenizer: a normalizer writing 20 characters for each one": "more than 2 a byte: it multiplies text",
    "tokenizer: a normalizer replacing the empty string (a panic)": "the tokenizers library fails on a sample text",
    "tokenizer: a pre-tokenizer regex past Onig's backtracking limit (a panic)": "retry-limit-in-match over",
    "tokenizer: eos added as id 2^32-1": "its added_tokens[1].id=4294967295 for '<|end_of_text|>', which the "
    "tokenizers library numbers",
    "tokenizer: eos in the vocabulary as id 2^32-1": "('<|end_of_text|>' is id 4294967295)",
    "tokenizer.json of 230 MB": "241,172,480 bytes, more than the 67,108,864 a tokenizer.json is read up to",
}


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_crafted_input_is_refused_in_one_line_saying_why_within_bounds(case, tmp_path):
    overrides = case.make(tmp_path)
    before = peak_rss()
    with pytest.raises(ConfigError) as refused:
        checked(overrides, tmp_path)
    assert SAYS[case.name] in str(refused.value) and "\n" not in str(refused.value)
    assert peak_rss() - before < MEMORY_BOUND
    assert not (tmp_path / "m.db").exists()


def test_a_record_longer_than_the_bound_is_refused_naming_it(tmp_path):
    """A one-line document past MAX_RECORD_CHARS (the probe's: 200 MB) is refused, read no further."""
    data = tmp_path / "long.jsonl"
    with open(data, "w") as file:
        file.write('{"text": "' + "a" * (MAX_RECORD_CHARS + 10) + '"}\n')
    before = peak_rss()
    with pytest.raises(ConfigError, match=f"record 0 is longer than {MAX_RECORD_CHARS:,} characters; split it"):
        checked(files_data(tmp_path, data), tmp_path)
    assert peak_rss() - before < MEMORY_BOUND


def test_records_without_text_after_the_first_are_skipped_and_said_once(tmp_path, capsys):
    """The first record judges the field (refused above when it holds no text); a later record
    whose text is null, a number, a list or missing is passed over, counted, and said once per file."""
    import json

    records = [{"text": f"document {i} with words"} for i in range(10)]
    records[3]["text"], records[5]["text"], records[7] = None, ["a"], {"id": 7}
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    overrides = files_data(tmp_path, data)
    checked(overrides, tmp_path)  # the pre-flight passes
    cfg = compose_job_config(overrides)
    source = FilesSource(cfg.data, 16, seed=0)
    source.samples(range(8))
    assert source.skipped >= 3
    said = capsys.readouterr().out
    assert said.count("records without text are skipped") == 1 and f"{data}: record 3 has no text" in said


def test_a_long_document_is_tokenized_in_pieces_and_resumed_inside_it(tmp_path):
    """A document past PIECE_CHARS goes through the tokenizer a piece at a time; the stream's
    position inside it is saved and read on from exactly there."""
    from titan_exp.data import tokenizer as tokenizer_module

    words = " ".join(f"word{i % 50}" for i in range(3000))
    data = tmp_path / "docs.txt"
    data.write_text(words + "\n\nshort one\n")
    cfg = compose_job_config(files_data(tmp_path, data)).data
    piece_chars = tokenizer_module.PIECE_CHARS
    tokenizer_module.PIECE_CHARS = 1000  # 3000 words: ~84 pieces (of 1000 // the BPE's growth, 4, characters)
    try:
        source = FilesSource(cfg, 16, seed=0)
        whole = source.samples(range(40))
        assert len(list(source.tokenizer.pieces(words))) > 10
        resumed = FilesSource(cfg, 16, seed=0)
        resumed.load_state(source.state_at(17))
        assert resumed.position.piece > 0  # inside the long document
        assert resumed.samples(range(17, 40)) == whole[17:]
    finally:
        tokenizer_module.PIECE_CHARS = piece_chars


def test_a_resume_that_needs_a_data_position_the_checkpoint_lacks_is_refused(tmp_path):
    """Issue 47: resuming a data=text checkpoint with data=files failed in the ranks (`Missing key in
    checkpoint state_dict: dataloader`) and turned the finished run FAILED; now the pre-flight says so."""
    import json

    from titan_exp.checkpoint.model_record import write_model_record

    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} with words"}) + "\n" for i in range(40)))
    overrides = [*files_data(tmp_path, data), "checkpoint=periodic", f"checkpoint.folder={tmp_path}/ck"]
    step = tmp_path / "ck" / "step-10"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    write_model_record(step, compose_job_config(overrides).model, data_position=False)
    with pytest.raises(
        ConfigError, match="^data.source=files: the checkpoint in .* kept no position in your documents"
    ):
        checked([*overrides, "training.steps=20"], tmp_path)
    (step / "model.json").unlink()  # a save writes a record once, in a folder of its own
    write_model_record(step, compose_job_config(overrides).model, data_position=True)
    checked([*overrides, "training.steps=20"], tmp_path)


@pytest.mark.parametrize("make", [tiny_llama, tiny_deepseek_float8, tiny_gpt_oss_mxfp4])
def test_a_well_formed_tiny_folder_passes(make, tmp_path):
    """The crafted cases' bases are themselves fine (float8 with its block scales, MXFP4 experts):
    what the cases change is what is refused."""
    checked(hf_load(make(tmp_path / "hf")), tmp_path)
