"""Pretrained models in numpy/cupy (MiniLM-L6) used by the demo."""
