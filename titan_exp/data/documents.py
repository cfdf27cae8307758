"""Your documents as data=files reads them, one record at a time (torch-free: the pre-flight reads
the first record of each): the files and saved datasets the globs of data.paths match, and the text
of each record, from .txt (documents separated by blank lines, as data=text reads its corpus),
.jsonl (a field), .parquet and folders written by datasets' save_to_disk (a column, read a batch at
a time). Only regular files are read, and no record longer than MAX_RECORD_CHARS (untrusted.py): a
record without text (null, a number, a list, the field missing) comes as None, for the reader to
skip and count."""

import glob
from collections.abc import Iterator
from pathlib import Path

from titan_exp.untrusted import parse_json, read_line, regular_file

SUFFIXES = (".txt", ".jsonl", ".parquet")
# A folder written by datasets' save_to_disk: its records are in Arrow stream files.
SAVED_DATASET_MARK = "dataset_info.json"
# Records read at a time from parquet and Arrow files.
_BATCH_ROWS = 1024
# The longest record read (a jsonl line, a .txt document): longer ones are refused, naming the file
# and the record, as a file that is not documents (a device, one line without end) would be.
MAX_RECORD_CHARS = 64 << 20


def expand(globs: list[str]) -> list[Path]:
    """The files and saved datasets the globs match, sorted, each once."""
    return sorted({Path(match) for pattern in globs for match in glob.glob(pattern, recursive=True)})


def records(path: Path, text_field: str, start: int = 0) -> Iterator[str | None]:
    """The documents of one file or saved dataset from record `start` on, read a batch at a time
    (None: a record without text)."""
    if path.is_dir():
        yield from _arrow_records(path, text_field, start)
        return
    regular_file(path)
    if path.suffix == ".txt":
        yield from _skip(_text_documents(path), start)
    elif path.suffix == ".jsonl":
        yield from _jsonl_records(path, text_field, start)
    elif path.suffix == ".parquet":
        yield from _parquet_records(path, text_field, start)
    else:
        raise ValueError(f"{path}: not one of {', '.join(SUFFIXES)} or a saved dataset folder")


def _jsonl_records(path: Path, text_field: str, start: int) -> Iterator[str | None]:
    for index, line in enumerate(_jsonl_lines(path)):
        if index >= start:  # those before are passed over unparsed
            text = _json_record(path, index, line).get(text_field)
            yield text if isinstance(text, str) else None


def _jsonl_lines(path: Path) -> Iterator[str]:
    """The lines of a jsonl file that are not blank, each at most MAX_RECORD_CHARS long."""
    with open(path, encoding="utf-8") as file:
        index = 0
        while line := read_line(file, MAX_RECORD_CHARS, f"{path}: record {index}"):
            if line.strip():
                yield line
                index += 1


def _json_record(path: Path, index: int, line: str) -> dict:
    record = parse_json(line, f"{path}: record {index}")
    if not isinstance(record, dict):
        raise ValueError(f"{path}: record {index} is a {type(record).__name__}, not an object with fields")
    return record


def _parquet_records(path: Path, text_field: str, start: int) -> Iterator[str]:
    """From record `start` on: the row groups before it are passed over by the file's metadata, unread."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    group = 0
    while group < parquet.num_row_groups and start >= (rows := parquet.metadata.row_group(group).num_rows):
        start, group = start - rows, group + 1
    groups = list(range(group, parquet.num_row_groups))
    batches = parquet.iter_batches(batch_size=_BATCH_ROWS, row_groups=groups, columns=[text_field])
    yield from _skip((text for batch in batches for text in batch.column(0).to_pylist()), start)


def _arrow_records(folder: Path, text_field: str, start: int) -> Iterator[str]:
    import pyarrow as pa

    for arrow in sorted(folder.glob("*.arrow")):
        with pa.memory_map(str(arrow)) as source:
            for batch in pa.ipc.open_stream(source):
                column = batch.column(batch.schema.get_field_index(text_field))
                if start >= len(column):
                    start -= len(column)
                    continue
                yield from column.slice(start).to_pylist()
                start = 0


def _text_documents(path: Path) -> Iterator[str]:
    """A text file's documents: paragraphs separated by blank lines (as data=text reads its corpus),
    each at most MAX_RECORD_CHARS long."""
    lines: list[str] = []
    length = 0
    with open(path, encoding="utf-8") as file:
        while line := read_line(file, MAX_RECORD_CHARS - length, f"{path}: a document"):
            if line.strip():
                lines.append(line)
                length += len(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines, length = [], 0
    if lines:
        yield "".join(lines).rstrip("\n")


def _skip(items: Iterator, count: int) -> Iterator:
    for index, item in enumerate(items):
        if index >= count:
            yield item


def first_record_fields(path: Path) -> dict[str, bool] | None:
    """The fields of a jsonl/parquet file's or saved dataset's records, each with whether it holds
    text, read from the first record or the schema only; None where there is nothing to judge
    (text, no records)."""
    if path.is_dir():
        import pyarrow as pa

        arrows = sorted(path.glob("*.arrow"))
        if not arrows:
            return None
        regular_file(arrows[0])
        with pa.memory_map(str(arrows[0])) as source:
            return _text_columns(pa.ipc.open_stream(source).schema)
    regular_file(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return _text_columns(pq.ParquetFile(path).schema_arrow)
    if path.suffix == ".jsonl":
        first = next(_jsonl_lines(path), None)
        return None if first is None else {k: isinstance(v, str) for k, v in _json_record(path, 0, first).items()}
    return None


def _text_columns(schema) -> dict[str, bool]:
    import pyarrow as pa

    return {f.name: pa.types.is_string(f.type) or pa.types.is_large_string(f.type) for f in schema}
