"""Causal work balanced whatever the caller's layout: the ring runs on a balanced layout, and
the results come back in the caller's.

A causal ring goes at its busiest rank's pace. With ``layout="contiguous"`` the last rank
sees almost every key and the first almost none (1.75x the mean pairs at 4 ranks, 1.87x at
8), so a plan whose geometry leaves the ranks unbalanced re-shards by itself: one
all-to-all moves each rank's q, k, v (the backward's dout, q, k, v, out, lse) to the rows a
balanced layout gives it, the ring runs there, and one all-to-all returns out and lse (dq,
dk, dv). Only the tokens that change rank travel (``transport.alltoall.TokenExchange``);
with documents the zigzag cuts each long document and keeps short ones whole, so the
exchange is irregular and the same code serves.

Which layout: every candidate's exact pair matrix (``Geometry.pairs``: windows, masks and
documents included) goes to the performance model with the exchange's bytes
(``model.balance``), and the fastest predicted wins where it beats the caller's layout by
``GAIN``. Zigzag is balanced for causal masks, striped for most windows (and runs every
ring step); neither for every mask, so the pairs decide, not a rule. A layout whose ranks'
pairs are already within ``GAIN`` of even is kept without asking (``even``): no candidate
could gain, and the model's collective and the candidates' matrices are spared. The
plan's ``balance`` setting forces a layout or turns this off; ``last_stats.ring_layout``
says what ran.

Schemes weighed and left (why: ``docs/design.md``): DistFlashAttn's helper
schedule (idle ranks compute query blocks of busy ones and return O and the statistics) needs
no re-shard but with whole blocks is at best (P+1)/P of the balanced time, 1.25 at 4 ranks,
and finer blocks multiply its messages; it also needs a second merge path in every backend.
The permutation costs one exchange of the inputs and one of the results, a few per cent of a
causal call on the CPU (``docs/performance.md``), and reuses the balanced ring, its backward modes, the
two-level ring, head parallelism and the GPU transports unchanged.
"""

import numpy as np

from .._transfers import Staging
from .._transport.alltoall import TokenExchange
from .._transport.mpi import MPITransport

__all__ = ["CANDIDATES", "GAIN", "NOMINAL_GBPS", "pair_matrix", "even", "moved_rows", "Balancing", "Mover"]

CANDIDATES = ("zigzag", "striped")  # in order of preference where they tie
GAIN = 0.03  # the predicted time a re-shard must save, as a fraction of the caller's layout's
# The links the choice assumes, GB/s (within a node, between nodes) where ``link_gbps`` is not
# set: measuring them would cost a collective per plan for a choice that is rarely close. On
# the host, the re-shard's own rate: 1 GB/s a rank was measured on a 2-core EPYC VM (16K
# causal tokens, 2 ranks: 177 MB in 176 ms a forward + backward, its gathers, scatters and
# fresh pages included), where MPI's ping-pong alone gave 11 GB/s.
NOMINAL_GBPS = {"host": (1.0, 1.0), "cuda": (100.0, 25.0)}


def pair_matrix(geo):
    """P x P visible pairs of ``geo``: [holder, owner] = holder's queries against owner's keys."""
    P = geo.layout.nranks
    return np.array([[geo.pairs(h, o) for o in range(P)] for h in range(P)], dtype=np.int64)


def even(pairs, gain=GAIN):
    """Is every rank's work within ``gain`` of the mean, its queries' pairs (the forward's and
    "ring"'s work) and its keys' ("burst")? Then a balanced layout, which at best computes
    the mean, cannot save ``gain`` of the compute, and the call stays on its layout without the
    model: windows, masks and zigzag or striped causal calls."""
    mean = pairs.sum() / len(pairs)
    return max(pairs.sum(axis=1).max(), pairs.sum(axis=0).max()) <= (1 + gain) * mean


def moved_rows(source, target):
    """Per rank, the tokens it sends away to go from layout ``source`` to ``target``. The
    way back each rank sends what it received: ``moved_rows(target, source)``."""
    P = source.nranks
    owner = np.empty(source.seqlen, np.int64)
    for r in range(P):
        owner[target.positions(r)] = r
    return np.array([int(np.count_nonzero(owner[source.positions(r)] != r)) for r in range(P)])


