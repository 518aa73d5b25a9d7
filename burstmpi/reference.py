"""Dense attention on the global sequence: the test oracle and the bench's check.

Quadratic in memory: for tests and for checking a sample of rows, never for real work.
``precision="float64"`` is the exact reference. ``precision="plain"`` is what a plain
implementation in the input dtype gets (scores, probabilities and outputs rounded to
that dtype, products accumulated in float32, as a GPU GEMM does): flash-attn's test rule
allows our error against float64 to be about twice that one's.
"""

import numpy as np

from ._interop import bfloat16
from .masks._intervals import Bounds

__all__ = ["visible", "forward", "backward", "rows", "key_rows", "random_problem", "ATOL",
           "flash_attn_rule"]

#: Slack on top of flash-attn's rule (our error <= 2 x a plain same-dtype implementation's
#: error, both against float64), per dtype: a few units in the last place of the dtype at
#: the reference's largest magnitude. It matters for float32/float64, where the plain error
#: can be tiny: our backward rebuilds P from the stored lse (as flash-attn does), and lse's
#: own rounding then shows up in sums like dv of an early key under a causal mask.
ATOL = {"float64": 1e-13, "float32": 1e-6, "float16": 1e-4, "bfloat16": 1e-3}


def visible(qpos, kpos, causal=False, window=None, cu_seqlens=None, mask=None, heads=1, seqlen=None):
    """Boolean (len(qpos), len(kpos)) mask of the keys each query sees: inside the window
    and, with ``cu_seqlens``, inside the query's own document; with a ``burstmpi.masks``
    ``mask`` (on a sequence of ``seqlen`` tokens) also what it lets through, and for a
    per-head mask one such matrix per head: (heads, len(qpos), len(kpos)). Written from
    the definitions (document ids compared, window offsets tested, the mask's own
    ``visible``), independently of the interval form the library uses."""
    w = Bounds(causal, window)
    d = np.asarray(kpos)[None, :] - np.asarray(qpos)[:, None]
    seen = (d >= -w.lo) & (d <= w.hi)
    if cu_seqlens is not None:
        cu = np.asarray(cu_seqlens)
        doc = lambda p: np.searchsorted(cu, np.asarray(p), side="right")
        seen &= doc(qpos)[:, None] == doc(kpos)[None, :]
    if mask is not None:
        if mask.heads is None:
            seen = seen & mask.visible(qpos, kpos, seqlen, cu_seqlens)
        else:
            seen = seen[None] & np.stack([mask.visible(qpos, kpos, seqlen, cu_seqlens, h) for h in range(heads)])
    return seen


def _rounder(dtype, precision):
    if precision == "float64":
        return np.float64, (lambda x: x)
    dt = np.dtype(dtype)
    if dt == np.float64:
        return np.float64, (lambda x: x)
    if dt == np.float32:
        return np.float32, (lambda x: x.astype(np.float32))
    return np.float32, (lambda x: x.astype(dt).astype(np.float32))


def _expand(x, heads):
    """(B, N, Zkv, d) -> (B, Zkv*g, N, d) with each KV head serving its query heads."""
    g = heads // x.shape[2]
    return np.repeat(x, g, axis=2).transpose(0, 2, 1, 3)


def forward(q, k, v, *, causal=False, window=None, softmax_scale=None, precision="float64",
            q_rows=None, cu_seqlens=None, mask=None):
    """Return (out, lse) for global q (B, N, Z, d), k, v (B, N, Zkv, d|dv).

    ``q_rows`` restricts the queries to those global positions (for spot checks).
    """
    B, N, Z, d = q.shape
    ct, rnd = _rounder(q.dtype, precision)
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    rows = np.arange(N) if q_rows is None else np.asarray(q_rows)
    qh = np.asarray(q[:, rows], dtype=ct).transpose(0, 2, 1, 3)
    kh, vh = _expand(np.asarray(k, dtype=ct), Z), _expand(np.asarray(v, dtype=ct), Z)
    s = rnd((qh @ kh.swapaxes(-1, -2)) * ct(scale))
    s = np.where(visible(rows, np.arange(N), causal, window, cu_seqlens, mask, Z, N), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    seen = l > 0
    p = rnd(p / np.where(seen, l, 1))
    out = rnd(p @ vh)
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)[..., 0]
    return out.transpose(0, 2, 1, 3), lse


