"""The local work of a ring step on burstmpi's CUDA kernels (cuda/), for any launcher.

``KernelBackend`` implements the backend interface of ``burstmpi.ring`` by describing
kernel launches (``burstmpi.kernels``) on the arrays the ring hands it, in the same
working layouts as the NumPy backend:

    query side  q, do, dq, acc : (B, Zkv, C, g, d)     row scalars D, lse, m, l : (B, Zkv, C, g)
    key side    k, v, dk, dv   : (B, Zkv, C, d)

Any strides are fine: the kernels address a query row by (batch, token, KV head, head in
group) and a key row by (batch, token, KV head), so the ring's views of the caller's
arrays and its contiguous packets go in unchanged.

Masks arrive as ``burstmpi.masks.Block`` s (host int64 arrays): for the query rows their
positions and the interval of key positions each row sees, for the key rows their
positions and the interval of query positions that see each. The kernels take the three
arrays each needs as int32 device copies, cached (see ``_device_ints``).

A block may have no rows at all (a rank holding no token when the sequence is shorter
than the ring): every launch goes through ``_run``, which never starts an empty grid, and
a block pair of which one side has no rows launches nothing.

What runs the launches is the subclass's business: ``CupyBackend`` on a GPU, and the
tests' emulator (tests/kernel_harness.py) on the CPU, with NumPy arrays standing in for
device memory. Everything between the ring and the launch is therefore tested in CI.
"""

import numpy as np

from .. import kernels
from ..interop import bfloat16

__all__ = ["KernelBackend"]


def _dtype_name(dtype):
    dtype = np.dtype(dtype)
    if bfloat16 is not None and dtype == bfloat16:
        return "bfloat16"
    if dtype in (np.float16, np.float32):
        return dtype.name
    raise ValueError(f"backend 'cuda': dtype: expected float16, bfloat16 or float32, got {dtype}")


class KernelBackend:
    """Backend interface over ``burstmpi.kernels`` launches; subclasses provide
    ``xp``, ``ptr(array)``, ``to_device(host_array)`` and ``launch(spec)`` (never called
    with an empty grid)."""

    name = "cuda"
    xp = np
    # dQ and dK/dV are separate kernels: the two-way ring's split backward costs nothing extra.
    split_backward_free = True

    def __init__(self, smem_limit=kernels.SMEM_LIMIT["sm_80"]):
        self.smem_limit = smem_limit
        self._ints = {}

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

    def _device_ints(self, a):
        """The device address of an int32 copy of a host array of token positions (a
        block's positions, or the first/last bounds of its rows' intervals), kept for reuse:
        a plan asks for the same few arrays (a handful per rank) on every step of every
        call. Keyed by content; the least recently used copy goes first."""
        a = np.asarray(a)
        key = (len(a), a.tobytes())
        dev = self._ints.pop(key, None)
        if dev is None:
            lo, hi = (int(a.min()), int(a.max())) if len(a) else (0, 0)
            if hi >= 2 ** 31 or lo < -2 ** 31:
                raise ValueError(f"backend 'cuda': positions: expected int32 values (< 2**31), "
                                 f"got {lo} .. {hi}")
            if len(self._ints) >= self._INTS_KEPT:
                del self._ints[next(iter(self._ints))]
            dev = self.to_device(a.astype(np.int32))
        self._ints[key] = dev  # (re)inserted last: the most recently used
        return self.ptr(dev)

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

    # -- the interface of burstmpi.ring --------------------------------------------------

    def fwd_state(self, B, Zkv, C, g, dv, acc):
        xp = self.xp
        return (xp.zeros((B, Zkv, C, g, dv), np.float32), xp.full((B, Zkv, C, g), -np.inf, np.float32),
                xp.zeros((B, Zkv, C, g), np.float32))

    def fwd_block(self, q, k, v, state, qb, kb, scale, poll=None):
        """Merge key block ``k``, ``v`` into the state of queries ``q``; ``qb``, ``kb``
        are the masks.Block of the query and the key rows."""
        acc, m, l = state
        B, Zkv, C, g, d = q.shape
        if self._rows("fwd_block", qb, kb, C, k.shape[2]):  # else no pair: the state stays
            self._run(kernels.fwd(
                _dtype_name(q.dtype), d, v.shape[-1], q=self._grouped(q), k=self._keyed(k),
                v=self._keyed(v), acc=self._grouped(acc), m=self._grouped(m), l=self._grouped(l),
                qfirst=self._device_ints(qb.first), qlast=self._device_ints(qb.last),
                kpos=self._device_ints(kb.pos), batch=B, cq=C, ck=k.shape[2], heads=Zkv * g,
                kv_heads=Zkv, scale=scale, smem_limit=self.smem_limit))
        if poll is not None:
            poll()

    def fwd_finalize(self, state, dtype):
        acc, m, l = state
        B, Zkv, C, g, dv = acc.shape
        out = self.xp.empty(acc.shape, dtype)
        lse = self.xp.empty(m.shape, np.float32)
        self._run(kernels.fwd_finalize(
            _dtype_name(dtype), dv, out=self._grouped(out), lse=self._grouped(lse),
            acc=self._grouped(acc), m=self._grouped(m), l=self._grouped(l), batch=B, c=C,
            heads=Zkv * g, kv_heads=Zkv))
        return out, lse

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

    def bwd_block(self, q, do, D, lse, k, v, dq, dk, dv, qb, kb, scale, poll=None):
        """Add one block pair's gradients to dq (unscaled), dk and dv; ``qb``, ``kb`` are
        the masks.Block of the query and the key rows. ``dq=None`` skips the dQ kernel and
        ``dk=dv=None`` the dK/dV one (the two-way ring computes each on its own rank)."""
        B, Zkv, C, g, d = q.shape
        if self._rows("bwd_block", qb, kb, C, k.shape[2]):  # else no pair: nothing to add
            common = dict(q=self._grouped(q), k=self._keyed(k), v=self._keyed(v),
                          dout=self._grouped(do), lse=self._grouped(lse), dsum=self._grouped(D),
                          batch=B, cq=C, ck=k.shape[2], heads=Zkv * g, kv_heads=Zkv, scale=scale,
                          smem_limit=self.smem_limit)
            dtype, dvd = _dtype_name(q.dtype), v.shape[-1]
            # dQ walks key columns from the query rows, dK/dV query columns from the key rows.
            if dq is not None:
                self._run(kernels.bwd_dq(dtype, d, dvd, dq=self._grouped(dq),
                                         qfirst=self._device_ints(qb.first),
                                         qlast=self._device_ints(qb.last),
                                         kpos=self._device_ints(kb.pos), **common))
            if dk is not None:
                for spec in kernels.bwd_dkdv(dtype, d, dvd, dk=self._keyed(dk), dv_=self._keyed(dv),
                                             qpos=self._device_ints(qb.pos),
                                             kfirst=self._device_ints(kb.first),
                                             klast=self._device_ints(kb.last), **common):
                    self._run(spec)
        if poll is not None:
            poll()
