"""The two-level ring: inner rings inside nodes, an outer ring between them
(``BurstAttention(topology="two-level")``).

Ranks (n, i) are local rank i of node n (``transport.nodes``: N nodes of g ranks each). A
phase runs N cycles of g steps. In cycle o rank (n, i) holds, at step s, the block of rank
(n - o, i - s): the cycle's *seed* B(n - o, i) came over the network, and the inner ring
passes it and its node-mates' seeds around the node, one hop a step. While a cycle's g
steps run, the outer ring moves the next seed, B(n - o - 1, i), from (n - 1, i): posted
at the start of the cycle, waited for at its end, so one network transfer hides behind g
steps of compute, and every rank's network link works at once. Per phase each rank sends
N - 1 blocks across the network, where a flat ring sends P - 1 through the busiest link.

Every rank still meets every block exactly once (cycle o, step s gives node n - o, rank
i - s: all N x g pairs), so the forward's online softmax and the gradients are the flat
ring's, merged in another fixed order: results are bitwise deterministic, and accumulate
in float32 (float64 for float64 inputs) as there.

The backward runs every mode of the flat ring's. ``"ring"`` circulates K and V with their
dK/dV partials, ``"burst"`` the query side (Q, dO, D, lse) with its dQ partial: a partial
follows its block around one node's inner ring, gathering that node's contributions, and
goes home from the loop's last holder straight to the block's owner. The owner adds the
partial of cycle o at the start of cycle o + 2 (the last two after the phase), so the home
transfer hides behind a cycle of compute too. ``"two-way"`` sends K/V along the rings and
the query side against them (a second pair of rings, mirrored: cycle o, step s holds the
queries of rank (n + o, i + s)); nothing goes home, and each rank adds dQ of its queries
and dK/dV of its keys itself, as the flat two-way ring does.

Inner and outer transfers use communicators of their own (split from the plan's), so
they match only among themselves; the home partials use the plan's. On each, a rank posts
its transfers to a peer in the order the peer receives them, so they pair without tags,
first in first out, as NCCL pairs them (the tests run the rings over such a transport,
``tests/fifo_transport.py``): a partial's receive goes before the step's packets, as its
sender sent it after the packet of its previous step (``_steps(first=)``). Packets carry a
rank's whole block (no shrinking, as the flat ring does for masks), and steps with no
visible pair skip their compute, not their transfer. Host arrays, MPI transports. The
buffers are the plan's, kept from call to call while the shapes stay
(``BurstAttention.buffer_bytes`` counts them).
"""

import time

import numpy as np

from .config import settings
from .ring import (Timer, _rows, backward_operands, bwd_pieces, finish_forward, finish_gradients, fwd_pieces,
                   key_operands, nbytes, packet_fields)
from .transport.comm import Channel, MPITransport, Packet, split_once
from .transport.nodes import Nodes
from .transport.slowlinks import SlowLinksTransport

__all__ = ["check_two_level", "block_owner", "choose_mode", "transport_name", "forward", "backward"]

TAG_INNER, TAG_OUTER, TAG_PARTIAL, TAG_HOME, TAG_Q_INNER, TAG_Q_OUTER = 41, 42, 43, 44, 45, 46
# The inner and outer rings' transport class. The tests put an ordered fake here
# (tests/fifo_transport.py: NCCL's first-in first-out matching, tags only checked), so
# every rank must post its transfers to a peer in the order that peer receives them.
RING_TRANSPORT = MPITransport


def check_two_level(fn, nodes, kind):
    """Raise ValueError naming ``topology`` where these nodes (or arrays of ``kind``) cannot
    run two rings."""
    if kind == "cuda":
        raise ValueError(f"{fn}: topology: 'two-level' runs on host arrays for now (its GPU rings over NCCL "
                         "are not built); use 'flat' or 'auto' with GPU arrays")
    if not nodes.equal:
        raise ValueError(f"{fn}: topology: 'two-level' needs nodes of equal size, got {nodes.describe()} "
                         "(BURSTMPI_RANKS_PER_NODE sets the node size)")


