"""The ring schedule: which steps compute, which transfers happen, and in which direction.

One block ("packet") per rank travels around the ring; at step t rank i holds the packet
owned by rank ``i - dir*t``. Every rank derives the whole schedule from the layout and
the mask alone, so a sender and its receiver always agree on whether a transfer happens:
nothing is negotiated at run time and a skipped send can never strand a posted receive.

Rules, for the packet owned by rank j:

* step t computes iff some query of one block sees some key of the other (``pair_matrix``
  counts the visible pairs exactly, documents and windows included);
* the packet moves on after step t iff some later holder computes with it: a causal
  contiguous K/V block stops travelling once it has passed the last rank that needs it;
* a moving gradient partial (dQ in "burst" mode, dK/dV in "ring" mode) starts at the
  first holder after the owner that computes, rides one step behind the packet as far
  as the last holder that computes, and goes from there straight home (no partial
  exists if no one contributed). Riding on through ranks that add nothing would cost
  bytes, and would chain each of them to the last contributor's compute: a rank cannot
  forward a partial before it arrives. The owner's own step-0 contribution never leaves
  home.

The direction (+1: send to rank+1, or -1) is the one that moves fewer bytes: a causal
contiguous forward sends K/V "up" the ring, a burst backward sends Q "down" it, so both
stop early. Ties go to +1.
"""

import threading

import numpy as np

from ..masks._intervals import count_visible

__all__ = ["Schedule", "pair_matrix", "interaction_matrix", "ring_bytes"]


def pair_matrix(layout, mask):
    """pairs[qi, kj]: visible (query token, key token) pairs of rank qi's queries and rank
    kj's keys (exact; int64). Batch and heads multiply every entry alike, so they are left out.

    Without a mask it is the product of the lengths; otherwise each query's visible key
    interval is counted against each rank's sorted positions: O(P N log N) for the whole
    matrix (the performance model uses it; a plan needs only ``interaction_matrix`` and
    its own rank's counts, ``geometry.Geometry.pairs``)."""
    P = layout.nranks
    if mask.dense:
        return np.outer(layout.counts, layout.counts)
    pairs = np.zeros((P, P), dtype=np.int64)
    for qi in range(P):
        qb = mask.query_block(layout.positions(qi))
        for kj in range(P):
            pairs[qi, kj] = count_visible(qb, layout.positions(kj))
    return pairs


def interaction_matrix(layout, mask):
    """A[qi, kj]: does some query of rank qi see some key of rank kj? (= pair_matrix > 0)

    ``mask``: an ``intervals.Mask`` or a lowered mask (``masks._terms.Lowered``), term by
    term. Cheaper than counting: the visible intervals of a rank's queries (both ends
    non-decreasing) merge into a few disjoint ranges of global positions (about one per
    document the rank holds), and a rank is needed iff it owns a position in one of them:
    binary searches per range instead of per query."""
    P = layout.nranks
    if mask.dense:
        return np.outer(layout.counts > 0, layout.counts > 0)
    a = np.zeros((P, P), dtype=bool)
    for qi in range(P):
        pos = layout.positions(qi)
        if len(pos) == 0:
            continue
        for qb, filt in mask.query_terms(pos):  # a mask's disjoint terms: the union of what they see
            if filt is not None:  # a block-sparse term: count its pairs (masks._blocks)
                for kj in range(P):
                    a[qi, kj] |= not a[qi, kj] and filt.count(qb, layout.positions(kj)) > 0
                continue
            # A new range starts where a row's interval begins past the previous row's end
            # (an empty row, first > last, sits where its neighbours' ends allow).
            new = np.concatenate([[True], qb.first[1:] > qb.last[:-1] + 1])
            starts, ends = qb.first[new], qb.last[np.concatenate([new[1:], [True]])]
            for kj in range(P):
                if not a[qi, kj]:
                    kpos = layout.positions(kj)
                    a[qi, kj] = bool((np.searchsorted(kpos, ends, side="right")
                                      > np.searchsorted(kpos, starts, side="left")).any())
    return a


class _Routes:
    """Where each packet goes in a ring of ``needs`` (holder, owner) with packets moving
    ``direction``, for every owner and step at once: ``later[o, t]``, does a holder after
    step t compute with owner o's packet (it moves on); ``started[o, t]``, has a holder
    other than the owner computed with it by step t (its partial exists); ``last[o]``, the
    last step at which one does (0: none). O(P^2) in arrays; a scalar rule per (owner,
    step) would make the schedule O(P^3) and the model's simulation, a schedule per rank,
    O(P^4): 12 s at 64 ranks."""

    def __init__(self, needs, direction):
        P = needs.shape[0]
        owner, step = np.arange(P)[:, None], np.arange(P)[None, :]
        seen = np.asarray(needs, bool)[(owner + direction * step) % P, owner]  # [o, s]: holder at step s computes
        seen[:, 0] = False  # the owner itself: not a holder the packet travels to
        after = np.logical_or.accumulate(seen[:, ::-1], axis=1)[:, ::-1]  # any at steps >= s
        self.later = np.concatenate([after[:, 1:], np.zeros((P, 1), bool)], axis=1)
        self.started = np.logical_or.accumulate(seen, axis=1)
        self.last = np.where(seen.any(axis=1), P - 1 - np.argmax(seen[:, ::-1], axis=1), 0)
        # Sends of each owner's partial: one per step from its first contributor to its
        # last (the last one's goes home).
        self.hops = (self.started & (step <= self.last[:, None])).sum(axis=1)


