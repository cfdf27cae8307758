"""A Hugging Face tokenizer (`tokenizer.json`, the format Llama 3's ships in, read by `tokenizers`)
and the tokens that open and close a document in it. Torch-free: the pre-flight reads it too."""

import functools
import json
from dataclasses import dataclass
from pathlib import Path

# Names documents are opened and closed with, by family, where no tokenizer_config.json says.
_BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>")
_EOS_NAMES = ("<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "<|im_end|>")


@dataclass(frozen=True)
class DocumentTokenizer:
    """Encodes a document as BOS + its ids + EOS (BOS left out where the tokenizer has none)."""

    tokenizer: object  # tokenizers.Tokenizer
    bos: int | None
    eos: int

    @property
    def vocab_size(self) -> int:
        """The rows an embedding needs for its ids: the largest id + 1 (added tokens included)."""
        return max(self.tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return ([self.bos] if self.bos is not None else []) + ids + [self.eos]


@functools.cache  # the pre-flight and both splits of a rank read the same file
def load_tokenizer(path: str) -> DocumentTokenizer:
    """The tokenizer in `path`; ValueError (one line) if it is none or has no end-of-document token."""
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as err:  # tokenizers raises a bare Exception for a file it cannot parse
        why = " ".join(str(err).split())
        raise ValueError(f"not a tokenizer.json that the tokenizers library reads ({why}); point it at one") from None
    bos_name, eos_name = _named_specials(Path(path))
    bos = _find(tokenizer, [bos_name] if bos_name else _BOS_NAMES)
    eos = _find(tokenizer, [eos_name] if eos_name else _EOS_NAMES)
    if eos is None and eos_name:
        raise ValueError(f"the tokenizer_config.json beside it names eos_token {eos_name}, which it does not hold")
    if eos is None:
        raise ValueError(
            f"no end-of-document token (none of {', '.join(_EOS_NAMES)}); put a tokenizer_config.json "
            "naming its eos_token beside it"
        )
    return DocumentTokenizer(tokenizer, bos, eos)


def _named_specials(path: Path) -> tuple[str | None, str | None]:
    """bos_token and eos_token of the tokenizer_config.json beside `path` (transformers writes one)."""
    config = path.with_name("tokenizer_config.json")
    if not config.is_file():
        return None, None
    values = json.loads(config.read_text())

    def name(key: str) -> str | None:
        token = values.get(key)
        return token.get("content") if isinstance(token, dict) else token

    return name("bos_token"), name("eos_token")


def _find(tokenizer, names) -> int | None:
    return next((tokenizer.token_to_id(n) for n in names if tokenizer.token_to_id(n) is not None), None)
