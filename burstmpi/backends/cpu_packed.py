"""The CPU forward's tiles on operands packed once: our own micro-kernel instead of sgemm.

BLAS's ``sgemm`` repacks both of its operands on every call. For a 512 x 512 tile that is
a small share of the work, but a block-sparse mask's tiles are 128 x 128 (its blocks), and
there the copies come to four per visible pair (Q, K, P, V) against 1.75 for a 512 x 512
tile: 7.1-8.3 ns a pair against 6.3-6.9 on one AVX2 core (``cpu_tiles``' docstring has
the table). Here every operand is laid out once, in the order the micro-kernel reads it:

- K once per block, in panels of ``MR`` keys: ``kp[i, c, x] = k[MR * i + x, c]``;
- V once per block, in panels of ``MR`` value columns: ``vp[i, j, x] = v[j, MR * i + x]``;
- a query tile's rows once per row of tiles, scaled, in panels of ``NR`` queries:
  ``qp[i, c, y] = scale * q[NR * i + y, c]``;
- and the scores come out of the micro-kernel already laid out as the second GEMM reads
  them: the kernel computes S^T = K Q^T (keys down, a panel's ``NR`` queries across), so
  the softmax runs across queries, one vector lane per query, and P^T is the right-hand
  operand of O^T = V^T P^T as it lies. The output accumulates transposed (``ot``: value
  columns down, queries across) and goes back to the caller's (n, dv) rows once per row.

So no visible pair pays for a copy: a tile costs its two GEMMs in the micro-kernel and one
sweep of the softmax. The micro-kernel is written in LLVM IR (``_micro``): ``MR`` rows of
``NR`` accumulators (2 vectors a row: 12 of AVX2's 16 registers for ``MR`` = 6, so that
the FMAs' latency is hidden), the A operand broadcast one element at a time, the B
operand loaded as two vectors. Measured on one AVX2 core (EPYC, znver3), packed operands
of 128 x 128 x 128: 96 GFLOP/s, against sgemm's 83 on the same shapes unpacked (89.5 at
512 x 512). Where the CPU has AVX-512 the vectors are 16 floats (``LANES``), ``NR`` 32.

Keys need not start at a multiple of ``MR``: a tile from column c0 starts at the panel
holding c0 and ignores the rows before it (``c0 % MR``) and after its end, at most
``2 * MR - 2`` extra rows of S^T; values and K are zero-padded to whole panels. The
loops compute, per query panel, only the key panels some query of the panel sees (a causal
diagonal tile costs about half of a whole one), and test elements only in tiles that are
partly visible (``iv >= 0``), with ``cpu_kernels``' arithmetic: the same exp, the same
rules for rows that see nothing (m stays -inf, alpha 1) and for NaN (it reaches the row).
The result is bitwise reproducible; it differs from ``cpu_tiles``' in rounding only
(another summation order), within the same tolerance against float64.
"""

import time

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from .cpu_kernels import _FM, _fmax, _fexp_run, fexp, wide_vectors

__all__ = ["LANES", "MR", "NR", "available", "k_shape", "v_shape", "pack_k", "pack_v", "fwd_row", "warm"]


def _host_lanes():
    """Floats per vector register of this CPU for the micro-kernel: 16 with AVX-512, 8 with
    AVX2 and FMA, 0 (no packed path) without them."""
    features = llvm.get_host_cpu_features()
    if features.get("avx512f", False):
        return 16
    return 8 if features.get("avx2", False) and features.get("fma", False) else 0


LANES = _host_lanes()
MR = 6
NR = 2 * max(LANES, 8)

_F = np.float32
_ZERO, _ONE = _F(0.0), _F(1.0)


def available():
    """Does this CPU run the packed path (AVX2 with FMA, or AVX-512)?"""
    return LANES > 0


_LANES_IR = NR // 2
_f32, _i64, _i32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
_VEC, _IVEC = ir.VectorType(_f32, _LANES_IR), ir.VectorType(_i32, _LANES_IR)
_I64 = types.int64


def _const(i):
    return ir.Constant(_i64, i)


def _splat(x):
    return ir.Constant(_VEC, [float(x)] * _LANES_IR)


