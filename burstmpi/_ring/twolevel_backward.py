"""The two-level ring's backward (``burstmpi._ring.twolevel`` describes the rings): "burst" and
"ring" move a block with its gradient partial around each node and the partial home from
the loop's last holder; "two-way" moves K/V on the rings and the query side on the
mirrored rings, and nothing home."""

import time

from .._transport.comm import Packet
from .flat import ROLE, Timer, _select, backward_operands, bwd_pieces, finish_gradients, packet_dims, packet_fields
from .twolevel import TAG_HOME, TAG_PARTIAL, TAG_Q_INNER, TAG_Q_OUTER, Route, channels, key, load, stats, steps

__all__ = ["backward"]


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


def backward(call, mode, dout, q, k, v, out, lse, dims):
    """Return (dq, dk, dv, stats) in ``mode``: "ring" (K, V and their dK/dV partials on the
    two rings), "burst" (the query side and its dQ partial) or "two-way"."""
    if mode == "two-way":
        return _backward_two_way(call, dout, q, k, v, out, lse, dims)
    run = _OneWay(call, mode, dout, q, k, v, out, lse, dims)
    for o, s, t, [(w, views)] in steps(call.rings, [run.ring], run.timer, run.hand_on):
        run.step(o, s, t, w, views)
    return run.finish(q.dtype)


