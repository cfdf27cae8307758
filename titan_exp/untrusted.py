"""Reading files someone else made (a Hugging Face folder, a tokenizer, a data file): only regular
files, and every read bounded by the file's own size and a limit, so a crafted file can neither
hang the reader (a FIFO, a device) nor make it allocate what the machine does not have (a header
that claims a terabyte, a line without end, JSON nested without end). Each refusal is a
ValueError of one line; the caller names the key that gave the file. Torch-free."""

import json
import os
import stat
from pathlib import Path
from typing import IO

import yaml

# config.json, tokenizer_config.json, a safetensors index: a few kB in every published model.
MAX_CONFIG_BYTES = 16 << 20
# safetensors' own limit on its header (safetensors/src/tensor.rs, MAX_HEADER_SIZE).
MAX_SAFETENSORS_HEADER_BYTES = 100_000_000
# safetensors' dtype names and their widths in bytes (safetensors/src/tensor.rs, Dtype); float8s included.
SAFETENSORS_DTYPES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1,
    "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
    "I32": 4, "U32": 4, "F32": 4,
    "I64": 8, "U64": 8, "F64": 8,
}  # fmt: skip
# What weights are loaded from as they are; float8 ones only with a block scale beside each
# (`<name>_scale_inv`, DeepSeek-V3's published format), which they mean nothing without.
FLOATING_DTYPES = ("F16", "BF16", "F32", "F64")
BLOCK_SCALED_DTYPE = "F8_E4M3"


def regular_file(path: Path) -> int:
    """The size of `path`, a regular file (after symlinks); refuses a FIFO, a device, a socket
    (opening one would wait for a writer or read for ever) and what is missing."""
    try:
        info = os.stat(path)
    except OSError as err:
        raise ValueError(f"{path} cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path} is {_kind(info.st_mode)}, not a regular file")
    return info.st_size


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):  # fmt: skip
        if test(mode):
            return name
    return "not a file"


def read_json(path: Path, max_bytes: int = MAX_CONFIG_BYTES) -> object:
    """A small JSON file's value (a config): refused when larger than `max_bytes`, not JSON, or
    nested deeper than Python's parser goes."""
    return parse_json(read_bytes(path, max_bytes), str(path))


def read_bytes(path: Path, max_bytes: int) -> bytes:
    """A small regular file's bytes, refused when larger than `max_bytes`."""
    size = regular_file(path)
    if size > max_bytes:
        raise ValueError(f"{path} is {size:,} bytes, more than the {max_bytes:,} such a file may be")
    with open(path, "rb") as file:
        return file.read(max_bytes)


def read_text(path: Path, max_bytes: int) -> str:
    """A small regular file's text, refused when larger than `max_bytes` or not UTF-8."""
    try:
        return read_bytes(path, max_bytes).decode()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start}: {err.reason})") from None


def plain_yaml(text: str, what: str, max_depth: int) -> object:
    """YAML as plain data, read as Hydra reads a config file (OmegaConf's loader: `1e3` is a number,
    a key given twice is refused): no anchors or aliases (a few lines of them expand to billions of
    values), no tags beyond YAML's own (SafeLoader's: no Python objects), no nesting deeper than
    `max_depth` collections."""
    from omegaconf._utils import get_yaml_loader  # the loader Hydra's config files go through

    loader, depth = get_yaml_loader(), 0
    try:
        for event in yaml.parse(text, Loader=loader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise ValueError(f"{what} uses YAML anchors or aliases (& and *); write each value out")
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if depth > max_depth:
                raise ValueError(f"{what} is nested more than {max_depth} deep; it holds plain settings")
        return yaml.load(text, Loader=loader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        why = (getattr(err, "problem", None) or str(err).splitlines()[0]) + (f", line {mark.line + 1}" if mark else "")
        raise ValueError(f"{what} is not YAML that can be read as plain data ({why})") from None


def parse_json(text: str | bytes, what: str) -> object:
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is JSON nested too deeply to read") from None
    except ValueError as err:  # JSONDecodeError, or bytes that are not UTF-8
        raise ValueError(f"{what} is not JSON ({' '.join(str(err).split())})") from None


def read_line(file: IO[str], limit: int, what: str) -> str:
    """The next line of a text file, refused when longer than `limit` characters ('' at the end)."""
    line = file.readline(limit + 1)
    if len(line) > limit and not line.endswith("\n"):
        raise ValueError(f"{what} is longer than {limit:,} characters; split it")
    return line


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors of a safetensors file (name → {dtype, shape, data_offsets}), from its header alone
    (an 8-byte little-endian length, then JSON), each entry checked against the file: a known dtype,
    a shape of sizes ≥ 0 and bytes inside the file that match it."""
    size = regular_file(path)
    if size < 8:
        raise ValueError(f"{path} is {size} bytes, too short for a safetensors file")
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        if length > min(size - 8, MAX_SAFETENSORS_HEADER_BYTES):
            raise ValueError(f"{path} says its header is {length:,} bytes, more than the file holds; not safetensors")
        header = parse_json(file.read(length), f"{path}'s header")
    if not isinstance(header, dict):
        raise ValueError(f"{path}'s header is a {type(header).__name__}, not a table of tensors; not safetensors")
    data_bytes = size - 8 - length
    tensors = {}
    for name, entry in header.items():
        if name != "__metadata__":
            tensors[name] = _checked_entry(path, name, entry, data_bytes)
    return tensors


def _checked_entry(path: Path, name: str, entry: object, data_bytes: int) -> dict:
    def bad(why: str) -> ValueError:
        return ValueError(f"{path}: tensor {name} {why}; not a safetensors file")

    if not isinstance(entry, dict):
        raise bad("is no table")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in SAFETENSORS_DTYPES:
        raise bad(f"has dtype {dtype!r}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise bad(f"has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)):
        raise bad(f"has data_offsets {offsets!r}")
    start, end = offsets
    count = 1
    for n in shape:
        count *= n
    if not 0 <= start <= end <= data_bytes or end - start != count * SAFETENSORS_DTYPES[dtype]:
        raise bad(f"claims bytes {start}..{end} for {count:,} {dtype} values in a file of {data_bytes:,} data bytes")
    return entry
