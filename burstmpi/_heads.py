"""Head parallelism inside nodes: the ring over groups of ranks, each rank of a group
serving a share of the heads (``BurstAttention(head_parallel=u)``).

Groups are u consecutive ranks of one node (``burstmpi._transport.nodes``). An all-to-all
inside each group (``transport.alltoall``) turns the members' sequence shards into head
shards: member i gets every token of its group for query heads ``i H/u .. (i+1) H/u - 1``
and the K/V heads those use. The ring then runs over the P/u groups, between the members
of equal index (a ring of P/u ranks, blocks u times longer), with the layout's tokens of
each group merged (``layout`` ``NAME/u``: the zigzag over the groups stays balanced), and
a second all-to-all returns every rank its own tokens. Callers keep their sequence shards
and layout; only the traffic changes: the ring's hops fall from P - 1 to P/u - 1 per
phase, and the all-to-all stays inside a node.

GQA/MQA with fewer K/V heads than u replicates each K/V head on the u / kv_heads members
whose query heads use it (never more): their dK/dV shares are summed on the way back, in
member order and float32 (float64 for float64 inputs), and rounded once. A per-head mask
is cut to each member's heads (``masks.head_slice``).
"""

import numpy as np

from .masks import head_slice
from ._transfers import Staging
from ._transport.alltoall import HeadExchange
from ._transport.lifetime import split_once
from ._transport.nodes import Nodes
from ._transport.watchdog import allgather

__all__ = ["HeadParallel", "check_head_parallel", "member_heads", "exchange_transport"]


