"""A Hugging Face tokenizer (`tokenizer.json`, the format Llama 3's ships in, read by `tokenizers`)
and the tokens that open and close a document in it. Torch-free: the pre-flight reads it too."""

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from titan_exp.data.tokenizer_growth import growth
from titan_exp.untrusted import read_json, regular_file

# The largest tokenizer.json read: published ones are 2-35 MB, and the tokenizers library holds up
# to 20 times a file's size parsing it (a Unigram vocabulary); a larger file is refused unparsed.
MAX_TOKENIZER_BYTES = 64 << 20
# Characters the tokenizer makes of a piece: a long document goes through it in pieces cut before a
# space (where byte-level BPE's pre-tokenizer cuts too), each of PIECE_CHARS divided by the most its
# normalizer and pre-tokenizer make of one character, so what the tokenizer holds stays bounded.
PIECE_CHARS = 1 << 20
# Names documents are opened and closed with, by family, where no tokenizer_config.json says.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>")


@dataclass(frozen=True)
class DocumentTokenizer:
    """Encodes a document as BOS + its ids + EOS (BOS left out where the tokenizer has none)."""

    tokenizer: object  # tokenizers.Tokenizer
    bos: int | None
    eos: int
    growth: int  # the most characters its normalizer and pre-tokenizer make of one (tokenizer_growth.py)

    @property
    def vocab_size(self) -> int:
        """The rows an embedding needs for its ids: the largest id + 1 (added tokens included)."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        return [token for piece in self.pieces(text) for token in piece]

    def pieces(self, text: str) -> Iterator[list[int]]:
        """BOS + the document's ids + EOS, tokenized PIECE_CHARS // growth characters at a time."""
        start, length = 0, max(1, PIECE_CHARS // self.growth)
        opening = [self.bos] if self.bos is not None else []
        while True:
            end = _cut(text, start, start + length)
            ids = self.tokenizer.encode(text[start:end], add_special_tokens=False).ids
            if end == len(text):
                yield opening + ids + [self.eos]
                return
            yield opening + ids
            opening, start = [], end


def _cut(text: str, start: int, limit: int) -> int:
    """Where a piece from `start` ends: before the last space up to `limit` (at `limit` if none)."""
    if limit >= len(text):
        return len(text)
    space = text.rfind(" ", start + 1, limit)
    return space if space > start else limit


@functools.cache  # the pre-flight and both splits of a rank read the same file
def load_tokenizer(path: str) -> DocumentTokenizer:
    """The tokenizer in `path`; ValueError (one line) if it is none or has no end-of-document token."""
    from tokenizers import Tokenizer

    if (size := regular_file(Path(path))) > MAX_TOKENIZER_BYTES:
        raise ValueError(f"{size:,} bytes, more than the {MAX_TOKENIZER_BYTES:,} a tokenizer.json is read up to")
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        why = " ".join(str(err).split())
        raise ValueError(f"not a tokenizer.json that the tokenizers library reads ({why}); point it at one") from None
    bos_name, eos_name = named_tokens(Path(path), "bos_token", "eos_token")
    bos = _find(tokenizer, [bos_name] if bos_name else _BOS_NAMES)
    eos = _find(tokenizer, [eos_name] if eos_name else _EOS_NAMES)
    if eos is None and eos_name:
        raise ValueError(f"the tokenizer_config.json beside it names eos_token {eos_name}, which it does not hold")
    if eos is None:
        raise ValueError(
            f"no end-of-document token (none of {', '.join(_EOS_NAMES)}); put a tokenizer_config.json "
            "naming its eos_token beside it"
        )
    return DocumentTokenizer(tokenizer, bos, eos, growth(tokenizer))


def named_tokens(path: Path, *keys: str) -> tuple[str | None, ...]:
    """The text of each special token of `keys` (bos_token, eos_token, pad_token) in the
    tokenizer_config.json beside the tokenizer.json `path` (transformers writes one); None for one
    it does not name."""
    config = path.with_name("tokenizer_config.json")
    if not config.exists():
        return (None,) * len(keys)
    values = read_json(config)
    if not isinstance(values, dict):
        raise ValueError(f"{config} holds a {type(values).__name__}, not a table of settings")

    def name(key: str) -> str | None:
        token = values.get(key)
        text = token.get("content") if isinstance(token, dict) else token
        if text is not None and not isinstance(text, str):
            raise ValueError(f"{config} has {key}={str(token)[:40]}, not a token's text")
        return text

    return tuple(name(key) for key in keys)


def _find(tokenizer, names) -> int | None:
    return next((tokenizer.token_to_id(n) for n in names if tokenizer.token_to_id(n) is not None), None)
