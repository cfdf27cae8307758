"""A real offline corpus through a real (byte-level BPE) tokenizer, prepared once and cached."""

import hashlib
import os
import tempfile
from pathlib import Path

import numpy as np

from titan_exp.data.config import DataConfig
from titan_exp.data.tokenizer import load_tokenizer

EOS = "<|end_of_text|>"
BOS = "<|begin_of_text|>"
# Bump when the preparation below changes, so stale caches are not reused (2: a given tokenizer's
# pieces shrink with what its normalizer and pre-tokenizer make of a character).
PREPARE_VERSION = "2"


def load_documents(corpus_path: str | None) -> list[str]:
    if corpus_path is None:
        try:
            from pydoc_data.topics import topics
        except ImportError as err:
            raise RuntimeError(
                "data.corpus_path is not set and this Python has no pydoc_data; "
                "point data.corpus_path at a UTF-8 text file"
            ) from err
        return [topics[key] for key in sorted(topics)]
    text = Path(corpus_path).read_text(encoding="utf-8")
    return [doc for doc in text.split("\n\n") if doc.strip()]


def train_tokenizer(documents: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[BOS, EOS],
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer)
    return tokenizer


def prepare_tokens(cfg: DataConfig) -> Path:
    """Tokenize the corpus into a cached .npy of int32 ids (documents joined by EOS; through
    data.tokenizer_path's tokenizer, BOS + ids + EOS each) and return its path.

    Safe to call from several processes: each writes to a temporary file and renames it into place.
    """
    documents = load_documents(cfg.corpus_path)
    digest = hashlib.sha256(PREPARE_VERSION.encode())
    if cfg.tokenizer_path is not None:
        digest.update(Path(cfg.tokenizer_path).read_bytes())
    else:
        digest.update(str(cfg.tokenizer_vocab_size).encode())
    for doc in documents:
        digest.update(doc.encode())
    cache = Path(cfg.cache_dir) / f"text-{digest.hexdigest()[:16]}"
    tokens_path = cache / "tokens.npy"
    if tokens_path.exists():
        return tokens_path
    cache.mkdir(parents=True, exist_ok=True)
    ids: list[int] = []
    if cfg.tokenizer_path is not None:
        given = load_tokenizer(cfg.tokenizer_path)
        for doc in documents:
            ids.extend(given.encode(doc))
    else:
        tokenizer = train_tokenizer(documents, cfg.tokenizer_vocab_size)
        eos = tokenizer.token_to_id(EOS)
        for encoding in tokenizer.encode_batch(documents):
            ids.extend(encoding.ids)
            ids.append(eos)
        _atomic_write(cache / "tokenizer.json", lambda f: f.write(tokenizer.to_str().encode()))
    _atomic_write(tokens_path, lambda f: np.save(f, np.asarray(ids, dtype=np.int32)))
    return tokens_path


def tokenizer_file(cfg: DataConfig) -> str | None:
    """The tokenizer.json whose ids a run of `cfg` trains on: data.tokenizer_path, or data=text's
    trained BPE (cached beside its ids); None for synthetic tokens."""
    if cfg.tokenizer_path is not None:
        return cfg.tokenizer_path
    if cfg.source == "text":
        return str(prepare_tokens(cfg).with_name("tokenizer.json"))
    return None


def document_end(cfg: DataConfig) -> int:
    """The id that ends each document in prepare_tokens' ids: the given tokenizer's EOS, or the
    trained one's (its cache beside the ids)."""
    if cfg.tokenizer_path is not None:
        return load_tokenizer(cfg.tokenizer_path).eos
    from tokenizers import Tokenizer

    return Tokenizer.from_file(tokenizer_file(cfg)).token_to_id(EOS)


def _atomic_write(path: Path, write) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "wb") as f:
        write(f)
    os.replace(tmp, path)
