"""The performance model: what a run will cost before the machines are booked.

``flat``: the one-level ring in lockstep, per layout and backward mode; ``topology``: the
same across nodes (the two-level ring, head parallelism) and at scale; ``cli``: the
command line (``python -m burstmpi.model predict|check|scale|pingpong``).
"""