_ROUTES, _ROUTES_KEPT, _ROUTES_LOCK = {}, 16, threading.Lock()


def _routes(needs, direction):
    """The ``_Routes`` of ``needs`` (kept: the model builds a schedule per rank of one
    matrix; a lock, as plans may be made in several threads)."""
    key = (needs.shape, np.packbits(np.asarray(needs, bool)).tobytes(), direction)
    with _ROUTES_LOCK:
        got = _ROUTES.get(key)
        if got is None:
            if len(_ROUTES) >= _ROUTES_KEPT:
                _ROUTES.pop(next(iter(_ROUTES)))
            got = _ROUTES[key] = _Routes(needs, direction)
    return got


def ring_bytes(needs, direction, packet_bytes, partial_bytes):
    """Bytes the whole ring sends in one phase with packets going ``direction``.

    ``packet_bytes``: bytes of a packet, or ``f(owner, t, direction)``, the bytes of
    ``owner``'s packet as the holder at step t receives it (packets shrink as their rows
    reach their last readers: ``geometry.Geometry.route``); ``partial_bytes``: bytes of a
    partial, or ``f(owner, direction)``."""
    P = needs.shape[0]
    r = _routes(needs, direction)
    moves = r.later[:, :P - 1]  # [o, t]: o's packet sent after step t
    if callable(packet_bytes):
        sent = sum(packet_bytes(int(o), int(t) + 1, direction) for o, t in zip(*np.nonzero(moves)))
    else:
        sent = packet_bytes * int(moves.sum())
    if callable(partial_bytes):
        return sent + sum(partial_bytes(o, direction) * int(r.hops[o]) for o in range(P))
    return sent + partial_bytes * int(r.hops.sum())


class Schedule:
    """The plan of one ring phase, seen from one rank.

    ``needs[holder, owner]`` says whether ``holder`` computes with ``owner``'s packet;
    ``packet_bytes`` and ``partial_bytes`` (numbers or functions, as ``ring_bytes`` takes
    them) weigh the choice of direction.
    """

    def __init__(self, needs, rank, packet_bytes, partial_bytes=0, direction=None):
        self.P = P = needs.shape[0]
        self.rank = rank
        cost = {d: ring_bytes(needs, d, packet_bytes, partial_bytes) for d in (1, -1)}
        if direction is None:
            direction = 1 if cost[1] <= cost[-1] else -1
        self.direction = d = direction
        self.ring_bytes = cost[d]
        own = [(rank - d * t) % P for t in range(P)]
        self.owners = own
        self.compute = [bool(needs[rank, own[t]]) for t in range(P)]
        r = _routes(needs, d)
        # Packet sent after step t (t < P-1), and the one received for step t+1.
        self.send = [bool(r.later[own[t], t]) for t in range(P - 1)]
        self.recv = [bool(r.later[own[t + 1], t]) for t in range(P - 1)]
        # Gradient partial sent after step t (t >= 1), to the next holder or, from the last
        # contributor, home (``partial_to``); received at step t (t >= 2) from the previous
        # holder. This rank's own partial comes home from rank ``home_from`` with the
        # transfers of group ``home_at`` (the step after its last contributor's).
        last = [int(x) for x in r.last]
        self.partial_send = [1 <= t <= last[own[t]] and bool(r.started[own[t], t]) for t in range(P)]
        self.partial_to = [own[t] if t == last[own[t]] else (rank + d) % P for t in range(P)]
        self.partial_recv = [2 <= t <= last[own[t]] and bool(r.started[own[t], t - 1]) for t in range(P)]
        self.partial_home = P > 1 and last[rank] > 0
        self.home_at = last[rank] + 1
        self.home_from = (rank + d * last[rank]) % P

    @property
    def steps_computed(self):
        return sum(self.compute)

    @property
    def steps_skipped(self):
        return self.P - self.steps_computed

    def __repr__(self):
        return (f"Schedule(rank={self.rank}, P={self.P}, direction={self.direction:+d}, "
                f"compute={self.compute}, send={self.send}, recv={self.recv})")
