"""The CPU backend (``CpuBackend``): FlashAttention-2 style tiled local attention on host memory.

Array layouts (row-major, chosen so that a tile of Q rows for one KV head is one
contiguous matrix and a GEMM covers the whole query-head group at once):

    query side  q, do, dq, acc : (B, Zkv, C, g, d)     g = Z // Zkv query heads per KV head
    row scalars D, lse, m, l   : (B, Zkv, C, g)
    key side    k, v, dk, dv   : (B, Zkv, C, d)

A tile is ``Tq`` tokens of the query side (``Tq * g`` GEMM rows, about ``tile_q``)
against ``Tk`` tokens of the key side. No array larger than a tile is ever created
beyond the O(C * heads * d) operands, so memory is linear in the local length. Those
operands (converted K/V blocks, accumulators) and the results' storage are reused from
call to call (``workspace``: fresh memory costs page faults on every call).

Computation runs in the accumulation dtype (float32, or float64 for float64 inputs):
float16/bfloat16 blocks are converted once per block (each key tile is read by every
query tile), since BLAS has no fast half-precision GEMM. The running softmax state
(acc, m, l) is unnormalised and lives across ring steps, so each step's block merges into
it inside the tile loop exactly as FlashAttention-2 merges one K tile into the next.

A query tile's loop over its key tiles is ``self.ops``'s ``fwd_row``, and ``bwd_rows``
runs the backward's loops of several query tiles in one call; both are
compiled with numba in ``tiles`` (BLAS's sgemm called from machine code, fused
elementwise sweeps between the GEMMs) or in NumPy in ``numpy_tiles``
(``BURSTMPI_CPU_KERNELS``). The float32 forward runs on ``packed`` instead where the
CPU has its micro-kernel and a block's keys meet enough query rows to pay for packing K
and V once (``BURSTMPI_CPU_GEMM``). ``tile_plan`` plans the tiles (and keeps the plans
from call to call); this module converts
and packs the blocks and hands the tiles out. Work items (a
query tile of one batch and KV head, or in the backward a band of them; for the sweeps
over whole blocks, zeroing and writing results out, a range of tokens) run on
``threads`` threads (``threads.Workers``), each writing only its own rows in a fixed tile
order: results are bitwise reproducible.
"""

import numpy as np

from ..._config import settings
from ..._validate import check_out
from .. import jit_cache
from . import decode as cpu_decode, numpy_tiles
from .tile_plan import TilePlans, runs as _runs
from .threads import Workers
from .workspace import OutputPool, Workspace

__all__ = ["CpuBackend"]

# Query tiles per call of the tile loops on one thread (the backward's, and the packed
# forward's): the Python around a call (views, checks, numba's dispatch) is paid once for
# several tiles, and ``poll`` still moves the transfers between calls, every few milliseconds.
_ROWS_PER_CALL = 8


def _rows_contiguous(x):
    """Are the last axis's elements adjacent (any strides elsewhere)? Such blocks go to the
    tile loops as they lie: their GEMMs take each matrix's row stride."""
    return x.ndim == 0 or x.shape[-1] <= 1 or x.strides[-1] == x.itemsize


def _slabs_contiguous(x):
    """Is every ``x[b, z]`` C-contiguous (a received packet's key-side rows are, but for
    padding rows between slabs)?"""
    want = x.itemsize
    for n, stride in zip(x.shape[:1:-1], x.strides[:1:-1]):
        if n > 1 and stride != want:
            return False
        want *= n
    return True


def _tile_rows(x, b, z, r0, r1):
    """``x[b, z, r0:r1]`` as (rows, width) or (rows,): the tile's own rows of an accumulator,
    a view (a copy would lose what the loops add)."""
    part = x[b, z, r0:r1]  # (tokens, g[, width])
    rows = part.reshape((-1,) + x.shape[4:])
    if part.size and not np.may_share_memory(rows, x):
        raise AssertionError(f"numpy backend: an accumulator of shape {x.shape} and strides {x.strides} "
                             "has tiles that are not views")
    return rows


