"""How many characters a tokenizer's normalizer and pre-tokenizer can make of one, at most, read from
the tokenizers library's own serialization of the parts it loaded. A crafted Replace normalizer
that writes a thousand characters for each `a` multiplies what the library holds while it
tokenizes; this bound sizes the pieces a document is tokenized in, and refuses what is past any
published tokenizer's. Torch-free."""

import base64
import binascii
import json

# The most a tokenizer.json's normalizer and pre-tokenizer together may make of one character:
# published ones reach 216 (NFKC's 18, lowercasing's 3, a byte-level pre-tokenizer's 4).
MAX_GROWTH = 256
# Characters out per character in, by part (Unicode's largest expansions: NFC 3, NFD 4, NFKC and
# NFKD 18; a lowercased character is at most 3; a byte-level part writes a character per UTF-8 byte).
_NORMALIZERS = {"NFC": 3, "NFD": 4, "NFKC": 18, "NFKD": 18, "Lowercase": 3, "ByteLevel": 4}
_KEEPING_LENGTH = {"Strip", "StripAccents", "Nmt"}
# Pre-tokenizers that only split text.
_SPLITTING = {"BertPreTokenizer", "CharDelimiterSplit", "Digits", "FixedLength", "Punctuation", "Split",
              "UnicodeScripts", "Whitespace", "WhitespaceSplit"}  # fmt: skip


def growth(tokenizer) -> int:
    """The most characters `tokenizer` (a tokenizers.Tokenizer) makes of one before its model reads
    them; ValueError (one line, naming the part) past MAX_GROWTH or for a part it cannot bound."""
    parts = []
    if tokenizer.normalizer is not None:
        parts += _normalizer(json.loads(tokenizer.normalizer.__getstate__()), "normalizer")
    if tokenizer.pre_tokenizer is not None:
        parts += _pre_tokenizer(json.loads(tokenizer.pre_tokenizer.__getstate__()), "pre_tokenizer")
    total = 1
    for _, times in parts:
        total = min(total * times, MAX_GROWTH + 1)  # past the bound is enough to know
    if total > MAX_GROWTH:
        where, most = max(parts, key=lambda part: part[1])
        raise ValueError(
            f"its {where} makes up to {most:,} characters of one: with its other parts, more than the "
            f"{MAX_GROWTH} of any published tokenizer (and as much more memory to tokenize); use another tokenizer"
        )
    return total


def _normalizer(part: dict, where: str) -> list[tuple[str, int]]:
    kind = part.get("type")
    if kind == "Sequence":
        parts = enumerate(part["normalizers"])
        return [p for i, n in parts for p in _normalizer(n, f"{where}.normalizers[{i}]")]
    if kind in _KEEPING_LENGTH:
        return []
    label = f"{where} ({kind})"
    return [(label, _normalizer_growth(part, label))]


def _normalizer_growth(part: dict, where: str) -> int:
    kind = part["type"]
    if kind in _NORMALIZERS:
        return _NORMALIZERS[kind]
    if kind == "Replace":  # each match (or an empty one before each character) becomes `content`
        return 1 + len(part["content"])
    if kind == "Prepend":  # before each stretch of text, which may be one character
        return 1 + len(part["prepend"])
    if kind == "BertNormalizer":
        lowercase, strip = part["lowercase"], part["strip_accents"]
        chinese = 3 if part["handle_chinese_chars"] else 1  # a space either side
        return chinese * (4 if strip or (strip is None and lowercase) else 1) * (3 if lowercase else 1)
    if kind == "Precompiled":
        return _longest_rewrite(part["precompiled_charsmap"])
    raise ValueError(f"its {where} is a normalizer titan_exp cannot bound; use another tokenizer")


def _pre_tokenizer(part: dict, where: str) -> list[tuple[str, int]]:
    kind = part.get("type")
    if kind == "Sequence":
        parts = enumerate(part["pretokenizers"])
        return [p for i, n in parts for p in _pre_tokenizer(n, f"{where}.pretokenizers[{i}]")]
    if kind in _SPLITTING:
        return []
    if kind == "ByteLevel":  # a character per UTF-8 byte, and a space before each stretch if add_prefix_space
        return [(f"{where} ({kind})", 4 + bool(part.get("add_prefix_space")))]
    if kind == "Metaspace":  # its one-character replacement for a space, and one more before a word
        return [(f"{where} ({kind})", 2)]
    raise ValueError(f"its {where} ({kind}) is a pre-tokenizer titan_exp cannot bound; use another tokenizer")


def _longest_rewrite(charsmap: str | None) -> int:
    """The longest text a SentencePiece charsmap writes for what it matches (a u32 trie length in
    bytes, the trie, then the rewrites, each ended by a NUL)."""
    if not charsmap:
        return 1
    try:
        blob = base64.b64decode(charsmap)
    except binascii.Error:
        raise ValueError("its Precompiled normalizer's charsmap is not base64; use another tokenizer") from None
    rewrites = blob[4 + int.from_bytes(blob[:4], "little") :]
    return max(1, *(len(text.decode("utf-8", "replace")) for text in rewrites.split(b"\0")))
