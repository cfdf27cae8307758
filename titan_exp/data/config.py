"""The `data` config group."""

from dataclasses import dataclass, field
from typing import Optional

from titan_exp.rules import ConfigError, Section, one_of

# A byte-level BPE needs the 256 bytes and 2 special tokens.
MIN_BPE_VOCAB = 258


@dataclass
class DataConfig(Section):
    # text: a real corpus through a BPE tokenizer; synthetic: a seeded, learnable token stream;
    # files: your own documents (data.paths) through your tokenizer (data.tokenizer_path).
    source: str = one_of("text", "synthetic", "files")
    # A Hugging Face tokenizer.json (Llama 3's format), BOS and EOS taken from it (or from the
    # tokenizer_config.json beside it); text: instead of the BPE trained on the corpus.
    tokenizer_path: Optional[str] = None
    # files: globs of .txt (documents separated by blank lines), .jsonl, .parquet files and folders
    # written by datasets' save_to_disk, e.g. '[data/*.jsonl,data/extra.parquet]'.
    paths: list[str] = field(default_factory=list)
    # files: the field of a jsonl record, the column of a parquet file or saved dataset, that holds the text.
    text_field: str = "text"
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

    @property
    def vocab_key(self) -> str | None:
        """The key that sets how many token ids the data uses (None: data.tokenizer_path's file says)."""
        if self.tokenizer_path is not None or self.source == "files":
            return None
        return "tokenizer_vocab_size" if self.source == "text" else "synthetic_vocab_size"

    def check(self, key: str) -> None:
        super().check(key)
        if not self.cache_dir:
            raise ConfigError(f"{key}.cache_dir", "''", "must name a folder")
        if self.source == "files" and not (self.paths and self.tokenizer_path):
            missing = "paths" if not self.paths else "tokenizer_path"
            what = "globs of your documents" if missing == "paths" else "your tokenizer.json"
            raise ConfigError(f"{key}.{missing}", getattr(self, missing), f"data=files reads {what}; set it")
        if self.source == "synthetic" and self.tokenizer_path is not None:
            raise ConfigError(f"{key}.tokenizer_path", self.tokenizer_path, "synthetic data has no text to tokenize")
        if self.vocab_key is None:
            return
        vocab = getattr(self, self.vocab_key)
        if self.source == "text" and vocab < MIN_BPE_VOCAB:
            fix = f"a byte-level BPE needs at least {MIN_BPE_VOCAB} ids (256 bytes + 2 special tokens)"
            raise ConfigError(f"{key}.{self.vocab_key}", vocab, fix)
        if self.source == "synthetic" and not 0 < self.synthetic_branching <= self.synthetic_vocab_size:
            raise ConfigError(
                f"{key}.synthetic_branching", self.synthetic_branching, "must lie in [1, data.synthetic_vocab_size]"
            )
