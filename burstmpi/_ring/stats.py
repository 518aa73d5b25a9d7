"""``PhaseStats``: what one rank did in one phase of a ring call (``BurstAttention.last_stats``).

It lives with the ring, which fills it in (the two-level ring counts its own hops), and is
exported as ``burstmpi.PhaseStats``.
"""

from dataclasses import dataclass

__all__ = ["PhaseStats"]


@dataclass
class PhaseStats:
    """What one rank did in one phase of the last call.

    ``bytes_sent``/``bytes_recv`` count payload bytes this rank moved, and
    ``bytes_internode`` the part of ``bytes_sent`` that went to other nodes
    (``burstmpi._transport.nodes``: ``BURSTMPI_RANKS_PER_NODE`` or the shared-memory split);
    ``steps_computed + steps_skipped`` is the number of ranks (``steps_computed``: the ranks
    whose blocks this rank computed with); ``direction`` is +1 when packets go to rank+1,
    -1 when they go to rank-1, and 0 on the two-way ring (``burstmpi._ring.twoway``). ``pairs``
    counts the visible (query token, key token) pairs this rank computed (times batch and
    heads for the work done; compare ranks to measure imbalance; in a two-way backward a
    remote pair's dQ half and dK/dV half each count, on their own ranks). ``compute_s`` is time inside local kernels and ``wait_s`` the
    exposed communication (time blocked on transfers); ``wall_s`` covers the whole phase.
    """

    bytes_sent: int = 0
    bytes_internode: int = 0
    bytes_recv: int = 0
    steps_computed: int = 0
    steps_skipped: int = 0
    pairs: int = 0
    direction: int = 1
    wall_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0