def backward(dout, q, k, v, *, causal=False, window=None, softmax_scale=None, precision="float64",
             cu_seqlens=None, mask=None):
    """Return (dq, dk, dv) of dense attention for global arrays."""
    B, N, Z, d = q.shape
    Zkv = k.shape[2]
    ct, rnd = _rounder(q.dtype, precision)
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    qh = np.asarray(q, dtype=ct).transpose(0, 2, 1, 3)
    kh, vh = _expand(np.asarray(k, dtype=ct), Z), _expand(np.asarray(v, dtype=ct), Z)
    doh = np.asarray(dout, dtype=ct).transpose(0, 2, 1, 3)
    s = (qh @ kh.swapaxes(-1, -2)) * ct(scale)
    s = np.where(visible(np.arange(N), np.arange(N), causal, window, cu_seqlens, mask, Z, N), s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    p = np.exp(s - np.where(np.isfinite(m), m, 0))
    l = p.sum(axis=-1, keepdims=True)
    p = rnd(p / np.where(l > 0, l, 1))
    o = rnd(p @ vh)
    dv = rnd(p.swapaxes(-1, -2) @ doh)
    dp = rnd(doh @ vh.swapaxes(-1, -2))
    ds = rnd(p * (dp - (doh * o).sum(axis=-1, keepdims=True)))
    dq = rnd((ds @ kh) * ct(scale))
    dk = rnd((ds.swapaxes(-1, -2) @ qh) * ct(scale))

    def fold(x):  # sum query-head gradients back onto their KV head, as returned: in the dtype
        return rnd(x.reshape(B, Zkv, Z // Zkv, N, -1).sum(axis=2).transpose(0, 2, 1, 3))

    return dq.transpose(0, 2, 1, 3), fold(dk), fold(dv)


CHUNK = 4096  # sequence rows per block in the sampled references: memory O(R * CHUNK)


def _chunks(n):
    return [(a, min(a + CHUNK, n)) for a in range(0, n, CHUNK)]


def rows(q_rows, k, v, dout_rows, positions, *, causal=False, window=None, softmax_scale=None,
         cu_seqlens=None, mask=None):
    """Float64 (out, lse, dq) of a few query rows at global ``positions`` of the sequence.

    ``q_rows``/``dout_rows`` are (B, R, Z, d|dv) for those rows only; ``k``, ``v`` are
    global. Keys are visited in blocks (three passes: max, sums, dq), so memory is
    O(R * CHUNK) whatever the length: the bench can check any problem it can run.
    """
    B, R, Z, d = q_rows.shape
    N = k.shape[1]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    qh = np.asarray(q_rows, dtype=np.float64).transpose(0, 2, 1, 3)
    doh = np.asarray(dout_rows, dtype=np.float64).transpose(0, 2, 1, 3)

    def block(a, b):
        kh = _expand(np.asarray(k[:, a:b], dtype=np.float64), Z)
        vh = _expand(np.asarray(v[:, a:b], dtype=np.float64), Z)
        s = (qh @ kh.swapaxes(-1, -2)) * scale
        seen = visible(positions, np.arange(a, b), causal, window, cu_seqlens, mask, Z, N)
        return np.where(seen, s, -np.inf), kh, vh

    m = np.full(qh.shape[:-1] + (1,), -np.inf)
    for a, b in _chunks(N):
        m = np.maximum(m, block(a, b)[0].max(axis=-1, keepdims=True))
    l, o = np.zeros_like(m), 0.0
    for a, b in _chunks(N):
        s, _, vh = block(a, b)
        p = np.exp(s - m)
        l += p.sum(axis=-1, keepdims=True)
        o = o + p @ vh
    o = o / l
    lse = m + np.log(l)
    D = (doh * o).sum(axis=-1, keepdims=True)
    dq = 0.0
    for a, b in _chunks(N):
        s, kh, vh = block(a, b)
        p = np.exp(s - lse)
        dq = dq + (p * (doh @ vh.swapaxes(-1, -2) - D)) @ kh
    return o.transpose(0, 2, 1, 3), lse[..., 0], (dq * scale).transpose(0, 2, 1, 3)


def key_rows(q, k_rows, v_rows, dout, lse, delta, positions, *, causal=False, window=None,
             softmax_scale=None, cu_seqlens=None, mask=None):
    """Float64 (dk, dv) of a few key rows at global ``positions``, given every query's
    ``lse`` and ``delta`` = rowsum(dout * out), both (B, Z, N).

    Checks the backward on its own: the forward's lse and out are taken as given (they
    are checked separately). Queries are visited in blocks; memory is O(R * CHUNK).
    """
    B, N, Z, d = q.shape
    Zkv = k_rows.shape[2]
    scale = 1.0 / np.sqrt(d) if softmax_scale is None else softmax_scale
    kh = _expand(np.asarray(k_rows, dtype=np.float64), Z)
    vh = _expand(np.asarray(v_rows, dtype=np.float64), Z)
    R = k_rows.shape[1]
    dk, dv = np.zeros((B, Z, R, d)), np.zeros((B, Z, R, vh.shape[-1]))  # shaped when R or N is 0
    for a, b in _chunks(N):
        qh = np.asarray(q[:, a:b], dtype=np.float64).transpose(0, 2, 1, 3)
        doh = np.asarray(dout[:, a:b], dtype=np.float64).transpose(0, 2, 1, 3)
        s = (qh @ kh.swapaxes(-1, -2)) * scale
        s = np.where(visible(np.arange(a, b), positions, causal, window, cu_seqlens, mask, Z, N), s, -np.inf)
        lse_b = np.asarray(lse[:, :, a:b], dtype=np.float64)[..., None]
        p = np.exp(s - np.where(np.isfinite(lse_b), lse_b, np.inf))
        dv = dv + p.swapaxes(-1, -2) @ doh
        ds = p * (doh @ vh.swapaxes(-1, -2) - np.asarray(delta[:, :, a:b], dtype=np.float64)[..., None])
        dk = dk + ds.swapaxes(-1, -2) @ qh

    def fold(x):
        return x.reshape(B, Zkv, Z // Zkv, R, x.shape[-1]).sum(axis=2).transpose(0, 2, 1, 3)

    return fold(dk * scale), fold(dv)


def flash_attn_rule(ours, exact, plain, dtype):
    """flash-attn's test rule against the float64 ``exact``: the same non-finite entries,
    equal infinities, and an error at most twice that of the ``plain`` same-dtype result
    plus ``ATOL``. Returns (problem, error): ``problem`` is None when the rule holds, else
    what broke it. Used by the test suite and by ``burstmpi-gpucheck``."""
    ours, exact, plain = (np.asarray(x, dtype=np.float64) for x in (ours, exact, plain))
    fin = np.isfinite(exact)
    if not np.array_equal(np.isfinite(ours), fin):
        return "non-finite values differ from the reference", float("inf")
    if not np.array_equal(ours[~fin], exact[~fin]):
        return "infinite values differ", float("inf")
    err = float(np.abs(ours[fin] - exact[fin]).max(initial=0.0))
    base = float(np.abs(plain[fin] - exact[fin]).max(initial=0.0))
    atol = ATOL[dtype] * max(1.0, float(np.abs(exact[fin]).max(initial=0.0)))
    if err > 2 * base + atol:
        return f"({dtype}) error {err:.3e} > 2 x plain {base:.3e} + atol {atol:.1e}", err
    return None, err


def random_problem(B, N, Z, Zkv, d, dv=None, dtype=np.float32, seed=0):
    """Random global (q, k, v, dout) of ``dtype`` (a NumPy dtype or "bfloat16")."""
    rng = np.random.default_rng(seed)
    dt = bfloat16 if dtype in ("bfloat16", bfloat16) else np.dtype(dtype)
    dv = d if dv is None else dv
    shapes = [(B, N, Z, d), (B, N, Zkv, d), (B, N, Zkv, dv), (B, N, Z, dv)]
    return tuple(rng.standard_normal(s).astype(dt) for s in shapes)
