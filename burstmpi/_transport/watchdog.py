"""A deadline on every wait on other ranks, and what happens when one passes.

MPI waits forever by design: a rank whose peer died, whose link went down or drops most
packets, or whose peer took another branch and never made the call, sits in ``MPI_Wait``
with no message while the job holds its allocation. burstmpi waits differently:

- ``complete(requests, ...)``: nonblocking MPI requests completed by a test loop that
  checks a deadline between polls. Where ranks take turns on a node's cores (``idle``) it
  sleeps between tests (a spinning rank would take half a core from the rank it waits
  for); elsewhere it spins, as ``MPI_Waitall`` would.
- ``guard(what)``: the few blocking calls MPI has no nonblocking form of (splitting or
  duplicating a communicator, allocating or freeing a shared window) run while a monitor thread
  holds their deadline. It sleeps until then, so a guard costs a lock and a notify, and
  nothing while it waits.
- ``allgather``, ``bcast`` and ``guarded(comm)``: pickled collectives built on nonblocking
  ones, completed by ``complete`` (the set-up's and the bench's bookkeeping).

When a deadline passes, the rank prints one line on stderr, ``burstmpi watchdog: rank R
(HOST) in CALL, WHERE: waited S s for rank Q (HOST2); aborting the job (exit 75)``, and
calls ``MPI_Abort`` with ``EXIT_TIMEOUT``, so the launcher ends every process on every
host it can reach; a rank cut off from its launcher ends itself (``abort``).

The deadline is ``timeout`` seconds per wait (``BurstAttention(timeout=)``, the bench's
``--timeout``, default ``BURSTMPI_TIMEOUT`` or 300 s: long enough for a slow first call
that compiles the CPU tile loops, a GPU's first kernel load or a congested cluster link;
short enough that a dead job frees its allocation within minutes). Ranks and hosts are
named by their ``MPI.COMM_WORLD`` rank and processor name (``learn_hosts``), what a user
sees in ``mpiexec``'s output.
"""

import contextlib
import functools
import os
import pickle
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

from .._config import Settings, check_setting

__all__ = ["EXIT_TIMEOUT", "EXIT_EXCEPTION", "DEFAULT_TIMEOUT", "PREFIX", "complete", "guard", "guarded",
           "allgather", "bcast", "collective", "GuardedComm", "gather_on_root", "barrier",
           "expire", "abort", "entering", "leaving", "learn_hosts", "who", "check_timeout", "install_excepthook"]

EXIT_TIMEOUT = 75     # sysexits' EX_TEMPFAIL: the job did not fail by itself; a rerun may pass
EXIT_EXCEPTION = 1    # an uncaught exception on one rank (``install_excepthook``), as Python exits
DEFAULT_TIMEOUT = Settings.timeout  # BURSTMPI_TIMEOUT's default
PREFIX = "burstmpi watchdog: "
# A rank that cannot reach its launcher (its host cut off) is not ended by MPI_Abort's
# message to mpiexec; it ends itself this long after asking.
ABORT_GRACE_S = 5.0

_hosts = {}           # COMM_WORLD rank -> processor name, learned by the runtimes
_call = [None]        # the burstmpi call in progress on this rank


def check_timeout(fn, timeout):
    """``timeout`` as a float number of seconds > 0, or ValueError naming ``fn`` (the
    ``timeout`` keyword's check, ``config.check_setting``)."""
    return check_setting(fn, "timeout", timeout)


# -- who and where ------------------------------------------------------------------------

def learn_hosts(comm, names):
    """Remember the processor name of every rank of ``comm`` (``names`` in rank order), to
    name the hosts of ranks a wait expires on."""
    world = _world_ranks(comm, range(comm.Get_size()))
    _hosts.update(zip(world, names))


def _world_ranks(comm, ranks):
    ranks = list(ranks)
    if comm is None or comm == MPI.COMM_WORLD:
        return ranks
    return [int(r) for r in MPI.Group.Translate_ranks(comm.Get_group(), ranks, MPI.COMM_WORLD.Get_group())]


def who(comm, ranks):
    """``rank 3 (node-b)`` / ``ranks [1, 2] (node-a, node-b)``: ranks of ``comm`` named by
    their COMM_WORLD rank and, where known, their hosts."""
    world = sorted(set(_world_ranks(comm, ranks)))
    hosts = sorted({_hosts[r] for r in world if r in _hosts})
    where = f" ({', '.join(hosts)})" if hosts else ""
    if len(world) == 1:
        return f"rank {world[0]}{where}"
    return f"ranks {world}{where}"


