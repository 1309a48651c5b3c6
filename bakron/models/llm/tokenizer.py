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

import numpy as np

from .config import UnsupportedModelError
from .schema import ModelFileError, shown

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

_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5   # GGUF token types


def _pre_tokenizer(pre: str):
    """The ``tokenizers`` pre-tokenizer of the GGUF pre-tokenizer name ``pre``."""
    from tokenizers import Regex, pre_tokenizers

    digits, pattern = PRE_TOKENIZERS[pre]
    steps = []
    if digits:
        steps.append(pre_tokenizers.Digits(individual_digits=True))
    if pattern is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps.append(pre_tokenizers.Split(Regex(pattern), behavior="isolated"))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


#: the name written for each way of splitting (the first name of PRE_TOKENIZERS llama.cpp
#: itself writes for it)
_PRE_NAMES = {(False, None): "gpt-2", (True, None): "smollm", (False, _LLAMA3): "llama-bpe",
              (False, _QWEN2): "qwen2"}


def _pre_signature(spec):
    """(digits split one by one, split pattern or None) of a tokenizer.json pre_tokenizer,
    or None when it is not one of the forms :func:`_pre_tokenizer` builds."""
    if not isinstance(spec, dict):
        return None
    steps = spec.get("pretokenizers") if spec.get("type") == "Sequence" else [spec]
    if not isinstance(steps, list):
        return None
    digits = False
    if steps and steps[0].get("type") == "Digits":
        if not steps[0].get("individual_digits"):
            return None
        digits, steps = True, steps[1:]
    if len(steps) == 1 and steps[0].get("type") == "ByteLevel":
        b = steps[0]
        if b.get("add_prefix_space") or not b.get("use_regex", True):
            return None
        return digits, None
    if len(steps) == 2 and steps[0].get("type") == "Split" and \
            steps[1].get("type") == "ByteLevel":
        split, b = steps
        pattern = (split.get("pattern") or {}).get("Regex")
        if (pattern is None or str(split.get("behavior", "")).lower() != "isolated"
                or split.get("invert") or b.get("add_prefix_space") or b.get("use_regex")):
            return None
        return digits, pattern
    return None


def _pre_name(spec) -> str | None:
    return _PRE_NAMES.get(_pre_signature(spec))


def _is_byte_level(spec) -> bool:
    dec = spec.get("decoder") or {}
    return dec.get("type") == "ByteLevel" or any(
        d.get("type") == "ByteLevel" for d in dec.get("decoders", []) or [])


