"""Error classes shared by the readers, the command line and the Dask runner."""
from __future__ import annotations

__all__ = ["InputError", "OutputExistsError"]


class InputError(ValueError):
    """An input file, folder or tensor is missing, unreadable, changed or holds invalid data.

    The message names the file (and the tensor) and the problem. The command line answers it
    with exit code 2; the Dask runner records the layer as failed and never retries it.
    """


class OutputExistsError(FileExistsError):
    """The output path exists and overwriting was not allowed (or it is not bakron's)."""
