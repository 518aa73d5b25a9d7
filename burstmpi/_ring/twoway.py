"""The two-way ring: every block travels only as far as it is needed, in each direction.

A one-way ring carries block j round the circle as long as any rank further along needs
it. A symmetric sliding window on the contiguous layout needs only each rank's two
neighbours, yet one-way block j makes P-1 hops to reach rank j-1; non-causal documents
that span ranks on both sides of j do the same. Here each block has two arcs: it goes
``up`` hops towards rank+1, rank+2, ... and ``down`` hops towards rank-1, ..., the
shortest pair of arcs that covers every rank needing it (``arcs``). Every step posts the
transfers of both directions in one group, so each rank's t-th group pairs with its
neighbours' t-th groups as an in-order transport (NCCL) needs, and a rank computes with
up to two blocks a step (in a fixed order: its own, then up, then down: results stay
bitwise reproducible).

Forward: K/V travel. Backward: nothing comes home (partials along two arcs would need two
chains and two sends home per block, and a holder could add to neither until the chain
before it had): K/V travel along their arcs and Q/dO/D/lse along theirs, and a rank
computes dQ of its own queries with every K/V block that reaches it and dK/dV of its own
keys with every Q block that reaches it. burstmpi's CUDA kernels compute dQ and dK/dV in
separate kernels anyway, so this costs the GPU no extra work; the CPU backend
recomputes the scores once more (7 tile GEMMs per block pair instead of 5), which is why
"auto" picks this backward only on backends where the split is free
(``BurstAttention.choose_bwd_mode``). Used from 3 ranks up: with 2 ranks both directions
reach the same neighbour.
"""

import time

from .._transport.comm import Channel
from .flat import (Timer, backward_operands, bwd_pieces, finish_forward, finish_gradients, fwd_pieces, grouped_rows,
                   key_operands, load_packet, packet_dims, packet_fields, runs)

__all__ = ["arcs", "TwoWaySchedule", "two_way_bytes", "forward", "backward"]

TAG_UP, TAG_DOWN, TAG_Q_UP, TAG_Q_DOWN = 31, 32, 33, 34


def arcs(needs, owner):
    """(up, down): the hops the owner's packet makes towards rank+1 and towards rank-1.

    The shortest pair of arcs covering every holder that needs it (fewest hops in all,
    then the fewest steps), from ``needs[holder, owner]``."""
    P = needs.shape[0]
    offsets = [s for s in range(1, P) if needs[(owner + s) % P, owner]]  # increasing
    best = None
    for i in range(len(offsets) + 1):  # offsets[:i] are reached going up, the rest going down
        up = offsets[i - 1] if i else 0
        down = P - offsets[i] if i < len(offsets) else 0
        key = (up + down, max(up, down), i)
        if best is None or key < best[0]:
            best = (key, up, down)
    return best[1], best[2]


def two_way_bytes(needs, packet_bytes):
    """Bytes the whole ring sends in one phase when every packet travels its two arcs.

    ``packet_bytes``: bytes of a packet, or ``f(owner, t, sign, arc)``, the bytes of the
    ``owner``'s packet the holder at step t of its ``arc``-hop way towards ``sign``
    receives (packets shrink: ``Geometry.route``)."""
    pb = packet_bytes if callable(packet_bytes) else (lambda o, t, sign, arc: packet_bytes)
    total = 0
    for o in range(needs.shape[0]):
        up, down = arcs(needs, o)
        total += sum(pb(o, t, +1, up) for t in range(1, up + 1)) + sum(pb(o, t, -1, down) for t in range(1, down + 1))
    return total


class _Direction:
    """One direction's plan for one rank: which packet it holds at each step, whether it
    computes with it, and the transfers after each step."""

    def __init__(self, needs, rank, reach, sign, steps, held=None):
        P = needs.shape[0]
        self.sign, self.reach = sign, reach
        self.owners = [(rank - sign * t) % P for t in range(steps)]
        holds = [t == 0 or t <= reach[o] for t, o in enumerate(self.owners)]
        self.compute = [t > 0 and holds[t] and bool(needs[rank, o]) for t, o in enumerate(self.owners)]
        self.send = [holds[t] and t + 1 <= reach[self.owners[t]] for t in range(steps - 1)]
        self.recv = [t + 1 <= reach[self.owners[t + 1]] for t in range(steps - 1)]
        # The rows of each transfer (``held(owner, sign, arc)``: ``Geometry.route``'s counts);
        # None: full packets.
        rows = lambda o, t: None if held is None else int(held(o, sign, reach[o])[t])
        self.send_rows = [rows(self.owners[t], t + 1) if self.send[t] else None for t in range(steps - 1)]
        self.recv_rows = [rows(self.owners[t + 1], t + 1) if self.recv[t] else None for t in range(steps - 1)]


