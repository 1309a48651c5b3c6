"""Sharded global Hessians on Dask: one task per (calibration shard, layer range), one reduce
per layer that sums the shards in a fixed order.

Built on the public API of :mod:`bakron.hessian` (``global_factors``, the stage protocol,
``HeadContext``): each task runs ``global_factors`` on its shard -- with the task's memory budget,
so the driver's checkpointing and layer-range bisection run per shard -- over a copy of the
chain in which only the task's layers collect factors, and whose head sees the shard's batches
under their *global* batch indices (so the Fisher labels are the ones an unsharded run draws).

Partial accumulators are float64 sums ``S_s = W_s · H_s`` (``H_s`` the shard's factor, ``W_s``
its total token weight). The reduce of a layer adds them in shard order and divides by the total
weight, ``H = sym(Σ_s S_s) / Σ_s W_s`` -- the arithmetic of ``FactorAccumulator.merge_all`` then
``value()`` -- so the factors depend on the shards, never on how many workers ran them or in
which order the tasks finished: bitwise identical for any cluster. They equal the unsharded
``global_factors`` up to summation order. Power-iteration refinement is not sharded (see
docs/distributed.md).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field

import numpy as np

from ._jobs import TensorRef, safe_file_name, tensor_checksum
from ._outputs import (OutputLock, clean_tmp, failure_record, now_iso, publish_tensors,
                       quarantine, read_manifest, verify_layer_file, write_manifest)

__all__ = ["sharded_global_factors", "ShardedResult", "PARTIAL_FORMAT", "model_fingerprint",
           "chain_layers"]

PARTIAL_FORMAT = "bakron-partial"
_JOB_FORMAT = 1


# --------------------------------------------------------------------------------------------
# chain helpers (public stage protocol only)


def _split(stages):
    stages = list(stages)
    if len(stages) < 2 or not getattr(stages[-1], "is_head", False):
        raise ValueError("the model must be a list of stages ending with a head (e.g. "
                         "bakron.hessian.SoftmaxCrossEntropy())")
    return stages[:-1], stages[-1]


def chain_layers(stages) -> list[tuple[str, tuple[int, int]]]:
    """``[(layer name, (m, n))]`` in chain order, named as ``global_factors`` names them."""
    body, _ = _split(stages)
    out, seen = [], set()
    for i, st in enumerate(body):
        for key, (m, n) in st.linears().items():
            name = f"stage{i}" if key is None else key
            if name in seen:
                raise ValueError(f"two linear layers are both named {name!r}")
            seen.add(name)
            out.append((name, (int(m), int(n))))
    if not out:
        raise ValueError("the chain holds no linear layers: nothing to collect")
    return out


def model_fingerprint(stages) -> str:
    """sha256 of the chain: stage types, names, linears and parameter bytes, in order."""
    from .._xp import to_numpy

    h = hashlib.sha256()
    for i, st in enumerate(stages):
        h.update(f"{i}|{type(st).__module__}.{type(st).__qualname__}|"
                 f"{getattr(st, 'name', None)}|".encode())
        lin = st.linears() if hasattr(st, "linears") else {}
        h.update(json.dumps({str(k): list(v) for k, v in lin.items()}, sort_keys=True).encode())
        for a in (st.arrays() if hasattr(st, "arrays") else ()):
            a = np.ascontiguousarray(to_numpy(a))
            h.update(f"{a.dtype.str}{a.shape}".encode())
            h.update(memoryview(a).cast("B"))
    return "sha256:" + h.hexdigest()


class _Only:
    """A stage whose factors are collected only for the layers in ``keep``."""

    def __init__(self, stage, keep, position):
        self._s, self._keep, self._pos = stage, frozenset(keep), position
        self.name = getattr(stage, "name", None)

    def _full(self, key):
        return f"stage{self._pos}" if key is None else key

    def linears(self):
        return {k: v for k, v in self._s.linears().items() if self._full(k) in self._keep}

    def arrays(self):
        return self._s.arrays() if hasattr(self._s, "arrays") else ()

    def out_shape(self, in_shape):
        return self._s.out_shape(in_shape)

    def forward(self, xp, h):
        return self._s.forward(xp, h)

    def vjp(self, xp, h, delta, collect, need_input_grad=True):
        def only(key, x, g):
            if self._full(key) in self._keep:
                collect(key, x, g)
        return self._s.vjp(xp, h, delta, only, need_input_grad=need_input_grad)


class _ShiftedHead:
    """The head, seeing batch ``k`` of a shard as global batch ``offset + k``."""

    is_head = True

    def __init__(self, head, offset):
        self._h, self._off = head, int(offset)
        self.name = getattr(head, "name", "head")

    def linears(self):
        return {}

    def arrays(self):
        return self._h.arrays() if hasattr(self._h, "arrays") else ()

    def check_input(self, in_shape):
        return self._h.check_input(in_shape)

    def grad(self, xp, z, ctx):
        import dataclasses

        return self._h.grad(xp, z, dataclasses.replace(ctx, batch_index=ctx.batch_index
                                                       + self._off))


# --------------------------------------------------------------------------------------------
# shards


def _shard_batches(src, batch_size):
    """The batches (numpy arrays) of one shard source."""
    if isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        if path.lower().endswith(".npy"):
            arrays = [np.load(path, allow_pickle=False)]
        elif path.lower().endswith(".npz"):
            with np.load(path, allow_pickle=False) as z:
                arrays = [z[k] for k in z.files]
            if batch_size is not None and len(arrays) != 1:
                raise ValueError(f"{path}: batch_size splits a single array; this .npz holds "
                                 f"{len(arrays)} (one batch each)")
        else:
            raise ValueError(f"{path}: a shard file is .npy (one array) or .npz (batches)")
    elif hasattr(src, "shape"):
        arrays = [np.array(src)]  # fresh, aligned copies: arrays that arrive from the network
    elif isinstance(src, (list, tuple)):  # may be unaligned, and numpy then skips BLAS (other bits)
        arrays = [np.array(a) for a in src]
        if batch_size is not None:
            raise ValueError("batch_size splits a single array; this shard is a list of batches")
    else:
        raise TypeError(f"a shard is a .npy/.npz path, an array or a list of arrays, got "
                        f"{type(src).__name__}")
    if batch_size is not None and len(arrays) == 1:
        x = arrays[0]
        bs = int(batch_size)
        if bs != batch_size or bs < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        arrays = [x[i:i + bs] for i in range(0, x.shape[0], bs)]
    if not arrays:
        raise ValueError("a shard has no batches")
    return arrays


def _shard_checksum(src) -> str:
    if isinstance(src, (str, os.PathLike)):
        p = os.path.abspath(os.fspath(src))
        if p.lower().endswith(".npy"):
            return tensor_checksum(TensorRef(p))
        h = hashlib.sha256()
        with np.load(p, allow_pickle=False) as z:
            for k in z.files:
                h.update(tensor_checksum(TensorRef(p, k)).encode())
        return "sha256:" + h.hexdigest()
    h = hashlib.sha256()
    for a in ([src] if hasattr(src, "shape") else list(src)):
        a = np.ascontiguousarray(np.asarray(a))
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(memoryview(a).cast("B"))
    return "sha256:" + h.hexdigest()


def _weights_checksum(ws) -> str | None:
    if ws is None:
        return None
    h = hashlib.sha256()
    for w in ws:
        if w is None:
            h.update(b"none|")
        else:
            a = np.ascontiguousarray(np.asarray(w, dtype=np.float64))
            h.update(f"{a.shape}".encode())
            h.update(memoryview(a).cast("B"))
    return "sha256:" + h.hexdigest()


def _total_weight(batches, ws) -> float:
    """Σ over the shard's tokens of their weight (the accumulators' total weight)."""
    tot = 0.0
    for k, x in enumerate(batches):
        lead = tuple(x.shape[:-1])
        w = None if ws is None else ws[k]
        if w is None:
            tot += float(math.prod(lead))
        else:
            w = np.array(w, dtype=np.float64)
            w = w.reshape(w.shape + (1,) * (len(lead) - w.ndim))
            tot += float(np.sum(np.broadcast_to(w, lead)))
    return tot


# --------------------------------------------------------------------------------------------
# tasks


def _partial_path(out_dir, r, s):
    return os.path.join(out_dir, "partials", f"r{r:03d}", f"s{s:05d}.safetensors")


def _factor_path(out_dir, name):
    return os.path.join(out_dir, "factors", safe_file_name(name) + ".safetensors")


def _info() -> dict:
    from ._task import _worker_info

    return _worker_info()


def partial_task(model, src, shard: int, rng: int, offset: int, names, settings: dict,
                 weights, key: str, out_dir: str) -> dict:
    """Accumulate the factors of ``names`` over one shard and publish the partial file."""
    from ..factor_files import pack_upper
    from ..hessian import global_factors
    from .._xp import to_numpy

    t0 = time.perf_counter()
    rec = {"shard": shard, "range": rng, "key": key, **_info(), "started": now_iso()}
    final = _partial_path(out_dir, rng, shard)
    ok, _, cs, meta = verify_layer_file(final, key, fmt=PARTIAL_FORMAT)
    if ok:
        return dict(rec, status="done", wrote=False, checksum=cs, finished=now_iso(),
                    seconds=time.perf_counter() - t0)
    if isinstance(model, bytes):  # a pickled list: unpickling makes fresh, aligned arrays
        import pickle

        stages = pickle.loads(model)
    else:
        stages = model() if callable(model) else list(model)
    body, head = _split(stages)
    keep = set(names)
    chain = [_Only(st, keep, i) for i, st in enumerate(body)] + [_ShiftedHead(head, offset)]
    batches = _shard_batches(src, settings["batch_size"])
    got = {}

    def sink(name, H_in, H_out):
        got[name] = (to_numpy(H_in), to_numpy(H_out))

    _, report = global_factors(chain, batches, budget_bytes=settings["budget_bytes"],
                               checkpoint=settings["checkpoint"],
                               snapshots=settings["snapshots"], seed=settings["seed"],
                               weights=weights, sink=sink)
    missing = keep - set(got)
    if missing:
        raise ValueError(f"global_factors returned no factors for {sorted(missing)}")
    W = _total_weight(batches, weights)
    tensors = {}
    for n in names:
        H_in, H_out = got[n]
        tensors[f"{n}.in_sum"] = pack_upper(np.asarray(H_in, np.float64) * W)
        tensors[f"{n}.out_sum"] = pack_upper(np.asarray(H_out, np.float64) * W)
    meta = {"key": key, "shard": str(shard), "range": str(rng), "names": json.dumps(list(names)),
            "weight": repr(float(W)), "batches": str(len(batches)),
            "passes": str(report.passes), "stage_evals": str(report.stage_evals),
            "peak_bytes": str(report.peak_bytes), "worker": rec["worker"],
            "created": now_iso()}
    _, cs, wrote = publish_tensors(final, tensors, meta, PARTIAL_FORMAT, out_dir=out_dir,
                                   journal={"partial": f"r{rng:03d}/s{shard:05d}", "key": key,
                                            "worker": rec["worker"], "time": now_iso()})
    return dict(rec, status="done", wrote=wrote, checksum=cs, weight=W,
                passes=report.passes, stage_evals=report.stage_evals,
                peak_bytes=report.peak_bytes, finished=now_iso(),
                seconds=time.perf_counter() - t0)


def reduce_task(name: str, rng: int, n_shards: int, partial_keys, key: str, out_dir: str,
                *deps) -> dict:
    """Sum one layer's partials in shard order and publish its factor file."""
    from ..factor_files import FORMAT, FORMAT_VERSION, PACKING, pack_upper, unpack_upper
    from .. import _safetensors

    t0 = time.perf_counter()
    rec = {"name": name, "key": key, **_info(), "started": now_iso()}
    final = _factor_path(out_dir, name)
    ok, _, cs, _ = verify_layer_file(final, key, fmt=FORMAT)
    if ok:
        return dict(rec, status="done", wrote=False, checksum=cs, finished=now_iso(),
                    seconds=time.perf_counter() - t0)
    S_in = S_out = None
    W = 0.0
    for s in range(n_shards):  # the fixed order: shard 0, 1, 2, ...
        p = _partial_path(out_dir, rng, s)
        okp, why, _, meta = verify_layer_file(p, partial_keys[s], fmt=PARTIAL_FORMAT)
        if not okp:
            raise OSError(f"partial {p} is not valid ({why})")
        t = _safetensors.load(p, [f"{name}.in_sum", f"{name}.out_sum"])
        a, b = unpack_upper(t[f"{name}.in_sum"]), unpack_upper(t[f"{name}.out_sum"])
        S_in = a if S_in is None else S_in + a
        S_out = b if S_out is None else S_out + b
        W = W + float(meta["weight"])
    if not W > 0:
        raise ValueError(f"layer {name}: total weight {W} over the shards is not positive")
    H_in = (S_in + S_in.T) * (0.5 / W)   # FactorAccumulator.merge_all(...).value()
    H_out = (S_out + S_out.T) * (0.5 / W)
    tensors = {"hin": pack_upper(H_in), "hout": pack_upper(H_out)}
    meta = {"key": key, "format_version": FORMAT_VERSION, "packing": PACKING,
            "n_in": str(H_in.shape[0]), "n_out": str(H_out.shape[0]), "layer": name,
            "shards": str(n_shards), "weight": repr(W), "worker": rec["worker"],
            "created": now_iso()}
    _, cs, wrote = publish_tensors(final, tensors, meta, FORMAT, out_dir=out_dir,
                                   journal={"factor": name, "key": key,
                                            "worker": rec["worker"], "time": now_iso()})
    return dict(rec, status="done", wrote=wrote, checksum=cs, weight=W, shards=n_shards,
                file=os.path.relpath(final, out_dir), finished=now_iso(),
                seconds=time.perf_counter() - t0)


