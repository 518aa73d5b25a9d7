"""An uncaught exception on one rank ends the job, as ``python -m mpi4py`` makes it.

Without it the other ranks wait for this one (until their deadline), and ``MPI_Finalize``
may wait for them.
"""

import sys

from mpi4py import MPI

from . import expiry, identity

_previous_hook = None


def install_excepthook():
    """Turn an uncaught exception on one rank into the end of the job, as ``python -m
    mpi4py`` does. Chained after the current hook (which prints the traceback); installed
    once, by the first plan of a job of several ranks. ``sys.excepthook`` runs on the main
    thread, which may call MPI at every thread level."""
    global _previous_hook
    if _previous_hook is not None:
        return
    identity.remember()
    _previous_hook = sys.excepthook

    def hook(kind, value, tb):
        _previous_hook(kind, value, tb)
        if issubclass(kind, (KeyboardInterrupt, SystemExit)) or not MPI.Is_initialized() or MPI.Is_finalized():
            return
        if MPI.COMM_WORLD.Get_size() > 1:
            expiry.expire(f"an uncaught {kind.__name__} ended this rank's program; ending the job so that no rank "
                          "waits for it", expiry.EXIT_EXCEPTION)

    sys.excepthook = hook