def _vector_intrinsic(builder, name):
    """The LLVM intrinsic ``name`` (llvm.fma, llvm.maxnum, llvm.floor) on our vectors."""
    full = f"{name}.v{_LANES_IR}f32"
    arity = 3 if name == "llvm.fma" else 2 if name == "llvm.maxnum" else 1
    return builder.module.globals.get(full) or ir.Function(builder.module, ir.FunctionType(_VEC, [_VEC] * arity), full)


def _vectors(builder, base, row, stride):
    """Pointers to the two vectors of row ``row`` (``stride`` floats a row) from float* ``base``."""
    start = builder.gep(base, [builder.mul(row, stride) if isinstance(stride, ir.Value) else builder.mul(row, _const(stride))])
    return [builder.bitcast(builder.gep(start, [_const(h * _LANES_IR)]), _VEC.as_pointer()) for h in range(2)]


def _loop(builder, count, carried):
    """Open a counted loop ``for p in range(count)`` carrying the vectors ``carried``
    (initial values); return (p, the carried phis, close), where ``close(values)`` ends the
    body with the next values and leaves the builder after the loop, returning the final
    values (``carried`` when count <= 0)."""
    entry = builder.block
    body, after = builder.append_basic_block("packed.loop"), builder.append_basic_block("packed.after")
    builder.cbranch(builder.icmp_signed(">", count, _const(0)), body, after)
    builder.position_at_end(body)
    p = builder.phi(_i64)
    p.add_incoming(_const(0), entry)
    phis = [builder.phi(x.type) for x in carried]
    for phi, x in zip(phis, carried):
        phi.add_incoming(x, entry)

    def close(values):
        following = builder.add(p, _const(1))
        end = builder.block
        p.add_incoming(following, end)
        for phi, x in zip(phis, values):
            phi.add_incoming(x, end)
        builder.cbranch(builder.icmp_signed("<", following, count), body, after)
        builder.position_at_end(after)
        finals = []
        for x, y in zip(carried, values):  # LLVM wants a block's phis first
            finals.append(builder.phi(x.type))
            finals[-1].add_incoming(x, entry)
            finals[-1].add_incoming(y, end)
        return finals

    return p, phis, close


def _micro(accumulate):
    """The micro-kernel, as a numba intrinsic: ``c[x, :] (+)= sum_p a[p, x] * b[p, :]`` for the
    ``MR`` rows x of c, where ``a`` is ``kc`` groups of ``MR`` floats, ``b`` ``kc`` groups of
    ``NR``, and c's rows lie ``ldc`` floats apart (addresses as int64). ``accumulate``
    False: c is overwritten, and the rows x with ``rlo <= x < rhi`` are also folded into the
    ``NR`` running maxima at ``mx`` (the softmax's first sweep, while the rows are still in
    registers)."""

    def codegen(context, builder, signature, args):
        a_addr, b_addr, kc, c_addr, ldc, mx_addr, rlo, rhi = args if len(args) == 8 else args + (None,) * 3
        fptr = _f32.as_pointer()
        a0, b0, c0 = (builder.inttoptr(x, fptr) for x in (a_addr, b_addr, c_addr))
        m0 = None if accumulate else builder.inttoptr(mx_addr, fptr)
        fma = _vector_intrinsic(builder, "llvm.fma")
        splat = ir.Constant(_IVEC, [0] * _LANES_IR)
        p, accs, close = _loop(builder, kc, [_splat(0)] * (2 * MR))
        bv = [builder.load(x, align=4) for x in _vectors(builder, b0, p, NR)]
        arow = builder.gep(a0, [builder.mul(p, _const(MR))])
        new = []
        for x in range(MR):
            ax = builder.load(builder.gep(arow, [_const(x)]), align=4)
            ax = builder.insert_element(ir.Constant(_VEC, ir.Undefined), ax, ir.Constant(_i32, 0))
            ax = builder.shuffle_vector(ax, ir.Constant(_VEC, ir.Undefined), splat)
            new += [builder.call(fma, [ax, bv[h], accs[2 * x + h]]) for h in range(2)]
        totals = close(new)
        if not accumulate:
            maxnum = _vector_intrinsic(builder, "llvm.maxnum")
            at_max = _vectors(builder, m0, _const(0), NR)
            best = [builder.load(x, align=4) for x in at_max]
        for x in range(MR):
            at = _vectors(builder, c0, _const(x), ldc)
            if not accumulate:
                inside = builder.and_(builder.icmp_signed("<=", rlo, _const(x)), builder.icmp_signed(">", rhi, _const(x)))
            for h in range(2):
                total = totals[2 * x + h]
                if accumulate:
                    total = builder.fadd(builder.load(at[h], align=4), total)
                else:
                    best[h] = builder.select(inside, builder.call(maxnum, [best[h], total]), best[h])
                builder.store(total, at[h], align=4)
        if not accumulate:
            for h in range(2):
                builder.store(best[h], at_max[h], align=4)
        return context.get_dummy_value()

    if accumulate:
        @intrinsic
        def micro(typingctx, a, b, kc, c, ldc):
            return types.void(*(_I64,) * 5), codegen
    else:
        @intrinsic
        def micro(typingctx, a, b, kc, c, ldc, mx, rlo, rhi):
            return types.void(*(_I64,) * 8), codegen
    return micro


