"""Argument checks at the API boundary, and agreement between ranks.

Every check names the function, the argument, what was expected and what came.
Because a ring stalls if one rank drops out, local errors are made collective:
``agree`` runs one tiny allreduce per call; only when something is wrong does it
gather the details, and then every rank raises the same error, naming the rank
that caused it.
"""

import builtins
import zlib

import numpy as np

from .layout import LAYOUTS

__all__ = ["SUPPORTED_DTYPES", "BWD_MODES", "check_window", "check_options",
           "check_forward", "check_backward", "agree"]

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
BWD_MODES = ("auto", "burst", "ring")


def _shape(x):
    return tuple(int(s) for s in x.shape)


def check_window(fn, window):
    if window is None:
        return
    ok = (isinstance(window, (tuple, list)) and len(window) == 2
          and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= -1
                  for w in window))
    if not ok:
        raise ValueError(f"{fn}: window: expected None or (left, right) with integers >= -1 "
                         f"(-1 = unbounded), got {window!r}")


def check_options(fn, *, causal, window, softmax_scale, layout, bwd_comm="auto"):
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{fn}: causal: expected a bool, got {causal!r}")
    check_window(fn, window)
    if causal and window is not None and window[1] not in (-1, 0):
        raise ValueError(f"{fn}: window: with causal=True the right bound must be 0 or -1, "
                         f"got {tuple(window)!r}")
    if softmax_scale is not None:
        try:
            ok = np.isfinite(float(softmax_scale))
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{fn}: softmax_scale: expected a finite number or None, got {softmax_scale!r}")
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout: expected one of {LAYOUTS}, got {layout!r}")
    if bwd_comm not in BWD_MODES:
        raise ValueError(f"{fn}: bwd_comm: expected one of {BWD_MODES}, got {bwd_comm!r}")


def _dtype_name(x):
    return np.dtype(x.dtype).name


def check_forward(fn, q, k, v, layout):
    """Check q, k, v (NumPy views of the caller's arrays); return the problem dims."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{fn}: {name}: expected 4 dims (batch, seqlen_local, heads, head_dim), "
                             f"got shape {_shape(x)}")
        if _dtype_name(x) not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name}.dtype: expected one of {SUPPORTED_DTYPES}, got {x.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{fn}: {name}.dtype: expected {q.dtype} (the dtype of q), got {x.dtype}")
    B, C, Z, d = _shape(q)
    if _shape(k) != (B, C, k.shape[2], d):
        raise ValueError(f"{fn}: k.shape: expected ({B}, {C}, kv_heads, {d}) to match q {_shape(q)}, "
                         f"got {_shape(k)}")
    Zkv = k.shape[2]
    if _shape(v)[:3] != (B, C, Zkv):
        raise ValueError(f"{fn}: v.shape: expected ({B}, {C}, {Zkv}, head_dim_v) to match k {_shape(k)}, "
                         f"got {_shape(v)}")
    if min(B, C, Z, d, Zkv, v.shape[3]) == 0:
        raise ValueError(f"{fn}: q, k, v: every dimension must be non-empty, got q {_shape(q)}, "
                         f"k {_shape(k)}, v {_shape(v)}")
    if Z % Zkv:
        raise ValueError(f"{fn}: k.shape[2]: expected a divisor of the {Z} query heads, got {Zkv} kv heads")
    if layout == "zigzag" and C % 2:
        raise ValueError(f"{fn}: q.shape[1]: layout='zigzag' needs an even seqlen_local "
                         f"(two chunks per rank), got {C}")
    return B, C, Z, Zkv, d, int(v.shape[3])


def check_backward(fn, dout, q, k, v, out, lse, layout, lse_dtype):
    dims = check_forward(fn, q, k, v, layout)
    B, C, Z, Zkv, d, dv = dims
    for name, x in (("dout", dout), ("out", out)):
        if _shape(x) != (B, C, Z, dv):
            raise ValueError(f"{fn}: {name}.shape: expected {(B, C, Z, dv)}, got {_shape(x)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{fn}: {name}.dtype: expected {q.dtype} (the dtype of q), got {x.dtype}")
    if _shape(lse) != (B, Z, C):
        raise ValueError(f"{fn}: lse.shape: expected (batch, heads, seqlen_local) = {(B, Z, C)}, "
                         f"got {_shape(lse)}")
    if _dtype_name(lse) not in ("float32", "float64"):
        raise TypeError(f"{fn}: lse.dtype: expected {lse_dtype} (as returned by the forward), got {lse.dtype}")
    return dims


def _checksum(signature):
    return zlib.crc32(repr(signature).encode()) & 0x7FFFFFFF


def agree(comm, fn, error, signature):
    """Raise on every rank if any rank has ``error`` or the ranks' signatures differ.

    ``signature`` is a tuple of (name, value) pairs that must match on all ranks.
    Costs one allreduce of three integers when all is well.
    """
    from mpi4py import MPI

    h = _checksum(signature)
    flags = np.array([1 if error else 0, h, -h], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
    if flags[0] == 0 and flags[1] == -flags[2]:
        return
    report = (None if error is None else (type(error).__name__, str(error)), signature)
    everyone = comm.allgather(report)
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if failed:
        rank, (kind, msg) = failed[0]
        others = [r for r, _ in failed[1:]]
        also = f" (ranks {others} failed too)" if others else ""
        exc = getattr(builtins, kind, None)
        if not (isinstance(exc, type) and issubclass(exc, Exception)):
            exc = RuntimeError
        raise exc(f"rank {rank}: {msg}{also}")
    sigs = [dict(s) for _, s in everyone]
    for key in sigs[0]:
        values = [s.get(key) for s in sigs]
        if any(v != values[0] for v in values):
            seen = ", ".join(f"rank {r} has {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{fn}: ranks disagree on {key}: {seen}")
    raise ValueError(f"{fn}: ranks disagree on their arguments")  # pragma: no cover
