"""The local work of a ring step on burstmpi's CUDA kernels (cuda/), for any launcher.

``KernelBackend`` implements the backend interface of ``burstmpi._ring.flat`` by describing
kernel launches (``burstmpi._gpu.kernels``) on the arrays the ring hands it, in the same
working layouts as the CPU backend:

    query side  q, do, dq, acc : (B, Zkv, C, g, d)     row scalars D, lse, m, l : (B, Zkv, C, g)
    key side    k, v, dk, dv   : (B, Zkv, C, d)

Any strides are fine: the kernels address a query row by (batch, token, KV head, head in
group) and a key row by (batch, token, KV head), so the ring's views of the caller's
arrays and its contiguous packets go in unchanged.

Masks arrive as ``burstmpi.masks._intervals.Block`` s (host int64 arrays): for the query rows their
positions and the interval of key positions each row sees, for the key rows their
positions and the interval of query positions that see each. The kernels take the three
arrays each needs as int32 device copies, cached (see ``_device_ints``).

A block may have no rows at all (a rank holding no token when the sequence is shorter
than the ring): every launch goes through ``_run``, which never starts an empty grid, and
a block pair of which one side has no rows launches nothing.

Decode (``burstmpi.KVCache``) adds two local operations: ``decode`` attends T new query
tokens to the first n rows of a cache shard (split-KV: the cache is cut in chunks that run
in parallel, each leaving a normalised partial in a workspace bounded by
``kernels.DECODE_MAX_SPLITS``, never by n), and ``combine`` merges normalised partials
(out, lse) in a fixed order, the splits of one decode and the ranks' results alike.

What runs the launches is the subclass's business: ``CupyBackend`` on a GPU, and the
tests' emulator (tests/kernel_harness.py) on the CPU, with NumPy arrays standing in for
device memory. Everything between the ring and the launch is therefore tested in CI.
"""

from typing import NamedTuple

import numpy as np

from .._gpu import decode_launch, kernels
from .._interop import bfloat16
from .._validate import check_out

__all__ = ["KernelBackend"]


def _dtype_name(dtype):
    dtype = np.dtype(dtype)
    if bfloat16 is not None and dtype == bfloat16:
        return "bfloat16"
    if dtype in (np.float16, np.float32):
        return dtype.name
    raise ValueError(f"backend 'cuda': dtype: expected float16, bfloat16 or float32, got {dtype}")


class _Ptrs(NamedTuple):
    """Device addresses of a block's int32 row arrays."""
    pos: int
    first: int
    last: int


