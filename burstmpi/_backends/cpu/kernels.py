"""The CPU backend's elementwise work, compiled with numba: one fused sweep per tile.

``numpy_tiles`` holds the same operations in NumPy (the fallback and the
tests' reference); the compiled tile loops (``tiles``) call these between their
GEMMs. NumPy does elementwise work as one full pass over the tile per operation (mask,
max, subtract, exp, sum, rescale), with an ``exp`` that is a libm-speed loop on CPUs
without AVX-512. Here each operation is one loop that LLVM vectorises (a tile's softmax
update about ten times as fast as NumPy's):

- ``softmax_update``: a row's visible scores' max (a vector max: ``_fmax``), then exp and
  sum in the same sweep (masked entries written as 0), and the running max, sum and
  rescale factor;
- ``probs``: the backward's ``P = exp(S - lse)`` inside each row's visible interval;
- ``dsoftmax``: ``dS = P * (dP - D)``;
- ``widen``: float16 / bfloat16 to float32 with integer operations (4-5x NumPy's casts).

``exp`` is computed arithmetically (``fexp``): e^x = 2^n e^r with n = round(x / ln 2), r =
x - n ln 2 (ln 2 in two parts, so r is exact to float32 however large |x| is), e^r by a
degree-6 polynomial fitted for relative error, and 2^n built in the exponent bits. Its
largest relative error is 3e-7 (a few float32 ulp, against NumPy's 1) and it gives exactly
0 below -87, where masked entries (-inf) are; the sweeps over visible runs use
``_fexp_run``, the same without that select. Only float32 is compiled: float64 inputs (the
reference precision) stay on NumPy.

Every kernel, and the tile loops of ``tiles``, asks for 512-bit vectors where the CPU
has them (``wide_vectors``). Every kernel runs on the calling thread and releases the GIL (``nogil``): the backend runs
tiles on several threads (``threads``), so there is no ``prange`` here.
Compiled code is cached on disk (numba's ``cache=True``, next to this file or under
``NUMBA_CACHE_DIR``); ``warm()`` compiles (or loads) everything and says how long it took.
The loops that compile these kernels in flush their cache when this file changes
(``jit_cache``): numba alone would keep their old copies.
"""

import threading
import time

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from ..._interop import bfloat16

# Fast-math flags without "nnan"/"ninf" (masked scores are -inf, and max/select must see
# them) and with "reassoc" (vectorised sums; the order is fixed by the compiled code, so
# results are still bitwise reproducible).
_FM = {"nsz", "arcp", "contract", "afn", "reassoc"}

_F = np.float32
_ZERO, _HALF = _F(0.0), _F(0.5)
_LOG2E = _F(1.4426950408889634)
# ln 2 in two parts (Cody and Waite): n * _LN2_HI is exact for |n| < 2^12, so the reduced
# argument keeps float32 precision however large |x| is.
_LN2_HI, _LN2_LO = _F(0.693359375), _F(-2.12194440e-4)
_LO, _HI = _F(-87.0), _F(88.0)  # below LO: 0 (e^-87 is near float32's smallest normal)
# e^r on [-ln2/2, ln2/2], degree 6, fitted for relative error (Chebyshev nodes, reweighted).
_C0, _C1, _C2, _C3, _C4, _C5, _C6 = (_F(c) for c in (1.0, 1.0, 0.49999991059303284, 0.16666419804096222,
                                                      0.041668202728033066, 0.00837482325732708,
                                                      0.001383816939778626))

name = "numba"  # what the bench and the stats call this set of operations
_warm = None  # (seconds, loaded from the disk cache) of the first warm()
# Threads of one process (a framework's, at MPI_THREAD_MULTIPLE) may make their first call at
# once: one compiles, the others wait (a second compile after disable_compile() would fail).
_warm_lock = threading.Lock()


@intrinsic
def _f32_from_bits(typingctx, bits):
    """Reinterpret an int32 as float32 (LLVM bitcast: vectorises, unlike a view)."""
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