class _Rings:
    """The inner and outer communicators and their transports (split once per plan)."""

    def __init__(self, plan):
        nodes, comm = plan.runtime.nodes, plan.comm
        self.node, self.local = nodes.node, nodes.local_rank
        self.N, self.g = nodes.count, len(nodes.members[0])
        self.members = nodes.members
        self.inner, self.outer = split_once(comm, ("two-level", nodes.node_of),
                                            [(self.node, self.local), (self.local, self.node)])
        gbps = settings().internode_gbps
        self.t_inner = RING_TRANSPORT(self.inner)
        self.t_outer = (SlowLinksTransport(self.outer, Nodes(range(self.N), self.node), gbps) if gbps
                        else RING_TRANSPORT(self.outer))
        for t in (self.t_inner, self.t_outer):
            t.idle = plan.transport.idle
        self._kept, self.nbytes = {}, 0

    def kept(self, key, make, be):
        """The buffers ``make(alloc)`` builds for ``key`` (fields), made once and counted."""
        if key not in self._kept:
            def alloc(n):
                self.nbytes += n
                return be.alloc(n)
            self._kept[key] = make(alloc)
        return self._kept[key]

    def owner(self, o, s, sign=1):
        """The world rank whose block this rank holds at cycle o, step s (``sign`` -1: on the
        mirrored rings)."""
        return block_owner(self.members, self.node, self.local, sign * o, sign * s)

    def channel(self, transport, fields, size, me, tag, alloc, sign):
        return Channel(transport, fields, send_to=(me + sign) % size, recv_from=(me - sign) % size, tag=tag,
                       alloc=alloc, single=size == 1)


def block_owner(members, node, local, o, s):
    """The rank whose block local rank ``local`` of node ``node`` holds at cycle o, step s
    (``members``: ``Nodes.members``, equal nodes; negative o and s: the mirrored rings)."""
    return members[(node - o) % len(members)][(local - s) % len(members[0])]


def choose_mode(bwd_comm, dims, dtype):
    """The backward mode of a two-level call: ``bwd_comm``, or for "auto" "burst" or "ring",
    whichever moves fewer bytes a hop (its packets do not shrink, so the full packet and
    partial decide; ties go to "burst", as on the flat ring). "two-way" only when asked
    for: it splits the backward into two passes over the scores, which costs the host
    backend more compute than it saves bytes."""
    if bwd_comm != "auto":
        return bwd_comm
    acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    cost = {mode: sum(nbytes(f) for f in packet_fields(mode, dims, dtype, acc)) for mode in ("burst", "ring")}
    return min(cost, key=cost.get)


def transport_name(plan):
    """What ``last_stats.transport`` says of a two-level call: its rings' transports."""
    r = _rings(plan)
    return f"two-level: inner {r.t_inner.name}, outer {r.t_outer.name}, partials home {plan.transport.name}"


def _rings(plan):
    rings = getattr(plan, "_rings", None)
    if rings is None:
        rings = plan._rings = _Rings(plan)  # collective: every rank's first two-level call
    return rings


def _seed(inner, outer, n):
    """Copy the cycle's seed (the outer ring's current packet, ``n`` rows) into the inner
    ring's own packet, which the inner ring sends on."""
    src = outer.current
    for name, view in inner.fill(n).items():
        view[...] = src[name]


def _steps(r, count, rings, timer, first=None):
    """Yield (o, s, [(owner, packet views) per ring pair]) for every step, posting and
    waiting the inner and outer transfers around them (``count``: rows of a rank's block;
    ``rings``: (inner, outer, sign) pairs of channels, run in lockstep). ``first(o, s)``
    posts what the step must post before its ring transfers (a partial's receive: a peer
    sends it before the next packet, and NCCL matches in order)."""
    for o in range(r.N):
        for inner, outer, sign in rings:
            seed = r.owner(o, 0, sign)
            if o < r.N - 1:
                outer.post(send=True, recv=True, send_rows=count(seed), recv_rows=count(r.owner(o + 1, 0, sign)))
            _seed(inner, outer, count(seed))
        for s in range(r.g):
            if first is not None:
                first(o, s)
            if s < r.g - 1:
                for inner, _, sign in rings:
                    inner.post(send=True, recv=True, send_rows=count(r.owner(o, s, sign)),
                               recv_rows=count(r.owner(o, s + 1, sign)))
            yield o, s, [(r.owner(o, s, sign), inner.current) for inner, _, sign in rings]
            if s < r.g - 1:
                for inner, _, _ in rings:
                    timer.run("wait", inner.wait)
        if o < r.N - 1:
            for _, outer, _ in rings:
                timer.run("wait", outer.wait)


