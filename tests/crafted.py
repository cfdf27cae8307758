"""Inputs from someone else, crafted to hurt (issue 47's probe): Hugging Face folders, safetensors,
tokenizers and data files that are devices, FIFOs, lies about their sizes or values of the wrong
type. Each case writes its files into a fresh folder and gives the command-line overrides that
point a job at them; every one must be refused before any rank starts (exit 2, one line, no run
folder), within a bound of memory and time. Torch-free: the files are written by hand.
benchmarks/probe_bad_inputs.py runs them as commands; tests/unit/test_unit_crafted_inputs.py
in-process."""

import json
import os
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
_WIDTHS = {"F32": 4, "I8": 1}


def write_safetensors(path: Path, tensors: dict[str, tuple[int, ...]], dtype: str = "F32") -> None:
    """A safetensors file of zeros: the header (each tensor's dtype, shape and bytes), then the data."""
    header, offset = {}, 0
    for name, shape in tensors.items():
        size = _WIDTHS[dtype]
        for n in shape:
            size *= n
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))


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
]