def _ops(setting):
    """The tile loops for ``setting`` ("auto", "numba" or "numpy")."""
    if setting == "numpy":
        return numpy_tiles
    try:  # numba is a dependency, but the CPU backend must work without it
        from . import tiles
    except ImportError as e:
        if setting == "numba":
            raise RuntimeError(f"BURSTMPI_CPU_KERNELS=numba: the compiled CPU tile loops are unavailable ({e}); "
                               "pip install numba, or set BURSTMPI_CPU_KERNELS=numpy") from None
        if settings().blas == "mkl":  # asked for by name: not quietly the slow loops instead
            raise RuntimeError(f"the compiled CPU tile loops are unavailable: {e}") from None
        return numpy_tiles
    return tiles  # warmed by CpuBackend, with the packed path: one first-use notice


def _packed(ops, setting):
    """``packed`` where the float32 forward's tiles may run on it (the compiled loops, a CPU
    with its micro-kernel, BURSTMPI_CPU_GEMM not "blas"), else None."""
    if setting == "blas" or ops is numpy_tiles:  # the NumPy loops (BURSTMPI_CPU_KERNELS=numpy) have their own GEMMs
        return None
    from . import packed

    if not packed.available():
        if setting == "packed":
            raise RuntimeError("BURSTMPI_CPU_GEMM=packed: the micro-kernel needs a CPU with AVX2 and FMA, or AVX-512")
        return None
    return packed