# --------------------------------------------------------------------------------------------
# the driver


@dataclass
class ShardedResult:
    """What :func:`sharded_global_factors` did. ``factors`` maps each layer to its factor file
    (``bakron.factor_files`` layout: ``hin``/``hout``); ``load(name)`` reads ``(H_in, H_out)``.
    """

    out_dir: str
    factors: dict = field(default_factory=dict)
    failed: dict = field(default_factory=dict)
    partials_computed: int = 0
    partials_reused: int = 0
    reduces_computed: int = 0
    reduces_reused: int = 0
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.failed

    @property
    def exit_code(self) -> int:
        return 0 if self.ok else 1

    def load(self, name: str):
        from ..factor_files import load_factors

        fs = load_factors(self.factors[name])
        return fs.h_in, fs.h_out


def _ranges(layers, layer_ranges):
    names = [n for n, _ in layers]
    if layer_ranges is None:
        return [names]
    if isinstance(layer_ranges, int):
        k = int(layer_ranges)
        if k < 1:
            raise ValueError(f"layer_ranges must be >= 1, got {layer_ranges}")
        k = min(k, len(names))
        cuts = [round(i * len(names) / k) for i in range(k + 1)]
        return [names[cuts[i]:cuts[i + 1]] for i in range(k)]
    out, seen = [], set()
    for r in layer_ranges:
        r = list(r)
        if not r:
            raise ValueError("a layer range is empty")
        for n in r:
            if n not in names:
                raise ValueError(f"layer {n!r} is not in the chain (layers: {names})")
            if n in seen:
                raise ValueError(f"layer {n!r} is in two ranges")
            seen.add(n)
        out.append(r)
    return out