@njit(inline="always", fastmath=_FM, cache=True)
def _exp_reduced(y):
    """e^y for float32 ``y`` in [-87, 88] (the callers clamp)."""
    n = np.floor(y * _LOG2E + _HALF)  # float32 (math.floor would give an int64 and float64 math)
    r = y - n * _LN2_HI
    r = r - n * _LN2_LO
    p = _C6 * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    p = p * r + _C1
    p = p * r + _C0
    return p * _f32_from_bits((np.int32(n) + np.int32(127)) << np.int32(23))


@njit(inline="always", fastmath=_FM, cache=True)
def fexp(x):
    """e^x for float32 ``x``: within 3e-7 relative on [-87, 88]; exactly 0 below -87 (and
    for -inf)."""
    return _exp_reduced(min(max(x, _LO), _HI)) if x >= _LO else _ZERO


@njit(inline="always", fastmath=_FM, cache=True)
def _fexp_run(x):
    """``fexp`` for a visible run's finite ``x <= 0`` (a score minus its row's max or lse),
    without the select: below -87 it gives e^-87 (1.6e-38, nothing beside a row sum of at
    least 1) instead of 0. 1.3x ``fexp``'s speed in the sweeps."""
    return _exp_reduced(max(x, _LO))


@intrinsic
def wide_vectors(typingctx):
    """Let LLVM vectorise the calling function with 512-bit registers where the CPU has
    them. LLVM's tuning for Intel's AVX-512 server cores prefers 256 bits (wide
    instructions can lower the clock), so numba's loops ran on ymm registers there; the
    tile loops' GEMMs (oneMKL, OpenBLAS) run on zmm anyway. On 512 bits a tile's
    ``softmax_update`` runs about a quarter faster, bitwise the same result.
    Set per function (``prefer-vector-width``; ``min-legal-vector-width`` survives
    inlining into the caller), so numba's process-wide CPU settings, and the user's own
    numba code, are left alone. CPUs without AVX-512 are unaffected."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        # llvmlite's attribute set only accepts its list of keywords: add the string
        # attributes to the underlying set directly.
        for attr in ('"prefer-vector-width"="512"', '"min-legal-vector-width"="512"'):
            set.add(builder.function.attributes, attr)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _fmax(typingctx, a, b):
    """LLVM's maxnum with "nnan nsz": the form its vectoriser turns into a vector max
    reduction (numba's ``max`` stays scalar, at a third of the speed). Only
    for finite operands, as scores in a visible run are."""
    sig = types.float32(types.float32, types.float32)

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.FloatType(), [ir.FloatType(), ir.FloatType()])
        fn = builder.module.declare_intrinsic("llvm.maxnum.f32", fnty=fnty)
        return builder.call(fn, args, fastmath=("nnan", "nsz"))

    return sig, codegen


# Loops run over slices from 0, not over range(a, b): numba cannot tell that a start
# read from an array is non-negative, adds negative-index wraparound to every access,
# and LLVM then leaves the loop scalar (6x slower, measured).


@njit(nogil=True, fastmath=_FM, cache=True)
def softmax_update(s, jlo, jhi, g, m, l, alpha):
    """Rows ``r`` of ``s`` (n x keys; token r // g sees columns jlo..jhi-1): masked
    entries set to 0, visible ones to exp(s - m_new); m, l updated, alpha[r] =
    exp(m_old - m_new), all in one pass after the row max."""
    wide_vectors()
    n, tk = s.shape
    for r in range(n):
        a, b = jlo[r // g], jhi[r // g]
        row = s[r, a:b]
        mx = _F(-np.inf)
        for j in range(row.size):
            mx = _fmax(mx, row[j])
        m_old = m[r]
        m_new = max(m_old, mx)
        # A row that has seen no key keeps m = -inf; shift by 0 so that -inf - 0 gives 0.
        m_safe = _ZERO if m_new == -np.inf else m_new
        total = _ZERO
        for j in range(row.size):
            e = _fexp_run(row[j] - m_safe)
            row[j] = e
            total += e
        s[r, :a] = _ZERO
        s[r, b:] = _ZERO
        al = fexp(m_old - m_safe)
        l[r] = l[r] * al + total
        m[r] = m_new
        alpha[r] = al


@njit(nogil=True, fastmath=_FM, cache=True)
def probs(p, jlo, jhi, g, lse):
    """p = exp(p - lse[:, None]) on each row's visible columns, 0 elsewhere (lse is +inf
    for rows that see no key, giving 0)."""
    wide_vectors()
    n, tk = p.shape
    for r in range(n):
        a, b = jlo[r // g], jhi[r // g]
        row = p[r, a:b]
        lr = lse[r]
        if lr == np.inf:  # a row that sees no key
            row[:] = _ZERO
        else:
            for j in range(row.size):
                row[j] = _fexp_run(row[j] - lr)
        p[r, :a] = _ZERO
        p[r, b:] = _ZERO


@njit(nogil=True, fastmath=_FM, cache=True)
def dsoftmax(ds, p, D):
    """ds = p * (ds - D[:, None]): dS from dP, in place."""
    wide_vectors()
    n, tk = ds.shape
    for r in range(n):
        d = D[r]
        for j in range(tk):
            ds[r, j] = p[r, j] * (ds[r, j] - d)


@njit(nogil=True, fastmath=_FM, cache=True)
def _widen_bf16(src, out):
    wide_vectors()
    for i in range(src.size):
        out[i] = _f32_from_bits(np.int32(src[i]) << np.int32(16))


@intrinsic
def _bits_of_f32(typingctx, x):
    """Reinterpret a float32 as int32."""
    sig = types.int32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@njit(nogil=True, fastmath=_FM, cache=True)
def _widen_f16(src, out):
    wide_vectors()
    # Exponent and mantissa shifted into float32 position, then scaled by 2^112: that
    # re-biases normals and normalises subnormals in one multiply; inf and NaN get the
    # float32 all-ones exponent back; the sign bit moves up 16 places.
    scale = _f32_from_bits(np.int32(0x77800000))  # 2^112
    for i in range(src.size):
        h = np.int32(src[i])
        bits = _bits_of_f32(_f32_from_bits((h & np.int32(0x7FFF)) << np.int32(13)) * scale)
        if (h & np.int32(0x7C00)) == np.int32(0x7C00):
            bits |= np.int32(0x7F800000)
        out[i] = _f32_from_bits(bits | ((h & np.int32(0x8000)) << np.int32(16)))


def widen(x, out=None):
    """``x`` (float16 or bfloat16, any shape) as float32: into ``out`` (C-contiguous, of
    ``x``'s shape) when given, else a new C-contiguous array."""
    x = np.ascontiguousarray(x)
    if out is None:
        out = np.empty(x.shape, np.float32)
    elif out.shape != x.shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ValueError(f"widen: out must be a C-contiguous float32 array of shape {x.shape}, "
                         f"got {out.dtype} of shape {out.shape} and strides {out.strides}")
    kernel = _widen_f16 if x.dtype == np.float16 else _widen_bf16
    kernel(x.reshape(-1).view(np.uint16), out.reshape(-1))
    return out


_KERNELS = ("softmax_update", "probs", "dsoftmax", "_widen_f16", "_widen_bf16")


def warm():
    """Compile every kernel (or load it from the disk cache) for the float32 tiles, once per
    process; return the seconds the first call took."""
    global _warm
    with _warm_lock:
        if _warm is None:
            t0 = time.perf_counter()
            s = np.zeros((2, 4), np.float32)
            lo, hi = np.zeros(2, np.int64), np.full(2, 4, np.int64)
            r = np.zeros(2, np.float32)
            softmax_update(s, lo, hi, 1, np.full(2, -np.inf, np.float32), r.copy(), r.copy())
            probs(s, lo, hi, 1, r)
            dsoftmax(s.copy(), s, r)
            widen(np.zeros(4, np.float16))
            widen(np.zeros(4, bfloat16))
            _warm = (time.perf_counter() - t0, cached())
    return _warm[0]


def cached():
    """Were the kernels called so far all loaded from numba's disk cache?"""
    return all(sum(globals()[k].stats.cache_hits.values()) > 0 for k in _KERNELS)