class Balancing:
    """A plan's re-sharding: the exchange of its latest (source, target) layouts, kept, since a
    training loop repeats its shapes and packed documents change them every batch."""

    def __init__(self, comm):
        self.comm = comm
        self._last = None  # (source layout, target layout, transport, xp, Mover)
        self._chosen = {}  # the caller's geometry (identity: geometries are cached) -> the layout's name

    def target(self, setting, geo, geometry_of, choose):
        """The geometry the ring runs on for a call of geometry ``geo`` (the caller's layout),
        or None to run on ``geo`` itself. ``setting``: the plan's ``balance``;
        ``geometry_of(name)``: the call's geometry on another layout; ``choose(candidates,
        caller)``: the model's pick (``model.balance.choose``: candidates map a name to
        (pairs, rows)). The same on every rank: everything it reads is agreed."""
        caller, P = geo.layout.name, geo.layout.nranks
        if setting == "off" or P == 1 or setting == caller:
            return None
        if setting != "auto":
            return geometry_of(setting)
        if geo.mask.dense:  # every layout computes every pair: nothing to balance
            return None
        got = self._chosen.get(geo)
        if got is None:
            mine = pair_matrix(geo)
            if even(mine):  # no re-shard can save GAIN: the model (and its collective) not asked
                got = caller
            else:
                others = {n: geometry_of(n) for n in CANDIDATES if n != caller}
                cands = {caller: (mine, None)}
                cands.update({n: (pair_matrix(g), (moved_rows(geo.layout, g.layout), moved_rows(g.layout, geo.layout)))
                              for n, g in others.items()})
                got = choose(cands, caller)[0]
            if len(self._chosen) >= 32:
                self._chosen.pop(next(iter(self._chosen)))
            self._chosen[geo] = got
        return None if got == caller else geometry_of(got)

    def mover(self, call, xp):
        """The ``Mover`` of ``call`` (``call.source``: the caller's geometry; ``call.geometry``
        the balanced one the ring runs on), for arrays of ``xp``."""
        src, dst, t = call.source.layout, call.geometry.layout, call.transport
        last = self._last
        if last is None or last[0] is not src or last[1] is not dst or last[2] is not t or last[3] is not xp:
            if xp is not np and t.name == "nccl":  # grouped NCCL transfers: GPU arrays skip the host
                how = dict(transport=t, xp=xp)
            else:  # MPI's transfers of host arrays, within the plan's deadline
                waits = MPITransport(self.comm)
                waits.idle, waits.timeout = getattr(t, "idle", False), call.timeout
                how = dict(waits=waits)
            ranks = range(src.nranks)
            ex = TokenExchange(self.comm, [src.positions(r) for r in ranks], [dst.positions(r) for r in ranks], **how)
            self._last = last = (src, dst, t, xp, Mover(ex, xp))
        last[4].exchange.reset()
        return last[4]


class Mover:
    """Arrays of ``xp`` through a ``TokenExchange`` (staged through host memory where the
    exchange runs on host arrays; the copies are counted, ``burstmpi._transfers``)."""

    def __init__(self, exchange, xp):
        self.exchange, self.xp = exchange, xp
        self._host = Staging(xp, exchange.xp)

    def forth(self, x, axis=1):
        """``x`` (its tokens on ``axis``) in the caller's rows to the balanced layout's."""
        return self._host.back(self.exchange.forth(self._host.out(x), axis))

    def back(self, y, axis=1):
        """``y`` in the balanced layout's rows back to the caller's."""
        return self._host.back(self.exchange.back(self._host.out(y), axis))

    def count(self, stats, nodes):
        """Add the exchange's bytes to a phase's ``PhaseStats`` (those to other nodes too)."""
        ex = self.exchange
        stats.bytes_sent += ex.bytes_sent
        if nodes is not None:
            stats.bytes_internode += nodes.internode(ex.bytes_to)
        ex.reset()
        return stats