def entering(name):
    """This rank enters the burstmpi call ``name`` (``BurstAttention.forward``,
    ``KVCache.decode``, ...; ``Runtime.begin``), named in the watchdog's line until
    ``leaving``."""
    _call[0] = name


def leaving():
    """The call's last wait is done (``Runtime.finish``)."""
    _call[0] = None


def _me():
    rank = MPI.COMM_WORLD.Get_rank()
    return f"rank {rank} ({_hosts.get(rank) or MPI.Get_processor_name()})"


_expiring = threading.Lock()  # the first thread to expire ends the job; a second one waits


def linger(timeout):
    """How long a rank whose line names no failed peer of its own (a barrier, a guarded
    call: it knows only who did not come) waits after printing it before it ends the job:
    ranks waiting on a transfer from the failed peer itself, whose deadlines run out a
    little later, then print the line that names it."""
    return min(5.0, 0.25 * timeout)


def expire(text, code=EXIT_TIMEOUT, wait=0.0):
    """A deadline passed: one line naming this rank, the call and ``text``; after ``wait``
    seconds (``linger``), end the job. Does not return."""
    if not _expiring.acquire(blocking=False):  # the monitor thread and the main one at once
        time.sleep(2 * ABORT_GRACE_S)
        os._exit(code)
    try:
        call = f" in {_call[0]}" if _call[0] else ""
        sys.stderr.write(f"{PREFIX}{_me()}{call}: {text}; aborting the job (MPI_Abort, exit {code})\n")
        sys.stderr.flush()
        time.sleep(wait)
        abort(code)
    finally:  # reached only where a test replaced ``abort``
        _expiring.release()


def abort(code, comm=None):
    """``MPI_Abort`` with exit status ``code`` on ``comm`` (default COMM_WORLD): the launcher
    ends every process of the job. Should the abort itself block (a launcher that cannot be
    reached), a timer ends this process. Does not return."""
    time.sleep(0.5)  # hydra drops output still in flight when an abort arrives (gpu/device.py)
    if threading.current_thread() is not threading.main_thread() and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
        os._exit(code)  # MPI may not be called from this thread: the launcher sees a rank die
    timer = threading.Timer(ABORT_GRACE_S, os._exit, (code,))
    timer.daemon = True
    timer.start()
    try:
        (MPI.COMM_WORLD if comm is None else comm).Abort(code)
    finally:
        os._exit(code)


# -- nonblocking requests -------------------------------------------------------------------

def complete(requests, idle=False, timeout=DEFAULT_TIMEOUT, expired=None):
    """Wait for MPI ``requests`` for at most ``timeout`` seconds.

    ``idle``: ranks take turns on this node's cores, so the loop sleeps between tests, 20 us
    at first, doubling up to 1 ms (a rank spinning in MPI_Wait on a shared core nearly
    halves the speed of the rank computing beside it); else it spins as
    MPI_Waitall does, giving up the GIL between tests (``sleep(0)``) for the caller's threads.
    ``expired(pending, waited)``, called when the deadline passes with the indices of the
    requests still pending and the seconds waited, describes what was awaited (it calls
    ``expire``); by default the line says only that the requests did not complete."""
    if MPI.Request.Testall(requests):
        return
    start = time.monotonic()
    deadline = start + timeout
    pause = 2e-5
    while True:
        if idle:
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        else:
            time.sleep(0)
        if MPI.Request.Testall(requests):
            return
        now = time.monotonic()
        if now > deadline:
            pending = [i for i, r in enumerate(requests) if r and not r.Test()]
            if not pending:  # done at the last moment
                return
            if expired is not None:
                expired(pending, now - start)
            expire(f"{len(pending)} transfer(s) did not complete within {now - start:.0f} s", wait=linger(timeout))


def peers_expired(comm, peers, where="a transfer"):
    """An ``expired`` callback for ``complete`` naming the ranks of ``comm`` that the
    pending requests wait for: ``peers[i]`` is ``("receive from", rank)`` or ``("send to",
    rank)`` for request i. Without peers (a collective) the line lingers (``linger``)."""
    def expired(pending, waited):
        parts = [f"{peers[i][0]} {who(comm, [peers[i][1]])}" for i in pending if i < len(peers) and peers[i]]
        if parts:
            expire(f"{where}: waited {waited:.0f} s to {'; '.join(dict.fromkeys(parts))}")
        expire(f"{where} did not complete within {waited:.0f} s (a rank or a link stopped answering, or a rank "
               "did not make the same call)", wait=linger(waited))
    return expired


