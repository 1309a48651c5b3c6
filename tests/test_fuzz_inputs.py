"""Fuzzing the file readers: arbitrary bytes give a named InputError, never a traceback.

Both readers are tried: :func:`bakron.io.read_tensors` (``bakron quantize``) and the Dask path's
:func:`bakron.distributed.jobs_from_path` + ``load_tensor``. The figures are in
docs/reliability.md.
"""
import io as _io
import json
import os
import struct
import tempfile

import numpy as np
from hypothesis import HealthCheck, given, settings, strategies as st

from bakron import io
from bakron.distributed._jobs import jobs_from_path, load_tensor

# 150 examples per strategy in CI (a few seconds); BAKRON_FUZZ_EXAMPLES=N for a longer run
FUZZ = settings(max_examples=int(os.environ.get("BAKRON_FUZZ_EXAMPLES", "150")), deadline=None,
                derandomize=True, suppress_health_check=[HealthCheck.too_slow])

# what the Dask path may raise for bad inputs (it turns them into exit code 2 / failed layers)
DASK_INPUT_ERRORS = (ValueError, KeyError, FileNotFoundError)


def _valid_npz() -> bytes:
    buf = _io.BytesIO()
    np.savez(buf, W=np.arange(12, dtype=np.float32).reshape(3, 4), H_in=np.eye(4))
    return buf.getvalue()


VALID_NPZ = _valid_npz()


def _try_both(data: bytes, suffix: str):
    with tempfile.TemporaryDirectory() as d:
        p = os.path.join(d, "layer" + suffix)
        with open(p, "wb") as f:
            f.write(data)
        try:
            io.read_tensors(p)
        except io.InputError:
            pass
        try:
            for job in jobs_from_path(p):
                for ref in job.inputs().values():
                    load_tensor(ref)
        except DASK_INPUT_ERRORS:
            pass


def _safetensors_bytes(header_bytes: bytes, data: bytes) -> bytes:
    return struct.pack("<Q", len(header_bytes)) + header_bytes + data


@FUZZ
@given(st.binary(max_size=200), st.binary(max_size=64))
def test_random_safetensors_headers(header, data):
    _try_both(_safetensors_bytes(header, data), ".safetensors")


_json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                          st.floats(allow_nan=True), st.text(max_size=6))
_entries = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "F64", "F16", "BF16", "I8", "U8", "BOOL", "X", 3]),
    "shape": st.one_of(st.lists(st.integers(-3, 40), max_size=3), _json_scalars),
    "data_offsets": st.one_of(st.lists(st.one_of(st.integers(-64, 2**40), st.floats()),
                                       max_size=3), _json_scalars),
})
_headers = st.dictionaries(st.sampled_from(["W", "H_in", "H_out", "__metadata__", "x"]),
                           st.one_of(_entries, _json_scalars), max_size=4)


@FUZZ
@given(_headers, st.binary(max_size=256), st.booleans())
def test_structured_safetensors_headers(header, data, nested):
    raw = json.dumps(header).encode()
    if nested:
        raw = b"[" * 5000 + b"]" * 5000
    _try_both(_safetensors_bytes(raw, data), ".safetensors")


@FUZZ
@given(st.binary(max_size=400))
def test_random_npz_bytes(data):
    _try_both(b"PK" + data, ".npz")


@FUZZ
@given(st.integers(0, len(VALID_NPZ) - 1), st.binary(min_size=1, max_size=8),
       st.integers(0, len(VALID_NPZ)))
def test_mutated_npz_bytes(pos, patch, cut):
    data = bytearray(VALID_NPZ)
    data[pos:pos + len(patch)] = patch
    _try_both(bytes(data[:max(cut, 2)]) if cut < len(data) // 2 else bytes(data), ".npz")
