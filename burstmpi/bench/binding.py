"""Where the bench's ranks run: ranks that share cores are pinned when the launcher did not.

MPICH's launcher (hydra) leaves every rank free to run on any core of its node unless
told ``-bind-to core`` (Open MPI's binds by default). With more ranks than cores the
kernel then moves ranks between cores as they wake and sleep around their transfers,
and the ranks wait longer on their transfers and run slower than when bound. So ``burstmpi-bench`` does what ``-bind-to core`` does
when, and only when, the ranks of a node outnumber its cores and all have the same
affinity mask (the launcher bound nothing): rank i of the node goes to core i mod cores,
so ring neighbours sit on different cores. ``--bind none`` leaves placement to the
launcher, and with ``--torch`` nothing is pinned either: torch's timer on rank 0 takes
every core while the other ranks wait. The library itself never sets affinity.
"""

import os

from .._backends.cpu.threads import node_masks

__all__ = ["core_for", "bind_ranks"]


def core_for(masks, rank):
    """The core for node rank ``rank``, given every node rank's affinity mask, or None: a
    core only when all the masks are equal and the ranks outnumber their cores."""
    first = masks[0]
    if any(m != first for m in masks) or len(masks) <= len(first):
        return None
    return sorted(first)[rank % len(first)]


def bind_ranks(comm, setting="auto", torch=False):
    """Collective on ``comm``: pin this rank (this thread, and the threads it starts later)
    to ``core_for``'s core when ``setting`` is "auto" and no torch timer runs. Returns the
    preamble's line (rank 0's node) and the mask to restore afterwards (None: unchanged)."""
    masks, here = node_masks(comm)
    mine = masks[here]
    ranks, ncores = len(masks), len(masks[0] or ())
    core = core_for(masks, here) if ncores else None
    if mine is None:
        why = "no CPU affinity on this system"
    elif core is None:
        why = "ranks do not outnumber cores, or the launcher bound them"
    elif setting != "auto":
        why = "--bind none"
    elif torch:
        why = "--torch: torch's timer takes every core"
    else:
        os.sched_setaffinity(0, {core})
        return (f"#  Binding: {ranks} ranks on {ncores} cores, left unbound by the launcher: rank i of a node "
                f"pinned to core i mod {ncores} (--bind none: as launched)"), mine
    return f"#  Binding: as launched ({why})", None