def collective(comm, requests, timeout=DEFAULT_TIMEOUT, what="a collective", idle=False):
    """Complete the requests of a collective on ``comm`` (``what`` names it) within
    ``timeout`` seconds: no peer to name, so the line lingers (``peers_expired``)."""
    complete(requests, idle, timeout, peers_expired(comm, (), what))


# -- arrivals ---------------------------------------------------------------------------------
# A barrier or an allgather cannot say who has not arrived. Records sent to rank 0 can: it
# names the ranks whose records did not come, and the others name rank 0 if it does not
# answer (a little later, so rank 0's line comes first when it can print one).

TAG_ARRIVE = 9  # on the communicator given; burstmpi's rings use tags 11 and up


def gather_on_root(comm, record, timeout=DEFAULT_TIMEOUT, doing="arrive", idle=False):
    """Every rank's ``record`` (a 1-D int64 array, the same length everywhere), in rank
    order, on every rank: sent to rank 0, which broadcasts them all. A rank whose record
    does not come within ``timeout`` seconds is named: ``ranks [1, 2] (node-b) did not
    {doing} within 300 s``. Point-to-point on ``TAG_ARRIVE`` of ``comm``."""
    record = np.ascontiguousarray(record, dtype=np.int64)
    P = comm.Get_size()
    every = np.empty((P, record.size), dtype=np.int64)
    if comm.Get_rank() == 0:
        every[0] = record
        reqs = [comm.Irecv([every[r], MPI.INT64_T], source=r, tag=TAG_ARRIVE) for r in range(1, P)]

        def missing(pending, waited):  # they may wait on the failed peer: let them say so
            expire(f"{who(comm, [i + 1 for i in pending])} did not {doing} within {waited:.0f} s (or cannot be "
                   "reached)", wait=linger(timeout))
        complete(reqs, idle, timeout, missing)
        collective(comm, [comm.Ibcast([every, MPI.INT64_T], root=0)], timeout,
                   f"the broadcast of every rank's arrival (to {doing})", idle)
    else:
        reqs = [comm.Isend([record, MPI.INT64_T], dest=0, tag=TAG_ARRIVE), comm.Ibcast([every, MPI.INT64_T], root=0)]

        def unanswered(pending, waited):
            expire(f"{who(comm, [0])}, which collects every rank's arrival, did not answer within {waited:.0f} s "
                   f"(a rank did not {doing}, or a host cannot be reached)", wait=linger(timeout))
        complete(reqs, idle, timeout + min(5.0, 0.25 * timeout), unanswered)
    return every


def barrier(comm, timeout=DEFAULT_TIMEOUT, what="a barrier", idle=False):
    """A barrier that names the ranks that did not reach it (``gather_on_root``)."""
    gather_on_root(comm, np.zeros(1, np.int64), timeout, f"reach {what}", idle)


# -- blocking calls -------------------------------------------------------------------------

class _Monitor:
    """One thread per process holding the deadlines of the guarded blocking calls in
    progress (a stack: guards nest). It sleeps until the earliest deadline or a change."""

    def __init__(self):
        self.cond = threading.Condition()
        self.stack = []
        self.thread = threading.Thread(target=self._run, name="burstmpi-watchdog", daemon=True)
        self.thread.start()

    def push(self, what, timeout):
        entry = (time.monotonic() + timeout, what, time.monotonic())
        with self.cond:
            self.stack.append(entry)
            self.cond.notify()
        return entry

    def pop(self, entry):
        with self.cond:
            if entry in self.stack:
                self.stack.remove(entry)

    def _run(self):
        with self.cond:
            while True:
                if not self.stack:
                    self.cond.wait()
                    continue
                deadline, what, start = min(self.stack)
                now = time.monotonic()
                if now < deadline:
                    self.cond.wait(deadline - now)
                    continue
                entry = (deadline, what, start)
                self.stack.remove(entry)  # fires once (``expire`` returns only where a test replaced it)
                expire(f"{what} did not complete within {now - start:.0f} s (a rank or a link stopped "
                       "answering, or a rank did not make the same call)", wait=linger(deadline - start))


_monitor = None
_monitor_lock = threading.Lock()


@contextlib.contextmanager
def guard(what, timeout=DEFAULT_TIMEOUT):
    """Run the body (a blocking MPI call) with a deadline of ``timeout`` seconds held by
    the monitor thread; ``what`` names it in the watchdog's line."""
    global _monitor
    if _monitor is None:
        with _monitor_lock:
            if _monitor is None:
                _monitor = _Monitor()
    entry = _monitor.push(what, timeout)
    try:
        yield
    finally:
        _monitor.pop(entry)


# -- pickled collectives ----------------------------------------------------------------------
# mpi4py's own pickled collectives may hold the GIL while they block (its allreduce does), so
# no thread could end them: these are built from nonblocking collectives on bytes instead.