def sharded_global_factors(model, shards, out_dir, client=None, *, batch_size=None,
                           layer_ranges=None, budget_bytes=None, checkpoint="auto",
                           snapshots=None, seed: int = 0, weights=None, retries: int = 2,
                           lock: bool = True, progress=False) -> ShardedResult:
    """Global K-FAC factors of every linear layer, computed shard by shard (on Dask).

    Parameters
    ----------
    model : list of stages, or a zero-argument callable returning one
        The chain (``bakron.hessian`` stages ending with a head). A callable (picklable, e.g.
        ``functools.partial(load_model, path)``) is called by each task, so big weights are
        read on the workers; a list is sent to the workers once (``scatter``).
    shards : list
        Calibration shards, in order: ``.npy`` paths (one array, split by ``batch_size``),
        ``.npz`` paths (one batch per array, in file order), arrays, or lists of batch arrays.
        Shard ``s``'s batches get global indices after those of shards ``0..s-1``, so the head
        draws the labels an unsharded run over the concatenated batches would draw.
    out_dir : path
        ``factors/<layer>.safetensors`` (factor files), ``partials/`` (float64 partial sums),
        ``manifest.json`` and ``.bakron/`` (lock, journal). Resumable like :func:`run_layers`.
    client : distributed.Client or None
        ``None`` runs every task here, in order (the reference).
    layer_ranges : None, int or list of lists of names
        Layers per task: all in one range (default), K contiguous ranges, or explicit ranges.
    budget_bytes, checkpoint, snapshots, seed
        Passed to :func:`bakron.hessian.global_factors` in every task (the budget is per task,
        so the checkpointing and layer-range bisection run per shard).
    weights : list, optional
        One entry per shard: ``None`` or a list with one weight array (or None) per batch.

    Returns
    -------
    ShardedResult
    """
    t0 = time.perf_counter()
    shards = list(shards)
    if not shards:
        raise ValueError("shards is empty")
    if weights is not None and len(weights) != len(shards):
        raise ValueError(f"weights has {len(weights)} entries for {len(shards)} shards")
    stages = model() if callable(model) else list(model)
    layers = chain_layers(stages)
    ranges = _ranges(layers, layer_ranges)
    fp = model_fingerprint(stages)
    settings = {"batch_size": batch_size, "budget_bytes": budget_bytes,
                "checkpoint": checkpoint, "snapshots": snapshots, "seed": int(seed)}
    from .. import __version__

    # batch counts (global offsets) and checksums of the shards
    offsets, sums, off = [], [], 0
    for s, src in enumerate(shards):
        nb = len(_shard_batches(src, batch_size))
        w = None if weights is None else weights[s]
        if w is not None and len(w) != nb:
            raise ValueError(f"weights[{s}] has {len(w)} entries for {nb} batches")
        offsets.append(off)
        off += nb
        sums.append((_shard_checksum(src), _weights_checksum(w)))

    def hkey(doc):
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()

    pkeys = {(r, s): hkey({"job_format": _JOB_FORMAT, "kind": "partial", "bakron": __version__,
                           "model": fp, "shard": sums[s], "offset": offsets[s],
                           "names": ranges[r], "settings": settings})
             for r in range(len(ranges)) for s in range(len(shards))}
    range_of = {n: r for r, names in enumerate(ranges) for n in names}
    fkeys = {n: hkey({"job_format": _JOB_FORMAT, "kind": "factor", "layer": n,
                      "partials": [pkeys[(range_of[n], s)] for s in range(len(shards))]})
             for n in range_of}

    out_dir = os.path.abspath(os.fspath(out_dir))
    os.makedirs(out_dir, exist_ok=True)
    lk = OutputLock(out_dir).acquire() if lock else None
    res = ShardedResult(out_dir=out_dir)
    show = progress if callable(progress) else (_printer() if progress else None)
    try:
        old = read_manifest(out_dir) or {"layers": {}}
        records = dict(old.get("layers", {}))
        precs = dict(old.get("partials", {}))
        clean_tmp(out_dir, 30.0, "partials")
        clean_tmp(out_dir, 30.0, "factors")
        need_f = []
        for n in range_of:
            path = _factor_path(out_dir, n)
            prev = records.get(n) or {}
            expect = prev.get("checksum") if prev.get("key") == fkeys[n] else None
            if os.path.exists(path):
                ok, why, cs, _ = verify_layer_file(path, fkeys[n], expect, fmt="bakron-factors")
                if ok:
                    res.factors[n] = path
                    res.reduces_reused += 1
                    records[n] = dict(prev, key=fkeys[n], checksum=cs, status="done",
                                      file=os.path.relpath(path, out_dir))
                    continue
                quarantine(out_dir, path)
            need_f.append(n)
            records[n] = {"status": "pending", "key": fkeys[n],
                          "file": os.path.relpath(path, out_dir)}
        need_r = sorted({range_of[n] for n in need_f})
        need_p = []
        for r in need_r:
            for s in range(len(shards)):
                path = _partial_path(out_dir, r, s)
                pid = f"r{r:03d}/s{s:05d}"
                if os.path.exists(path):
                    ok, _, cs, _ = verify_layer_file(path, pkeys[(r, s)], fmt=PARTIAL_FORMAT)
                    if ok:
                        res.partials_reused += 1
                        precs[pid] = dict(precs.get(pid) or {}, key=pkeys[(r, s)],
                                          checksum=cs, status="done")
                        continue
                    quarantine(out_dir, path)
                need_p.append((r, s))
                precs[pid] = {"status": "pending", "key": pkeys[(r, s)]}
        write_manifest(out_dir, records, {"kind": "sharded-hessian", "partials": precs})

        def on_partial(r, s, rec):
            precs[f"r{r:03d}/s{s:05d}"] = _clean(rec)
            if rec.get("status") == "done":
                res.partials_computed += bool(rec.get("wrote"))
                res.partials_reused += not rec.get("wrote")
            if show:
                show(f"partial r{r:03d}/s{s:05d}", rec)

        def on_factor(n, rec):
            records[n] = _clean(rec)
            if rec.get("status") == "done":
                res.factors[n] = _factor_path(out_dir, n)
                res.reduces_computed += bool(rec.get("wrote"))
                res.reduces_reused += not rec.get("wrote")
            else:
                res.failed[n] = rec.get("error") or "failed"
            if show:
                show(f"factor {n}", rec)

        weights_of = (lambda s: None) if weights is None else (lambda s: weights[s])
        try:
            if client is None:
                bad = set()
                for r, s in need_p:
                    try:
                        rec = partial_task(model if callable(model) else stages, shards[s], s,
                                           r, offsets[s], ranges[r], settings, weights_of(s),
                                           pkeys[(r, s)], out_dir)
                    except Exception as exc:
                        rec = failure_record(pkeys[(r, s)], exc)
                        bad.add(r)
                    on_partial(r, s, rec)
                for n in need_f:
                    r = range_of[n]
                    if r in bad:
                        on_factor(n, {"status": "failed", "key": fkeys[n],
                                      "error": "a partial of its layer range failed"})
                        continue
                    try:
                        rec = reduce_task(n, r, len(shards),
                                          [pkeys[(r, s)] for s in range(len(shards))],
                                          fkeys[n], out_dir)
                    except Exception as exc:
                        rec = failure_record(fkeys[n], exc)
                    on_factor(n, rec)
            else:
                _run_dask(client, model, stages, shards, need_p, need_f, ranges, range_of,
                          offsets, settings, weights_of, pkeys, fkeys, out_dir, retries,
                          on_partial, on_factor)
        finally:
            write_manifest(out_dir, records, {"kind": "sharded-hessian", "partials": precs})
    finally:
        if lk is not None:
            lk.release()
        res.seconds = time.perf_counter() - t0
    return res


