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
    be, geo = call.backend, call.geometry
    C = dims[1]
    acc = be.acc_dtype(q.dtype)
    r = call.rings
    burst = mode == "burst"
    role = ROLE[mode]
    route = Route(r, geo, role, 1)
    packet, partial = packet_fields(mode, packet_dims(call, dims, role), q.dtype, acc)
    ring = channels(r, packet, be, route)
    inner, outer = ring.inner, ring.outer
    # A partial passes to the next rank of the node with its block, or goes home, as soon
    # as it is finished (``then``): two buffers, each reused once its send is done.
    # ``incoming``: the previous rank's partial of the block in hand. A partial holds the
    # rows its block brought to the node, in packet order: a holder adds to the first
    # rows, those it was handed.
    ipart, incoming, home = r.kept(("partials", key(partial)), lambda alloc: (
        [Packet(partial, alloc) for _ in range(2)], Packet(partial, alloc), _Home(partial, alloc)), be)
    home.begin(call.transport)
    timer, t_start = Timer(), time.perf_counter()
    home_q, home_k, grads = backward_operands(be, dout, q, k, v, out, lse, dims, acc)
    if burst:  # K and V stay home for every step: as the tiles read them, once
        home_k = be.resident_keys(home_k["k"], home_k["v"], acc)
    me = call.rank
    travelling = home_q if burst else home_k
    load(ring, travelling, me, be)
    mine = route.mine(me)
    qb_me, kb_me = geo.block("q", me), geo.block("k", me)
    # The pairs the holder computes of owner w's block: w's queries against our keys
    # (burst), or ours against w's keys.
    visible = (lambda w: geo.pairs(w, me)) if burst else (lambda w: geo.pairs(me, w))
    # Cycle o's partial of our block comes home from the last holder of its loop in node
    # n + o (none at cycle 0 when a node has one rank: we held it alone).
    has_home = [o > 0 or r.g > 1 for o in range(r.N)]
    last_holder = lambda o: r.members[(r.node + o) % r.N][(r.local - 1) % r.g]
    pend = []  # (slot, our rows) of home partials posted, the older added when a third comes
    owners, ipart_req, ipart_recv, inner_sent, inner_recv = [], [None, None], None, 0, 0
    ready, going_home = None, None  # finished partials: (buffer, rows) for the next rank; (owner, rows) home
    poll = lambda: any([inner.progress(), outer.progress(), bool(home.pending()) and not
                        call.transport.progress(home.pending())])
    pb_index = 0

    def then(o, s):
        # After step (o, s)'s compute, each rank's partial of the block in hand leaves in
        # one group with the receive of the partial it will add to next: to the next rank
        # of the node (every step of a cycle but the last; neither exists after the first
        # step, which held each rank's own block), or home, in one group on the plan's
        # transport with our own block's partial of this cycle coming back.
        nonlocal ipart_recv, inner_recv, inner_sent, ready, going_home
        if s < r.g - 1:
            if o == 0 and s == 0:
                return
            with r.t_inner.group():
                into = incoming.message(route.rows(r.owner(o, s + 1), o * r.g))
                ipart_recv = r.t_inner.irecv(into, (r.local - 1) % r.g, TAG_PARTIAL)
                inner_recv += into.nbytes
                i, rows = ready
                msg = ipart[i].message(rows)
                ipart_req[i] = r.t_inner.isend(msg, (r.local + 1) % r.g, TAG_PARTIAL)
                inner_sent += msg.nbytes
                ready = None
            return
        while len(pend) >= 2:  # the older of the two landing buffers: add it now
            _add(timer, home, grads, *pend.pop(0))
        with call.transport.group():
            if going_home is not None:
                home.post_send(*going_home)
                going_home = None
            if has_home[o]:
                n = route.rows(me, o * r.g)
                home.post_recv(o % 2, last_holder(o), n)
                pend.append((o % 2, _select(be, mine[:n], C)))

    for o, s, t, [(w, views)] in steps(r, [ring], timer, then):
        own = t == 0  # our own block, whole: straight into our accumulators
        if own:
            parts = [(travelling, geo.block(role, me), grads)]
        else:
            prows = route.rows(w, o * r.g)
            buf = ipart[pb_index]
            if ipart_req[pb_index] is not None:  # its last send is done before it is reused
                timer.run("wait", r.t_inner.wait, [ipart_req[pb_index]])
                ipart_req[pb_index] = None
            buf.message(prows).fill(0)
            pv = buf.views(prows)
            parts = [(views_run, blk, {**grads, **pv_run}) for (views_run, pv_run), blk in route.runs(w, t, views, pv)]
        if visible(w):
            owners.append(w)
            for trav, blk, target in parts:
                qs, ks, qb, kb = (trav, home_k, blk, kb_me) if burst else (home_q, trav, qb_me, blk)
                timer.run("compute", bwd_pieces, be, qs["q"], qs["do"], qs["D"], qs["lse"], ks["k"], ks["v"],
                          target["dq"], target["dk"], target["dv"], geo.pieces(qb, kb), call.scale, poll=poll)
        if own:
            continue
        if ipart_recv is not None:  # the previous holder's partial of this block: added after ours
            timer.run("wait", r.t_inner.wait, [ipart_recv])
            for name, view in incoming.views(prows).items():
                pv[name] += view
            ipart_recv = None
        if s < r.g - 1:  # on to the next rank of the node with the block (``then``)
            ready = (pb_index, prows)
        else:  # the loop is done: home to the owner (``then``)
            for name, view in home.buffer(prows).items():
                view[...] = pv[name]
            going_home = (w, prows)
        pb_index = 1 - pb_index
    timer.run("wait", r.t_inner.wait, [x for x in ipart_req if x is not None])
    timer.run("wait", home.drain)
    for slot, at in pend:
        _add(timer, home, grads, slot, at)
    dq, dk, dvv = finish_gradients(call, grads, q.dtype)
    pairs = sum(visible(w) for w in owners)
    st = stats(call, inner.bytes_sent + inner_sent, outer.bytes_sent, home.sent,
               inner.bytes_recv + outer.bytes_recv + inner_recv + home.received_bytes, owners, pairs, timer, t_start)
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