class TwoWaySchedule:
    """The two-way plan of one phase, seen from one rank (``needs[holder, owner]`` as in
    ``schedule.Schedule``). ``steps`` may pad the plan to run in lockstep with another;
    ``held`` gives the shrinking packets' row counts (as ``_Direction`` takes it)."""

    def __init__(self, needs, rank, steps=None, held=None):
        P = needs.shape[0]
        reach = [arcs(needs, o) for o in range(P)]
        self.steps = steps or 1 + max(max(r) for r in reach)
        self.local = bool(needs[rank, rank])
        self.up = _Direction(needs, rank, [r[0] for r in reach], +1, self.steps, held)
        self.down = _Direction(needs, rank, [r[1] for r in reach], -1, self.steps, held)


def _held(geo, role):
    """``Geometry.route``'s row counts of ``role``'s packets, as ``_Direction`` takes them."""
    return lambda o, sign, arc: geo.route(role, o, sign, arc)[1]


def _load(chans, dirs, geo, role, home, rank, be):
    """Write this rank's packet of each direction: the rows its arc's readers see (``be``:
    the arrays' backend)."""
    for chan, d in zip(chans, dirs):
        order, _ = geo.route(role, rank, d.sign, d.reach[rank])
        load_packet(chan, home, geo.travelling_rows(role, rank)[order], be)


def _runs(geo, role, chan, d, t):
    """(views, BlockSet) of each run of rows the holder at step t has from the packet in
    ``chan`` (``Geometry.carried``)."""
    o = d.owners[t]
    return [(views, blk) for (views,), blk in runs(geo, role, o, d.sign, t, chan.current, arc=d.reach[o])]


def _run(call, steps, channels, timer, compute):
    """The double-buffering rhythm with two directions: each step posts the transfers of
    every (channel, direction plan) in ``channels`` as one group, runs ``compute(t)``,
    then waits for them."""
    for t in range(steps):
        more = t < steps - 1
        with call.transport.group():
            if more:
                for chan, d in channels:
                    chan.post(send=d.send[t], recv=d.recv[t], send_rows=d.send_rows[t], recv_rows=d.recv_rows[t])
        compute(t)
        if more:
            for chan, _ in channels:
                timer.run("wait", chan.wait)