class _OneWay:
    """One phase of the one-way backward, in the order it runs: ``__init__`` sets it up (the
    operands, the rings' channels, the partials' buffers, our block loaded); for each step
    of ``twolevel.steps``, ``step`` computes with the block in hand and then adds the
    previous holder's partial of it and readies ours to move on (``_after_compute``), and
    ``hand_on``, called by ``steps`` after the compute, posts what is ready: to the next
    rank of the node, or home; ``finish`` waits for the last partials home, adds them and
    counts the phase.

    A partial passes to the next rank of the node with its block, or goes home, as soon as
    it is finished: two buffers, each reused once its send is done. ``incoming``: the
    previous rank's partial of the block in hand. A partial holds the rows its block brought
    to the node, in packet order: a holder adds to the first rows, those it was handed."""

    def __init__(self, call, mode, dout, q, k, v, out, lse, dims):
        self.call, be, geo = call, call.backend, call.geometry
        self.C, acc = dims[1], be.acc_dtype(q.dtype)
        r = self.r = call.rings
        self.burst, self.role = mode == "burst", ROLE[mode]
        route = self.route = Route(r, geo, self.role, 1)
        packet, partial = packet_fields(mode, packet_dims(call, dims, self.role), q.dtype, acc)
        self.ring = channels(r, packet, be, route)
        self.ipart, self.incoming, self.home = r.kept(("partials", key(partial)), lambda alloc: (
            [Packet(partial, alloc) for _ in range(2)], Packet(partial, alloc), _Home(partial, alloc)), be)
        self.home.begin(call.transport)
        self.timer, self.t_start = Timer(), time.perf_counter()
        home_q, home_k, self.grads = backward_operands(be, dout, q, k, v, out, lse, dims, acc)
        if self.burst:  # K and V stay home for every step: as the tiles read them, once
            home_k = be.resident_keys(home_k["k"], home_k["v"], acc)
        self.home_q, self.home_k, me = home_q, home_k, call.rank
        self.travelling = home_q if self.burst else home_k
        load(self.ring, self.travelling, me, be)
        self.mine = route.mine(me)
        self.qb_me, self.kb_me = geo.block("q", me), geo.block("k", me)
        # Cycle o's partial of our block comes home from the last holder of its loop in node
        # n + o (none at cycle 0 when a node has one rank: we held it alone).
        self.has_home = [o > 0 or r.g > 1 for o in range(r.N)]
        self.pend = []  # (slot, our rows) of home partials posted, the older added when a third comes
        self.owners, self.ipart_req, self.ipart_recv, self.inner_sent, self.inner_recv = [], [None, None], None, 0, 0
        self.ready, self.going_home = None, None  # finished partials: (buffer, rows) next rank; (owner, rows) home
        self.pb_index, self.prows, self.pv = 0, None, None

    def visible(self, w):
        """The pairs this rank computes of owner w's block: w's queries against our keys
        (burst), or ours against w's keys."""
        geo, me = self.call.geometry, self.call.rank
        return geo.pairs(w, me) if self.burst else geo.pairs(me, w)

    def poll(self):
        home, t = self.home, self.call.transport
        return any([self.ring.inner.progress(), self.ring.outer.progress(),
                    bool(home.pending()) and not t.progress(home.pending())])

    def hand_on(self, o, s):
        """After step (o, s)'s compute, each rank's partial of the block in hand leaves in
        one group with the receive of the partial it will add to next: to the next rank
        of the node (every step of a cycle but the last; neither exists after the first
        step, which held each rank's own block), or home, in one group on the plan's
        transport with our own block's partial of this cycle coming back."""
        r, route = self.r, self.route
        if s < r.g - 1:
            if o == 0 and s == 0:
                return
            with r.t_inner.group():
                into = self.incoming.message(route.rows(r.owner(o, s + 1), o * r.g))
                self.ipart_recv = r.t_inner.irecv(into, (r.local - 1) % r.g, TAG_PARTIAL)
                self.inner_recv += into.nbytes
                i, rows = self.ready
                msg = self.ipart[i].message(rows)
                self.ipart_req[i] = r.t_inner.isend(msg, (r.local + 1) % r.g, TAG_PARTIAL)
                self.inner_sent += msg.nbytes
                self.ready = None
            return
        while len(self.pend) >= 2:  # the older of the two landing buffers: add it now
            _add(self.timer, self.home, self.grads, *self.pend.pop(0))
        me, be = self.call.rank, self.call.backend
        with self.call.transport.group():
            if self.going_home is not None:
                self.home.post_send(*self.going_home)
                self.going_home = None
            if self.has_home[o]:
                n = route.rows(me, o * r.g)
                last_holder = r.members[(r.node + o) % r.N][(r.local - 1) % r.g]
                self.home.post_recv(o % 2, last_holder, n)
                self.pend.append((o % 2, _select(be, self.mine[:n], self.C)))

    def step(self, o, s, t, w, views):
        """Step (o, s): compute with owner w's block (``views``), our own whole at t = 0."""
        call, geo, me, timer = self.call, self.call.geometry, self.call.rank, self.timer
        own = t == 0  # our own block, whole: straight into our accumulators
        if own:
            parts = [(self.travelling, geo.block(self.role, me), self.grads)]
        else:
            parts = self._partial_for(o, t, w, views)
        if self.visible(w):
            self.owners.append(w)
            for trav, blk, target in parts:
                qs, ks, qb, kb = (trav, self.home_k, blk, self.kb_me) if self.burst else (self.home_q, trav,
                                                                                         self.qb_me, blk)
                timer.run("compute", bwd_pieces, call.backend, qs["q"], qs["do"], qs["D"], qs["lse"], ks["k"],
                          ks["v"], target["dq"], target["dk"], target["dv"], geo.pieces(qb, kb), call.scale,
                          poll=self.poll)
        if not own:
            self._after_compute(s, w)

    def _partial_for(self, o, t, w, views):
        """A zeroed partial for owner w's block (its buffer's last send done first), and the
        (block views, rows, gradient targets) of its runs."""
        r = self.r
        self.prows = self.route.rows(w, o * r.g)
        buf = self.ipart[self.pb_index]
        if self.ipart_req[self.pb_index] is not None:  # its last send is done before it is reused
            self.timer.run("wait", r.t_inner.wait, [self.ipart_req[self.pb_index]])
            self.ipart_req[self.pb_index] = None
        buf.message(self.prows).fill(0)
        self.pv = pv = buf.views(self.prows)
        return [(views_run, blk, {**self.grads, **pv_run})
                for (views_run, pv_run), blk in self.route.runs(w, t, views, pv)]

    def _after_compute(self, s, w):
        """The previous holder's partial of this block added after ours; ours readied for the
        next rank of the node, or, the loop done, copied out to go home (``hand_on``)."""
        r, pv, prows = self.r, self.pv, self.prows
        if self.ipart_recv is not None:
            self.timer.run("wait", r.t_inner.wait, [self.ipart_recv])
            for name, view in self.incoming.views(prows).items():
                pv[name] += view
            self.ipart_recv = None
        if s < r.g - 1:
            self.ready = (self.pb_index, prows)
        else:
            for name, view in self.home.buffer(prows).items():
                view[...] = pv[name]
            self.going_home = (w, prows)
        self.pb_index = 1 - self.pb_index

    def finish(self, dtype):
        """The last partials home waited for and added; ``(dq, dk, dv, stats)``."""
        r, timer, home, ring = self.r, self.timer, self.home, self.ring
        timer.run("wait", r.t_inner.wait, [x for x in self.ipart_req if x is not None])
        timer.run("wait", home.drain)
        for slot, at in self.pend:
            _add(timer, home, self.grads, slot, at)
        dq, dk, dvv = finish_gradients(self.call, self.grads, dtype)
        pairs = sum(self.visible(w) for w in self.owners)
        inner, outer = ring.inner, ring.outer
        st = stats(self.call, inner.bytes_sent + self.inner_sent, outer.bytes_sent, home.sent,
                   inner.bytes_recv + outer.bytes_recv + self.inner_recv + home.received_bytes, self.owners, pairs,
                   timer, self.t_start)
        return dq, dk, dvv, st


