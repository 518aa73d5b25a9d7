"""The decode's one collective: every rank's partial to every rank, merged in rank order.

``Exchange`` is the part of ``KVCache`` that talks to the other ranks during a decode call.
Each rank's message is a header (status, a checksum of the call's arguments, T, heads)
followed by its partial (out, lse) over its own shard; one allgather gives every rank
every message. The header's words are written with one small copy to the device, and the
fingerprint of q, k, v (computed on the device, argument check on) is folded into its
checksum word there; reading the gathered headers copies only their bytes to the host, so
a call's trips through the host do not grow with the heads, the batch or the ranks'
partials. A call whose shape differs from the agreed one announces it with status
``RESHAPE`` and, when every rank announces the same, the exchange runs again at the new
size; any error or disagreement makes every rank see "error" and raise the same error.
"""

import time

import numpy as np

from .._ring.flat import nbytes
from .._transport.comm import packed_fields
from .._transfers import to_device, to_host
from .._validate import checksum

__all__ = ["Exchange", "OK", "FAILED", "RESHAPE"]

# The header's status word.
OK, FAILED, RESHAPE = 0, 1, 2


class Exchange:
    """``KVCache``'s collective (a mixin: the message buffers ``_message``, the counters
    ``_calls``/``_compute_s`` and the storage are the cache's)."""

    def _buffers(self, T, Z):
        """The decode's message (header, lse, out) for shape (T, Z), and the gather buffer."""
        key = (T, Z)
        if self._message is not None and self._message[0] == key:
            return self._message[1]
        be, P = self.runtime.backend, self.runtime.nranks
        try:
            acc = be.acc_dtype(self.dtype)
        except ValueError:  # the call fails and says so collectively; the sizes must still agree
            acc = np.dtype(np.float32)
        R = self.batch * T * (Z or 0)  # rows of partial results
        fields = [("hdr", (4,), np.int64), ("lse", (R,), acc), ("out", (R, self.v_head_dim), acc)]
        size = nbytes(fields)
        raw = be.alloc(size * (P + 1))
        offset = [0]

        def carve(nb):
            view = raw[offset[0]:offset[0] + nb]
            offset[0] += nb
            return view

        send = packed_fields(fields, carve)
        recv_raw = raw[size:]
        parts = [packed_fields(fields, carve)[1] for _ in range(P)]
        msg = (send, recv_raw, parts)
        self._message = (key, msg)
        return msg

    def _exchange(self, h, status, sig, T, Z, shape, n, fp=None):
        """The decode's one collective: fill this rank's message (header and, when the
        shape is the agreed one, its partial), allgather, read every header. ``fp``: the
        call's ``validate.device_fingerprint`` of q, k, v (None: argument check off), folded
        into the header's checksum word on the device. Returns the gathered messages' views,
        None when every rank asks for the same new shape, or "error" (an error, different
        arguments, or different shapes somewhere)."""
        be, rt = self.runtime.backend, self.runtime
        (send_raw, send), recv_raw, parts = self._buffers(*shape)
        if status == OK:
            B, Zkv, dv = self.batch, self.kv_heads, self.v_head_dim
            g = Z // Zkv
            qg = h["q"].reshape(B, T, Zkv, g, self.head_dim).transpose(0, 2, 1, 3, 4)
            t0 = time.perf_counter()
            outs = lambda o: o.reshape(B, T, Zkv, g, dv).transpose(0, 2, 1, 3, 4)
            lses = lambda x: x.reshape(B, T, Zkv, g).transpose(0, 2, 1, 3)
            if not self._ns:
                be.decode(qg, self._k, self._v, self._kpos, n, self.seqlen, self.left, self.scale,
                          outs(send["out"]), lses(send["lse"]))
            else:  # the window's slots and the sinks: two disjoint sets, merged here
                R = send["lse"].shape[0]
                part_out, part_lse = be.xp.empty((2, R, dv), send["out"].dtype), be.xp.empty((2, R), send["lse"].dtype)
                be.decode(qg, self._k, self._v, self._kpos, n, self.seqlen, self.left, self.scale,
                          outs(part_out[0]), lses(part_lse[0]))
                be.decode(qg, self._sk, self._sv, self._skpos, self._ns, self.seqlen, -1, self.scale,
                          outs(part_out[1]), lses(part_lse[1]))
                be.combine(part_out, part_lse, send["out"], send["lse"])
            self._compute_s += time.perf_counter() - t0
        hdr = send["hdr"]
        hdr[...] = to_device(be.xp, np.array([status, checksum(sig), T, Z], np.int64))  # one small copy
        if fp is not None:  # device to device: the fingerprint never visits the host
            word = hdr[1:2].view(np.uint64)
            be.xp.bitwise_xor(word, fp, out=word)
        rt.transport.allgather(send_raw, recv_raw)
        rt.finish()  # NCCL: wait with a timeout and the async error check, never hang
        self._calls += 1
        # The header leads every message (comm.packed_fields puts the widest fields first, and
        # it is listed first): one copy of the P headers alone (a strided view of the gathered
        # bytes) reads them all, P x 32 bytes whatever the partials' size.
        size, P = send_raw.nbytes, rt.nranks
        headers = recv_raw[:P * size].reshape(P, size)[:, :hdr.nbytes]
        got = np.array(to_host(headers)).view(np.int64)  # a copy: the buffer is the next call's
        if (got[:, 0] == OK).all() and (got[:, 1] == got[0, 1]).all() and status == OK:
            return parts
        if (got[:, 0] == RESHAPE).all() and (got[:, 1:] == got[0, 1:]).all():
            return None
        return "error"

    def _merge(self, parts, T, Z):
        """Every rank's partial, merged in rank order: out (B, T, Z, dv), lse (B, Z, T)."""
        be = self.runtime.backend
        xp = be.xp
        B, dv = self.batch, self.v_head_dim
        R = B * T * Z
        parts_out = xp.stack([p["out"] for p in parts])
        parts_lse = xp.stack([p["lse"] for p in parts])
        out = xp.empty((R, dv), self.dtype)
        lse = xp.empty(R, parts_lse.dtype)
        be.combine(parts_out, parts_lse, out, lse)
        return out.reshape(B, T, Z, dv), lse.reshape(B, T, Z).transpose(0, 2, 1)