def forward(call, q, k, v, dims):
    """Return (out, lse, stats), K/V travelling two ways."""
    be = call.backend
    B, C, Z, Zkv, d, dv = dims
    acc = be.acc_dtype(q.dtype)
    geo = call.geometry
    packet, _ = packet_fields("forward", packet_dims(call, dims, "k"), q.dtype, acc)
    sched = TwoWaySchedule(geo.needs("forward"), call.rank, held=_held(geo, "k"))
    up, down = call.channels("forward-two-way", [(Channel, packet, TAG_UP, +1), (Channel, packet, TAG_DOWN, -1)])
    timer, t_start = Timer(), time.perf_counter()
    home_k = key_operands(k, v)
    _load((up, down), (sched.up, sched.down), geo, "k", home_k, call.rank, be)
    q_rows = grouped_rows(q, Zkv)
    state = be.fwd_state(B, Zkv, C, Z // Zkv, dv, acc)
    qb = geo.block("q", call.rank)
    owners = []
    poll = lambda: any([up.progress(), down.progress()])

    def block(parts, owner):
        owners.append(owner)
        for ks, kb in parts:
            timer.run("compute", fwd_pieces, be, q_rows, ks["k"], ks["v"], state, geo.pieces(qb, kb), call.scale,
                      poll=poll)

    def compute(t):
        if t == 0:
            if sched.local:
                block([(home_k, geo.block("k", call.rank))], call.rank)
            return
        for chan, dplan in ((up, sched.up), (down, sched.down)):
            if dplan.compute[t]:
                block(_runs(geo, "k", chan, dplan, t), dplan.owners[t])

    _run(call, sched.steps, [(up, sched.up), (down, sched.down)], timer, compute)
    out, lse = finish_forward(be, state, q.dtype, dims)
    pairs = sum(geo.pairs(call.rank, o) for o in owners)
    return out, lse, call.phase_stats([up, down], owners, pairs, 0, timer, t_start)


def backward(call, dout, q, k, v, out, lse, dims):
    """Return (dq, dk, dv, stats): K/V and Q/dO/D/lse travel two ways, nothing comes home."""
    be = call.backend
    B, C, Z, Zkv, d, dv = dims
    acc = be.acc_dtype(q.dtype)
    geo = call.geometry
    kv_fields, _ = packet_fields("forward", packet_dims(call, dims, "k"), q.dtype, acc)
    q_fields, _ = packet_fields("burst", packet_dims(call, dims, "q"), q.dtype, acc)
    kv_needs, q_needs = geo.needs("forward"), geo.needs("burst")
    steps = max(TwoWaySchedule(kv_needs, call.rank).steps, TwoWaySchedule(q_needs, call.rank).steps)
    kv_s = TwoWaySchedule(kv_needs, call.rank, steps, _held(geo, "k"))
    q_s = TwoWaySchedule(q_needs, call.rank, steps, _held(geo, "q"))
    kvu, kvd, qu, qd = call.channels("two-way", [
        (Channel, kv_fields, TAG_UP, +1), (Channel, kv_fields, TAG_DOWN, -1),
        (Channel, q_fields, TAG_Q_UP, +1), (Channel, q_fields, TAG_Q_DOWN, -1)])
    timer, t_start = Timer(), time.perf_counter()
    home_q, home_k, grads = backward_operands(be, dout, q, k, v, out, lse, dims, acc)
    _load((kvu, kvd), (kv_s.up, kv_s.down), geo, "k", home_k, call.rank, be)
    _load((qu, qd), (q_s.up, q_s.down), geo, "q", home_q, call.rank, be)
    qb_home, kb_home = geo.block("q", call.rank), geo.block("k", call.rank)
    owners, pairs = [], 0
    chans = (kvu, kvd, qu, qd)
    poll = lambda: any([c.progress() for c in chans])

    def run(qs, ks, dq, dk, dv_, qb, kb):
        timer.run("compute", bwd_pieces, be, qs["q"], qs["do"], qs["D"], qs["lse"], ks["k"], ks["v"],
                  dq, dk, dv_, geo.pieces(qb, kb), call.scale, poll=poll)

    def compute(t):
        nonlocal pairs
        if t == 0:
            if kv_s.local:
                owners.append(call.rank)
                pairs += geo.pairs(call.rank, call.rank)
                run(home_q, home_k, grads["dq"], grads["dk"], grads["dv"], qb_home, kb_home)
            return
        for chan, dplan in ((kvu, kv_s.up), (kvd, kv_s.down)):
            if dplan.compute[t]:  # their keys: dQ of our queries
                o = dplan.owners[t]
                owners.append(o)
                pairs += geo.pairs(call.rank, o)
                for ks, kb in _runs(geo, "k", chan, dplan, t):
                    run(home_q, ks, grads["dq"], None, None, qb_home, kb)
        for chan, dplan in ((qu, q_s.up), (qd, q_s.down)):
            if dplan.compute[t]:  # their queries: dK, dV of our keys
                o = dplan.owners[t]
                owners.append(o)
                pairs += geo.pairs(o, call.rank)
                for qs, qb in _runs(geo, "q", chan, dplan, t):
                    run(qs, home_k, None, grads["dk"], grads["dv"], qb, kb_home)

    _run(call, steps, [(kvu, kv_s.up), (kvd, kv_s.down), (qu, q_s.up), (qd, q_s.down)], timer, compute)
    dq, dk, dvv = finish_gradients(call, grads, q.dtype)
    return dq, dk, dvv, call.phase_stats(list(chans), owners, pairs, 0, timer, t_start)
