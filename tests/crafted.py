"""Inputs from someone else, crafted to hurt (issue 47's probe): Hugging Face folders, safetensors,
tokenizers and data files that are devices, FIFOs, lies about their sizes or values of the wrong
type. Each case writes its files into a fresh folder and gives the command-line overrides that
point a job at them; every one must be refused before any rank starts (exit 2, one line, no run
folder), within a bound of memory and time. Torch-free: the files are written by hand.
benchmarks/probe_bad_inputs.py runs them as commands; tests/unit/test_unit_crafted_inputs.py
in-process."""

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# A Llama small enough to write by hand: its config.json and one F32 tensor file.
TINY_LLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
_LAYER = {
    "self_attn.q_proj.weight": (16, 16),
    "self_attn.k_proj.weight": (8, 16),
    "self_attn.v_proj.weight": (8, 16),
    "self_attn.o_proj.weight": (16, 16),
    "mlp.gate_proj.weight": (32, 16),
    "mlp.up_proj.weight": (32, 16),
    "mlp.down_proj.weight": (16, 32),
    "input_layernorm.weight": (16,),
    "post_attention_layernorm.weight": (16,),
}
TINY_TENSORS = {
    "model.embed_tokens.weight": (256, 16),
    "model.norm.weight": (16,),
    "lm_head.weight": (256, 16),
    **{f"model.layers.0.{name}": shape for name, shape in _LAYER.items()},
}
_WIDTHS = {"F32": 4, "I8": 1, "U8": 1, "F8_E4M3": 1}


def write_safetensors(path: Path, tensors: dict[str, tuple[int, ...]], dtype: str = "F32") -> None:
    """A safetensors file of zeros: the header (each tensor's dtype, shape and bytes), then the data."""
    write_typed(path, {name: (dtype, shape) for name, shape in tensors.items()})


def write_typed(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]], data: dict | None = None) -> None:
    """A safetensors file of each tensor's (dtype, shape), its bytes those `data` gives or zeros."""
    header, raw_data, data = {}, b"", data or {}
    for name, (dtype, shape) in tensors.items():
        size = _WIDTHS[dtype]
        for n in shape:
            size *= n
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(raw_data), len(raw_data) + size]}
        raw_data += data.get(name, bytes(size))
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + raw_data)


def raw_safetensors(path: Path, header: bytes, length: int | None = None, data: bytes = b"") -> None:
    """A file that says it is safetensors: `length` (the header's own by default), the header, data."""
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)


def tiny_llama(folder: Path, tensors: bool = True, **changes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, **changes}))
    if tensors:
        write_safetensors(folder / "model.safetensors", TINY_TENSORS)
    return folder


def hf_model(folder: Path) -> list[str]:
    return [
        "model=hf",
        f"model.hf_path={folder}",
        "training.seq_len=16",
        "data=synthetic",
        "data.synthetic_vocab_size=256",
    ]


def hf_load(folder: Path) -> list[str]:
    return [*hf_model(folder), f"checkpoint.initial_load_path={folder}", "checkpoint.initial_load_in_hf=true"]


def tokenizer(folder: Path, config: object = None) -> Path:
    """A byte-level BPE tokenizer.json (with <|end_of_text|>), and `config` as tokenizer_config.json."""
    from titan_exp.data.text import train_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "tokenizer.json"
    path.write_text(train_tokenizer(["a few words to learn from", "and some more words"], 300).to_str())
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def files_data(folder: Path, data: Path, tokenizer_path: Path | None = None) -> list[str]:
    tokenizer_path = tokenizer_path or tokenizer(folder / "tok")
    return ["data=files", f"data.paths=[{data}]", f"data.tokenizer_path={tokenizer_path}", "training.seq_len=16"]


def _jsonl(folder: Path, *records: object) -> Path:
    path = folder / "docs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def _symlink(path: Path, target: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(target)
    return path


def _nested(depth: int) -> str:
    return '{"model_type": "llama", "x": ' + "[" * depth + "]" * depth + "}"


@dataclass(frozen=True)
class Case:
    name: str
    make: Callable[[Path], list[str]]  # writes the files into a fresh folder; the overrides


def _config_case(name: str, text: str) -> Case:
    def make(folder: Path) -> list[str]:
        (folder / "hf").mkdir()
        (folder / "hf" / "config.json").write_text(text)
        return hf_model(folder / "hf")

    return Case(name, make)