def allgather(comm, obj, timeout=DEFAULT_TIMEOUT, what="an allgather"):
    """Every rank's ``obj`` (picklable), in rank order, within ``timeout`` seconds."""
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.empty(comm.Get_size(), np.int64)
    collective(comm, [comm.Iallgather([np.array([data.size], np.int64), MPI.INT64_T], [sizes, MPI.INT64_T])],
            timeout, what)
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    got = np.empty(int(sizes.sum()), np.uint8)
    collective(comm, [comm.Iallgatherv([data, MPI.BYTE], [got, (sizes.tolist(), displs.tolist()), MPI.BYTE])],
            timeout, what)
    return [pickle.loads(got[d:d + n].tobytes()) for d, n in zip(displs.tolist(), sizes.tolist())]


def bcast(comm, obj, root=0, timeout=DEFAULT_TIMEOUT, what="a broadcast"):
    """``obj`` of rank ``root`` on every rank, within ``timeout`` seconds."""
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if comm.Get_rank() == root else None
    size = np.array([0 if data is None else data.size], np.int64)
    collective(comm, [comm.Ibcast([size, MPI.INT64_T], root=root)], timeout, what)
    if data is None:
        data = np.empty(int(size[0]), np.uint8)
    collective(comm, [comm.Ibcast([data, MPI.BYTE], root=root)], timeout, what)
    return obj if comm.Get_rank() == root else pickle.loads(data.tobytes())


class GuardedComm(MPI.Intracomm):
    """An intracommunicator sharing another's handle whose pickled collectives and
    barriers wait within the deadline (nonblocking collectives completed by ``complete``).
    Gathers and reductions go to every rank (the same bytes as a gather plus a broadcast;
    small objects: a program's bookkeeping)."""

    def __new__(cls, comm=None, timeout=DEFAULT_TIMEOUT, who="burstmpi"):
        # ``comm=None``: mpi4py's ``Dup`` makes its result of the caller's class, unargued.
        self = super().__new__(cls, comm)
        self._timeout, self._who = float(timeout), who
        return self

    def _what(self, name):
        return f"{self._who}: {name}"

    def Dup(self, *info):
        """A duplicate with the same deadline (burstmpi's private communicator of this one)."""
        dup = super().Dup(*info)
        dup._timeout, dup._who = self._timeout, self._who
        return dup

    def allgather(self, sendobj):
        return allgather(self, sendobj, self._timeout, self._what("allgather"))

    def allreduce(self, sendobj, op=MPI.SUM):
        return functools.reduce(op, allgather(self, sendobj, self._timeout, self._what("allreduce")))

    def gather(self, sendobj, root=0):
        every = allgather(self, sendobj, self._timeout, self._what("gather"))
        return every if self.Get_rank() == root else None

    def reduce(self, sendobj, op=MPI.SUM, root=0):
        value = functools.reduce(op, allgather(self, sendobj, self._timeout, self._what("reduce")))
        return value if self.Get_rank() == root else None

    def bcast(self, obj, root=0):
        return bcast(self, obj, root, self._timeout, self._what("bcast"))

    def Barrier(self):
        barrier(self, self._timeout, self._what("a barrier"))

    barrier = Barrier


def guarded(comm, timeout=DEFAULT_TIMEOUT, who="burstmpi"):
    """``comm`` (an mpi4py intracommunicator) with a deadline on its pickled collectives
    and barrier: a ``GuardedComm`` on the same handle, so it is the same communicator to
    MPI and to burstmpi's plans."""
    return GuardedComm(comm, timeout, who)


# -- an uncaught exception on one rank ------------------------------------------------------

_previous_hook = None


def install_excepthook():
    """Turn an uncaught exception on one rank into the end of the job, as ``python -m
    mpi4py`` does: without it the other ranks wait for this one (until their deadline),
    and ``MPI_Finalize`` may wait for them. Chained after the current hook (which prints
    the traceback); installed once, by the first plan of a job of several ranks."""
    global _previous_hook
    if _previous_hook is not None:
        return
    _previous_hook = sys.excepthook

    def hook(kind, value, tb):
        _previous_hook(kind, value, tb)
        if issubclass(kind, (KeyboardInterrupt, SystemExit)) or not MPI.Is_initialized() or MPI.Is_finalized():
            return
        if MPI.COMM_WORLD.Get_size() > 1:
            expire(f"an uncaught {kind.__name__} ended this rank's program; ending the job so that no rank waits "
                   "for it", EXIT_EXCEPTION)

    sys.excepthook = hook