class Tokenizer:
    """Encode texts to token ids (no special tokens added) and decode ids back to text."""

    def __init__(self, backend, *, bos_id=None, eos_id=None, source: str = ""):
        self.backend = backend
        self.bos_id, self.eos_id, self.source = bos_id, eos_id, source

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def max_id(self) -> int:
        """The largest token id of the vocabulary and the added tokens (-1 when empty)."""
        return max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)

    @staticmethod
    def _check_text(text: str, what: str) -> None:
        """``ValueError`` naming ``what`` and the position of a lone surrogate (a str that is
        not Unicode text: it cannot be encoded as UTF-8)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"{what} holds the lone surrogate {text[exc.start]!r} at position "
                             f"{exc.start}, which is not Unicode text (decode the bytes it "
                             f"came from with errors='replace' or 'surrogatepass')") from None

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a string, got {type(text).__name__}")
        self._check_text(text, "text")
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if isinstance(texts, str):
            raise TypeError("texts must be a sequence of strings, not a single string")
        texts = list(texts)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] must be a string, got {type(t).__name__}")
            self._check_text(t, f"texts[{i}]")
        return [list(e.ids) for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of token ids ``ids``; ``ValueError`` naming the first id that is not an
        integer in ``0 .. max_id()``."""
        if isinstance(ids, str):
            raise TypeError("ids must be token ids, not a string")
        ids = list(ids)
        top = self.max_id() if ids else -1
        out = []
        for i, t in enumerate(ids):
            if isinstance(t, (bool, np.bool_)) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"ids[{i}] is {type(t).__name__} {t!r}, not a token id "
                                 f"(an integer)")
            if not 0 <= t <= top:
                raise ValueError(f"ids[{i}] = {int(t)} is outside the vocabulary 0..{top}")
            out.append(int(t))
        return self.backend.decode(out, skip_special_tokens=skip_special_tokens)

    @classmethod
    def from_gguf_fields(cls, *, model: str, pre: str | None, tokens: Sequence[str],
                         merges: Sequence[str], token_types: Sequence[int] | None = None,
                         bos_id=None, eos_id=None, source: str = "") -> "Tokenizer":
        """The tokenizer that the GGUF metadata describes (``tokenizer.ggml.*``)."""
        from tokenizers import AddedToken, decoders, models
        from tokenizers import Tokenizer as _Backend

        if model != "gpt2":
            raise UnsupportedModelError(f"{source}: tokenizer model {model!r} is not supported "
                                        f"(only byte-level BPE, tokenizer.ggml.model = gpt2)")
        pre = pre or "default"
        if not isinstance(pre, str) or pre not in PRE_TOKENIZERS:
            raise UnsupportedModelError(
                f"{source}: pre-tokenizer {pre!r} is not supported (known: "
                f"{', '.join(sorted(PRE_TOKENIZERS))})")
        for key, values, kind in (("tokens", tokens, str), ("merges", merges, str),
                                  ("token_type", token_types or [], int)):
            bad = next((i for i, v in enumerate(values)
                        if not isinstance(v, kind) or isinstance(v, bool)), None)
            if bad is not None:
                raise ModelFileError(f"{source}: tokenizer.ggml.{key}[{bad}] is "
                                     f"{shown(values[bad])}, not a {kind.__name__}")
        if token_types is not None and len(token_types) != len(tokens):
            raise ModelFileError(f"{source}: tokenizer.ggml.token_type has {len(token_types)} "
                                 f"entries for {len(tokens)} tokens")
        vocab = {t: i for i, t in enumerate(tokens)}
        if len(vocab) != len(tokens):
            raise ModelFileError(f"{source}: tokenizer.ggml.tokens has duplicate entries")
        pairs = []
        for m in merges:
            a, sep, b = m.partition(" ")
            if not sep or not a or not b:
                raise ModelFileError(f"{source}: malformed merge {m!r} in "
                                     f"tokenizer.ggml.merges")
            pairs.append((a, b))
        try:
            backend = _Backend(models.BPE(vocab, pairs, fuse_unk=False, byte_fallback=False))
        except Exception as exc:   # the Rust error type is not exported
            raise ModelFileError(f"{source}: the tokenizer in the metadata is invalid "
                                 f"({exc})") from None
        backend.pre_tokenizer = _pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()
        if token_types is not None:
            special = [AddedToken(tokens[i], special=True, normalized=False)
                       for i, t in enumerate(token_types) if int(t) in (_CONTROL, _USER_DEFINED)]
            if special:
                backend.add_special_tokens(special)
        return cls(backend, bos_id=bos_id, eos_id=eos_id, source=source)

    def to_json(self) -> str:
        """The tokenizer as a Hugging Face ``tokenizer.json`` text."""
        return self.backend.to_str()

    def save(self, path) -> None:
        """Write :meth:`to_json` to ``path`` (a ``tokenizer.json``)."""
        pathlib.Path(path).write_text(self.to_json(), encoding="utf-8")

    def gguf_fields(self, vocab_size: int | None = None) -> dict:
        """The GGUF metadata of this tokenizer (``tokenizer.ggml.*`` without the prefix):
        ``model`` (``"gpt2"``), ``pre`` (the llama.cpp pre-tokenizer name whose splitting
        this tokenizer's pre-tokenizer does), ``tokens`` (by id; ids without a token up to
        ``vocab_size`` become ``[PAD{id}]``, as llama.cpp's converter writes them),
        ``token_type`` (1 normal, 3 control for special added tokens, 4 user-defined for the
        other added tokens, 5 unused for the padding), ``merges`` ("a b").

        Raises :class:`UnsupportedModelError` for a tokenizer that is not byte-level BPE or
        whose pre-tokenizer is none of :data:`PRE_TOKENIZERS`."""
        import json

        spec = json.loads(self.to_json())
        model = spec.get("model") or {}
        if model.get("type") != "BPE" or not _is_byte_level(spec):
            raise UnsupportedModelError(f"{self.source or 'tokenizer'}: only byte-level BPE "
                                        f"tokenizers can be written as GGUF (tokenizer.ggml."
                                        f"model gpt2)")
        pre = _pre_name(spec.get("pre_tokenizer"))
        if pre is None:
            raise UnsupportedModelError(
                f"{self.source or 'tokenizer'}: its pre-tokenizer splits text in none of the "
                f"ways llama.cpp names that bakron knows ({', '.join(sorted(PRE_TOKENIZERS))})")
        by_id = {int(i): t for t, i in model.get("vocab", {}).items()}
        kinds = {}
        for a in spec.get("added_tokens") or []:
            by_id[int(a["id"])] = a["content"]
            kinds[int(a["id"])] = _CONTROL if a.get("special") else _USER_DEFINED
        n = max(max(by_id, default=-1) + 1, vocab_size or 0)
        tokens, types = [], []
        for i in range(n):
            if i in by_id:
                tokens.append(by_id[i])
                types.append(kinds.get(i, _NORMAL))
            else:
                tokens.append(f"[PAD{i}]")
                types.append(_UNUSED)
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
        return {"model": "gpt2", "pre": pre, "tokens": tokens, "token_type": types,
                "merges": merges}

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
