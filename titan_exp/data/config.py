"""The `data` config group."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class DataConfig:
    # text: a real corpus through a BPE tokenizer; synthetic: a seeded, learnable token stream.
    source: str = "text"
    # A UTF-8 text file, documents separated by blank lines. None: the Python documentation that ships
    # with every CPython (pydoc_data), so nothing is downloaded.
    corpus_path: Optional[str] = None
    # Byte-level BPE trained on the corpus, once, and cached; must not exceed model.vocab_size.
    tokenizer_vocab_size: int = 2048
    # Where the tokenizer and token ids are cached (relative paths are taken from the launch directory).
    cache_dir: str = "outputs/cache"
    # synthetic: tokens drawn from a fixed random Markov chain in which every token has
    # `synthetic_branching` possible successors, so the best reachable loss is ln(branching).
    synthetic_vocab_size: int = 1024
    synthetic_branching: int = 4
