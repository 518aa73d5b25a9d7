"""The micro-kernel of the packed CPU forward (``packed``), written in LLVM IR for numba.

``micro_set`` / ``micro_add`` compute one ``MR`` x ``NR`` block of C = A B (``micro_add``:
C = alpha C + A B, one factor a column) over a sum of ``kc`` terms, with A and B packed so
that each term's operands are adjacent: A as ``kc`` groups of ``MR`` floats, B as ``kc``
groups of ``NR``. ``MR`` rows of two vectors of
accumulators stay in registers for the whole sum (12 of AVX2's 16 registers for ``MR`` =
6 and 8-float vectors: enough independent FMAs to hide their latency, with room for B's
two vectors and A's broadcast element), then go to C once. ``exp_sweep`` is the
softmax's exponential over rows of ``NR`` floats, vectorised the same way, with
``kernels``' arithmetic.

Written as IR because numba's loops give LLVM no way to keep a block of accumulators in
registers (a plain triple loop over a local array ran at a twentieth of this kernel's
speed), and LLVM's intrinsics (``llvm.fma``, ``llvm.maxnum``, ``llvm.floor`` on vectors)
are portable: the same IR compiles for 16-float vectors where the CPU has AVX-512
(``LANES``; ``NR`` = 32). The width follows the features numba compiles for: the host
CPU's, or ``NUMBA_CPU_FEATURES`` where set (so ``NUMBA_CPU_NAME=haswell`` with those
features less AVX-512 runs the AVX2 kernel on an AVX-512 machine).

A change here reaches ``packed``'s cached machine code: ``jit_cache`` flushes it when
this file changes (numba alone keys it on ``packed.py``).
"""

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

__all__ = ["LANES", "MR", "NR", "available", "micro_set", "micro_add", "exp_sweep"]


def _target_features():
    """The CPU features numba compiles for: ``NUMBA_CPU_FEATURES`` where set, else the host's."""
    from numba.core import config

    if config.CPU_FEATURES is not None:
        return {f[1:]: f[0] == "+" for f in config.CPU_FEATURES.split(",") if f[:1] in ("+", "-")}
    return llvm.get_host_cpu_features()


def _host_lanes():
    """Floats per vector register for the micro-kernel on the CPU numba compiles for: 16 with
    AVX-512, 8 with AVX2 and FMA, 0 (no packed path) without them."""
    features = _target_features()
    if features.get("avx512f", False):
        return 16
    return 8 if features.get("avx2", False) and features.get("fma", False) else 0


LANES = _host_lanes()
MR = 6
NR = 2 * max(LANES, 8)


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
    """The micro-kernel, as a numba intrinsic: ``c[x, :] = sum_p a[p, x] * b[p, :]`` for the
    ``MR`` rows x of c, where ``a`` is ``kc`` groups of ``MR`` floats, ``b`` ``kc`` groups
    of ``NR``, and c's rows lie ``ldc`` floats apart (addresses as int64).
    ``accumulate`` True: ``c[x, :] = alpha * c[x, :] + sum_p ...``, with the ``NR`` factors
    at ``alpha``: the online softmax's rescale of the output, on the rows while they pass
    through registers anyway (a separate sweep over them cost 10 % of a 128-key tile here).
    ``accumulate`` False: c is overwritten, and the rows x with ``rlo <= x < rhi`` are also
    folded into the ``NR`` running maxima at ``mx`` (the softmax's first sweep, while the
    rows are still in registers)."""

    def codegen(context, builder, signature, args):
        if accumulate:
            a_addr, b_addr, kc, c_addr, ldc, alpha_addr = args
        else:
            a_addr, b_addr, kc, c_addr, ldc, mx_addr, rlo, rhi = args
        fptr = _f32.as_pointer()
        a0, b0, c0 = (builder.inttoptr(x, fptr) for x in (a_addr, b_addr, c_addr))
        m0 = None if accumulate else builder.inttoptr(mx_addr, fptr)
        if accumulate:
            alpha = [builder.load(x, align=4) for x in _vectors(builder, builder.inttoptr(alpha_addr, fptr), _const(0), NR)]
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
                if accumulate:  # rounded as alpha * c, then + the sum: as a separate rescale would
                    total = builder.fadd(builder.fmul(builder.load(at[h], align=4), alpha[h]), total)
                else:
                    best[h] = builder.select(inside, builder.call(maxnum, [best[h], total]), best[h])
                builder.store(total, at[h], align=4)
        if not accumulate:
            for h in range(2):
                builder.store(best[h], at_max[h], align=4)
        return context.get_dummy_value()

    if accumulate:
        @intrinsic
        def micro(typingctx, a, b, kc, c, ldc, alpha):
            return types.void(*(_I64,) * 6), codegen
    else:
        @intrinsic
        def micro(typingctx, a, b, kc, c, ldc, mx, rlo, rhi):
            return types.void(*(_I64,) * 8), codegen
    return micro


micro_set, micro_add = _micro(False), _micro(True)

# kernels' exp (``_exp_reduced``), on vectors: e^y = 2^n e^r, n = round(y / ln 2).
_EXP = dict(log2e=1.4426950408889634, ln2_hi=0.693359375, ln2_lo=-2.12194440e-4, lo=-87.0, hi=88.0,
            poly=(1.0, 1.0, 0.49999991059303284, 0.16666419804096222, 0.041668202728033066,
                  0.00837482325732708, 0.001383816939778626))


@intrinsic
def exp_sweep(typingctx, pt, rows, sh, tot):
    """Rows 0..rows-1 of ``pt`` (``NR`` floats a row) become exp(pt - sh) (one shift a
    column), and ``tot`` the columns' sums: the softmax's second sweep over the rows every
    query of a panel sees. As ``kernels.fexp`` computes it, exactly 0 below -87, but a
    NaN stays NaN (a NaN score must reach its row)."""
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
            # Clamped to [-87, 88] (NaN to -87) before the arithmetic, whose float-to-int
            # conversion must not see a NaN or an infinity; the result is 0 below -87, and
            # NaN for a NaN.
            lo, hi = _splat(_EXP["lo"]), _splat(_EXP["hi"])
            kept = builder.fcmp_ordered(">=", y, lo)
            nan = builder.fcmp_unordered("uno", y, y)
            z = builder.select(kept, y, lo)
            z = builder.select(builder.fcmp_ordered("<=", z, hi), z, hi)
            n = builder.call(floor, [builder.fadd(builder.fmul(z, _splat(_EXP["log2e"])), _splat(0.5))])
            r = builder.fsub(z, builder.fmul(n, _splat(_EXP["ln2_hi"])))
            r = builder.fsub(r, builder.fmul(n, _splat(_EXP["ln2_lo"])))
            poly = _splat(_EXP["poly"][6])
            for c in _EXP["poly"][5::-1]:
                poly = builder.fadd(builder.fmul(poly, r), _splat(c))
            bits = builder.shl(builder.add(builder.fptosi(n, _IVEC), ir.Constant(_IVEC, [127] * _LANES_IR)),
                               ir.Constant(_IVEC, [23] * _LANES_IR))
            e = builder.select(kept, builder.fmul(poly, builder.bitcast(bits, _VEC)), _splat(0))
            e = builder.select(nan, y, e)
            builder.store(e, at[h], align=4)
            new.append(builder.fadd(sums[h], e))
        finals = close(new)
        for x, total in zip(_vectors(builder, t0, _const(0), NR), finals):
            builder.store(total, x, align=4)
        return context.get_dummy_value()

    return sig, codegen
