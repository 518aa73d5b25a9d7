"""The local work of a ring step on burstmpi's CUDA kernels (cuda/), for any launcher.

``KernelBackend`` implements the backend interface of ``burstmpi.ring`` by describing
kernel launches (``burstmpi.kernels``) on the arrays the ring hands it, in the same
working layouts as the NumPy backend:

    query side  q, do, dq, acc : (B, Zkv, C, g, d)     row scalars D, lse, m, l : (B, Zkv, C, g)
    key side    k, v, dk, dv   : (B, Zkv, C, d)

Any strides are fine: the kernels address a query row by (batch, token, KV head, head in
group) and a key row by (batch, token, KV head), so the ring's views of the caller's
arrays and its contiguous packets go in unchanged.

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
    ``xp``, ``ptr(array)``, ``to_device(host_array)`` and ``launch(spec)``."""

    name = "cuda"
    xp = np

    def __init__(self, smem_limit=kernels.SMEM_LIMIT["sm_80"]):
        self.smem_limit = smem_limit
        self._positions = {}

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

    def _pos(self, pos):
        """Device int32 copy of a positions array, kept for reuse (a plan asks for the
        same few arrays, one per rank, on every step of every call)."""
        pos = np.asarray(pos)
        key = (len(pos), pos.tobytes())
        dev = self._positions.get(key)
        if dev is None:
            if len(pos) and pos[-1] >= 2 ** 31:
                raise ValueError(f"backend 'cuda': positions: expected < 2**31, got {int(pos[-1])}")
            if len(self._positions) > 64:
                self._positions.clear()
            dev = self._positions[key] = self.to_device(pos.astype(np.int32))
        return dev

    # -- the interface of burstmpi.ring --------------------------------------------------

    def fwd_state(self, B, Zkv, C, g, dv, acc):
        xp = self.xp
        return (xp.zeros((B, Zkv, C, g, dv), np.float32), xp.full((B, Zkv, C, g), -np.inf, np.float32),
                xp.zeros((B, Zkv, C, g), np.float32))

    def fwd_block(self, q, k, v, state, qpos, kpos, win, scale, poll=None):
        acc, m, l = state
        B, Zkv, C, g, d = q.shape
        self.launch(kernels.fwd(
            _dtype_name(q.dtype), d, v.shape[-1], q=self._grouped(q), k=self._keyed(k),
            v=self._keyed(v), acc=self._grouped(acc), m=self._grouped(m), l=self._grouped(l),
            qpos=self.ptr(self._pos(qpos)), kpos=self.ptr(self._pos(kpos)), batch=B, cq=C,
            ck=k.shape[2], heads=Zkv * g, kv_heads=Zkv, lo=win.lo, hi=win.hi, scale=scale,
            smem_limit=self.smem_limit))
        if poll is not None:
            poll()

    def fwd_finalize(self, state, dtype):
        acc, m, l = state
        B, Zkv, C, g, dv = acc.shape
        out = self.xp.empty(acc.shape, dtype)
        lse = self.xp.empty(m.shape, np.float32)
        self.launch(kernels.fwd_finalize(
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
        self.launch(kernels.bwd_preprocess(
            _dtype_name(dout.dtype), dv, dsum=self._grouped(D), dout=grouped(dout), out=grouped(out),
            batch=B, c=C, heads=Z, kv_heads=Zkv))
        return D

    def bwd_block(self, q, do, D, lse, k, v, dq, dk, dv, qpos, kpos, win, scale, poll=None):
        B, Zkv, C, g, d = q.shape
        common = dict(q=self._grouped(q), k=self._keyed(k), v=self._keyed(v), dout=self._grouped(do),
                      lse=self._grouped(lse), dsum=self._grouped(D), qpos=self.ptr(self._pos(qpos)),
                      kpos=self.ptr(self._pos(kpos)), batch=B, cq=C, ck=k.shape[2], heads=Zkv * g,
                      kv_heads=Zkv, lo=win.lo, hi=win.hi, scale=scale, smem_limit=self.smem_limit)
        dtype, dvd = _dtype_name(q.dtype), v.shape[-1]
        self.launch(kernels.bwd_dq(dtype, d, dvd, dq=self._grouped(dq), **common))
        for spec in kernels.bwd_dkdv(dtype, d, dvd, dk=self._keyed(dk), dv_=self._keyed(dv), **common):
            self.launch(spec)
        if poll is not None:
            poll()