def _changed_config(name: str, remove: tuple[str, ...] = (), **changes) -> Case:
    values = {k: v for k, v in {**TINY_LLAMA, **changes}.items() if k not in remove}
    return _config_case(name, json.dumps(values))


def _tensors_case(name: str, write: Callable[[Path], None]) -> Case:
    def make(folder: Path) -> list[str]:
        hf = tiny_llama(folder / "hf", tensors=False)
        write(hf)
        return hf_load(hf)

    return Case(name, make)


def _two_files(hf: Path) -> None:
    write_safetensors(hf / "model-1.safetensors", TINY_TENSORS)
    write_safetensors(hf / "model-2.safetensors", {"model.norm.weight": (16,)})


ST = "model.safetensors"
_DOC = {"text": "a few words"}
_HEADER = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()

# Issue 68: the quantized forms of the published checkpoints, written by hand. A DeepSeek-V3 whose
# matrices are float8 with a scale per 16 × 16 block (its config.json says so unless `block` is
# None), and a GPT-OSS whose experts are MXFP4; `tweak` changes the tensors (name → (dtype, shape)).
TINY_DEEPSEEK = {
    "model_type": "deepseek_v3",
    "hidden_size": 32,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 2,
    "first_k_dense_replace": 1,
    "num_attention_heads": 2,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 2,
    "num_experts_per_tok": 1,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}
TINY_GPT_OSS = {
    "model_type": "gpt_oss",
    "hidden_size": 32,
    "intermediate_size": 32,  # MXFP4 packs 32 values a block along the inputs
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "num_local_experts": 2,
    "num_experts_per_tok": 1,
    "sliding_window": 8,
    "vocab_size": 256,
    "max_position_embeddings": 64,
    "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0},
}
Tensors = dict[str, tuple[str, tuple[int, ...]]]
Tweak = Callable[[Tensors], None]
_FLOAT8_BLOCK = 16


def _unchanged(tensors: Tensors) -> None:
    """The published form, as it is."""


def _hf_folder(folder: Path, config: dict) -> tuple[Path, dict[str, tuple[int, ...]]]:
    """`config` as a folder's config.json, and HF's name and shape of each tensor its model needs."""
    from titan_exp.models.registry import config_from_hf, family_of

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    cfg = config_from_hf(str(folder), "crafted")
    hf = family_of(cfg).hf
    return folder, hf.expected_shapes(cfg, fused=hf.is_fused(set()))