class CpuBackend:
    """Local attention kernels on host memory: the backend named "cpu" (``backend="cpu"``;
    "numpy" is its old name)."""

    name = "cpu"
    xp = np

    def __init__(self, tile_q=512, tile_k=512, threads=1, kernels="auto", gemm="auto"):
        self.tile_q, self.tile_k = tile_q, tile_k
        self.ops = _ops(kernels)  # numpy_tiles (NumPy) or tiles (numba)
        self.packed = _packed(self.ops, gemm)  # packed, for the float32 forward, or None
        # Compiled, or loaded from the disk cache, once per process; a first compile says so
        # on rank 0 (about 20 s that used to pass in silence).
        jit_cache.first_use("the CPU tile loops", [m for m in (self.ops, self.packed) if hasattr(m, "_SIGNATURES")])
        self.pack_always = gemm == "packed"
        self.workers = Workers(threads)
        # The converted K/V blocks and the accumulators, kept from call to call, and the
        # results' storage, recycled once the caller drops them (``workspace``'s docstring
        # says why); the workers keep their tile scratch.
        self.workspace, self.outputs = Workspace(), OutputPool()
        self.plans = TilePlans(tile_q, tile_k)

    @property
    def threads(self):
        return self.workers.n

    @property
    def held_bytes(self):
        """Bytes kept between calls: working arrays, the workers' scratch and the free blocks
        of the output pool (``release()`` frees them)."""
        return self.workspace.nbytes + self.outputs.nbytes + sum(s.nbytes for s in self.workers.scratch)

    def release(self):
        """Free the working arrays, scratch and pooled output blocks (allocated again on the
        next call)."""
        self.workspace.clear()
        self.outputs.clear()
        self.plans.clear()
        for s in self.workers.scratch:
            s.clear()

    def _ops_for(self, cd):
        """The compiled loops are float32; float64 (the reference precision) stays on NumPy."""
        return self.ops if cd == np.float32 else numpy_tiles

    def _convert(self, x, out):
        """``x`` copied into ``out`` (the accumulation dtype): float16/bfloat16 by the compiled
        widening where there is one (NumPy's half casts are 4-20x slower)."""
        if out.dtype == np.float32 and x.dtype.itemsize == 2:
            return self._ops_for(out.dtype).widen(x, out)
        np.copyto(out, x)
        return out

    def _rows(self, x, cd, scratch, key, copy=False):
        """A tile's query-side rows (n, d) in the accumulation dtype with contiguous rows:
        ``x`` itself when it already is (the tile loops take any row stride) and not
        ``copy``, else converted into this worker's scratch ``key``. The backward copies
        dO, an operand of two GEMMs a tile (see ``_blocks`` for rows 4 KB apart)."""
        if x.dtype == cd and _rows_contiguous(x) and not copy:
            return x
        return self._convert(x, scratch.array(key, x.shape, cd))

    def _blocks(self, k, v, cd):
        """The key-side blocks (B, Zkv, C, d) in the accumulation dtype with every (batch, KV
        head) slab C-contiguous: a received packet's rows as they are, else converted once
        per block (each of its tiles is read by many items) into the workspace, a slab per
        work item on the workers, before the tiles start (converting each head's slabs as
        its first item needed them, overlapped with the other threads' tiles, measured no
        faster: the copies compete with the GEMMs for memory). The caller's own K and V
        have rows heads * d apart, 4 KB at 8 heads of 128, so every row of a tile falls in
        the same L1 set: read in place (with the accumulators' rows as far apart) the 8K
        forward ran ~5 % slower than with copies (one thread, alternating runs)."""
        done, work = [], []
        for slot, x in (("k", k), ("v", v)):
            if x.dtype == cd and _slabs_contiguous(x):
                done.append(x)
                continue
            out = self.workspace.array(slot, x.shape, cd)
            done.append(out)
            work += [(x[b, z], out[b, z]) for b in range(x.shape[0]) for z in range(x.shape[1])]
        if work:
            self.workers.run(work, lambda it, scratch: self._convert(*it))
        return done

    def resident_keys(self, k, v, acc):
        """The key side of a phase whose K and V stay home at every step (the burst
        backward), as every step's tiles read it: converted once here instead of once per
        step (each ``_blocks`` then takes it as it is): {k, v}. A converted copy lives in
        the workspace's "k"/"v" slots, which the next conversion of other keys overwrites:
        only for a phase in which no other key block is converted (the two-level two-way
        backward, whose travelling K/V would be, reads its home keys as they are)."""
        k, v = self._blocks(k, v, np.dtype(acc))
        return {"k": k, "v": v}

    @staticmethod
    def alloc(nbytes):
        return np.empty(nbytes, dtype=np.uint8)

    def output(self, shape, dtype):
        """A new array for a result the caller keeps (``OutputPool``)."""
        return self.outputs.empty(shape, dtype)

    @staticmethod
    def acc_dtype(dtype):
        return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)

    def _plan(self, g, qb, kb, blocks=None):
        """The tile plan of a block pair (``TilePlans``), kept for the next call."""
        return self.plans.get(g, qb, kb, blocks)[0]

    # -- forward ----------------------------------------------------------------------

    # The running state and the gradient accumulators are workspace slots: the query side's
    # accumulator is one slot for both phases (a forward's is copied out before it returns).

    def fwd_state(self, B, Zkv, C, g, dv, acc):
        """Zeroed running state (acc, m, l) for C query tokens, in the workspace."""
        ws = self.workspace
        return (self._zeros("q_acc", (B, Zkv, C, g, dv), acc), ws.array("m", (B, Zkv, C, g), acc, -np.inf),
                ws.array("l", (B, Zkv, C, g), acc, 0))

    def bwd_state(self, B, Zkv, C, g, d, dv, acc):
        """Zeroed gradient accumulators {dq, dk, dv}: (B, Zkv, C, g, d), (B, Zkv, C, d), (B, Zkv, C, dv),
        in the workspace."""
        return {"dq": self._zeros("q_acc", (B, Zkv, C, g, d), acc), "dk": self._zeros("k_acc", (B, Zkv, C, d), acc),
                "dv": self._zeros("v_acc", (B, Zkv, C, dv), acc)}

    # -- passes over whole blocks, on the workers ------------------------------------------

    def _by_tokens(self, x, fn):
        """``fn(lo, hi)`` for ranges of tokens (axis 2 of the (B, Zkv, C, ...) array ``x``,
        about a megabyte each) on the workers: the sweeps of a whole block outside the tile
        loops (zeroing, copying results out) take the rank's cores too, and a range of
        tokens of every head at once is one contiguous run of each batch entry of a result in
        the caller's (B, C, heads, d) layout (one head's rows lie heads * d apart there)."""
        C = x.shape[2]
        self._spans(C, max(1, (1 << 20) // max(1, x.nbytes // max(C, 1))), fn)

    def _spans(self, n, per, fn):
        """``fn(lo, hi)`` for ranges of ``per`` of ``range(n)``, on the workers."""
        self.workers.run([(lo, min(n, lo + per)) for lo in range(0, n, per)], lambda span, scratch: fn(*span))

    def _zeros(self, slot, shape, dtype):
        x = self.workspace.array(slot, shape, dtype)
        self._by_tokens(x, lambda lo, hi: x[:, :, lo:hi].fill(0))
        return x

    def store(self, dst, src, scale=None, divisor=None):
        """``dst[...] = src`` times ``scale``, in ``dst``'s dtype: one pass, on the workers
        (the backends' interface). ``dst`` may have any strides (the ring gives a view of
        the caller's layout); the arithmetic is in ``src``'s dtype, then rounded once to
        ``dst``'s, as an in-place scale and a copy would. ``divisor`` (one value per row,
        ``src.shape[:-1]``) divides instead: ``fwd_finalize``'s normalisation."""
        if scale is not None:
            scale = src.dtype.type(scale)

        def part(lo, hi):
            s, o = src[:, :, lo:hi], dst[:, :, lo:hi]
            if divisor is not None:
                np.divide(s, divisor[:, :, lo:hi, ..., None], out=o, casting="unsafe")
            elif scale is not None:
                np.multiply(s, scale, out=o, casting="unsafe")
            else:
                np.copyto(o, s, casting="unsafe")

        self._by_tokens(src, part)

    def fwd_block(self, q, k, v, state, qb, kb, scale, poll=None, blocks=None):
        """Merge attention of queries ``q`` over the block (k, v) into ``state``.

        ``qb``, ``kb``: the ``masks._intervals.Block`` of the query and key rows; ``blocks``:
        a block-sparse mask's ``masks._blocks.BlockFilter`` on top of them. One work item is a
        query tile of one (batch, KV head) against every key tile it sees, on the workers
        (``_fwd_runs``: a few of them on one thread); ``poll`` runs meanwhile."""
        acc, m, l = state
        B, Zkv, C, g, d = q.shape
        cd = acc.dtype
        ops = self._ops_for(cd)
        tiling, kept = self.plans.get(g, qb, kb, blocks)
        packed = self._pack(k, v, tiling, g, cd)
        if packed is None:
            k, v = self._blocks(k, v, cd)
        elif self.workers.n == 1 and tiling:
            self._fwd_runs(q, packed, (acc, m, l), _runs(tiling, -(-len(tiling) // _ROWS_PER_CALL), kept), scale, poll)
            return
        width = max((int((t[1] - t[0]).max()) for _, _, t in tiling), default=0)

        def item(it, scratch):
            b, z, r0, r1, tiles = it
            n = (r1 - r0) * g
            rows = self._rows(q[b, z, r0:r1].reshape(n, d), cd, scratch, "q")
            state = _tile_rows(acc, b, z, r0, r1), _tile_rows(m, b, z, r0, r1), _tile_rows(l, b, z, r0, r1)
            if packed:
                self.packed.fwd_row(rows, packed[0][b, z], packed[1][b, z], *tiles, g, scale, *state)
            else:
                ops.fwd_row(rows, k[b, z], v[b, z], *tiles, g, scale, *state, scratch.array("qs", (n * d,), cd),
                            scratch.array("s", (n * width,), cd), scratch.array("alpha", (n,), cd))

        # Head by head (the threads then share one head's K and V in cache), each head's
        # longest rows first (a causal mask's last query tiles see the most key tiles), so
        # the last items are short and the threads finish together. Each item writes only
        # its own rows: the order does not change the result.
        tiling = sorted(tiling, key=lambda row: -len(row[2][0]))
        items = [(b, z, r0, r1, tiles) for b in range(B) for z in range(Zkv) for r0, r1, tiles in tiling]
        self.workers.run(items, item, poll)

    def _fwd_runs(self, q, packed, state, bands, scale, poll):
        """``fwd_block`` on one thread on the packed micro-kernel: a few query tiles per call
        (``_ROWS_PER_CALL``, in the plan's order, the backward's runs), so that the Python
        around each call is paid once for several tiles."""
        B, Zkv, C, g, d = q.shape

        def item(it, scratch):
            b, z, i = it
            t0, t1, tiles = bands[i]
            n = (t1 - t0) * g
            rows = self._rows(q[b, z, t0:t1].reshape(n, d), state[0].dtype, scratch, "q")
            self.packed.fwd_rows(rows, packed[0][b, z], packed[1][b, z], tiles, g, scale,
                                 *(_tile_rows(x, b, z, t0, t1) for x in state))

        self.workers.run([(b, z, i) for b in range(B) for z in range(Zkv) for i in range(len(bands))], item, poll)

    def _pack(self, k, v, tiling, g, cd):
        """(kp, vp): the block's K and V packed for ``packed`` (a (batch, KV head) slab per
        work item, on the workers) when the forward's tiles take that path, else None. It
        does for float32 where the backend has it and the keys meet 512 query rows or more
        on average (BURSTMPI_CPU_GEMM=packed: always): packing copies each key's K and V
        rows once, about what a few hundred of its pairs save on the micro-kernel."""
        if self.packed is None or cd != np.float32:
            return None
        B, Zkv, Ck, d = k.shape
        if not self.pack_always and g * sum((r1 - r0) * int((t[1] - t[0]).sum()) for r0, r1, t in tiling) < 512 * Ck:
            return None
        if k.dtype != cd or v.dtype != cd or not (_rows_contiguous(k) and _rows_contiguous(v)):
            k, v = self._blocks(k, v, cd)  # else packed from where the rows lie (each read once)
        out = [self.workspace.array(slot, (B, Zkv) + self.packed.packed_shape(slot[0], *x.shape[2:]), cd)
               for slot, x in (("kp", k), ("vp", v))]

        def pack(it, scratch):
            self.packed.pack("k", k[it], out[0][it])
            self.packed.pack("v", v[it], out[1][it])

        self.workers.run([(b, z) for b in range(B) for z in range(Zkv)], pack)
        return out

    # -- decode (burstmpi._decode.cache) --------------------------------------------------------

    def decode(self, q, k, v, kpos, n, qpos0, left, scale, out, lse):
        """T new queries over the first ``n`` rows of a cache shard: a normalised partial
        written into ``out`` and ``lse`` (``decode``)."""
        cpu_decode.decode(q, k, v, kpos, n, qpos0, left, scale, out, lse, rows=self.tile_q)

    @staticmethod
    def combine(parts_out, parts_lse, out, lse):
        """Merge normalised partials in a fixed order (``decode.combine``)."""
        cpu_decode.combine(parts_out, parts_lse, out, lse)

    def fwd_finalize(self, state, dtype, out=None):
        """Return (out, lse) from the running state; rows that saw no key give 0 and -inf.

        With ``out`` (B, Zkv, C, g, dv), of any strides (the ring passes a view of the
        caller's layout), the normalised rows are written there in its dtype, in one pass
        on the workers. Without, ``acc`` is normalised in place and returned: the
        accumulation dtype, and the workspace's array, valid until the next ``fwd_state``
        or ``bwd_state``.
        """
        acc, m, l = state
        check_out("fwd_finalize", out, acc.shape, dtype)
        seen = l != 0  # NaN too: a NaN in q, k or v reaches the row's out and lse, never a silent 0
        l_safe = np.where(seen, l, 1)
        if out is None:
            acc /= l_safe[..., None]
            out = acc
        else:
            self.store(out, acc, divisor=l_safe)
        lse = np.where(seen, m + np.log(l_safe), -np.inf)
        return out, lse

    # -- backward ---------------------------------------------------------------------

    def bwd_preprocess(self, dout, out, Zkv, acc):
        """D = rowsum(dout * out) as (B, Zkv, C, g), from (B, C, Z, dv) arrays; a few
        hundred tokens at a time on the workers, so the products are small temporaries,
        not one as large as ``out`` in fresh memory (each row's sum is the same either way)."""
        B, C, Z, dv = dout.shape
        D = np.empty((B, C, Z), acc)

        def part(lo, hi):
            D[:, lo:hi] = (dout[:, lo:hi].astype(acc, copy=False) * out[:, lo:hi].astype(acc, copy=False)).sum(axis=-1)

        self._spans(C, max(1, (1 << 18) // max(1, B * Z * dv)), part)
        return D.reshape(B, C, Zkv, Z // Zkv).transpose(0, 2, 1, 3)

    def bwd_block(self, q, do, D, lse, k, v, dq, dk, dv, qb, kb, scale, poll=None, blocks=None):
        """Accumulate the gradients of one (query block, key block) pair.

        ``lse`` must hold +inf (not -inf) for rows that see no key, so that
        exp(s - lse) is 0 there. ``dq`` accumulates dS @ K without the softmax scale
        (the owner applies it once); ``dk`` and ``dv`` are complete. ``dq=None`` or
        ``dk=dv=None`` computes only the other side's gradients (the two-way ring).

        A work item is a band of query tiles of one (batch, KV head) against every key
        tile they see, run in one call of the tile loops (``bwd_rows``): it owns its rows of
        ``dq``, and adds into ``dk``/``dv`` directly when it is its head's only band; with
        fewer heads than twice the workers, a head is cut into bands whose ``dk``/``dv``
        partials are added afterwards in band order. On one thread a band is a few query
        tiles (``_ROWS_PER_CALL``), in the same order, so that ``poll`` runs between them.
        """
        B, Zkv, C, g, d = q.shape
        dvd = v.shape[-1]
        cd = (dq if dq is not None else dk).dtype
        ops = self._ops_for(cd)
        k, v = self._blocks(k, v, cd)
        Ck = k.shape[2]
        tiling, kept = self.plans.get(g, qb, kb, blocks)
        if not tiling:
            return
        width = max(int((t[1] - t[0]).max()) for _, _, t in tiling)
        tall = max(r1 - r0 for r0, r1, _ in tiling) * g
        if self.workers.n > 1:
            count = -(-2 * self.workers.n // (B * Zkv))
        else:
            count = -(-len(tiling) // _ROWS_PER_CALL)
        bands = _runs(tiling, count, kept)
        split = dk is not None and self.workers.n > 1 and len(bands) > 1
        if split:  # each band's own dK/dV partial, added in band order afterwards
            dk_parts = self.workspace.array("dk_parts", (B, Zkv, len(bands), Ck, d), cd, 0)
            dv_parts = self.workspace.array("dv_parts", (B, Zkv, len(bands), Ck, dvd), cd, 0)

        def item(it, scratch):
            b, z, i = it
            t0, t1, rows = bands[i]
            if dk is None:
                dk_h = dv_h = None
            elif split:
                dk_h, dv_h = dk_parts[b, z, i], dv_parts[b, z, i]
            else:
                dk_h, dv_h = dk[b, z], dv[b, z]
            n = (t1 - t0) * g
            ops.bwd_rows(self._rows(q[b, z, t0:t1].reshape(n, d), cd, scratch, "q"),
                         self._rows(do[b, z, t0:t1].reshape(n, dvd), cd, scratch, "do", copy=True),
                         D[b, z, t0:t1].reshape(n).astype(cd, copy=False),
                         lse[b, z, t0:t1].reshape(n).astype(cd, copy=False),
                         k[b, z], v[b, z], rows, g, scale,
                         None if dq is None else _tile_rows(dq, b, z, t0, t1), dk_h, dv_h,
                         scratch.array("qs", (tall * d,), cd), scratch.array("p", (tall * width,), cd),
                         scratch.array("ds", (tall * width,), cd))

        self.workers.run([(b, z, i) for b in range(B) for z in range(Zkv) for i in range(len(bands))], item, poll)
        if split:
            for b in range(B):
                for z in range(Zkv):
                    for i in range(len(bands)):  # band order: deterministic
                        dk[b, z] += dk_parts[b, z, i]
                        dv[b, z] += dv_parts[b, z, i]
