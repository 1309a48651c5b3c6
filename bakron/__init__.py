"""bakron: fast two-sided (Kronecker-factored) second-order rounding for quantization."""
from .factors import Factor, NotPositiveDefiniteError, block_ldl, prepare_factor
from .layer import LayerResult, proxy_error, quantize_layer
from .layer_groups import quantize_layers
from .quantizers import TileQuantizer, UniformQuantizer
from .solvers import SolveResult, solve
from .solvers.options import CudaOptions, NumbaOptions
from .solvers.stack import fit_quantizers, solve_stack

__version__ = "0.1.0"

__all__ = [
    "CudaOptions", "Factor", "LayerResult", "NotPositiveDefiniteError", "NumbaOptions",
    "SolveResult", "TileQuantizer", "UniformQuantizer", "block_ldl", "fit_quantizers",
    "prepare_factor", "proxy_error", "quantize_layer", "quantize_layers", "solve", "solve_stack", "__version__",
]
