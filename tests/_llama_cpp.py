"""llama.cpp itself on a GGUF file, in a child process: its logits at every position of a few
token sequences and its tokenization of a few texts.

The binding is ``cyllama`` (prebuilt llama.cpp, MIT; ``pip install 'bakron[test]'`` installs
it on Linux x86-64). A child process, because llama.cpp aborts the whole process (not an
exception) on a file its kernels cannot run, e.g. F16 norm weights; the parent then reports
the child's exit status and the end of its stderr.

Run as a script: ``python tests/_llama_cpp.py SPEC.json OUT.npz`` with SPEC
``{"model": path, "sequences": [[ids]], "texts": [str]}``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

#: the switch that turns a missing binding into a failure (set by .ci/run); read here only
REQUIRE_ENV = "BAKRON_REQUIRE_LLAMA_CPP"
PINNED = "cyllama==0.2.18 (llama.cpp b9190)"


def binding_error() -> str | None:
    """None when the llama.cpp binding loads here, else why not."""
    try:
        import cyllama.llama.llama_cpp  # noqa: F401
    except Exception as exc:   # ImportError, or an OSError of the shared library
        return f"{type(exc).__name__}: {exc}"
    return None


def required() -> bool:
    """Whether a missing binding is a failure rather than a skip (``BAKRON_REQUIRE_LLAMA_CPP=1``)."""
    return os.environ.get(REQUIRE_ENV, "") == "1"


def llama_cpp_version() -> str:
    import cyllama.llama.llama_cpp as cy

    return f"ggml {cy.ggml_version()} ({cy.ggml_commit()})"


# -- llama.cpp's arithmetic on the CPU, in numpy (for reference_logits' hooks) ----------------
#: a value this close to a rounding tie (in units of the rounding step) may round the other
#: way in llama.cpp's float32 sums than in the emulation's float64 ones
TIE_Q8 = 1e-4          # of Q8's step max|x| / 127
TIE_REL = 1e-6         # relative, for the float16 / bfloat16 roundings


def _near_midpoint(x, lo, hi) -> np.ndarray:
    """Whether float64 ``x`` lies within TIE_REL · |x| of the midpoint of ``lo`` and ``hi``."""
    return np.abs(x - (lo + hi) / 2) <= TIE_REL * np.abs(x)


def f16_ties(x) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    h = x.astype(np.float16)
    other = np.nextafter(h, np.where(h.astype(np.float64) > x, -np.inf, np.inf).astype(np.float16))
    return _near_midpoint(x, h.astype(np.float64), other.astype(np.float64))


def quantize_q8(h):
    """``h`` (float32, last axis in blocks of 32) as llama.cpp's x86 Q8_0 / Q8_1 activation
    blocks: per block d = max|x| / 127 (float32, stored as float16), q = round(x · 127 /
    max|x|) in [-127, 127]. Returns (f16(d) · q as float64, per block d · sum(q) as Q8_1
    stores it (float16) as float64, per row whether some q or d is within a tie)."""
    x = np.asarray(h, dtype=np.float32)
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    y = blocks * inv
    q = np.rint(y)
    value = (d.astype(np.float16).astype(np.float64) * q).reshape(x.shape)
    s = (d[..., 0] * q.sum(axis=-1, dtype=np.float32)).astype(np.float16).astype(np.float64)
    ties = (np.abs(np.abs(y - np.floor(y)) - 0.5) < TIE_Q8).any(axis=-1) | f16_ties(d[..., 0])
    return value, s, ties.reshape(x.shape[0], -1).any(axis=-1)


def round_f16(a) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float64)


def round_bf16(a):
    """float32 -> bfloat16 (round to nearest even) -> float64, and per row whether a value
    is within a tie."""
    x = np.ascontiguousarray(a, dtype=np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    lo = (b >> 16 << 16).astype(np.uint32).view(np.float32).astype(np.float64)
    hi = ((b >> 16 << 16) + (1 << 16)).astype(np.uint32).view(np.float32).astype(np.float64)
    ties = _near_midpoint(x.astype(np.float64), lo, hi)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    value = b.astype(np.uint32).view(np.float32).astype(np.float64)
    return value, ties.reshape(x.shape[0], -1).any(axis=-1)


def _q4_1_offsets(tensor, shape):
    """The per-block offsets m (float16) of a Q4_1 tensor, (rows, blocks), file row order."""
    raw = np.asarray(tensor.data, dtype=np.uint8).reshape(shape[0], -1, 20)
    return raw[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)


class Emulation:
    """``reference_logits`` keywords (``hooks``) that model llama.cpp's CPU arithmetic on the
    GGUF file ``gguf_path`` of a model with ``config``: each matrix product rounds its input
    as the weight's type asks (llama.cpp's vec_dot pairs Q4_0 / Q8_0 with Q8_0 blocks, Q4_1
    with Q8_1 blocks -- whose offset term uses Q8_1's float16 d · sum(q) --, F16 / BF16 with
    their own type, F32 with F32), and q, k, v and the attention probabilities are float16
    (the K/V cache is f16, and the products with it convert their other operand to f16).

    ``first_tie`` is the first position (since :meth:`reset`) where an 8-bit or bfloat16
    rounding was within a tie (``TIE_Q8``, ``TIE_REL``): from there on (the attention carries
    it forward) llama.cpp may have rounded one value the other way, which moves the logits
    by up to a few percent of their spread. (Float16 near-ties move them by less than 1e-3.)"""

    def __init__(self, gguf_path, config):
        import gguf

        self.path, self.config = gguf_path, config
        self.tensors = {t.name: t for t in gguf.GGUFReader(str(gguf_path)).tensors}
        self.offsets = {}
        self.first_tie = None
        self.hooks = {"linear": self._linear, "attention_round": round_f16}

    def reset(self):
        self.first_tie = None

    def _tie(self, rows):
        hit = np.flatnonzero(rows)
        if hit.size and (self.first_tie is None or hit[0] < self.first_tie):
            self.first_tie = int(hit[0])

    def _q4_1_offsets(self, name, shape):
        from bakron.models.llm.gguf_file import unpermute_rows

        if name not in self.offsets:
            m = _q4_1_offsets(self.tensors[name], shape)
            cfg = self.config
            if cfg.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
                m = unpermute_rows(m, cfg.num_heads if "attn_q" in name else cfg.num_kv_heads)
            self.offsets[name] = m
        return self.offsets[name]

    def _linear(self, name, h, W):
        kind = self.tensors[name].tensor_type.name
        if kind in ("Q4_0", "Q8_0", "Q4_1"):
            x, s, ties = quantize_q8(h)
            self._tie(ties)
            out = x @ W.T
            if kind == "Q4_1":   # + Σ_b m_b · (Q8_1's s_b − f16(d_b) · Σ q_b)
                xb = x.reshape(*x.shape[:-1], -1, 32).sum(axis=-1)
                out = out + (s - xb) @ self._q4_1_offsets(name, W.shape).T
            return out
        if kind == "F16":
            return round_f16(h) @ W.T
        if kind == "BF16":
            x, ties = round_bf16(h)
            self._tie(ties)
            return x @ W.T
        if kind == "F32":
            return np.asarray(h, np.float32).astype(np.float64) @ W.T
        raise ValueError(f"{self.path}: no emulation of {kind} ({name})")


def run(model, sequences, texts=(), *, timeout=300) -> dict:
    """``{"logits": [(T, n_vocab) float64 per sequence], "tokens": [ids per text]}`` from
    llama.cpp on the GGUF file ``model`` (no BOS added, special tokens not parsed).
    AssertionError with the child's exit status and stderr when llama.cpp fails."""
    with tempfile.TemporaryDirectory() as d:
        spec, out = Path(d) / "spec.json", Path(d) / "out.npz"
        spec.write_text(json.dumps({"model": str(model), "texts": list(texts),
                                    "sequences": [[int(t) for t in s] for s in sequences]}))
        # GGML_NO_BACKTRACE: on an abort, ggml would otherwise attach gdb for a backtrace
        env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
        r = subprocess.run([sys.executable, __file__, str(spec), str(out)], capture_output=True,
                           text=True, timeout=timeout, env=env)
        if r.returncode != 0:
            tail = "\n".join(r.stderr.strip().splitlines()[-5:])
            raise AssertionError(f"llama.cpp failed on {model} (exit status {r.returncode}):"
                                 f"\n{tail}")
        with np.load(out) as z:
            return {"logits": [z[f"logits{i}"] for i in range(len(sequences))],
                    "tokens": [z[f"tokens{i}"].tolist() for i in range(len(texts))]}


