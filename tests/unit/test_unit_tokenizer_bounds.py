"""Issue 68: a tokenizer.json from someone else is tried in a child process held to a memory and a
time bound; what its normalizer and pre-tokenizer can make of one character is bounded, and a
document is tokenized in pieces that shrink with it. (tests/crafted.py's tokenizer cases go through
the whole pre-flight: tests/unit/test_unit_crafted_inputs.py.)"""

import struct
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from titan_exp.data import tokenizer as tokenizer_module
from titan_exp.data import tokenizer_trial
from titan_exp.data.text import train_tokenizer
from titan_exp.data.tokenizer import load_tokenizer
from titan_exp.data.tokenizer_growth import MAX_GROWTH, growth
from titan_exp.data.tokenizer_trial import try_tokenizer

EOS = "<|end_of_text|>"


def _bpe(normalizer=None) -> Tokenizer:
    """A small byte-level BPE with <|end_of_text|>, and `normalizer`."""
    tokenizer = train_tokenizer(["a few words to learn from", "and some more words"], 300)
    tokenizer.normalizer = normalizer
    return tokenizer


def _saved(tokenizer: Tokenizer, folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    return str(folder / "tokenizer.json")


def _charsmap(rewrite: str) -> "normalizers.Precompiled":
    """A SentencePiece charsmap (an empty trie) whose one rewrite is `rewrite`."""
    return normalizers.Precompiled(struct.pack("<I", 0) + rewrite.encode() + b"\0")


def test_a_tokenizer_is_tried_within_the_trials_time(monkeypatch, tmp_path):
    monkeypatch.setattr(tokenizer_trial, "TRIAL_SECONDS", 0.01)
    with pytest.raises(ValueError, match=r"^the tokenizers library took more than 0.01 s to load it"):
        try_tokenizer(_saved(_bpe(), tmp_path))


def test_a_tokenizer_the_library_needs_more_memory_for_is_refused_in_one_line(monkeypatch, tmp_path):
    """A Unigram vocabulary of 500,000 pieces (25 MB) takes the library about 300 MB: past a 200 MiB
    trial, refused in one line, while the small BPE passes under the same bound."""
    monkeypatch.setattr(tokenizer_trial, "TRIAL_ADDRESS_SPACE", 200 << 20)
    try_tokenizer(_saved(_bpe(), tmp_path / "small"))
    pieces = [(f"piece{i:07d}", -1.0) for i in range(500_000)] + [(EOS, 0.0)]
    big = _saved(Tokenizer(models.Unigram(pieces, 0, False)), tmp_path / "big")
    with pytest.raises(ValueError) as refused:
        try_tokenizer(big)
    assert str(refused.value) == "the tokenizers library needs more than 200 MiB to hold it; use another tokenizer"


@pytest.mark.parametrize(
    ("normalizer", "pre_tokenizer", "most"),
    [
        (None, pre_tokenizers.ByteLevel(add_prefix_space=False), 4),  # Llama 3, GPT-2
        (normalizers.NFC(), pre_tokenizers.ByteLevel(add_prefix_space=False), 12),  # Qwen 2
        (normalizers.BertNormalizer(), pre_tokenizers.BertPreTokenizer(), 36),  # BERT
        (normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]), None, 4),  # Llama 2
        (_charsmap("x" * 18), pre_tokenizers.Metaspace(), 36),  # T5: NFKC's longest rewrite, 18
        (
            normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
            216,
        ),
    ],
)
def test_what_published_tokenizers_make_of_a_character_is_within_the_bound(normalizer, pre_tokenizer, most):
    tokenizer = _bpe(normalizer)
    tokenizer.pre_tokenizer = pre_tokenizer
    assert growth(tokenizer) == most <= MAX_GROWTH


@pytest.mark.parametrize(
    ("normalizer", "pre_tokenizer", "says"),
    [
        (
            None,
            pre_tokenizers.Sequence([pre_tokenizers.ByteLevel()] * 4),  # a space before, a character per byte: 5⁴
            "its pre_tokenizer.pretokenizers[0] (ByteLevel) makes up to 5 characters of one",
        ),
        (_charsmap("x" * 1000), None, "its normalizer (Precompiled) makes up to 1,000 characters of one"),
        (
            normalizers.Sequence([normalizers.NFKC(), normalizers.Replace("a", "b" * 20)]),
            None,
            "its normalizer.normalizers[1] (Replace) makes up to 21 characters of one: with its other parts, more",
        ),
    ],
)
def test_a_tokenizer_that_makes_more_of_a_character_is_refused_naming_the_part(normalizer, pre_tokenizer, says):
    tokenizer = _bpe(normalizer)
    tokenizer.pre_tokenizer = pre_tokenizer
    with pytest.raises(ValueError) as refused:
        growth(tokenizer)
    assert str(refused.value).startswith(says)


def test_pieces_shrink_with_what_the_normalizer_makes_so_each_holds_a_bounded_number_of_ids(monkeypatch, tmp_path):
    """A normalizer writing 50 characters for each `a` (with the byte-level pre-tokenizer, up to 204
    a character): each piece of a long document of `a`s makes at most PIECE_CHARS ids, and the
    pieces together are the document's ids between BOS and EOS."""
    path = _saved(_bpe(normalizers.Replace("a", "a" * 50)), tmp_path)
    monkeypatch.setattr(tokenizer_module, "PIECE_CHARS", 10_000)
    found = load_tokenizer(path)
    text = "a " * 50_000
    pieces = list(found.pieces(text))
    assert found.growth == 204
    assert max(len(ids) for ids in pieces) <= 10_000
    whole = found.tokenizer.encode(text, add_special_tokens=False).ids
    assert [i for ids in pieces for i in ids] == [found.bos, *whole, found.eos]