_micro_set, _micro_add = _micro(False), _micro(True)

# cpu_kernels' exp (``_exp_reduced``), on vectors: e^y = 2^n e^r, n = round(y / ln 2).
_EXP = dict(log2e=1.4426950408889634, ln2_hi=0.693359375, ln2_lo=-2.12194440e-4, lo=-87.0,
            poly=(1.0, 1.0, 0.49999991059303284, 0.16666419804096222, 0.041668202728033066,
                  0.00837482325732708, 0.001383816939778626))


@intrinsic
def _exp_sweep(typingctx, pt, rows, sh, tot):
    """Rows 0..rows-1 of ``pt`` (``NR`` floats a row) become exp(pt - sh) (one shift a
    column), and ``tot`` the columns' sums: the softmax's second sweep over a tile every
    query sees, as ``cpu_kernels._fexp_run`` computes it (a NaN stays NaN)."""
    sig = types.void(*(_I64,) * 4)

    def codegen(context, builder, signature, args):
        pt_addr, rows, sh_addr, tot_addr = args
        fptr = _f32.as_pointer()
        p0, s0, t0 = (builder.inttoptr(x, fptr) for x in (pt_addr, sh_addr, tot_addr))
        floor = _vector_intrinsic(builder, "llvm.floor")
        shift = [builder.load(x, align=4) for x in _vectors(builder, s0, _const(0), NR)]
        p, sums, close = _loop(builder, rows, [_splat(0)] * 2)
        at = _vectors(builder, p0, p, NR)
        new = []
        for h in range(2):
            y = builder.fsub(builder.load(at[h], align=4), shift[h])
            lo = _splat(_EXP["lo"])
            y = builder.select(builder.fcmp_unordered(">=", y, lo), y, lo)  # NaN passes
            n = builder.call(floor, [builder.fadd(builder.fmul(y, _splat(_EXP["log2e"])), _splat(0.5))])
            r = builder.fsub(y, builder.fmul(n, _splat(_EXP["ln2_hi"])))
            r = builder.fsub(r, builder.fmul(n, _splat(_EXP["ln2_lo"])))
            poly = _splat(_EXP["poly"][6])
            for c in _EXP["poly"][5::-1]:
                poly = builder.fadd(builder.fmul(poly, r), _splat(c))
            bits = builder.shl(builder.add(builder.fptosi(n, _IVEC), ir.Constant(_IVEC, [127] * _LANES_IR)),
                               ir.Constant(_IVEC, [23] * _LANES_IR))
            e = builder.fmul(poly, builder.bitcast(bits, _VEC))
            builder.store(e, at[h], align=4)
            new.append(builder.fadd(sums[h], e))
        finals = close(new)
        for x, total in zip(_vectors(builder, t0, _const(0), NR), finals):
            builder.store(total, x, align=4)
        return context.get_dummy_value()

    return sig, codegen


@njit(inline="always", cache=True)
def _addr(x, i):
    """Address of element ``i`` of the contiguous float32 array ``x``."""
    return x.ctypes.data + 4 * i


@njit(nogil=True, cache=True)
def pack_k(k, kp):
    """K (Ck, d), any row stride, into panels of ``MR`` keys: ``kp`` (ceil(Ck / MR), d, MR),
    the rows past Ck zero."""
    ck, d = k.shape
    for i in range(kp.shape[0]):
        panel = kp[i]
        for x in range(MR):
            j = i * MR + x
            if j < ck:
                row = k[j]
                for c in range(d):
                    panel[c, x] = row[c]
            else:
                for c in range(d):
                    panel[c, x] = _ZERO


