"""Where each cached token's keys and values live on its rank: ``KVCache``'s slot storage.

``SlotStore`` is the part of ``KVCache`` that places tokens. Without a window a rank
appends its tokens; with ``window=(left, 0)`` its slots are a ring buffer (``_head`` is the
oldest) whose slot is reused once no future query can see its token; sinks live in storage
of their own that is never reused (position p is sink slot p // P of rank p % P). The
state it keeps on the cache: ``_k``/``_v`` (B, Zkv, slots, d), the slots' positions
``_kpos_host`` (and ``_kpos``, its device copy), ``_n`` slots used, ``_head``, and the sinks'
``_sk``/``_sv``/``_skpos``/``_ns``. A decode call asks ``_slots_for`` where its tokens go
before it writes anything, and ``_undo`` puts the slots back if the call fails anywhere.
"""

import numpy as np
from mpi4py import MPI

from .._transfers import to_device, to_host
from .._transport.watchdog import collective

__all__ = ["SlotStore"]


class SlotStore:
    """``KVCache``'s token placement (a mixin: the state is the cache's, set up in its
    ``_allocate``)."""

    def _store(self, k, v, positions):
        """Append every row of (B, C, Zkv, d) arrays ``k``, ``v`` at the next slots."""
        n = k.shape[1]
        xp = self.runtime.backend.xp
        self._k[:, :, self._n:self._n + n] = k.transpose(0, 2, 1, 3)
        self._v[:, :, self._n:self._n + n] = v.transpose(0, 2, 1, 3)
        self._kpos_host[self._n:self._n + n] = positions
        if self._kpos is not self._kpos_host:
            self._kpos[self._n:self._n + n] = to_device(xp, self._kpos_host[self._n:self._n + n])
        self._n += n

    def _drop_older_than(self, oldest):
        """Windowed load after cached tokens: keep only the slots of positions >= ``oldest``,
        moved to the front in position order (the ring buffer restarts at slot 0)."""
        n = self._n
        pos = self._kpos_host[:n].copy()
        keep = np.nonzero(pos >= oldest)[0]
        keep = keep[np.argsort(pos[keep], kind="stable")]
        m = len(keep)
        if m == n and self._head == 0 and (keep == np.arange(n)).all():
            return
        xp = self.runtime.backend.xp
        idx = to_device(xp, keep)
        self._k[:, :, :m] = self._k[:, :, idx]  # the gather copies before it writes
        self._v[:, :, :m] = self._v[:, :, idx]
        self._kpos_host[:m], self._kpos_host[m:n] = pos[keep], -1
        if self._kpos is not self._kpos_host:
            self._kpos[:n] = to_device(xp, self._kpos_host[:n])
        self._n, self._head = m, 0

    def _store_window_tail(self, fn, k, v, lay):
        """Windowed prefill (or load): keep only the positions a later query can see (the
        last ``left``, and the sinks), dealt round-robin by position: one all-to-all of those
        rows. Positions count from ``seqlen``, the tokens cached before."""
        rt = self.runtime
        P, me = rt.nranks, rt.rank
        S = self.seqlen
        live = lambda pos: (pos >= lay.seqlen - self.left) | (S + pos < self.sinks)  # positions in the piece
        B, Zkv, d, dv = self.batch, self.kv_heads, self.head_dim, self.v_head_dim
        row = B * Zkv * (d + dv) * self.dtype.itemsize  # bytes of one token's keys and values
        mine = lay.positions(me)
        keep = np.nonzero(live(mine))[0]
        dest = (S + mine[keep]) % P
        order = np.argsort(dest, kind="stable")
        rows = keep[order]
        send_counts = np.bincount(dest, minlength=P)
        # Every rank's positions are known everywhere: what comes from whom, in which order.
        src_pos = [lay.positions(r)[live(lay.positions(r))] for r in range(P)]
        src_pos = [S + p[(S + p) % P == me] for p in src_pos]
        recv_counts = np.array([len(p) for p in src_pos])
        xp = rt.backend.xp
        idx = to_device(xp, rows)
        kk = to_host(k[:, idx]).transpose(1, 0, 2, 3).reshape(len(rows), B * Zkv * d)
        vv = to_host(v[:, idx]).transpose(1, 0, 2, 3).reshape(len(rows), B * Zkv * dv)
        send = np.ascontiguousarray(np.concatenate([kk, vv], axis=1)).view(np.uint8)
        recv = np.empty((int(recv_counts.sum()), row), np.uint8)
        displ = lambda c: np.concatenate([[0], np.cumsum(c)[:-1]]) * row
        req = rt.comm.Ialltoallv([send, (send_counts * row, displ(send_counts)), MPI.BYTE],
                                 [recv, (recv_counts * row, displ(recv_counts)), MPI.BYTE])
        collective(rt.comm, [req], rt.timeout, "the all-to-all that moves the cache's tokens to their slots",
                   getattr(rt.transport, "idle", False))
        pos = np.concatenate(src_pos)
        order = np.argsort(pos, kind="stable")  # slots in position order: the oldest first
        got, pos = recv.view(self.dtype)[order], pos[order]
        xp = rt.backend.xp
        split = lambda a, e: np.ascontiguousarray(a.reshape(-1, B, Zkv, e).transpose(1, 0, 2, 3))
        for sink in (True, False):
            sel = (pos < self.sinks) == sink
            if not sel.any():
                continue
            kn, vn = split(got[sel, :B * Zkv * d], d), split(got[sel, B * Zkv * d:], dv)
            kn, vn = to_device(xp, kn), to_device(xp, vn)
            if sink:
                self._store_sinks(kn, vn, pos[sel])
            else:
                # At most ceil(min(seqlen, left) / P) live tokens each, those kept from before
                # included (``_drop_older_than``): _admit's check (that the tail fits in the
                # capacity less the sinks) keeps them in the slots.
                assert self._n + int(sel.sum()) <= self.slots, (self._n, int(sel.sum()), self.slots)
                self._store(kn, vn, pos[sel])

    def _store_sinks(self, k, v, positions):
        """Sinks (B, n, Zkv, d) at their slots: position p is slot p // P of rank p % P."""
        xp = self.runtime.backend.xp
        idx = np.asarray(positions) // self.runtime.nranks
        both = to_device(xp, np.stack([idx, np.asarray(positions)]).astype(np.int64))  # one copy for the two
        at = both[0]
        self._sk[:, :, at] = k.transpose(0, 2, 1, 3)
        self._sv[:, :, at] = v.transpose(0, 2, 1, 3)
        self._skpos[at] = both[1]  # int32 on assignment
        self._ns = max(self._ns, int(idx.max()) + 1)

    def _slots_for(self, fn, T):
        """The slots the new tokens this rank owns go to, and what they held before
        (restored if the call fails): ``(tokens, slots, old positions, n, head, sink
        tokens)``; the last are this call's tokens that are sinks, which go to the sinks'
        storage instead."""
        P, me, S = self.runtime.nranks, self.runtime.rank, self.seqlen
        if self.left < 0 and S + T > self.capacity:
            raise ValueError(f"{fn}: the cache is full: capacity={self.capacity} tokens, {S} cached, "
                             f"q.shape[1] = {T} new ones do not fit")
        new_sinks = max(0, min(T, self.sinks - S))  # this call's first tokens may still be sinks
        live = min(max(S - self.sinks, 0), self.left)
        if self.left >= 0 and self.sinks + live + T - new_sinks > self.capacity:
            raise ValueError(f"{fn}: the cache is full: with window={self.window} a call needs the last "
                             f"{live} tokens" + (f", the {self.sinks} sinks" if self.sinks else "")
                             + f" and its {T - new_sinks} new ones, more than capacity={self.capacity}")
        tokens = [t for t in range(new_sinks, T) if (S + t) % P == me]
        sink_tokens = [t for t in range(new_sinks) if (S + t) % P == me]
        n, head, slots = self._n, self._head, []
        oldest_seen = S - self.left  # the first new query sees positions from here on
        for _ in tokens:
            if n < self.slots:
                slots.append(n)
                n += 1
            elif self.left >= 0 and self._kpos_host[head] < oldest_seen:
                slots.append(head)
                head = (head + 1) % self.slots
            else:
                raise ValueError(f"{fn}: the cache is full on rank {me}: its {self.slots} slots hold "
                                 f"tokens a new query still sees (capacity={self.capacity})")
        return tokens, slots, self._kpos_host[slots].copy(), n, head, sink_tokens

    def _write(self, k, v, tokens, slots):
        """The new tokens this rank owns (indices into k, v) into their slots: the indices,
        slots and positions go to the device in one small copy (with the header's, a decode
        call's copies to the device once the sinks are stored)."""
        if not tokens:
            return
        xp = self.runtime.backend.xp
        pos = (self.seqlen + np.asarray(tokens)).astype(np.int32)
        idx = to_device(xp, np.array([tokens, slots, pos], np.int64))
        t, s, p = idx[0], idx[1], idx[2]
        self._k[:, :, s] = k[:, t].transpose(0, 2, 1, 3)
        self._v[:, :, s] = v[:, t].transpose(0, 2, 1, 3)
        self._kpos_host[slots] = pos
        if self._kpos is not self._kpos_host:
            self._kpos[s] = p  # int32 on assignment

    def _undo(self, written):
        if written is None:
            return
        slots, old, _, _, sink_idx, ns = written
        xp = self.runtime.backend.xp
        if len(sink_idx):
            self._skpos[to_device(xp, np.asarray(sink_idx))] = -1
            self._ns = ns
        self._kpos_host[slots] = old
        if self._kpos is not self._kpos_host and slots:
            idx = to_device(xp, np.array([slots, old], np.int64))
            self._kpos[idx[0]] = idx[1]
