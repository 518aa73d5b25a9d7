"""The ring algorithm, written once for every backend and transport.

``flat``: the one-way ring (forward, and the backward's "burst" and "ring" modes), the
packets it sends and the timers it keeps; ``twoway``: the two-way ring, blocks sent only
as far as they are needed each way; ``twolevel`` and ``twolevel_backward``: a ring inside
each node and one between nodes; ``schedule``: which steps compute and which transfers
happen; ``geometry``: a call's layout, mask and pair counts, shared by the schedule, the
backends and the statistics; ``stats``: ``PhaseStats``, what a rank did in a phase. Nothing here knows about arrays' devices: a backend
(``burstmpi._backends``) does the local work and a transport (``burstmpi._transport``)
moves the bytes.
"""
