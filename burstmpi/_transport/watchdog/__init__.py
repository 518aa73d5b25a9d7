"""A deadline on every wait on other ranks, and what happens when one passes.

MPI waits forever by design: a rank whose peer died, whose link went down or drops most
packets, or whose peer took another branch and never made the call, sits in ``MPI_Wait``
with no message while the job holds its allocation. burstmpi waits differently:

- ``complete(requests, ...)`` (``deadline``): nonblocking MPI requests completed by a test
  loop that checks a deadline between polls. Where ranks take turns on a node's cores
  (``idle``) it sleeps between tests (a spinning rank would take half a core from the rank
  it waits for); elsewhere it spins, as ``MPI_Waitall`` would.
- ``guard(what)`` (``monitor``): the few blocking calls MPI has no nonblocking form of
  (splitting or duplicating a communicator, allocating or freeing a shared window) run
  while a monitor thread holds their deadline. It sleeps until then, so a guard costs a
  lock and a notify, and nothing while it waits.
- ``allgather``, ``bcast``, ``barrier``, ``gather_on_root`` (``collectives``) and
  ``guarded(comm)`` (``guarded_comm``): pickled collectives built on nonblocking ones, completed
  by ``complete`` (the set-up's and the bench's bookkeeping). mpi4py's own pickled
  reductions hold the GIL while they block (on their first call on a communicator), so no
  thread could end them.

When a deadline passes (``expiry``), the rank prints one line on stderr, ``burstmpi
watchdog: rank R (HOST) in CALL, WHERE: waited S s for rank Q (HOST2); aborting the job
(exit 75)``, and calls ``MPI_Abort`` with ``EXIT_TIMEOUT``, so the launcher ends every
process on every host it can reach; a rank cut off from its launcher ends itself
(``abort``). An uncaught exception on one rank ends the job too (``excepthook``).

The deadline is ``timeout`` seconds per wait (``BurstAttention(timeout=)``, the bench's
``--timeout``, default ``BURSTMPI_TIMEOUT`` or 300 s: long enough for a slow first call
that compiles the CPU tile loops, a GPU's first kernel load or a congested cluster link;
short enough that a dead job frees its allocation within minutes). Ranks and hosts are
named by their ``MPI.COMM_WORLD`` rank and processor name (``hosts``), what a user sees in
``mpiexec``'s output.

Threads (``identity``): the monitor (and the bench's signal thread) never call MPI below
``MPI_THREAD_MULTIPLE``. This rank's name and MPI's thread level are read once on a thread
that may; below MULTIPLE a helper hands the abort to the caller's thread, which takes it at
its next poll (``checkpoint``), and where that thread stays inside a blocking MPI call the
process ends by ``os._exit``: ``expiry`` says what the launcher then prints and returns.

The modules, one concern each: ``identity`` (this rank, the call in progress, which threads
may call MPI), ``hosts`` (ranks named with their hosts), ``expiry`` (the line, the abort,
handing it to the caller's thread), ``deadline`` (``complete`` and its callbacks),
``monitor`` (``guard``), ``collectives``, ``guarded_comm`` (``GuardedComm``), ``excepthook``.
A function is looked up on the module that owns it, so a test replaces it there
(``monkeypatch.setattr(watchdog.expiry, "abort", ...)``): the names below are the same
objects, and replacing one here changes nothing the modules call.
"""

from . import collectives, deadline, excepthook, expiry, guarded_comm, hosts, identity, monitor
from .collectives import TAG_ARRIVE, allgather, barrier, bcast, gather_on_root
from .deadline import DEFAULT_TIMEOUT, check_timeout, collective, complete, peers_expired
from .excepthook import install_excepthook
from .expiry import (ABORT_GRACE_S, CALLER_GRACE_S, EXIT_EXCEPTION, EXIT_TIMEOUT, PREFIX, abort, checkpoint,
                     end_job, expire, linger, on_callers_thread)
from .guarded_comm import GuardedComm, guarded, timeout_of
from .hosts import _hosts, _me, _world_ranks, learn_hosts, who
from .identity import (_call, check_caller_thread, entering, helper, leaving, level_name, may_call_mpi, remember,
                       require_multiple)
from .monitor import _Monitor, guard

__all__ = ["EXIT_TIMEOUT", "EXIT_EXCEPTION", "DEFAULT_TIMEOUT", "PREFIX", "complete", "guard", "guarded",
           "allgather", "bcast", "collective", "GuardedComm", "gather_on_root", "barrier",
           "expire", "abort", "entering", "leaving", "learn_hosts", "who", "check_timeout", "install_excepthook",
           # threads below MPI_THREAD_MULTIPLE (``identity``, ``expiry``)
           "checkpoint", "on_callers_thread", "end_job", "helper", "may_call_mpi", "remember", "level_name",
           "require_multiple", "check_caller_thread",
           "timeout_of"]
