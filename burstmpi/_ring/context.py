"""``Call``: everything one ring call reads, made once per call by the plan and passed down.

The ring, two-way, two-level and head-parallel code reads this and nothing else of the
plan that made it: its geometry (layout, mask, pair counts), softmax scale, backend,
transport, the runtime's channels, the ranks' nodes, the deadline and, for the two-level
ring, the rings the runtime keeps. It is immutable, so a call cannot leave state behind
for the next one; what lives between calls (buffers, communicators, rings) is the
runtime's, keyed by what it depends on. The choices that weigh a call's bytes (which
direction, one-way or two-way, which backward mode moves fewer) are made here from the
same facts, so the plan holds policy only.
"""

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from .._transport.comm import rows_bytes
from . import flat, twoway
from .schedule import Schedule
from .stats import PhaseStats

__all__ = ["Call"]


@dataclass(frozen=True)
class Call:
    """One call of the ring, seen from one rank.

    ``channels(phase, specs)``: the runtime's buffers for a phase (``Runtime.channels``);
    ``rings``: the two-level rings (``twolevel.Rings``), for a two-level call only;
    ``kv_grads_accumulated``: dK/dV are returned unrounded (head parallelism adds the
    shares of replicated K/V heads first, ``flat.finish_gradients``); ``source``: the
    geometry of the caller's layout where the call was re-sharded to ``geometry``'s
    balanced one (``balance``), else None.
    """

    rank: int
    nranks: int
    geometry: Any
    scale: float
    backend: Any
    transport: Any
    channels: Callable
    nodes: Any
    timeout: float
    kv_grads_accumulated: bool = False
    rings: Optional[Any] = None
    source: Optional[Any] = None

    # -- the schedule and its bytes --------------------------------------------------------

    def fields(self, mode, dims, dtype):
        """The packet and partial fields of ``mode`` (``flat.packet_fields``)."""
        acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        return flat.packet_fields(mode, flat.packet_dims(self, dims, flat.ROLE[mode]), dtype, acc)

    def sizes(self, mode, dims, dtype):
        """Bytes of ``mode``'s packets and partials as they shrink (``Geometry.route``):
        ``packet(owner, t, direction, arc=None)``, what the holder at step t receives, and
        ``partial(owner, direction)``."""
        role, geo = flat.ROLE[mode], self.geometry
        packet, partial = self.fields(mode, dims, dtype)
        return (lambda o, t, d, arc=None: rows_bytes(packet, geo.route(role, o, d, arc)[1][t]),
                lambda o, d: rows_bytes(partial, geo.route(role, o, d)[1][0]) if partial else 0)

    def schedule(self, mode, dims, dtype):
        """The ring schedule of ``mode``: its direction is the one that moves fewer bytes,
        with packets and partials of the rows they carry (``Geometry.route``)."""
        packet, partial = self.sizes(mode, dims, dtype)
        return Schedule(self.geometry.needs(mode), self.rank, packet, partial)

    def full_bytes(self, mode, dims, dtype):
        """Bytes of one full packet and partial of ``mode``."""
        packet, partial = self.fields(mode, dims, dtype)
        return flat.nbytes(packet), flat.nbytes(partial)

    def forward_two_way(self, dims, dtype):
        """Does the two-way ring move fewer forward bytes than the one-way ring?"""
        if self.nranks < 3:
            return False
        packet, _ = self.sizes("forward", dims, dtype)
        return twoway.two_way_bytes(self.geometry.needs("forward"), packet) < \
            self.schedule("forward", dims, dtype).ring_bytes

    def backward_costs(self, dims, dtype, two_way):
        """{mode: (bytes the ring moves, bytes of a full step)} of the backward's modes,
        "two-way" included where ``two_way``; dicts keep order: ties go to "burst", then
        "ring"."""
        cost = {}
        for mode in ("burst", "ring"):
            packet, partial = self.full_bytes(mode, dims, dtype)
            cost[mode] = (self.schedule(mode, dims, dtype).ring_bytes, packet + partial)
        if two_way:
            geo = self.geometry
            kv, _ = self.full_bytes("forward", dims, dtype)
            qp, _ = self.full_bytes("burst", dims, dtype)
            cost["two-way"] = (twoway.two_way_bytes(geo.needs("forward"), self.sizes("forward", dims, dtype)[0])
                               + twoway.two_way_bytes(geo.needs("burst"), self.sizes("burst", dims, dtype)[0]),
                               kv + qp)
        return cost

    # -- what a phase reports ----------------------------------------------------------------

    def phase_stats(self, chans, owners, pairs, direction, timer, t_start):
        """A phase's ``PhaseStats``. ``owners``: the ranks whose blocks this rank computed
        with; ``pairs``: the visible pairs of those computations."""
        computed = len(set(owners))
        internode = sum(self.nodes.internode(c.bytes_to) for c in chans) if self.nodes else 0
        return PhaseStats(bytes_sent=sum(c.bytes_sent for c in chans), bytes_internode=internode,
                          bytes_recv=sum(c.bytes_recv for c in chans),
                          steps_computed=computed, steps_skipped=self.nranks - computed,
                          pairs=int(pairs), direction=direction, wall_s=time.perf_counter() - t_start,
                          compute_s=timer.compute, wait_s=timer.wait)
