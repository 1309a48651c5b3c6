"""bakron._lib.threads.blas_limit: the one threadpoolctl wrapper (demo, quantize_model, the
stacked solver)."""
import pytest

from bakron._lib.threads import blas_limit
from bakron.demo._common import blas_limit as demo_blas_limit

threadpoolctl = pytest.importorskip("threadpoolctl")


def _blas_threads():
    return {i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"}


def test_limits_inside_and_restores():
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        before = _blas_threads()
        if before != {2}:
            pytest.skip(f"BLAS does not run two threads here ({before})")
        with blas_limit(1) as applied:
            assert applied == 1 and _blas_threads() == {1}
        assert _blas_threads() == before
        with blas_limit(None) as applied:
            assert applied is None and _blas_threads() == before
        with demo_blas_limit(1) as described:
            assert described == "1 (threadpoolctl)" and _blas_threads() == {1}
        with demo_blas_limit(None) as described:
            assert described == "library default" and _blas_threads() == before


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_counts_are_refused(bad):
    with pytest.raises(ValueError, match="positive integer"):
        with blas_limit(bad):
            pass
    with pytest.raises(ValueError, match="blas_threads"):
        with demo_blas_limit(bad):
            pass