def _channels(r, fields, be, sign=1, tags=(TAG_INNER, TAG_OUTER)):
    """The inner and outer rings' channels for packets of ``fields`` going ``sign``, ready
    for a phase: (inner, outer, sign)."""
    inner, outer = r.kept(("channels", _key(fields), sign), lambda alloc: (
        r.channel(r.t_inner, fields, r.g, r.local, tags[0], alloc, sign),
        r.channel(r.t_outer, fields, r.N, r.node, tags[1], alloc, sign)), be)
    inner.begin()
    outer.begin()
    return inner, outer, sign


def _load(ring, home, C):
    """Our block into the outer ring's packet, where cycle 0 seeds the inner ring from."""
    for name, view in ring[1].fill(C).items():
        view[...] = home[name]


def _key(fields):
    return tuple((name, tuple(shape), str(dt)) for name, shape, dt in fields)


def _stats(plan, sent_inner, sent_outer, sent_home, received, owners, pairs, timer, t_start):
    from .plan import PhaseStats
    home_inter = sum(n for dest, n in sent_home.items() if plan.runtime.nodes.remote(plan.rank, dest))
    total = sent_inner + sent_outer + sum(sent_home.values())
    computed = len(set(owners))
    return PhaseStats(bytes_sent=total, bytes_internode=sent_outer + home_inter, bytes_recv=received,
                      steps_computed=computed,
                      steps_skipped=plan.nranks - computed, pairs=int(pairs), direction=1,
                      wall_s=time.perf_counter() - t_start, compute_s=timer.compute, wait_s=timer.wait)