def _run_dask(client, model, stages, shards, need_p, need_f, ranges, range_of, offsets,
              settings, weights_of, pkeys, fkeys, out_dir, retries, on_partial, on_factor):
    from distributed import as_completed

    if callable(model):
        m = model
    else:
        # sent once as a pickle, unpickled by each task: arrays deserialised by Dask can sit at
        # unaligned addresses, where numpy's matmul leaves BLAS and rounds differently
        import pickle

        m = client.scatter(pickle.dumps(stages, protocol=4),  # protocol 4: arrays are copied
                           broadcast=True, hash=False)
    pf = {}
    for r, s in need_p:
        pf[(r, s)] = client.submit(partial_task, m, shards[s], s, r, offsets[s], ranges[r],
                                   settings, weights_of(s), pkeys[(r, s)], out_dir,
                                   key=f"bakron-partial-{pkeys[(r, s)][:16]}-r{r}-s{s}",
                                   retries=retries, pure=False)
    ff = {}
    for n in need_f:
        r = range_of[n]
        deps = [pf[(r, s)] for s in range(len(shards)) if (r, s) in pf]
        ff[n] = client.submit(reduce_task, n, r, len(shards),
                              [pkeys[(r, s)] for s in range(len(shards))], fkeys[n], out_dir,
                              *deps, key=f"bakron-reduce-{fkeys[n][:16]}-{safe_file_name(n)}",
                              retries=retries, pure=False)
    which = {f: ("p", k) for k, f in pf.items()}
    which.update({f: ("f", k) for k, f in ff.items()})
    try:
        for f in as_completed(list(which)):
            kind, k = which[f]
            if f.status == "finished":
                rec = f.result()
            else:
                rec = failure_record(pkeys[k] if kind == "p" else fkeys[k], f.exception())
            if kind == "p":
                on_partial(k[0], k[1], rec)
            else:
                on_factor(k, rec)
    except BaseException:
        client.cancel(list(which))
        raise




def _clean(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if isinstance(v, (str, int, float, bool, type(None)))}


def _printer():
    import sys

    def show(what, rec):
        extra = f" -- {rec.get('error')}" if rec.get("error") else ""
        print(f"{what}: {rec.get('status')}{'' if rec.get('wrote', True) else ' (reused)'}"
              f" on {rec.get('worker')}{extra}", file=sys.stderr, flush=True)
    return show