class KernelBackend:
    """Backend interface over ``burstmpi._gpu.kernels`` launches; subclasses provide
    ``xp``, ``ptr(array)``, ``to_device(host_array)`` and ``launch(spec)`` (never called
    with an empty grid)."""

    name = "cuda"
    xp = np
    # dQ and dK/dV are separate kernels: the two-way ring's split backward costs nothing extra.
    split_backward_free = True

    def __init__(self, smem_limit=kernels.SMEM_LIMIT["sm_80"]):
        self.smem_limit = smem_limit
        self._ints = {}
        self._planes = {}  # id(filter) -> (filter, device plane): see _bitmap
        self._decode_modules = {}  # V head dim -> the (dtype, d, dv) module decode last used

    # -- what a subclass provides ------------------------------------------------------

    @staticmethod
    def ptr(a):
        """The address of ``a``'s first element."""
        raise NotImplementedError

    def to_device(self, a):
        raise NotImplementedError

    def launch(self, spec):
        raise NotImplementedError

    # -- memory -------------------------------------------------------------------------

    def alloc(self, nbytes):
        return self.xp.empty(nbytes, dtype=np.uint8)

    def output(self, shape, dtype):
        """A new array for a result the caller keeps (from CuPy's memory pool)."""
        return self.xp.empty(shape, dtype)

    @staticmethod
    def acc_dtype(dtype):
        _dtype_name(dtype)
        return np.dtype(np.float32)

    def _grouped(self, a):
        """A (B, Zkv, C, g[, d]) query-side array as kernel strides."""
        s = [x // a.itemsize for x in a.strides]
        return kernels.Grouped(self.ptr(a), s[0], s[2], s[1], s[3])

    def _keyed(self, a):
        """A (B, Zkv, C, d) key-side array as kernel strides."""
        s = [x // a.itemsize for x in a.strides]
        return kernels.Strided(self.ptr(a), s[0], s[2], s[1])

    _INTS_KEPT = 256

    def _kept(self, key, make):
        """The device array ``make()`` copies from the host, kept under ``key`` (its
        content) for reuse: a plan asks for the same few arrays (a handful per rank) on
        every step of every call, so only its first call copies them to the device. The
        least recently used copy goes first."""
        dev = self._ints.pop(key, None)
        if dev is None:
            if len(self._ints) >= self._INTS_KEPT:
                del self._ints[next(iter(self._ints))]
            dev = make()
        self._ints[key] = dev  # (re)inserted last: the most recently used
        return dev

    def _device_ints(self, a):
        """The device address of an int32 copy of a host array of token positions (a
        block's positions, or the first/last bounds of its rows' intervals), kept for reuse
        (``_kept``)."""
        a = np.asarray(a)

        def make():
            lo, hi = (int(a.min()), int(a.max())) if len(a) else (0, 0)
            if hi >= 2 ** 31 or lo < -2 ** 31:
                raise ValueError(f"backend 'cuda': positions: expected int32 values (< 2**31), "
                                 f"got {lo} .. {hi}")
            return self.to_device(a.astype(np.int32))

        return self.ptr(self._kept(("int32", a.dtype.str, len(a), a.tobytes()), make))

    def device_rows(self, rows):
        """A device copy of ``rows`` (a host array of local row indices: the rows of a
        packet, in packet order), kept for reuse (``_kept``): the ring gathers and scatters
        its packets' rows with it on every call."""
        rows = np.asarray(rows)
        return self._kept(("rows", rows.dtype.str, len(rows), rows.tobytes()),
                          lambda: self.to_device(np.ascontiguousarray(rows)))

    @staticmethod
    def _rows(fn, qb, kb, cq, ck):
        """The kernels read one bound per row: a Block shorter than its rows would be read
        past its end on the device, where nothing catches it."""
        for name, block, n in (("qb", qb, cq), ("kb", kb, ck)):
            if not len(block.pos) == len(block.first) == len(block.last) == n:
                raise ValueError(f"backend 'cuda': {fn}: {name}: expected {n} rows, got "
                                 f"{(len(block.pos), len(block.first), len(block.last))}")
        return cq and ck

    def _run(self, spec):
        """Launch ``spec`` unless its grid is empty (a block of 0 rows): CUDA rejects a
        grid with a 0 dimension, and there is nothing to compute."""
        if 0 not in spec.grid:
            self.launch(spec)

    # -- the interface of burstmpi._ring.flat --------------------------------------------------

    def fwd_state(self, B, Zkv, C, g, dv, acc):
        xp = self.xp
        return (xp.zeros((B, Zkv, C, g, dv), np.float32), xp.full((B, Zkv, C, g), -np.inf, np.float32),
                xp.zeros((B, Zkv, C, g), np.float32))

    def bwd_state(self, B, Zkv, C, g, d, dv, acc):
        """Zeroed gradient accumulators {dq, dk, dv}: (B, Zkv, C, g, d), (B, Zkv, C, d), (B, Zkv, C, dv)."""
        xp = self.xp
        return {"dq": xp.zeros((B, Zkv, C, g, d), acc), "dk": xp.zeros((B, Zkv, C, d), acc),
                "dv": xp.zeros((B, Zkv, C, dv), acc)}

    def _ptrs(self, block):
        """Device addresses of a Block's int32 positions, first and last ends (``_device_ints``)."""
        return _Ptrs(*(self._device_ints(x) for x in (block.pos, block.first, block.last)))

    def _bitmap(self, blocks, qb, kb):
        """The ``kernels.Bitmap`` of a block-sparse filter for a block pair, or None: the
        plane on the device (kept per filter, ``_PLANES_KEPT`` of them) and both sides'
        block indices (``_device_ints``)."""
        if blocks is None:
            return None
        entry = self._planes.pop(id(blocks), None)
        if entry is None or entry[0] is not blocks:
            plane = blocks.plane
            if plane.size >= 2 ** 31:
                raise ValueError(f"backend 'cuda': mask: expected a block-sparse plane of < 2**31 blocks, "
                                 f"got {plane.shape[0]} x {plane.shape[1]}")
            if len(self._planes) >= self._PLANES_KEPT:
                del self._planes[next(iter(self._planes))]
            entry = (blocks, self.to_device(np.ascontiguousarray(plane, dtype=np.uint8)))
        self._planes[id(blocks)] = entry  # the most recently used last
        dev = entry[1]
        return kernels.Bitmap(self.ptr(dev), self._device_ints(qb.pos // blocks.bs),
                              self._device_ints(kb.pos // blocks.bs), dev.shape[1], dev.size)

    _PLANES_KEPT = 8

    def fwd_block(self, q, k, v, state, qb, kb, scale, poll=None, blocks=None):
        """Merge key block ``k``, ``v`` into the state of queries ``q``; ``qb``, ``kb``
        are the masks._intervals.Block of the query and the key rows; ``blocks``, a
        block-sparse filter on top, which the kernels read as a bitmap (cuda/mask.cuh):
        tiles of unset blocks are skipped, tiles of set ones run unmasked."""
        acc, m, l = state
        C, Ck = q.shape[2], k.shape[2]
        if self._rows("fwd_block", qb, kb, C, Ck):  # else no pair: the state stays
            qp, kp = self._ptrs(qb), self._ptrs(kb)
            B, Zkv, _, g, d = q.shape
            self._run(kernels.fwd(
                _dtype_name(q.dtype), d, v.shape[-1], q=self._grouped(q), k=self._keyed(k),
                v=self._keyed(v), acc=self._grouped(acc), m=self._grouped(m), l=self._grouped(l),
                qfirst=qp.first, qlast=qp.last, kpos=kp.pos, batch=B, cq=C, ck=Ck, heads=Zkv * g,
                kv_heads=Zkv, scale=scale, bits=self._bitmap(blocks, qb, kb), smem_limit=self.smem_limit))
        if poll is not None:
            poll()

    def fwd_finalize(self, state, dtype, out=None):
        """(out, lse) from the running state; the kernel writes ``out`` through its strides,
        so a view of the caller's layout (the ring's) takes the result directly."""
        acc, m, l = state
        B, Zkv, C, g, dv = acc.shape
        check_out("fwd_finalize", out, acc.shape, dtype)  # the kernel writes dtype's elements through a raw pointer
        out = self.xp.empty(acc.shape, dtype) if out is None else out
        lse = self.xp.empty(m.shape, np.float32)
        self._run(kernels.fwd_finalize(
            _dtype_name(dtype), dv, out=self._grouped(out), lse=self._grouped(lse),
            acc=self._grouped(acc), m=self._grouped(m), l=self._grouped(l), batch=B, c=C,
            heads=Zkv * g, kv_heads=Zkv))
        return out, lse

    def store(self, dst, src, scale=None):
        """``dst[...] = src`` times ``scale``, in ``dst``'s dtype. ``src`` is an accumulator
        the ring is done with: the scale is applied to it in place, then copied."""
        if scale is not None:
            src *= src.dtype.type(scale)
        dst[...] = src

    @staticmethod
    def resident_keys(k, v, acc):
        """The kernels read K and V where they lie, at every step: {k, v} as given."""
        return {"k": k, "v": v}

    def bwd_preprocess(self, dout, out, Zkv, acc):
        """D = rowsum(dout * out) as (B, Zkv, C, g) fp32, from (B, C, Z, dv) arrays."""
        B, C, Z, dv = dout.shape
        g = Z // Zkv
        D = self.xp.empty((B, Zkv, C, g), np.float32)
        grouped = lambda a: kernels.Grouped.of_heads(
            self.ptr(a), *(x // a.itemsize for x in a.strides[:3]), g)
        self._run(kernels.bwd_preprocess(
            _dtype_name(dout.dtype), dv, dsum=self._grouped(D), dout=grouped(dout), out=grouped(out),
            batch=B, c=C, heads=Z, kv_heads=Zkv))
        return D

    def bwd_block(self, q, do, D, lse, k, v, dq, dk, dv, qb, kb, scale, poll=None, blocks=None):
        """Add one block pair's gradients to dq (unscaled), dk and dv; ``qb``, ``kb`` are
        the masks._intervals.Block of the query and the key rows (``blocks`` as in
        ``fwd_block``). ``dq=None`` skips the dQ kernel and ``dk=dv=None`` the dK/dV one (the
        two-way ring computes each on its own rank)."""
        C, Ck = q.shape[2], k.shape[2]
        if self._rows("bwd_block", qb, kb, C, Ck):  # else no pair: nothing to add
            self._bwd(q, do, D, lse, k, v, dq, dk, dv, self._ptrs(qb), self._ptrs(kb), scale,
                      self._bitmap(blocks, qb, kb))
        if poll is not None:
            poll()

    def _bwd(self, q, do, D, lse, k, v, dq, dk, dv, qp, kp, scale, bits):
        B, Zkv, C, g, d = q.shape
        common = dict(q=self._grouped(q), k=self._keyed(k), v=self._keyed(v),
                      dout=self._grouped(do), lse=self._grouped(lse), dsum=self._grouped(D),
                      batch=B, cq=C, ck=k.shape[2], heads=Zkv * g, kv_heads=Zkv, scale=scale,
                      bits=bits, smem_limit=self.smem_limit)
        dtype, dvd = _dtype_name(q.dtype), v.shape[-1]
        # dQ walks key columns from the query rows, dK/dV query columns from the key rows.
        if dq is not None:
            self._run(kernels.bwd_dq(dtype, d, dvd, dq=self._grouped(dq), qfirst=qp.first, qlast=qp.last,
                                     kpos=kp.pos, **common))
        if dk is not None:
            for spec in kernels.bwd_dkdv(dtype, d, dvd, dk=self._keyed(dk), dv_=self._keyed(dv), qpos=qp.pos,
                                         kfirst=kp.first, klast=kp.last, **common):
                self._run(spec)

    # -- decode: the local work of burstmpi.KVCache ----------------------------------------

    def decode(self, q, k, v, kpos, n, qpos0, left, scale, out, lse):
        """Attention of T new queries over the first n rows of a cache shard, as a
        normalised partial.

        q      (B, Zkv, T, g, d) query-side view, any strides, float16/bfloat16/float32;
        k, v   (B, Zkv, S, d), (B, Zkv, S, dv) views of the cache storage in q's dtype, any
               strides with a contiguous feature axis (rows that are not 16-byte aligned are
               loaded element by element: correct, slower); rows 0 .. n-1 are read, 0 <= n <= S;
        kpos   int32 array of this backend's memory, contiguous, length >= n: the global
               position of each cache row, in any order (a windowed cache is a ring buffer);
        qpos0  the position of query token 0: token t sits at qpos0 + t and sees row j iff
               kpos[j] <= qpos0 + t and (left < 0 or kpos[j] >= qpos0 + t - left);
        out    (B, Zkv, T, g, dv) float32 view to write: sum_j p_j v_j / sum_j p_j with
               p_j = exp(scale q.k_j - max), 0 where a row sees no key (never NaN);
        lse    (B, Zkv, T, g) float32 view to write: natural-log logsumexp of scale q.k_j over
               the visible rows, -inf where none. n = 0 gives out 0 and lse -inf everywhere.

        The cache is cut in ``kernels.decode_splits`` chunks that run as separate blocks;
        with more than one, their partials go to a workspace of splits x rows x (dv + 1)
        fp32 (splits <= kernels.DECODE_MAX_SPLITS, whatever n) that ``combine``'s kernel
        then merges into ``out`` and ``lse`` in a fixed order: two calls on the same
        inputs give the same bits.
        """
        fn = "decode"
        if q.ndim != 5 or k.ndim != 4 or v.ndim != 4:
            raise ValueError(f"backend 'cuda': {fn}: q, k, v: expected (B, Zkv, T, g, d), (B, Zkv, S, d), "
                             f"(B, Zkv, S, dv) arrays, got shapes {q.shape}, {k.shape}, {v.shape}")
        B, Zkv, T, g, d = q.shape
        S, dv = k.shape[2], v.shape[3]
        if k.shape != (B, Zkv, S, d) or v.shape[:3] != (B, Zkv, S):
            raise ValueError(f"backend 'cuda': {fn}: k, v: expected shapes {(B, Zkv, S, d)} and "
                             f"{(B, Zkv, S, 'dv')}, got {k.shape} and {v.shape}")
        dtype = _dtype_name(q.dtype)
        for name, a in (("k", k), ("v", v)):
            if a.dtype != q.dtype:
                raise ValueError(f"backend 'cuda': {fn}: {name}: expected q's dtype {q.dtype}, got {a.dtype}")
            if a.strides[-1] != a.itemsize and a.shape[-1] > 1:
                raise ValueError(f"backend 'cuda': {fn}: {name}: expected a contiguous last (feature) axis, "
                                 f"got strides {a.strides}")
        for name, a, shape in (("out", out, (B, Zkv, T, g, dv)), ("lse", lse, (B, Zkv, T, g))):
            if tuple(a.shape) != shape or a.dtype != np.float32:
                raise ValueError(f"backend 'cuda': {fn}: {name}: expected a float32 array of shape {shape}, "
                                 f"got {a.dtype} {tuple(a.shape)}")
        n = int(n)
        if not 0 <= n <= S:
            raise ValueError(f"backend 'cuda': {fn}: n: expected 0 <= n <= S = {S}, got {n}")
        if kpos.dtype != np.int32 or kpos.ndim != 1 or len(kpos) < n or (len(kpos) > 1 and kpos.strides[0] != 4):
            raise ValueError(f"backend 'cuda': {fn}: kpos: expected a contiguous int32 array of length >= {n}, "
                             f"got {kpos.dtype} {tuple(kpos.shape)} strides {kpos.strides}")
        left = -1 if left is None or left < 0 else int(left)
        if out.size == 0:  # no batch or no KV head: nothing to attend, nothing to write
            return
        if q.strides[-1] != q.itemsize and d > 1:
            q = self.xp.ascontiguousarray(q)  # a few rows: copying costs nothing
        dest = out
        if out.strides[-1] != 4 and dv > 1:
            out = self.xp.empty(out.shape, np.float32)
        rows = T * g
        bn = kernels.decode_tile(dtype, d, dv)
        blocks = B * Zkv * -(-rows // kernels.DECODE_ROWS)
        splits, chunk = kernels.decode_splits(n, blocks, bn)
        if splits == 1:  # the one split writes the caller's arrays
            parts_out, parts_lse = out, lse
            out_split = lse_split = 0
        else:
            ws = self.alloc(4 * splits * B * Zkv * rows * (dv + 1)).view(np.float32)
            parts_out = ws[:splits * B * Zkv * rows * dv].reshape(splits, B, Zkv, T, g, dv)
            parts_lse = ws[splits * B * Zkv * rows * dv:].reshape(splits, B, Zkv, T, g)
            out_split, lse_split = B * Zkv * rows * dv, B * Zkv * rows
        module = (dtype, d, dv)
        self._decode_modules[dv] = module
        self._run(decode_launch.decode(
            dtype, d, dv, q=self._grouped(q), k=self._cache(k), v=self._cache(v), kpos=self.ptr(kpos),
            out=self._grouped(parts_out[0] if splits > 1 else parts_out),
            lse=self._grouped(parts_lse[0] if splits > 1 else parts_lse), out_split=out_split,
            lse_split=lse_split, batch=B, kv_heads=Zkv, tokens=T, group=g, n=n, chunk=chunk,
            splits=splits, qpos0=int(qpos0), left=left, scale=scale, smem_limit=self.smem_limit))
        if splits > 1:
            self._run(decode_launch.decode_combine(
                "float32", dv, out=self._grouped(out), lse=self._grouped(lse),
                parts_out=kernels.Stacked(self.ptr(parts_out), out_split, dv),
                parts_lse=kernels.Stacked(self.ptr(parts_lse), lse_split, 1),
                rows=B * Zkv * rows, kv_heads=Zkv, tokens=T, group=g, parts=splits, module=module))
        if out is not dest:
            dest[...] = out

    def _cache(self, a):
        """A (B, Zkv, S, d) cache view as kernel strides, those of length-1 axes zeroed:
        they are never stepped along, and must not cost a view its 16-byte alignment."""
        s = [x // a.itemsize if a.shape[i] > 1 else 0 for i, x in enumerate(a.strides)]
        return kernels.Strided(self.ptr(a), s[0], s[2], s[1])

    def combine(self, parts_out, parts_lse, out, lse):
        """Merge P normalised partials of R rows, in the fixed order p = 0 .. P-1 (no
        atomics: the same inputs give the same bits).

        parts_out  (P, R, dv) float32, parts_lse (P, R) float32 (natural log, -inf for a
                   partial that saw nothing), rows with a contiguous last axis;
        out        (R, dv) float16/bfloat16/float32 to write, lse (R,) float32 to write:
                   m = max_p lse_p, w_p = exp(lse_p - m), L = sum_p w_p,
                   out = sum_p w_p out_p / L, lse = m + log L; rows where every lse_p is -inf
                   get out 0 and lse -inf.
        """
        fn = "combine"
        if parts_out.ndim != 3:
            raise ValueError(f"backend 'cuda': {fn}: parts_out: expected a (P, R, dv) array, got shape "
                             f"{tuple(parts_out.shape)}")
        P, R, dv = parts_out.shape
        for name, a, shape in (("parts_out", parts_out, (P, R, dv)), ("parts_lse", parts_lse, (P, R)),
                               ("lse", lse, (R,))):
            if tuple(a.shape) != shape or a.dtype != np.float32:
                raise ValueError(f"backend 'cuda': {fn}: {name}: expected a float32 array of shape {shape}, "
                                 f"got {a.dtype} {tuple(a.shape)}")
        if tuple(out.shape) != (R, dv):
            raise ValueError(f"backend 'cuda': {fn}: out: expected shape {(R, dv)}, got {tuple(out.shape)}")
        dtype = _dtype_name(out.dtype)
        for name, a in (("parts_out", parts_out), ("out", out)):
            if a.strides[-1] != a.itemsize and dv > 1:
                raise ValueError(f"backend 'cuda': {fn}: {name}: expected a contiguous last axis, got strides "
                                 f"{a.strides}")
        el = lambda a, i: a.strides[i] // a.itemsize
        self._run(decode_launch.decode_combine(
            dtype, dv, out=kernels.Grouped(self.ptr(out), 0, el(out, 0), 0, 0),
            lse=kernels.Grouped(self.ptr(lse), 0, el(lse, 0), 0, 0),
            parts_out=kernels.Stacked(self.ptr(parts_out), el(parts_out, 0), el(parts_out, 1)),
            parts_lse=kernels.Stacked(self.ptr(parts_lse), el(parts_lse, 0), el(parts_lse, 1)),
            rows=R, kv_heads=1, tokens=max(R, 1), group=1, parts=P, module=self._decode_modules.get(dv)))