def _child(spec_path, out_path) -> None:
    import cyllama.llama.llama_cpp as cy

    spec = json.loads(Path(spec_path).read_text())
    cy.disable_logging()

    class Model(cy.LlamaModel):
        # cyllama 0.2.18's get_logits_ith reads ``model.n_vocab``, which LlamaModel lacks
        @property
        def n_vocab(self):
            return self.get_vocab().n_vocab

    mp = cy.LlamaModelParams()
    mp.n_gpu_layers = 0
    model = Model(spec["model"], mp)
    vocab = model.get_vocab()
    out = {}
    for i, text in enumerate(spec["texts"]):
        out[f"tokens{i}"] = np.asarray(vocab.tokenize(text, False, False), dtype=np.int64)
    for i, ids in enumerate(spec["sequences"]):
        n = max(len(ids), 1)
        cp = cy.LlamaContextParams()
        cp.n_ctx = cp.n_batch = cp.n_ubatch = max(n, 32)
        cp.n_threads = cp.n_threads_batch = 2
        cp.flash_attn_type = 0   # the plain attention: f16 K/V cache, f32 softmax
        ctx = cy.LlamaContext(model, cp)
        batch = cy.LlamaBatch(n_tokens=n, embd=0, n_seq_max=1)
        for pos, t in enumerate(ids):
            batch.add(int(t), pos, [0], True)
        rc = ctx.decode(batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out[f"logits{i}"] = np.array([ctx.get_logits_ith(p) for p in range(len(ids))],
                                     dtype=np.float64).reshape(len(ids), -1)
        ctx.close()
    np.savez(out_path, **out)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
