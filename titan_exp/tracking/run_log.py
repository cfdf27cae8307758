"""Rank 0's console output, also kept in a file that becomes the run's `logs/` artifact.

Everything Python writes to stdout/stderr (the step lines, warnings, tracebacks) is copied; output
written straight to the file descriptors by C++ code stays in the launcher's own log only.
"""

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO


class _Tee:
    def __init__(self, stream: TextIO, copy: TextIO):
        self._stream, self._copy = stream, copy

    def write(self, text: str) -> int:
        self._copy.write(text)
        return self._stream.write(text)

    def flush(self) -> None:
        self._copy.flush()
        self._stream.flush()

    def __getattr__(self, name: str):
        return getattr(self._stream, name)  # isatty, fileno, encoding, ...


@contextlib.contextmanager
def run_log(path: Path) -> Iterator[TextIO]:
    """Copy stdout and stderr into `path` while inside; yields the file (for what only it should get)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", buffering=1) as copy:
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = _Tee(stdout, copy), _Tee(stderr, copy)
        try:
            yield copy
        finally:
            sys.stdout, sys.stderr = stdout, stderr