def tiny_deepseek_float8(folder: Path, block: object = (16, 16), tweak: Tweak = _unchanged) -> Path:
    config = dict(TINY_DEEPSEEK)
    if block is not None:
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": block}
    folder, shapes = _hf_folder(folder, TINY_DEEPSEEK)
    (folder / "config.json").write_text(json.dumps(config))
    tensors: Tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 2 and "proj" in name:
            tensors[name] = ("F8_E4M3", shape)
            tensors[f"{name}_scale_inv"] = ("F32", tuple(-(-n // _FLOAT8_BLOCK) for n in shape))
        else:
            tensors[name] = ("F32", shape)
    tweak(tensors)
    write_typed(folder / ST, tensors)
    return folder


def tiny_gpt_oss_mxfp4(folder: Path, tweak: Tweak = _unchanged, data: dict | None = None) -> Path:
    folder, shapes = _hf_folder(folder, TINY_GPT_OSS)
    tensors: Tensors = {}
    for name, shape in shapes.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            experts, inputs, outputs = shape  # stored transposed; MXFP4 keeps experts × out × in
            tensors[f"{name}_blocks"] = ("U8", (experts, outputs, inputs // 32, 16))
            tensors[f"{name}_scales"] = ("U8", (experts, outputs, inputs // 32))
        else:
            tensors[name] = ("F32", shape)
    tweak(tensors)
    write_typed(folder / ST, tensors, data)
    return folder


def _float8_case(name: str, block: object = (16, 16), tweak: Tweak = _unchanged) -> Case:
    return Case(name, lambda f: hf_load(tiny_deepseek_float8(f / "hf", block, tweak)))


def _mxfp4_case(name: str, tweak: Tweak = _unchanged, data: dict | None = None) -> Case:
    return Case(name, lambda f: hf_load(tiny_gpt_oss_mxfp4(f / "hf", tweak, data)))


_O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # 32 × 32: 2 × 2 blocks of 16
_NORM = "model.layers.0.input_layernorm.weight"
_SINKS = "model.layers.0.self_attn.sinks"
_GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"
_NAN_SCALE = {f"{_GATE_UP}_scales": bytes(2 * 64 - 1) + b"\xff"}  # the last expert's last row's


# Issue 68: a checkpoint folder others can write in (a shared file system): a step or a save's folder
# that is a link, a file a rank would read that is a FIFO or a link, a step that does not say which
# model it holds, a run-id file that never ends.
def _checkpoint_case(name: str, plant: Callable[[Path], object], initial_load: bool = False) -> Case:
    """A job resuming from checkpoint.folder=<folder>/ck, whose step-3 has DCP's files (its
    .metadata, a shard) and no model.json, after `plant` (given <folder>/ck) changed it; with
    `initial_load`, a job loading step-3's weights instead."""

    def make(folder: Path) -> list[str]:
        ck = folder / "ck"
        for step in (ck / "step-3", folder / "elsewhere"):
            step.mkdir(parents=True)
            (step / ".metadata").write_bytes(b"")
            (step / "__0_0.distcp").write_bytes(b"")
        plant(ck)
        if initial_load:
            return ["data=synthetic", f"checkpoint.initial_load_path={ck / 'step-3'}"]
        return ["data=synthetic", "checkpoint=periodic", f"checkpoint.folder={ck}", "training.steps=10"]

    return Case(name, make)


def _replace(path: Path, make: Callable[[Path], object]) -> None:
    """The file `path` replaced by what `make` makes there."""
    path.unlink()
    make(path)


# Issue 68: tokenizer.json files the tokenizers library reads, crafted to make it hold a thousand
# times the text, panic, renumber the end-of-document token, or parse for a minute.
def _tokenizer_case(name: str, change: Callable[[dict], object]) -> Case:
    """A data=files job whose tokenizer.json (tokenizer()'s) `change` changed."""

    def make(folder: Path) -> list[str]:
        path = tokenizer(folder / "t")
        values = json.loads(path.read_text())
        change(values)
        path.write_text(json.dumps(values))
        return files_data(folder, _jsonl(folder, _DOC), path)

    return Case(name, make)


def _eos_numbered(values: dict, id_: int, in_vocab: bool) -> None:
    """<|end_of_text|> (added token 1) given `id_`, in its vocabulary too or only as an added token."""
    vocab = values["model"]["vocab"]
    del vocab["<|end_of_text|>"]
    if in_vocab:
        vocab["<|end_of_text|>"] = id_
    values["added_tokens"][1]["id"] = id_


def _sized(size: int) -> Callable[[Path], list[str]]:
    def make(folder: Path) -> list[str]:
        path = tokenizer(folder / "t")
        os.truncate(path, size)  # a sparse file: the size is what is judged
        return files_data(folder, _jsonl(folder, _DOC), path)

    return make


_REPLACE = {"type": "Replace", "pattern": {"String": "a"}, "content": "a" * 1000}
_BACKTRACKING = {"type": "Split", "pattern": {"Regex": r"(\w+\s?)*$"}, "behavior": "Isolated", "invert": False}


CASES: list[Case] = [
    # Data files: not regular files, records without end, texts that are not text.
    Case("data file: a link to /dev/zero", lambda f: files_data(f, _symlink(f / "d" / "x.jsonl", "/dev/zero"))),
    Case("data file: a FIFO", lambda f: files_data(f, _fifo(f / "d" / "x.jsonl"))),
    Case("data file: a .txt link to /dev/random", lambda f: files_data(f, _symlink(f / "d" / "x.txt", "/dev/urandom"))),
    *(
        Case(f"data file: the first record's text is {kind}", lambda f, v=value: files_data(f, _jsonl(f, {"text": v})))
        for kind, value in (("null", None), ("a number", 5), ("a table", {"a": 1}), ("a list", ["a"]))
    ),
    Case(
        "tokenizer_config.json is a list", lambda f: files_data(f, _jsonl(f, {"text": "words"}), tokenizer(f / "t", []))
    ),
    Case(
        "tokenizer_config.json: eos_token 5",
        lambda f: files_data(f, _jsonl(f, {"text": "a"}), tokenizer(f / "t", {"eos_token": 5})),
    ),  # fmt: skip
    Case(
        "tokenizer.json is a FIFO",
        lambda f: files_data(f, _jsonl(f, {"text": "words"}), _fifo(f / "t" / "tokenizer.json")),
    ),  # fmt: skip
    # config.json of a Hugging Face folder.
    _config_case("config.json is []", "[]"),
    _config_case("config.json is null", "null"),
    _config_case("config.json nested 200k deep", _nested(200_000)),
    _changed_config("config.json without num_attention_heads", remove=("num_attention_heads",)),
    _changed_config("config.json without hidden_size", remove=("hidden_size",)),
    _changed_config("rope_parameters is text", rope_parameters="llama3"),
    _changed_config("rope_parameters is a list", rope_parameters=[1, 2]),
    _changed_config("rope_type llama3 without factor", rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}),
    _changed_config("rms_norm_eps is text", rms_norm_eps="1e-5"),
    _changed_config("num_hidden_layers: true", num_hidden_layers=True),
    _changed_config("num_hidden_layers: 1e9", num_hidden_layers=1e9),
    _changed_config("num_hidden_layers: 10^9", num_hidden_layers=10**9),
    _changed_config("model_type is a list", model_type=["llama"]),
    Case("config.json is a FIFO", lambda f: hf_model(_fifo(f / "hf" / "config.json").parent)),
    # Safetensors that lie.
    _tensors_case("safetensors of 4 bytes", lambda hf: (hf / ST).write_bytes(b"abcd")),
    _tensors_case("safetensors header not JSON", lambda hf: raw_safetensors(hf / ST, b"{not json")),
    _tensors_case("safetensors header a list", lambda hf: raw_safetensors(hf / ST, b"[1, 2]")),
    _tensors_case(
        "safetensors entry without shape",
        lambda hf: raw_safetensors(hf / ST, b'{"w": {"dtype": "F32", "data_offsets": [0, 8]}}', data=bytes(8)),
    ),  # fmt: skip
    _tensors_case("safetensors: a link to /etc/passwd", lambda hf: _symlink(hf / ST, "/etc/passwd")),
    _tensors_case("safetensors: a link to /dev/zero", lambda hf: _symlink(hf / ST, "/dev/zero")),
    _tensors_case("safetensors: a FIFO", lambda hf: _fifo(hf / ST)),
    _tensors_case("safetensors header length 2^40", lambda hf: raw_safetensors(hf / ST, _HEADER, 1 << 40)),
    _tensors_case("safetensors header length 2^33", lambda hf: raw_safetensors(hf / ST, _HEADER, 1 << 33)),
    _tensors_case("safetensors cut short", lambda hf: raw_safetensors(hf / ST, _HEADER, data=bytes(4))),
    _tensors_case(
        "safetensors claims a 1 TB tensor",
        lambda hf: raw_safetensors(
            hf / ST,
            json.dumps({"w": {"dtype": "F32", "shape": [1 << 38], "data_offsets": [0, 1 << 40]}}).encode(),
            data=bytes(8),
        ),
    ),
    _tensors_case("safetensors all int8", lambda hf: write_safetensors(hf / ST, TINY_TENSORS, "I8")),
    _tensors_case("a tensor in two files", _two_files),
    Case("tie_word_embeddings: 'yes'", lambda f: hf_load(tiny_llama(f / "hf", tie_word_embeddings="yes"))),
    Case("model.moe.num_experts=-4", lambda f: ["model=qwen3_moe_debug", "model.moe.num_experts=-4"]),
    # Issue 68: quantized weights that would crash a rank or be read wrong, GPT-OSS shapes that would.
    *(
        _float8_case(f"float8 weight_block_size {block!r}", block)
        for block in ([0, 16], [-16, 16], "16", [16.5, 16], [16], [10**12, 16])
    ),
    _float8_case(
        "float8 weight_scale_inv too small", tweak=lambda t: t.update({f"{_O_PROJ}_scale_inv": ("F32", (1, 2))})
    ),
    _float8_case("float8 16-blocks without quantization_config", block=None),
    _float8_case(
        "float8 norm weight with a scale",
        tweak=lambda t: t.update({_NORM: ("F8_E4M3", (32,)), f"{_NORM}_scale_inv": ("F32", (2,))}),
    ),
    _float8_case("a scale beside an F32 weight", tweak=lambda t: t.update({_O_PROJ: ("F32", (32, 32))})),
    _mxfp4_case(
        "GPT-OSS float8 sinks with a scale",
        tweak=lambda t: t.update({_SINKS: ("F8_E4M3", (2,)), f"{_SINKS}_scale_inv": ("F32", (1,))}),
    ),
    _mxfp4_case("MXFP4 and F32 experts both", tweak=lambda t: t.update({_GATE_UP: ("F32", (2, 32, 64))})),
    _mxfp4_case("MXFP4 scale 255", data=_NAN_SCALE),
    _config_case("GPT-OSS sliding_window: 10^30", json.dumps({**TINY_GPT_OSS, "sliding_window": 10**30})),
    _config_case("GPT-OSS num_hidden_layers: 10^9", json.dumps({**TINY_GPT_OSS, "num_hidden_layers": 10**9})),
    _config_case("GPT-OSS num_hidden_layers: 1e9", json.dumps({**TINY_GPT_OSS, "num_hidden_layers": 1e9})),
    _checkpoint_case(
        "checkpoint step a link", lambda ck: [shutil.rmtree(ck / "step-3"), _symlink(ck / "step-3", "../elsewhere")]
    ),
    _checkpoint_case("checkpoint step-4.saving a link", lambda ck: _symlink(ck / "step-4.saving", "../elsewhere")),
    _checkpoint_case("checkpoint step-4.saving not a save's", lambda ck: (ck / "step-4.saving").mkdir()),
    _checkpoint_case("checkpoint .metadata a FIFO", lambda ck: _replace(ck / "step-3" / ".metadata", _fifo)),
    _checkpoint_case(
        "checkpoint shard a link to /dev/zero",
        lambda ck: _replace(ck / "step-3" / "__0_0.distcp", lambda p: _symlink(p, "/dev/zero")),
    ),
    _checkpoint_case("checkpoint model.json a FIFO", lambda ck: _fifo(ck / "step-3" / "model.json")),
    _checkpoint_case("checkpoint without model.json", lambda ck: None),
    _checkpoint_case("checkpoint without model.json as initial_load_path", lambda ck: None, initial_load=True),
    _checkpoint_case("checkpoint mlflow_run_id a FIFO", lambda ck: _fifo(ck / "mlflow_run_id")),
    _checkpoint_case(
        "checkpoint mlflow_run_id a link to /dev/zero", lambda ck: _symlink(ck / "mlflow_run_id", "/dev/zero")
    ),
    _checkpoint_case(  # printed when the run cannot go on: it would retitle the terminal
        "checkpoint mlflow_run_id a terminal escape", lambda ck: (ck / "mlflow_run_id").write_text("\x1b]0;owned\x07")
    ),
    # Issue 68: tokenizers that multiply text, make the library panic, renumber their eos, or are too big.
    _tokenizer_case("tokenizer: a normalizer writing 1,000 a for each a", lambda t: t.update(normalizer=_REPLACE)),
    _tokenizer_case(
        "tokenizer: a normalizer writing 20 characters for each one",
        lambda t: t.update(normalizer={**_REPLACE, "pattern": {"Regex": "."}, "content": "x" * 20}),
    ),
    _tokenizer_case(
        "tokenizer: a normalizer replacing the empty string (a panic)",
        lambda t: t.update(normalizer={**_REPLACE, "pattern": {"String": ""}, "content": "x"}),
    ),
    _tokenizer_case(
        "tokenizer: a pre-tokenizer regex past Onig's backtracking limit (a panic)",
        lambda t: t.update(pre_tokenizer=_BACKTRACKING),
    ),
    _tokenizer_case("tokenizer: eos added as id 2^32-1", lambda t: _eos_numbered(t, 2**32 - 1, in_vocab=False)),
    _tokenizer_case("tokenizer: eos in the vocabulary as id 2^32-1", lambda t: _eos_numbered(t, 2**32 - 1, True)),
    Case("tokenizer.json of 230 MB", _sized(230 << 20)),
]