@njit(nogil=True, cache=True)
def pack_v(v, vp):
    """V (Ck, dv), any row stride, into panels of ``MR`` value columns: ``vp`` (ceil(dv /
    MR), Ck, MR), the columns past dv zero. Row by row: V is read once, in order."""
    ck, dv = v.shape
    panels = vp.shape[0]
    for j in range(ck):
        row = v[j]
        for i in range(panels):
            dst = vp[i, j]
            for x in range(MR):
                c = i * MR + x
                dst[x] = row[c] if c < dv else _ZERO


@njit(inline="always", fastmath=_FM, cache=True)
def _softmax(pt, a, b, whole, jlo, jhi, m, l, alpha, mx, sh, tot):
    """One query panel's running softmax over rows a..b-1 of ``pt`` (keys down, ``NR``
    queries across): ``pt`` becomes P^T there, and m, l, alpha become what
    ``cpu_kernels.softmax_update`` makes of them. ``whole``: every query sees every row,
    and ``mx`` already holds their maxima (``_micro_set`` folded them in); else query y
    sees rows jlo[y]..jhi[y]-1 only, and the others become 0."""
    if not whole:
        for y in range(NR):
            mx[y] = -np.inf
        for j in range(a, b):
            row = pt[j]
            for y in range(NR):
                if jlo[y] <= j and j < jhi[y]:
                    mx[y] = _fmax(mx[y], row[y])
    for y in range(NR):
        mx[y] = max(m[y], mx[y])  # m_new
        sh[y] = _ZERO if mx[y] == -np.inf else mx[y]  # a row that has seen no key shifts by 0
    if whole:
        _exp_sweep(_addr(pt, a * NR), b - a, sh.ctypes.data, tot.ctypes.data)
    else:
        for y in range(NR):
            tot[y] = _ZERO
        for j in range(a, b):
            row = pt[j]
            for y in range(NR):
                e = _fexp_run(row[y] - sh[y]) if jlo[y] <= j and j < jhi[y] else _ZERO
                row[y] = e
                tot[y] += e
    for y in range(NR):
        al = fexp(m[y] - sh[y])
        l[y] = l[y] * al + tot[y]
        m[y] = mx[y]
        alpha[y] = al