def forward(plan, q, k, v, dims):
    """Return (out, lse, stats) for this rank's q, k, v."""
    be, geo = plan.backend, plan.geometry
    B, C, Z, Zkv, d, dv = dims
    acc = be.acc_dtype(q.dtype)
    r = _rings(plan)
    lay = geo.layout
    packet, _ = packet_fields("forward", (B, lay.max_count, Z, Zkv, d, dv), q.dtype, acc)
    ring = _channels(r, packet, be)
    timer, t_start = Timer(), time.perf_counter()
    _load(ring, key_operands(k, v), C)
    inner, outer, _ = ring
    q_rows = _rows(q, Zkv)
    state = be.fwd_state(B, Zkv, C, Z // Zkv, dv, acc)
    qb = geo.block("q", plan.rank)
    owners = []
    poll = lambda: any([inner.progress(), outer.progress()])
    for _, _, [(w, views)] in _steps(r, lay.count, [ring], timer):
        if geo.pairs(plan.rank, w) == 0:
            continue
        owners.append(w)
        timer.run("compute", fwd_pieces, be, q_rows, views["k"], views["v"], state,
                  geo.pieces(qb, geo.block("k", w)), plan.scale, poll=poll)
    out, lse = finish_forward(be, state, q.dtype, dims)
    pairs = sum(geo.pairs(plan.rank, w) for w in owners)
    return out, lse, _stats(plan, inner.bytes_sent, outer.bytes_sent, {}, inner.bytes_recv + outer.bytes_recv,
                            owners, pairs, timer, t_start)


class _Home:
    """Partials going home across the plan's communicator: this rank's sends (two buffers,
    each reused once its last send is done) and the receives of its own block's partials
    (two buffers: cycle o's lands while cycle o - 1's waits to be added)."""

    def __init__(self, fields, alloc):
        self.send = [Packet(fields, alloc) for _ in range(2)]
        self.recv = [Packet(fields, alloc) for _ in range(2)]

    def begin(self, transport):
        """A phase starts: on ``transport`` (the plan's), with nothing in flight."""
        self.t = transport
        self.sreq, self.rreq = [None, None], [None, None]
        self.next, self.sent, self.received_bytes = 0, {}, 0
        return self

    def buffer(self, rows):
        """Views of the next send buffer (its last send waited for), to copy a partial into."""
        i = self.next
        if self.sreq[i] is not None:
            self.t.wait([self.sreq[i]])
            self.sreq[i] = None
        return self.send[i].views(rows)

    def post_send(self, dest, rows):
        i = self.next
        out = self.send[i].message(rows)
        self.sreq[i] = self.t.isend(out, dest, TAG_HOME)
        self.sent[dest] = self.sent.get(dest, 0) + out.nbytes
        self.next = 1 - i

    def post_recv(self, slot, source, rows):
        into = self.recv[slot].message(rows)
        self.rreq[slot] = (self.t.irecv(into, source, TAG_HOME), rows)
        self.received_bytes += into.nbytes

    def received(self, slot):
        req, rows = self.rreq[slot]
        self.t.wait([req])
        self.rreq[slot] = None
        return self.recv[slot].views(rows)

    def pending(self):
        return [x for x in self.sreq if x is not None] + [x[0] for x in self.rreq if x is not None]

    def drain(self):
        reqs = [x for x in self.sreq if x is not None]
        if reqs:
            self.t.wait(reqs)
        self.sreq = [None, None]


def backward(plan, mode, dout, q, k, v, out, lse, dims):
    """Return (dq, dk, dv, stats) in ``mode``: "ring" (K, V and their dK/dV partials on the
    two rings), "burst" (the query side and its dQ partial) or "two-way"."""
    if mode == "two-way":
        return _backward_two_way(plan, dout, q, k, v, out, lse, dims)
    be, geo = plan.backend, plan.geometry
    B, C, Z, Zkv, d, dv = dims
    acc = be.acc_dtype(q.dtype)
    r = _rings(plan)
    lay = geo.layout
    count = lay.count
    burst = mode == "burst"
    packet, partial = packet_fields(mode, (B, lay.max_count, Z, Zkv, d, dv), q.dtype, acc)
    ring = _channels(r, packet, be)
    inner, outer, _ = ring
    # A partial passes to the next rank of the node with its block (two buffers, each reused
    # once its send is done), or goes home; ``incoming``: the previous rank's partial of the
    # block in hand.
    ipart, incoming, home = r.kept(("partials", _key(partial)), lambda alloc: (
        [Packet(partial, alloc) for _ in range(2)], Packet(partial, alloc), _Home(partial, alloc)), be)
    home.begin(plan.transport)
    timer, t_start = Timer(), time.perf_counter()
    home_q, home_k, grads = backward_operands(be, dout, q, k, v, out, lse, dims, acc)
    if burst:  # K and V stay home for every step: as the tiles read them, once
        home_k = be.resident_keys(home_k["k"], home_k["v"], acc)
    _load(ring, home_q if burst else home_k, C)
    me = plan.rank
    qb_me, kb_me = geo.block("q", me), geo.block("k", me)
    # The pairs the holder computes of owner w's block: w's queries against our keys
    # (burst), or ours against w's keys.
    visible = (lambda w: geo.pairs(w, me)) if burst else (lambda w: geo.pairs(me, w))
    # Cycle o's partial of our block comes home from the last holder of its loop in node
    # n + o (none at cycle 0 when a node has one rank: we held it alone).
    has_home = [o > 0 or r.g > 1 for o in range(r.N)]
    last_holder = lambda o: r.members[(r.node + o) % r.N][(r.local - 1) % r.g]
    pend = []  # slots of home partials posted, each added at the start of the cycle after next
    owners, ipart_req, ipart_recv, inner_sent, inner_recv = [], [None, None], None, 0, 0
    poll = lambda: any([inner.progress(), outer.progress(), bool(home.pending()) and not
                        plan.transport.progress(home.pending())])
    pb_index = 0

    def first(o, s):
        # The previous rank of the node sent its partial of the block we hold now after
        # its step's compute, after the packet for our step and before the next one: its
        # receive goes before this step's ring transfers, in that order.
        nonlocal ipart_recv, inner_recv
        if s >= 1 and not (o == 0 and s == 1):  # the previous holder made a partial of it
            into = incoming.message(count(r.owner(o, s)))
            ipart_recv = r.t_inner.irecv(into, (r.local - 1) % r.g, TAG_PARTIAL)
            inner_recv += into.nbytes

    for o, s, [(w, views)] in _steps(r, count, [ring], timer, first):
        if s == 0:
            while pend and len(pend) >= 2:  # the older of the two landing buffers: add it now
                _add(timer, home, grads, pend.pop(0))
            if has_home[o]:
                home.post_recv(o % 2, last_holder(o), C)
                pend.append(o % 2)
        own = o == 0 and s == 0  # our own block: straight into our accumulators
        rows = count(w)
        if own:
            target = grads
        else:
            buf = ipart[pb_index]
            if ipart_req[pb_index] is not None:  # its last send is done before it is reused
                timer.run("wait", r.t_inner.wait, [ipart_req[pb_index]])
                ipart_req[pb_index] = None
            buf.message(rows).fill(0)
            pv = buf.views(rows)
            target = {**grads, **pv}
        if visible(w):
            owners.append(w)
            qs, ks, qb, kb = ((views, home_k, geo.block("q", w), kb_me) if burst else
                              (home_q, views, qb_me, geo.block("k", w)))
            timer.run("compute", bwd_pieces, be, qs["q"], qs["do"], qs["D"], qs["lse"], ks["k"], ks["v"],
                      target["dq"], target["dk"], target["dv"], geo.pieces(qb, kb), plan.scale, poll=poll)
        if own:
            continue
        if ipart_recv is not None:  # the previous holder's partial of this block: added after ours
            timer.run("wait", r.t_inner.wait, [ipart_recv])
            for name, view in incoming.views(rows).items():
                pv[name] += view
            ipart_recv = None
        if s < r.g - 1:  # on to the next rank of the node, with the block
            msg = buf.message(rows)
            ipart_req[pb_index] = r.t_inner.isend(msg, (r.local + 1) % r.g, TAG_PARTIAL)
            inner_sent += msg.nbytes
        else:  # the loop is done: home to the owner
            for name, view in home.buffer(rows).items():
                view[...] = pv[name]
            home.post_send(w, rows)
        pb_index = 1 - pb_index
    timer.run("wait", r.t_inner.wait, [x for x in ipart_req if x is not None])
    timer.run("wait", home.drain)
    for p in pend:
        _add(timer, home, grads, p)
    dq, dk, dvv = finish_gradients(plan, grads, q.dtype)
    pairs = sum(visible(w) for w in owners)
    st = _stats(plan, inner.bytes_sent + inner_sent, outer.bytes_sent, home.sent,
                inner.bytes_recv + outer.bytes_recv + inner_recv + home.received_bytes, owners, pairs, timer, t_start)
    return dq, dk, dvv, st


def _add(timer, home, grads, slot):
    for name, view in timer.run("wait", home.received, slot).items():
        grads[name][...] += view


def _backward_two_way(plan, dout, q, k, v, out, lse, dims):
    """K/V on the rings, the query side on the mirrored rings, nothing home: dQ of our
    queries from every K/V block that reaches us, dK/dV of our keys from every query block
    (the flat two-way ring's split, ``burstmpi.twoway``)."""
    be, geo = plan.backend, plan.geometry
    B, C, Z, Zkv, d, dv = dims
    acc = be.acc_dtype(q.dtype)
    r = _rings(plan)
    lay = geo.layout
    rows = (B, lay.max_count, Z, Zkv, d, dv)
    kv_ring = _channels(r, packet_fields("forward", rows, q.dtype, acc)[0], be)
    q_ring = _channels(r, packet_fields("burst", rows, q.dtype, acc)[0], be, -1, (TAG_Q_INNER, TAG_Q_OUTER))
    timer, t_start = Timer(), time.perf_counter()
    home_q, home_k, grads = backward_operands(be, dout, q, k, v, out, lse, dims, acc)
    _load(kv_ring, home_k, C)
    _load(q_ring, home_q, C)
    me = plan.rank
    qb_me, kb_me = geo.block("q", me), geo.block("k", me)
    rings = (kv_ring, q_ring)
    poll = lambda: any([c.progress() for ring in rings for c in ring[:2]])
    owners, pairs = [], 0

    def run(qs, ks, dq, dk, dv_, qb, kb):
        timer.run("compute", bwd_pieces, be, qs["q"], qs["do"], qs["D"], qs["lse"], ks["k"], ks["v"],
                  dq, dk, dv_, geo.pieces(qb, kb), plan.scale, poll=poll)

    for o, s, [(wk, kv), (wq, qv)] in _steps(r, lay.count, rings, timer):
        if o == 0 and s == 0:  # our own block, once, for all three gradients
            if geo.pairs(me, me):
                owners.append(me)
                pairs += geo.pairs(me, me)
                run(home_q, home_k, grads["dq"], grads["dk"], grads["dv"], qb_me, kb_me)
            continue
        if geo.pairs(me, wk):  # their keys: dQ of our queries
            owners.append(wk)
            pairs += geo.pairs(me, wk)
            run(home_q, kv, grads["dq"], None, None, qb_me, geo.block("k", wk))
        if geo.pairs(wq, me):  # their queries: dK, dV of our keys
            owners.append(wq)
            pairs += geo.pairs(wq, me)
            run(qv, home_k, None, grads["dk"], grads["dv"], geo.block("q", wq), kb_me)
    dq, dk, dvv = finish_gradients(plan, grads, q.dtype)
    sent = sum(ring[0].bytes_sent for ring in rings), sum(ring[1].bytes_sent for ring in rings)
    received = sum(c.bytes_recv for ring in rings for c in ring[:2])
    return dq, dk, dvv, _stats(plan, sent[0], sent[1], {}, received, owners, pairs, timer, t_start)
