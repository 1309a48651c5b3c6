"""An uncased BERT WordPiece tokenizer in plain Python (no ``tokenizers``, no ``transformers``).

It follows the rules of the original BERT tokenizer as packaged with all-MiniLM-L6-v2
(``BertNormalizer(clean_text, handle_chinese_chars, lowercase)`` + ``BertPreTokenizer`` +
``WordPiece(##, [UNK], max 100 chars)`` + ``[CLS] … [SEP]``):

1. *clean*: drop NUL, U+FFFD and "other" characters (Unicode category C*, except tab, newline
   and carriage return, which count as whitespace); map every whitespace character to a space;
2. put spaces around CJK ideographs (the CJK Unified Ideographs blocks and their extensions and
   compatibility blocks — Hangul, Hiragana and Katakana are not included, as in BERT);
3. strip accents: NFD, then drop non-spacing marks (category Mn);
4. lower-case character by character (as the Rust ``tokenizers`` normaliser does);
5. split on whitespace, then isolate every punctuation character (ASCII punctuation or Unicode
   category P*);
6. WordPiece: greedy longest-match-first with the ``##`` continuation prefix; a word longer than
   100 characters, or one that cannot be covered by vocabulary pieces, becomes ``[UNK]``;
7. wrap in ``[CLS]`` … ``[SEP]`` and truncate so that the total length is at most ``max_length``.

``tests/test_minilm_tokenizer.py`` checks the ids against the ``tokenizers`` package on the 256
reference sentences and on edge cases.
"""
from __future__ import annotations

import unicodedata
from functools import lru_cache
from typing import Iterable, Sequence

import numpy as np

__all__ = ["WordPieceTokenizer", "basic_tokenize"]

_CJK_RANGES = (
    (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
    (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F),
)
_ASCII_PUNCT = frozenset("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")


def _is_cjk(cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in _CJK_RANGES)


def _is_whitespace(ch: str) -> bool:
    return ch in " \t\n\r" or ch.isspace() or unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    if ch in "\t\n\r":
        return False
    return unicodedata.category(ch).startswith("C")


def _is_punctuation(ch: str) -> bool:
    return ch in _ASCII_PUNCT or unicodedata.category(ch).startswith("P")


def _normalize(text: str) -> str:
    out = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            continue
        if _is_whitespace(ch):
            out.append(" ")
        elif _is_cjk(cp):
            out.append(f" {ch} ")
        else:
            out.append(ch)
    text = unicodedata.normalize("NFD", "".join(out))
    return "".join(c.lower() for c in text if unicodedata.category(c) != "Mn")


def basic_tokenize(text: str) -> list[str]:
    """Normalise ``text`` and split it into words and single punctuation characters."""
    if not isinstance(text, str):
        raise TypeError(f"text must be a str, got {type(text).__name__}")
    words = []
    for chunk in _normalize(text).split():
        start = 0
        for i, ch in enumerate(chunk):
            if _is_punctuation(ch):
                if i > start:
                    words.append(chunk[start:i])
                words.append(ch)
                start = i + 1
        if start < len(chunk):
            words.append(chunk[start:])
    return words


class WordPieceTokenizer:
    """Uncased BERT tokenizer over a ``vocab.txt`` vocabulary (one token a line, id = line).

    Parameters
    ----------
    vocab : sequence of str
        The tokens, in id order.
    max_length : int
        Maximum number of ids per text, ``[CLS]`` and ``[SEP]`` included (truncation drops the
        tail of the word pieces).
    max_chars_per_word : int
        Words longer than this become ``[UNK]``.
    """

    def __init__(self, vocab: Sequence[str], *, max_length: int = 256,
                 max_chars_per_word: int = 100, unk_token: str = "[UNK]",
                 cls_token: str = "[CLS]", sep_token: str = "[SEP]", pad_token: str = "[PAD]",
                 prefix: str = "##"):
        self.vocab = {tok: i for i, tok in enumerate(vocab)}
        if len(self.vocab) != len(vocab):
            raise ValueError("the vocabulary has duplicate tokens")
        for tok in (unk_token, cls_token, sep_token, pad_token):
            if tok not in self.vocab:
                raise ValueError(f"the vocabulary has no {tok!r} token")
        if max_length < 2:
            raise ValueError(f"max_length must be at least 2 ([CLS] and [SEP]), got {max_length}")
        self.max_length = int(max_length)
        self.max_chars_per_word = int(max_chars_per_word)
        self.prefix = prefix
        self.unk_id = self.vocab[unk_token]
        self.cls_id = self.vocab[cls_token]
        self.sep_id = self.vocab[sep_token]
        self.pad_id = self.vocab[pad_token]
        self._word_ids = lru_cache(maxsize=1 << 16)(self._word_ids_uncached)

    @classmethod
    def from_vocab_text(cls, text: str, **kwargs) -> "WordPieceTokenizer":
        """Build from the contents of a ``vocab.txt`` file."""
        lines = text.split("\n")
        if lines and lines[-1] == "":
            lines = lines[:-1]
        return cls([ln.rstrip("\r") for ln in lines], **kwargs)

    def _word_ids_uncached(self, word: str) -> tuple[int, ...]:
        if len(word) > self.max_chars_per_word:
            return (self.unk_id,)
        ids, start, n = [], 0, len(word)
        while start < n:
            end, hit = n, None
            while end > start:
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                hit = self.vocab.get(piece)
                if hit is not None:
                    break
                end -= 1
            if hit is None:
                return (self.unk_id,)
            ids.append(hit)
            start = end
        return tuple(ids)

    def tokenize_ids(self, text: str) -> list[int]:
        """Word-piece ids of ``text`` without special tokens or truncation."""
        out: list[int] = []
        for w in basic_tokenize(text):
            out.extend(self._word_ids(w))
        return out

    def encode(self, text: str) -> list[int]:
        """``[CLS] pieces [SEP]``, truncated to ``max_length`` ids in all."""
        ids = self.tokenize_ids(text)[: self.max_length - 2]
        return [self.cls_id, *ids, self.sep_id]

    def encode_batch(self, texts: Iterable[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def pad(self, encoded: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
        """Right-pad to the longest sequence of ``encoded``: ``(ids, mask)`` int64 / bool."""
        if len(encoded) == 0:
            raise ValueError("nothing to pad: the batch is empty")
        T = max(len(e) for e in encoded)
        ids = np.full((len(encoded), T), self.pad_id, dtype=np.int64)
        mask = np.zeros((len(encoded), T), dtype=bool)
        for i, e in enumerate(encoded):
            ids[i, : len(e)] = e
            mask[i, : len(e)] = True
        return ids, mask