def check_head_parallel(fn, u, nranks, nodes, heads, kv_heads):
    """Raise ValueError naming ``head_parallel`` where groups of ``u`` ranks cannot serve a
    call of ``heads`` query and ``kv_heads`` K/V heads on these ``nodes``."""
    if nranks % u:
        raise ValueError(f"{fn}: head_parallel: expected a divisor of the {nranks} ranks, got {u}")
    for g in range(nranks // u):
        where = {nodes.node_of[r] for r in range(g * u, (g + 1) * u)}
        if len(where) > 1:
            raise ValueError(f"{fn}: head_parallel: a group of {u} consecutive ranks must lie inside one node, "
                             f"but ranks {g * u}..{(g + 1) * u - 1} span nodes {sorted(where)} ({nodes.describe()}; "
                             "BURSTMPI_RANKS_PER_NODE sets the node size)")
    if heads % u:
        raise ValueError(f"{fn}: head_parallel: expected a divisor of the {heads} query heads, got {u}")
    if kv_heads % u and u % kv_heads:
        raise ValueError(f"{fn}: head_parallel: {u} must divide the {kv_heads} K/V heads or be a multiple of "
                         "them (each member's query heads then share one replicated K/V head)")


def member_heads(u, heads, kv_heads):
    """Per member: the slice of query heads it serves and the slice of K/V heads they use."""
    q = [slice(i * heads // u, (i + 1) * heads // u) for i in range(u)]
    if kv_heads % u == 0:
        kv = [slice(i * kv_heads // u, (i + 1) * kv_heads // u) for i in range(u)]
    else:  # replicated: member i's query heads all use one K/V head
        group = heads // kv_heads
        kv = [slice(s.start // group, s.start // group + 1) for s in q]
    return q, kv


class HeadParallel:
    """The head-parallel side of a plan over ``comm`` (its private communicator; ``nodes``
    its ranks' nodes): the group and ring communicators, the ring of groups' plans and
    the exchange. Owned by the plan's runtime (``Runtime.owned``), so ``release`` frees
    the ring's buffers and ``buffer_bytes`` counts them. The plan checks and agrees on
    every call's arguments first, then hands each call its ``ring.context.Call``.

    ``make(comm, nodes, layout_name, mask, runtime, kv_grads_accumulated)`` builds a plan
    of the ring of groups (the owning plan's options; ``BurstAttention._groups_ring``), so
    this module needs no import of ``plan``: one per share of a per-head mask, all on one
    runtime (a mask's shares differ between members and calls; up to ``KEEP`` are kept).
    """

    KEEP = 4

    def __init__(self, u, comm, nodes, timeout, make):
        self.u, self.comm, self.timeout, self._make = int(u), comm, timeout, make
        rank, nranks = comm.Get_rank(), comm.Get_size()
        self.rank = rank
        # The members of my group, in order; the members of my index, group by group.
        self._comms = split_once(comm, ("head_parallel", u), [(rank // u, rank % u), (rank % u, rank // u)], timeout)
        self._nodes = Nodes([nodes.node_of[g * u + rank % u] for g in range(nranks // u)], rank // u)
        self._plans = {}  # the mask share's digest (None: no mask) -> the ring's plan
        self._last = None
        self._exchange = None  # (layout, the plan's transport, HeadExchange) of the last call
        self._mover = None     # (the plan's transport, what the exchange runs on: None for MPI)

    def _exchange_for(self, call, xp):
        """The group's exchange for this call's layout and arrays (the last one kept: a
        training loop repeats its lengths, and packed documents change them every batch):
        on the ring's transport where it moves device arrays itself (``exchange_transport``),
        else MPI's all-to-all of host arrays (nonblocking, within the plan's deadline)."""
        layout, transport, group = call.geometry.layout, call.transport, self._comms[0]
        if self._mover is None or self._mover[0] is not transport:  # made once per ring transport
            self._mover = (transport, exchange_transport(transport, group))
        if self._exchange is None or self._exchange[0] is not layout or self._exchange[1] is not transport:
            g, mover = self.rank // self.u, self._mover[1]
            self._exchange = (layout, transport, HeadExchange(
                group, [layout.positions(r) for r in range(g * self.u, (g + 1) * self.u)],
                transport=mover, xp=np if mover is None else xp,
                waits=transport.on(group) if mover is None else None))
        return self._exchange[2]

    def _inner_for(self, mask, layout_name, heads, accumulated):
        """The ring's plan with this member's share of a per-head mask (``accumulated``:
        dK/dV come back unrounded, for replicated K/V heads)."""
        share = member_heads(self.u, heads, 1)[0][self.rank % self.u]  # its query heads
        cut = None if mask is None else head_slice(mask, share.start, share.stop - share.start)
        key = (None if cut is None else cut.digest(), accumulated)
        plan = self._plans.get(key)
        if plan is None:
            runtime = next(iter(self._plans.values())).runtime if self._plans else None
            if len(self._plans) >= self.KEEP:  # the oldest share's plan; its buffers are the shared runtime's
                self._plans.pop(next(iter(self._plans)))
            plan = self._plans[key] = self._make(self._comms[1], self._nodes, f"{layout_name}/{self.u}", cut,
                                                 runtime, accumulated)
        self._last = plan
        return plan

    def _slices(self, heads, kv_heads):
        return member_heads(self.u, heads, kv_heads)

    def _everywhere(self, run, *args, **kwargs):
        """``run`` on the ring of groups, its failure raised on every rank of the plan: a
        ring's plan raises on its own ranks only, and the other rings' ranks would wait for
        theirs in the all-to-all back."""
        error = None
        try:
            result = run(*args, **kwargs)
        except Exception as e:  # every kind: the others must not hang
            error = e
        failed = allgather(self.comm, error is not None, self.timeout,
                           "head_parallel: the check that every ring of groups succeeded")
        if error is not None:
            raise error
        if any(failed):
            raise RuntimeError(f"head_parallel: the ring of groups failed on rank {failed.index(True)} "
                               "(its error says why)")
        return result

    def _begin(self, call, dims, xp):
        """A call's exchange (its byte count reset), head slices and host staging (none
        where the exchange moves the arrays where they are)."""
        Z, Zkv = dims[2], dims[3]
        ex = self._exchange_for(call, xp)
        ex.reset()
        return ex, self._slices(Z, Zkv), Staging(xp, ex.xp)

    def forward(self, call, mask, layout_name, h, dims, cu_seqlens, xp):
        """``(out, lse, stats)`` of checked and agreed arrays ``h`` (q, k, v) of ``call``
        (the plan's: its layout and transport), under ``mask`` on layout ``layout_name``."""
        Z, Zkv = dims[2], dims[3]
        ex, (qs, kvs), host = self._begin(call, dims, xp)
        q, k, v = (host.back(ex.to_heads(host.out(h[n]), s)) for n, s in (("q", qs), ("k", kvs), ("v", kvs)))
        inner = self._inner_for(mask, layout_name, Z, Zkv % self.u != 0)
        out, lse = self._everywhere(inner.forward, q, k, v, cu_seqlens=cu_seqlens)
        out = ex.to_tokens(host.out(out), qs, Z)
        lse = _rows_last(ex.to_tokens(_rows_last(host.out(lse)), qs, Z))  # (B, heads, C): tokens on axis 1 there
        return host.back(out), host.back(lse), self._stats(inner.last_stats.forward, ex)

    def backward(self, call, mask, layout_name, h, dims, cu_seqlens, xp):
        """``(dq, dk, dv, stats, mode)`` of checked and agreed arrays ``h`` (as ``forward``)."""
        Z, Zkv = dims[2], dims[3]
        ex, (qs, kvs), host = self._begin(call, dims, xp)
        sl = {"dout": qs, "q": qs, "out": qs, "k": kvs, "v": kvs}
        a = {n: host.back(ex.to_heads(host.out(h[n]), s)) for n, s in sl.items()}
        a["lse"] = host.back(_rows_last(ex.to_heads(_rows_last(host.out(h["lse"])), qs)))
        replicated = Zkv % self.u != 0  # the replicas' shares are summed unrounded
        inner = self._inner_for(mask, layout_name, Z, replicated)
        dq, dk, dvv = self._everywhere(inner.backward, a["dout"], a["q"], a["k"], a["v"], a["out"], a["lse"],
                                       cu_seqlens=cu_seqlens)
        dq = ex.to_tokens(host.out(dq), qs, Z)
        dk, dvv = (ex.to_tokens(host.out(x), kvs, Zkv, add=replicated).astype(h["k"].dtype, copy=False)
                   for x in (dk, dvv))
        st = inner.last_stats
        return host.back(dq), host.back(dk), host.back(dvv), self._stats(st.backward, ex), st.bwd_mode

    @property
    def topology(self):
        """The ring the groups ran (``last_stats.topology`` of the ring's plan)."""
        return self._last.last_stats.topology

    @property
    def nbytes(self):
        """The ring's buffers, held by its plans' runtime (the all-to-all's are the call's
        temporaries)."""
        return 0 if not self._plans else self._last.runtime.buffer_bytes

    def release(self, window=True):
        """Free the ring's buffers (the communicators and plans stay); ``window``: its
        shared window too (``Runtime.release``)."""
        if self._plans:
            self._last.runtime.release(window)

    @staticmethod
    def _stats(st, ex):
        """The ring's stats over the groups, with the all-to-all's bytes added (sent inside
        the node: never inter-node)."""
        st.bytes_sent += ex.bytes_sent
        return st


def exchange_transport(transport, group):
    """The transport the all-to-all of ``group`` (an MPI communicator) runs on, or None for
    MPI's all-to-all of host arrays: NCCL's grouped transfers where the ring's transport
    is NCCL (a communicator of the group's own), so GPU arrays skip the host."""
    return transport.on(group) if transport.name == "nccl" else None


def _rows_last(lse):
    """(B, heads, C) <-> (B, C, heads), contiguous: lse with its tokens where the exchange
    wants them (axis 1), and back (NumPy or CuPy: ``copy`` makes C order in both)."""
    return lse.transpose(0, 2, 1).copy()
