"""A tokenizer.json from someone else, tried before any rank starts in a child process held to
TRIAL_ADDRESS_SPACE and TRIAL_SECONDS: the tokenizers library parses a file whole (up to
MAX_TOKENIZER_BYTES, into many times that), and some crafted normalizers and regexes make it panic
or abort, none of which the launching process may suffer. The child loads it as the ranks do
(tokenizer.py), checks the ids its added tokens claim, and tokenizes a sample text; what it refuses,
or how it ended, comes back as one line. Torch-free.

    python -m titan_exp.data.tokenizer_trial TOKENIZER_JSON ADDRESS_SPACE_BYTES   # the child
"""

import os
import resource
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from titan_exp.data.tokenizer import MAX_TOKENIZER_BYTES, load_tokenizer
from titan_exp.untrusted import read_json

# What the child may map: a BPE of the largest published vocabulary (Gemma 3's, 262k tokens) takes
# 0.3 GiB parsed, and the launching process, which loads it again once tried, stays within the 2 GiB
# a refusal may take.
TRIAL_ADDRESS_SPACE = 1 << 30
# Such a BPE loads in about a second; a busy machine gets twenty.
TRIAL_SECONDS = 20
# The most ids a tokenizer may make of each UTF-8 byte of SAMPLE: a byte-level or byte-fallback
# model makes at most one, and a word's leading marker one more.
MAX_IDS_PER_BYTE = 2
# Text of the kinds a corpus holds: words, digits, code, runs of white space, accents, other scripts.
SAMPLE = (
    "The quick brown fox jumps over the lazy dog. 0123456789 +-*/=%$#@!?&|^~ (a[b]{c}) <tag> \"q\" 'q'\n"
    "def f(x):\n\treturn x ** 2  # comment\n\n   spaced   out   \r\n"
    "Ça coûte 5 € — naïve façade, Straße, İstanbul, ǅemal. Ελληνικά κείμενα. Русский текст. "
    "中文文本测试。日本語のテキスト。한국어 텍스트. النص العربي. हिन्दी पाठ. ไทย. 😀👍🏽🇫🇷 e\u0301\u200b\ufeff"
)
_REFUSED = 2


def try_tokenizer(path: str) -> None:
    """ValueError (one line) unless a child process loads, checks and uses `path` within the bounds."""
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "MALLOC_ARENA_MAX": "2"}  # no thread pools
    command = [sys.executable, "-m", __name__, path, str(TRIAL_ADDRESS_SPACE)]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            status = subprocess.run(command, stdout=out, stderr=err, env=env, timeout=TRIAL_SECONDS).returncode
        except subprocess.TimeoutExpired:
            raise ValueError(
                f"the tokenizers library took more than {TRIAL_SECONDS} s to load it and tokenize a sample; "
                "use another tokenizer"
            ) from None
        said, crash = _head(out), _head(err)
    if status == 0:
        return
    if status == _REFUSED and said:
        raise ValueError(said)
    if "memory allocation of" in crash:  # Rust's own words when an allocation fails (then it aborts)
        raise ValueError(_needs_more_memory(TRIAL_ADDRESS_SPACE))
    how = f"killed by {signal.Signals(-status).name}" if status < 0 else f"exit {status}"
    last = crash.splitlines()[-1][:200] if crash.strip() else "nothing said"
    raise ValueError(f"the tokenizers library failed on it ({how}: {last}); use another tokenizer")


def _head(file) -> str:
    file.seek(0)
    return file.read(4096).decode("utf-8", "replace").strip()


def _needs_more_memory(address_space: int) -> str:
    return f"the tokenizers library needs more than {address_space >> 20} MiB to hold it; use another tokenizer"


def _trial(path: str) -> None:
    """What the child checks: the load, the added tokens' ids, a sample tokenized (ValueError, one line)."""
    found = load_tokenizer(path).tokenizer
    _claimed_ids(path, found)
    try:
        ids = found.encode(SAMPLE, add_special_tokens=False).ids
    except BaseException as err:  # a Rust panic arrives as pyo3's PanicException, a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit, MemoryError)):
            raise
        why = _one_line(err)[:200]
        raise ValueError(f"the tokenizers library fails on a sample text ({why}); use another tokenizer") from None
    size = len(SAMPLE.encode())
    if len(ids) > MAX_IDS_PER_BYTE * size:
        raise ValueError(
            f"it makes {len(ids):,} ids of a sample text of {size} bytes, more than {MAX_IDS_PER_BYTE} a byte: "
            "it multiplies text (its normalizer or pre-tokenizer); use another tokenizer"
        )


def _claimed_ids(path: str, found) -> None:
    """Each added token's id in the file is the one the library gives it: it renumbers, without a
    word, one past its vocabulary (an eos id of 2^32-1) or one the vocabulary already holds."""
    added = read_json(Path(path), MAX_TOKENIZER_BYTES).get("added_tokens") or []
    for i, token in enumerate(added):
        given = found.token_to_id(token["content"])
        if token["id"] != given:
            raise ValueError(
                f"its added_tokens[{i}].id={token['id']} for {token['content'][:40]!r}, which the tokenizers "
                f"library numbers {given}; give it its id"
            )


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def main(path: str, address_space: int) -> int:
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    try:
        _trial(path)
    except ValueError as err:
        print(_one_line(err), flush=True)
        return _REFUSED
    except MemoryError:
        print(_needs_more_memory(address_space), flush=True)
        return _REFUSED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