@njit(nogil=True, fastmath=_FM, cache=True)
def _fwd_row(q, kp, vp, c0, c1, iv, lo, hi, g, scale, acc, m, l):
    wide_vectors()
    n, d = q.shape
    dv = acc.shape[1]
    ck = vp.shape[1]
    panels = (n + NR - 1) // NR
    dvp = vp.shape[0] * MR
    widest = 0
    for t in range(c0.size):
        widest = max(widest, c1[t] - c0[t])
    qp = np.empty((panels, d, NR), np.float32)
    ot = np.empty((panels, dvp, NR), np.float32)
    pt = np.empty((widest + 2 * MR, NR), np.float32)
    ms, ls = np.empty((panels, NR), np.float32), np.empty((panels, NR), np.float32)
    lanes = np.empty((4, NR), np.float32)
    alpha, mx, sh, tot = lanes[0], lanes[1], lanes[2], lanes[3]
    jlo, jhi = np.zeros(NR, np.int64), np.zeros(NR, np.int64)
    # The tile's rows, scaled, and the running state, transposed into query panels (rows
    # past n: zero queries that see nothing, never written back).
    for i in range(panels):
        for y in range(NR):
            r = i * NR + y
            if r < n:
                src = q[r]
                for c in range(d):
                    qp[i, c, y] = src[c] * scale
                row = acc[r]
                for c in range(dv):
                    ot[i, c, y] = row[c]
                ms[i, y], ls[i, y] = m[r], l[r]
            else:
                for c in range(d):
                    qp[i, c, y] = _ZERO
                for c in range(dv):
                    ot[i, c, y] = _ZERO
                ms[i, y], ls[i, y] = -np.inf, _ZERO
            for c in range(dv, dvp):
                ot[i, c, y] = _ZERO
    for t in range(c0.size):
        col, w = c0[t], c1[t] - c0[t]
        first = col // MR
        off = col - first * MR  # row j of pt is key col - off + j
        whole = iv[t] < 0
        for i in range(panels):
            if whole:
                a, b = off, off + w
            else:
                a, b = off + w, off
                for y in range(NR):
                    r = i * NR + y
                    if r < n:
                        x = r // g
                        jlo[y], jhi[y] = lo[iv[t], x] + off, hi[iv[t], x] + off
                        if jhi[y] > jlo[y]:
                            a, b = min(a, jlo[y]), max(b, jhi[y])
                    else:
                        jlo[y], jhi[y] = 0, 0
                if b <= a:  # no query of this panel sees the tile
                    continue
            for y in range(NR):
                mx[y] = -np.inf
            for kb in range(a // MR, (b + MR - 1) // MR):  # S^T, and (whole tiles) each query's max
                rlo, rhi = (a - kb * MR, b - kb * MR) if whole else (0, 0)
                _micro_set(_addr(kp, (first + kb) * d * MR), _addr(qp, i * d * NR), d, _addr(pt, kb * MR * NR), NR,
                           mx.ctypes.data, rlo, rhi)
            _softmax(pt, a, b, whole, jlo, jhi, ms[i], ls[i], alpha, mx, sh, tot)
            rescale = False
            for y in range(NR):
                rescale |= alpha[y] != _ONE
            if rescale:  # the panel's max moved: O^T *= alpha, column by column
                for c in range(dv):
                    orow = ot[i, c]
                    for y in range(NR):
                        orow[y] *= alpha[y]
            for vb in range(vp.shape[0]):
                _micro_add(_addr(vp, (vb * ck + col - off + a) * MR), _addr(pt, a * NR), b - a,
                           _addr(ot, (i * dvp + vb * MR) * NR), NR)
    for i in range(panels):
        for y in range(NR):
            r = i * NR + y
            if r < n:
                row = acc[r]
                for c in range(dv):
                    row[c] = ot[i, c, y]
                m[r], l[r] = ms[i, y], ls[i, y]


def fwd_row(q, kp, vp, c0, c1, iv, lo, hi, g, scale, acc, m, l):
    """``cpu_tiles.fwd_row`` on packed K and V (``pack_k``, ``pack_v`` of the block): one
    query tile over its key tiles, merged into (acc, m, l) in place. ``q`` float32 with
    contiguous rows (any row stride); ``acc``, ``m``, ``l`` as ``cpu_tiles`` takes them."""
    _fwd_row(q, kp, vp, c0, c1, iv, lo, hi, g, _F(scale), acc, m, l)


def k_shape(ck, d):
    """The shape ``pack_k`` packs (ck, d) keys into."""
    return (-(-ck // MR), d, MR)


def v_shape(ck, dv):
    """The shape ``pack_v`` packs (ck, dv) values into."""
    return (-(-dv // MR), ck, MR)


def _array(dtype, ndim, layout="A", readonly=False):
    return types.Array(dtype, ndim, layout, readonly=readonly)


# One compiled version of each function, as ``cpu_tiles`` does (any row stride, read-only
# inputs), so every caller shares the machine code and the disk cache entry.
_IN2, _OUT1, _OUT2 = _array(types.float32, 2, readonly=True), _array(types.float32, 1), _array(types.float32, 2)
_PACKED = _array(types.float32, 3, "C")
_TILES = (_array(types.int64, 1, readonly=True),) * 3 + (_array(types.int64, 2, readonly=True),) * 2 + (types.int64,)
_SIGNATURES = {
    pack_k: (_IN2, _PACKED),
    pack_v: (_IN2, _PACKED),
    _fwd_row: (_IN2, _array(types.float32, 3, "C", readonly=True), _array(types.float32, 3, "C", readonly=True))
    + _TILES + (types.float32, _OUT2, _OUT1, _OUT1),
}
_warm = None


def warm():
    """Compile (or load from the disk cache) the packed path, once per process; return the
    seconds the first call took."""
    global _warm
    if _warm is None:
        t0 = time.perf_counter()
        for fn, signature in _SIGNATURES.items():
            fn.compile(signature)
            fn.disable_compile()
        _warm = time.perf_counter() - t0
    return _warm
