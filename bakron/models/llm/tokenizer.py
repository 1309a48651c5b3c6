"""Byte-level BPE tokenizers (GPT-2 style) for the causal LMs, built with ``tokenizers``.

From a GGUF file the vocabulary and merges are in the metadata (``tokenizer.ggml.tokens``,
``tokenizer.ggml.merges``) and the pre-tokenizer is named by ``tokenizer.ggml.pre``; from a
Hugging Face folder ``tokenizer.json`` is used as it is. Texts are encoded without special
tokens (no BOS): the model sees exactly the text's tokens. Control tokens written in a text
(``<|im_start|>`` ...) are still recognised as single tokens.
"""
from __future__ import annotations

import pathlib
from typing import Sequence

from .config import UnsupportedModelError

__all__ = ["Tokenizer", "PRE_TOKENIZERS"]

# Split patterns of the GGUF pre-tokenizer names (llama.cpp's names; the patterns are the
# published ones of each tokenizer family). None: GPT-2's own pattern (ByteLevel's regex).
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
           r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
          r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

#: ``tokenizer.ggml.pre`` -> (split digits one by one first, split pattern or None for GPT-2's)
PRE_TOKENIZERS = {
    "default": (False, None), "gpt-2": (False, None), "gpt2": (False, None),
    "smollm": (True, None), "starcoder": (True, None), "refact": (True, None),
    "llama-bpe": (False, _LLAMA3), "llama3": (False, _LLAMA3),
    "qwen2": (False, _QWEN2),
}

_CONTROL, _USER_DEFINED = 3, 4   # GGUF token types


class Tokenizer:
    """Encode texts to token ids (no special tokens added) and decode ids back to text."""

    def __init__(self, backend, *, bos_id=None, eos_id=None, source: str = ""):
        self.backend = backend
        self.bos_id, self.eos_id, self.source = bos_id, eos_id, source

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, not a single string")
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be a string, got {type(t).__name__}")
        return [list(e.ids) for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.backend.decode([int(i) for i in ids],
                                   skip_special_tokens=skip_special_tokens)

    @classmethod
    def from_gguf_fields(cls, *, model: str, pre: str | None, tokens: Sequence[str],
                         merges: Sequence[str], token_types: Sequence[int] | None = None,
                         bos_id=None, eos_id=None, source: str = "") -> "Tokenizer":
        """The tokenizer that the GGUF metadata describes (``tokenizer.ggml.*``)."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as _Backend

        if model != "gpt2":
            raise UnsupportedModelError(f"{source}: tokenizer model {model!r} is not supported "
                                        f"(only byte-level BPE, tokenizer.ggml.model = gpt2)")
        pre = pre or "default"
        if pre not in PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"{source}: pre-tokenizer {pre!r} is not supported (known: "
                f"{', '.join(sorted(PRE_TOKENIZERS))})")
        digits, pattern = PRE_TOKENIZERS[pre]
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ValueError(f"{source}: tokenizer.ggml.tokens has duplicate entries")
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep or not a or not b:
                raise ValueError(f"{source}: malformed merge {m!r} in tokenizer.ggml.merges")
            pairs.append((a, b))
        backend = _Backend(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        steps = []
        if digits:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        if pattern is None:
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        else:
            steps.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
            steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()
        if token_types is not None:
            special = [AddedToken(tokens[i], special=True, normalized=False)
                       for i, t in enumerate(token_types) if int(t) in (_CONTROL, _USER_DEFINED)]
            if special:
                backend.add_special_tokens(special)
        return cls(backend, bos_id=bos_id, eos_id=eos_id, source=source)

    @classmethod
    def from_file(cls, path, *, bos_id=None, eos_id=None) -> "Tokenizer":
        """A Hugging Face ``tokenizer.json``."""
        from tokenizers import Tokenizer as _Backend

        path = pathlib.Path(path)
        try:
            backend = _Backend.from_file(str(path))
        except Exception as exc:   # the Rust error type is not exported
            raise ValueError(f"{path}: cannot read the tokenizer ({exc})") from None
        return cls(backend, bos_id=bos_id, eos_id=eos_id, source=str(path))
