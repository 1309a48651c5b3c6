"""Exports that real consumers load: GGUF block formats (llama.cpp) and GPTQ-packed safetensors.

:mod:`bakron.export.grids` holds the tile quantizers that round onto exactly the formats'
grids; the writers turn a quantized layer's ``W_hat`` into the format's bytes without loss.
:func:`gguf_to_hf` and :func:`gguf_source_from_hf` convert a source between the two kinds
(GGUF file, Hugging Face folder), so that any source can be written in any format.
"""
from ._hf import hf_linear_name
from .float_export import write_dequantized
from .from_gguf import gguf_to_hf
from .gguf_writer import GGUFSource, qk_permutation, write_gguf
from .gptq import GPTQGrid, as_gptq_grid, read_gptq, write_gptq
from .to_gguf import gguf_source_from_hf
from .grids import (BLOCK, GGUF_FORMATS, BlockGrid, Q4_0Grid, Q4_1Grid, Q8_0Grid,
                    as_block_grid, fit_block_grid, grid_for_format)

__all__ = [
    "BLOCK", "GGUF_FORMATS", "BlockGrid", "Q4_0Grid", "Q4_1Grid", "Q8_0Grid", "as_block_grid",
    "fit_block_grid", "grid_for_format", "GGUFSource", "qk_permutation", "write_gguf",
    "GPTQGrid", "as_gptq_grid", "write_gptq", "read_gptq", "write_dequantized", "hf_linear_name",
    "gguf_to_hf", "gguf_source_from_hf",
]
