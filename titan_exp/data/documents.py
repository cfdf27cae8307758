"""Your documents as data=files reads them, one record at a time (torch-free: the pre-flight reads
the first record of each): the files and saved datasets the globs of data.paths match, and the text
of each record, from .txt (documents separated by blank lines, as data=text reads its corpus),
.jsonl (a field), .parquet and folders written by datasets' save_to_disk (a column, read a batch at
a time)."""

import glob
import json
from collections.abc import Iterator
from pathlib import Path

SUFFIXES = (".txt", ".jsonl", ".parquet")
# A folder written by datasets' save_to_disk: its records are in Arrow stream files.
SAVED_DATASET_MARK = "dataset_info.json"
# Records read at a time from parquet and Arrow files.
_BATCH_ROWS = 1024


def expand(globs: list[str]) -> list[Path]:
    """The files and saved datasets the globs match, sorted, each once."""
    return sorted({Path(match) for pattern in globs for match in glob.glob(pattern, recursive=True)})


def records(path: Path, text_field: str, start: int = 0) -> Iterator[str]:
    """The documents of one file or saved dataset from record `start` on, read a batch at a time."""
    if path.is_dir():
        yield from _arrow_records(path, text_field, start)
    elif path.suffix == ".txt":
        yield from _skip(_text_documents(path), start)
    elif path.suffix == ".jsonl":
        yield from _jsonl_records(path, text_field, start)
    elif path.suffix == ".parquet":
        yield from _parquet_records(path, text_field, start)
    else:
        raise ValueError(f"{path}: not one of {', '.join(SUFFIXES)} or a saved dataset folder")


def _jsonl_records(path: Path, text_field: str, start: int) -> Iterator[str]:
    with open(path, encoding="utf-8") as file:
        lines = (line for line in file if line.strip())
        for index, line in enumerate(lines):
            if index < start:  # passed over unparsed
                continue
            record = _json_record(path, index, line)
            if text_field not in record:
                raise ValueError(f"{path}: record {index} has no field {text_field!r} (data.text_field)")
            yield record[text_field]


def _json_record(path: Path, index: int, line: str) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: record {index} is not JSON ({err})") from None
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
    """A text file's documents: paragraphs separated by blank lines (as data=text reads its corpus)."""
    lines: list[str] = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            if line.strip():
                lines.append(line)
            elif lines:
                yield "".join(lines).rstrip("\n")
                lines = []
    if lines:
        yield "".join(lines).rstrip("\n")


def _skip(items: Iterator, count: int) -> Iterator:
    for index, item in enumerate(items):
        if index >= count:
            yield item


def first_record_fields(path: Path) -> list[str] | None:
    """The fields of a jsonl/parquet file's or saved dataset's records, read from the first record
    or the schema only; None where there is nothing to judge (text, no records)."""
    if path.is_dir():
        import pyarrow as pa

        arrows = sorted(path.glob("*.arrow"))
        if not arrows:
            return None
        with pa.memory_map(str(arrows[0])) as source:
            return list(pa.ipc.open_stream(source).schema.names)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.ParquetFile(path).schema_arrow.names)
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as file:
            first = next((line for line in file if line.strip()), None)
        return None if first is None else list(_json_record(path, 0, first))
    return None
