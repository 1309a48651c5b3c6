"""Scale-out on Dask distributed (optional extra ``bakron[dask]``).

Importing this package does not import dask: only the functions that talk to a cluster do.
See docs/distributed.md.
"""
from ._jobs import (DEFAULT_SETTINGS, LayerJob, TensorRef, job_key, jobs_from_path,
                    tensor_checksum)
from ._outputs import LockHeld, OutputLock, read_journal, read_manifest, verify_layer_file
from ._run import (EXIT_FAILED, EXIT_INTERRUPTED, EXIT_LOCKED, EXIT_OK, EXIT_UNAVAILABLE,
                   EXIT_USAGE, EXIT_WRITE_FAILED, RunResult, run_layers)
from ._folder import quantize_folder
from .cluster import cpu_cluster, gpu_cluster, visible_gpus
from .hessian import ShardedResult, sharded_global_factors

__all__ = [
    "DEFAULT_SETTINGS", "LayerJob", "TensorRef", "job_key", "jobs_from_path", "tensor_checksum",
    "LockHeld", "OutputLock", "read_journal", "read_manifest", "verify_layer_file",
    "RunResult", "run_layers", "quantize_folder", "cpu_cluster", "gpu_cluster", "visible_gpus",
    "EXIT_OK", "EXIT_FAILED", "EXIT_USAGE", "EXIT_LOCKED", "EXIT_UNAVAILABLE", "EXIT_WRITE_FAILED",
    "EXIT_INTERRUPTED", "ShardedResult", "sharded_global_factors",
]