def _add(timer, home, grads, slot, at):
    """Add a partial home to our rows ``at`` (in packet order)."""
    for name, view in timer.run("wait", home.received, slot).items():
        grads[name][:, :, at] += view


def _backward_two_way(call, dout, q, k, v, out, lse, dims):
    """K/V on the rings, the query side on the mirrored rings, nothing home: dQ of our
    queries from every K/V block that reaches us, dK/dV of our keys from every query block
    (the flat two-way ring's split, ``burstmpi._ring.twoway``)."""
    be, geo = call.backend, call.geometry
    acc = be.acc_dtype(q.dtype)
    r = call.rings
    me = call.rank
    kv_ring = channels(r, packet_fields("forward", packet_dims(call, dims, "k"), q.dtype, acc)[0], be,
                        Route(r, geo, "k", 1))
    q_ring = channels(r, packet_fields("burst", packet_dims(call, dims, "q"), q.dtype, acc)[0], be,
                       Route(r, geo, "q", -1), (TAG_Q_INNER, TAG_Q_OUTER))
    timer, t_start = Timer(), time.perf_counter()
    home_q, home_k, grads = backward_operands(be, dout, q, k, v, out, lse, dims, acc)
    load(kv_ring, home_k, me, be)
    load(q_ring, home_q, me, be)
    qb_me, kb_me = geo.block("q", me), geo.block("k", me)
    both = (kv_ring, q_ring)
    poll = lambda: any([c.progress() for ring in both for c in (ring.inner, ring.outer)])
    owners, pairs = [], 0

    def run(qs, ks, dq, dk, dv_, qb, kb):
        timer.run("compute", bwd_pieces, be, qs["q"], qs["do"], qs["D"], qs["lse"], ks["k"], ks["v"],
                  dq, dk, dv_, geo.pieces(qb, kb), call.scale, poll=poll)

    for o, s, t, [(wk, kv), (wq, qv)] in steps(r, both, timer):
        if t == 0:  # our own block, once, for all three gradients
            if geo.pairs(me, me):
                owners.append(me)
                pairs += geo.pairs(me, me)
                run(home_q, home_k, grads["dq"], grads["dk"], grads["dv"], qb_me, kb_me)
            continue
        if geo.pairs(me, wk):  # their keys: dQ of our queries
            owners.append(wk)
            pairs += geo.pairs(me, wk)
            for (ks,), kb in kv_ring.route.runs(wk, t, kv):
                run(home_q, ks, grads["dq"], None, None, qb_me, kb)
        if geo.pairs(wq, me):  # their queries: dK, dV of our keys
            owners.append(wq)
            pairs += geo.pairs(wq, me)
            for (qs,), qb in q_ring.route.runs(wq, t, qv):
                run(qs, home_k, None, grads["dk"], grads["dv"], qb, kb_me)
    dq, dk, dvv = finish_gradients(call, grads, q.dtype)
    sent = [sum(getattr(ring, c).bytes_sent for ring in both) for c in ("inner", "outer")]
    received = sum(c.bytes_recv for ring in both for c in (ring.inner, ring.outer))
    return dq, dk, dvv, stats(call, sent[0], sent[1], {}, received, owners, pairs, timer, t_start)
