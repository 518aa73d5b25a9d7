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
goes home from the loop's last holder straight to the block's owner. A partial leaves as
soon as it is finished, in one group with the receive of the partial its rank adds to
next (at a cycle's end: home, in one group with the receive of our own block's partial);
the owner adds a home partial a cycle later (the last two after the phase), so the home
transfer hides behind a cycle of compute too (``burstmpi._ring.twolevel_backward``).
``"two-way"`` sends K/V along the rings and the query side against them (a second pair
of rings, mirrored: cycle o, step s holds the queries of rank (n + o, i + s)); nothing
goes home, and each rank adds dQ of its queries and dK/dV of its keys itself, as the
flat two-way ring does.

Inner and outer transfers use communicators of their own (split from the plan's), so
they match only among themselves; the home partials use the plan's. Each ring runs the
plan's kind of transport on its communicator (``on``): NCCL with an NCCL communicator
and a comm stream per ring for GPU arrays, MPI for host arrays. On each, every rank
posts its transfers as the same groups in the same order (``steps``), so they pair up
without tags, group by group, as NCCL pairs them, and NCCL's communicators used side by
side see every rank queue its work in one order (the tests run the rings on such a
transport, ``tests/ordered_transport.py``).

Under masks packets shrink as they go (``Route``): a hop carries only the rows that some
later holder reads, and an outer hop only those that later nodes read, so the network
carries no row no node ahead needs. A partial holds the rows its block brought to the
node. Steps with no visible pair skip their compute; their transfer still runs, shrunk,
often to nothing, so that every rank posts the same transfers in the same order. The
rings and their buffers are the runtime's (``Runtime.owned``: one ``Rings`` per kind of
arrays, device and transport), kept from call to call while the shapes stay, counted by
``buffer_bytes`` and freed by ``release()``; a call reads them from its ``Call``.
"""

import time
from typing import NamedTuple

import numpy as np

from .._transport.comm import Channel
from .._transport.lifetime import split_once
from .._transport.nodes import Nodes
from .._transport.slowlinks import SlowLinksTransport, refuse_device_arrays
from .flat import (Timer, cut_runs, finish_forward, fwd_pieces, grouped_rows, key_operands, load_packet, nbytes,
                   packet_dims, packet_fields)
from .stats import PhaseStats

__all__ = ["Rings", "check_two_level", "block_owner", "choose_mode", "forward"]

TAG_INNER, TAG_OUTER, TAG_PARTIAL, TAG_HOME, TAG_Q_INNER, TAG_Q_OUTER = 41, 42, 43, 44, 45, 46
def check_two_level(fn, nodes, kind, internode_gbps=None):
    """Raise ValueError naming ``topology`` where these nodes (or arrays of ``kind``) cannot
    run two rings (``internode_gbps``: the caller's slowed-links setting)."""
    if kind == "cuda":
        refuse_device_arrays(f"{fn}: topology", nodes, internode_gbps)
    if not nodes.equal:
        raise ValueError(f"{fn}: topology: 'two-level' needs nodes of equal size, got {nodes.describe()} "
                         "(BURSTMPI_RANKS_PER_NODE sets the node size)")


class Rings:
    """The inner and outer communicators, their transports and buffers: made once per
    runtime and kind of arrays (``Runtime.owned``; the split is collective: every rank's
    first two-level call), from the plan's communicator ``comm``, the ranks' ``nodes`` and
    the plan's ``transport``, whose kind each ring runs on its communicator (``on``):
    NCCL with a communicator and a stream per ring on GPUs, MPI on the host (a shared
    window is the plan communicator's, so its rings copy through MPI). ``internode_gbps``:
    the slowed links' simulation aid (host arrays only, ``check_two_level``)."""

    def __init__(self, comm, nodes, transport, timeout, internode_gbps=0.0):
        self.node, self.local = nodes.node, nodes.local_rank
        self.N, self.g = nodes.count, len(nodes.members[0])
        self.members = nodes.members
        self.where = [(n, nodes.members[n].index(x)) for x, n in enumerate(nodes.node_of)]  # (node, local rank)
        # names this node map in the geometry's cache of routes (a string: its hash is kept)
        self.path_name = "two-level:" + ",".join(map(str, nodes.node_of))
        self.inner, self.outer = split_once(comm, ("two-level", nodes.node_of),
                                            [(self.node, self.local), (self.local, self.node)], timeout)
        self.t_inner = transport.on(self.inner)
        if internode_gbps:
            self.t_outer = SlowLinksTransport(self.outer, Nodes(range(self.N), self.node), internode_gbps)
            self.t_outer.idle, self.t_outer.timeout = transport.idle, transport.timeout
        else:
            self.t_outer = transport.on(self.outer)
        self.home_name = transport.name  # the partials home travel on the plan's transport
        self._kept, self.nbytes = {}, 0

    def finish(self):
        """End of a phase: the rings' transports that run asynchronously (NCCL) check that
        their transfers completed, as ``Runtime.finish`` does for the plan's."""
        self.t_inner.finish()
        self.t_outer.finish()

    def release(self, window=True):
        """Drop the buffers (made again by the next call); the communicators and transports
        stay, since remaking them is collective. Its buffers are its own: ``window`` is
        the runtime's argument, nothing to do here."""
        self._kept, self.nbytes = {}, 0

    @property
    def name(self):
        """What ``last_stats.transport`` says of a two-level call."""
        return f"two-level: inner {self.t_inner.name}, outer {self.t_outer.name}, partials home {self.home_name}"

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
        # A packet passed on with fewer rows than it came with is packed into a staging
        # packet first: in the backend's memory too (``alloc``), or GPU rows would be
        # copied into a host buffer and handed to NCCL.
        return Channel(transport, fields, send_to=(me + sign) % size, recv_from=(me - sign) % size, tag=tag,
                       alloc=alloc, single=size == 1, stage=alloc)


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


def _seed(inner, outer, n):
    """Copy the cycle's seed (the outer ring's current packet, ``n`` rows) into the inner
    ring's own packet, which the inner ring sends on."""
    src = outer.current
    for name, view in inner.fill(n).items():
        view[...] = src[name]


class Route:
    """How the blocks of one role ("k": keys, "q": queries) travel the rings going ``sign``
    (``Geometry.route_along``). Rank (n, i) holds the block of rank (n', i') at step
    t = o g + s of the phase: cycle o = (n - n') sign mod N, hop s = (i - i') sign mod g.
    A packet carries only the rows some later holder reads, those read latest first: an
    outer hop to cycle o + 1 carries the rows that nodes from the next one on read (the
    network never carries a row no later node needs), an inner hop the rows read from its
    next step on (in this node or later ones: the node's links are the fast ones)."""

    def __init__(self, r, geo, role, sign):
        self.r, self.geo, self.role, self.sign = r, geo, role, sign
        self.path = (r.path_name, sign)

    def _route(self, owner):
        N, g, sign = self.r.N, self.r.g, self.sign
        n0, i0 = self.r.where[owner]
        when = lambda: np.array([(sign * (n - n0)) % N * g + (sign * (i - i0)) % g for n, i in self.r.where])
        return self.geo.route_along(self.role, owner, self.path, when)

    def rows(self, owner, t):
        """Rows of ``owner``'s packet that its holder at step t has."""
        return int(self._route(owner)[1][t])

    def mine(self, rank):
        """``rank``'s local rows that leave home, in packet order."""
        return self.geo.travelling_rows(self.role, rank)[self._route(rank)[0]]

    def runs(self, owner, t, *packets):
        """``ring.cut_runs`` of what the holder at step t computes on from ``owner``'s packet."""
        self._route(owner)
        return cut_runs(self.geo.carried_along(self.role, owner, self.path, t), *packets)


class _Ring(NamedTuple):
    inner: Channel
    outer: Channel
    route: Route


def steps(r, rings, timer, then=None):
    """Yield (o, s, t, [(owner, packet views) per ring]) for every step t = o g + s,
    posting and waiting the inner and outer transfers around it (``rings``: ``_Ring``s,
    run in lockstep; each hop carries the rows its route keeps aboard).

    Each transport's transfers are posted as groups (``transport.group()``), every rank
    posting the same groups in the same order, so that a transport which runs its groups
    in order, matching sends to receives without tags (NCCL; ``tests/ordered_transport.py``
    plays it on MPI), pairs them up: an outer group at the start of each cycle, an inner
    group of packets at each step. ``then(o, s)`` runs after the step's compute, before
    the wait for the next packet, and posts its own groups (the backward's partials: sent
    as soon as they are finished, not held up by the next packet's arrival)."""
    g = r.g
    for o in range(r.N):
        with r.t_outer.group():
            for ring in rings:
                sign, route = ring.route.sign, ring.route
                if o < r.N - 1:
                    ring.outer.post(send=True, recv=True, send_rows=route.rows(r.owner(o, 0, sign), (o + 1) * g),
                                    recv_rows=route.rows(r.owner(o + 1, 0, sign), (o + 1) * g))
        for ring in rings:
            _seed(ring.inner, ring.outer, ring.route.rows(r.owner(o, 0, ring.route.sign), o * g))
        for s in range(g):
            t = o * g + s
            if s < g - 1:
                with r.t_inner.group():
                    for ring in rings:
                        sign, route = ring.route.sign, ring.route
                        ring.inner.post(send=True, recv=True, send_rows=route.rows(r.owner(o, s, sign), t + 1),
                                        recv_rows=route.rows(r.owner(o, s + 1, sign), t + 1))
            yield o, s, t, [(r.owner(o, s, ring.route.sign), ring.inner.current) for ring in rings]
            if then is not None:
                then(o, s)
            if s < g - 1:
                for ring in rings:
                    timer.run("wait", ring.inner.wait)
        if o < r.N - 1:
            for ring in rings:
                timer.run("wait", ring.outer.wait)


def channels(r, fields, be, route, tags=(TAG_INNER, TAG_OUTER)):
    """The inner and outer rings' channels for packets of ``fields`` on ``route``, ready
    for a phase, with this rank's packet still to load (``load``)."""
    sign = route.sign
    inner, outer = r.kept(("channels", key(fields), sign), lambda alloc: (
        r.channel(r.t_inner, fields, r.g, r.local, tags[0], alloc, sign),
        r.channel(r.t_outer, fields, r.N, r.node, tags[1], alloc, sign)), be)
    inner.begin()
    outer.begin()
    return _Ring(inner, outer, route)


def load(ring, home, me, be):
    """Our rows that leave home, in packet order, into the outer ring's packet (where cycle
    0 seeds the inner ring from); ``be``: the arrays' backend."""
    load_packet(ring.outer, home, ring.route.mine(me), be)


def key(fields):
    return tuple((name, tuple(shape), str(dt)) for name, shape, dt in fields)


def stats(call, sent_inner, sent_outer, sent_home, received, owners, pairs, timer, t_start):
    home_inter = sum(n for dest, n in sent_home.items() if call.nodes.remote(call.rank, dest))
    total = sent_inner + sent_outer + sum(sent_home.values())
    computed = len(set(owners))
    return PhaseStats(bytes_sent=total, bytes_internode=sent_outer + home_inter, bytes_recv=received,
                      steps_computed=computed,
                      steps_skipped=call.nranks - computed, pairs=int(pairs), direction=1,
                      wall_s=time.perf_counter() - t_start, compute_s=timer.compute, wait_s=timer.wait)


def forward(call, q, k, v, dims):
    """Return (out, lse, stats) for this rank's q, k, v."""
    be, geo = call.backend, call.geometry
    B, C, Z, Zkv, d, dv = dims
    acc = be.acc_dtype(q.dtype)
    r = call.rings
    me = call.rank
    packet, _ = packet_fields("forward", packet_dims(call, dims, "k"), q.dtype, acc)
    ring = channels(r, packet, be, Route(r, geo, "k", 1))
    timer, t_start = Timer(), time.perf_counter()
    home = key_operands(k, v)
    load(ring, home, me, be)
    q_rows = grouped_rows(q, Zkv)
    state = be.fwd_state(B, Zkv, C, Z // Zkv, dv, acc)
    qb = geo.block("q", me)
    owners = []
    poll = lambda: any([ring.inner.progress(), ring.outer.progress()])
    for _, _, t, [(w, views)] in steps(r, [ring], timer):
        if geo.pairs(me, w) == 0:
            continue
        owners.append(w)
        parts = [(home, geo.block("k", me))] if t == 0 else [(ks, kb) for (ks,), kb in ring.route.runs(w, t, views)]
        for ks, kb in parts:
            timer.run("compute", fwd_pieces, be, q_rows, ks["k"], ks["v"], state, geo.pieces(qb, kb), call.scale,
                      poll=poll)
    out, lse = finish_forward(be, state, q.dtype, dims)
    pairs = sum(geo.pairs(me, w) for w in owners)
    inner, outer = ring.inner, ring.outer
    return out, lse, stats(call, inner.bytes_sent, outer.bytes_sent, {}, inner.bytes_recv + outer.bytes_recv,
                            owners, pairs, timer, t_start)
