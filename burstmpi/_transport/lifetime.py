"""What burstmpi keeps for a caller's communicator, and when it goes.

For each communicator a caller hands it, burstmpi makes MPI objects of its own: a private
duplicate (so its messages never match the caller's), communicators split from that one
(the two-level ring's, head parallelism's), NCCL communicators, a shared-memory window for
the ring buffers, and, above this floor, the functional API's cached plans. A program that
runs for days makes and frees communicators of its own, and MPI has a few thousand context
ids: everything burstmpi makes for a communicator must go when that communicator goes.

One ``CommState`` per caller communicator holds all of it, in an MPI attribute of that
communicator (MPI's attribute caching exists so that a library's state dies with the
communicator). It is freed, in one order (MPI orders no two keyvals' delete callbacks,
so a single state with its own order is the simple shape):

1. what the floors above attached (``attach``: the plan cache), last attached first;
2. the runtimes made on it are told (``depend``): a plan used afterwards raises
   ``CommunicatorFreed`` on every rank, and drops its views of the freed buffers;
3. the MPI objects made for it (``resource``), last made first: an NCCL communicator over a
   split goes before the split, a window before the duplicate it was allocated on;
4. the private duplicate itself.

When, and how:

- the caller frees the communicator (``comm.Free()``): the attribute's delete callback runs
  the teardown with its collective frees (``MPI_Win_free``, ``MPI_Comm_free``): the
  caller's ``Free`` is collective, so every rank is there, in the same order of its calls;
- ``release(comm)`` (``burstmpi.release_cached``): collective by contract, the same
  teardown, unless a plan the caller made on ``comm`` is still alive on some rank (agreed
  on by every rank: then only what no plan uses is freed, and the report says so);
- at exit, or at ``MPI_Finalize`` as the last resort (a ``COMM_SELF`` attribute, whose
  delete callback MPI runs first in ``MPI_Finalize``): the frees are local. Ranks reach
  their exit at different times, so nothing collective happens there: Python's references
  are dropped and MPI (or the process's end) reclaims the rest.

Collective frees happen only at those points, never from garbage collection or a cache's
eviction, whose timing may differ between ranks. Every collective free runs under the
watchdog's deadline (``guard``), so a rank that never frees its communicator ends the job
with the watchdog's line rather than a hang.

``live()`` counts what burstmpi holds now (states, communicators, windows, NCCL
communicators): the soak run watches it stay flat.
"""

import atexit
import gc
import itertools
import sys
import threading
import weakref
from collections import Counter
from typing import NamedTuple

from mpi4py import MPI

from .segments import unlink_node_segments
from .watchdog import DEFAULT_TIMEOUT, allgather, collective, guard

__all__ = ["CommState", "CommunicatorFreed", "Released", "state_of", "owner", "private_comm", "split_once",
           "resource", "release", "release_all", "states", "live", "count"]


class CommunicatorFreed(RuntimeError):
    """A plan or cache used after the communicator it was made on was freed (or released
    by ``burstmpi.release_cached``)."""


class Released(NamedTuple):
    """What ``release`` freed for one communicator, and what it kept and why."""

    plans: int           # cached plans dropped (their buffers freed)
    communicators: int   # MPI communicators freed (the private duplicate, splits)
    windows: int         # shared windows freed
    nccl: int            # NCCL communicators destroyed
    kept: str            # why something was kept ("" when everything went)


_lock = threading.RLock()  # the states' registry (JAX may call in from XLA's threads)
_STATES = {}               # serial -> CommState, live ones, in the order they were made
_serial = itertools.count()
_counts = Counter()        # what burstmpi holds now, by kind (``live``)
_KEYVAL = None             # on a caller's communicator: its CommState
_MADE_KEYVAL = None        # on a communicator burstmpi made: (its CommState, its name)
_finalize_hooked = False
_exiting = False           # after exit or MPI_Finalize began: local frees only


def count(kind, n=1):
    """Count ``n`` more (or fewer) MPI objects of ``kind`` held (``live``); transports that
    allocate their own (a shared window) report them here."""
    _counts[kind] += n


def live():
    """What burstmpi holds now: ``{"states", "communicators", "windows", "nccl"}``."""
    with _lock:
        return {"states": len(_STATES), "communicators": _counts["communicators"],
                "windows": _counts["windows"], "nccl": _counts["nccl"]}


class CommState:
    """Everything burstmpi keeps for one caller communicator (the module's docstring)."""

    def __init__(self, comm):
        self.serial = next(_serial)
        self.handle = comm.py2f()  # for the exit hook, valid while this state is registered
        self.size = comm.Get_size()
        self.freed = None          # why it was torn down, once it was
        self.timeout = DEFAULT_TIMEOUT
        self._private = None
        self._resources = {}       # key -> (object, free(object)), in the order made
        self._attached = {}        # name -> object with ``teardown(collective)``
        self._dependents = weakref.WeakValueDictionary()  # serial -> a runtime on this state
        self._dependent_serial = itertools.count()
        # Held across a check and the collective that makes what was missing: two threads
        # (at MPI_THREAD_MULTIPLE) must not both make it, or the ranks' collectives differ.
        self._making = threading.RLock()

    # -- what the state holds -------------------------------------------------------------

    def check(self, fn):
        """Raise ``CommunicatorFreed`` naming ``fn`` if this state was torn down."""
        if self.freed is not None:
            raise CommunicatorFreed(f"{fn}: comm: expected a live communicator, got one that {self.freed}; make "
                                    "the plan or cache again on a live communicator")

    def private(self, timeout=DEFAULT_TIMEOUT):
        """burstmpi's duplicate of the caller's communicator, made on first use (collective,
        within ``timeout`` seconds)."""
        self.check("burstmpi")
        self.timeout = timeout
        with self._making:
            return self._private if self._private is not None else self._duplicate(timeout)

    def _duplicate(self, timeout):
        """Make the private duplicate (``private``). Nonblocking, completed by the watchdog's
        polls on this thread: an expiry then ends the job from here, at any thread level (a
        guard's monitor thread could only end this process below MPI_THREAD_MULTIPLE)."""
        caller = MPI.Intracomm.f2py(self.handle)
        dup, request = caller.Idup()
        collective(caller, [request], timeout,
                   "MPI_Comm_idup of the caller's communicator (a rank did not make its first burstmpi call?)")
        _mark(dup, self, "private")
        count("communicators")
        self._private = dup
        return dup

    def split(self, purpose, colors, timeout=DEFAULT_TIMEOUT):
        """``private.Split(color, key)`` for each (color, key) of ``colors``, made once per
        ``purpose`` (hashable, the same on every rank) and freed with the state: plans made
        per call share their sub-communicators rather than each split its own."""
        def make():
            private = self.private(timeout)
            with guard(f"MPI_Comm_split for {purpose}", timeout):
                comms = tuple(private.Split(color, k) for color, k in colors)
            for i, c in enumerate(comms):
                _mark(c, self, ("split", purpose, i))
            count("communicators", len(comms))
            return comms

        return self.resource(("split", purpose), make, _free_comms)

    def resource(self, key, make, free):
        """``make()`` once per ``key``; ``free(object, collective)`` at the teardown, before
        everything made earlier (with ``collective`` False it only forgets the object, and
        lowers ``live``'s counts)."""
        self.check("burstmpi")
        with self._making:
            got = self._resources.get(key)
            if got is None:
                got = self._resources[key] = (make(), free)
        return got[0]

    def attach(self, name, make):
        """The object of the floor above named ``name`` (the plan cache), made once; its
        ``teardown(collective)`` runs first when the state goes."""
        with _lock:
            got = self._attached.get(name)
            if got is None:
                got = self._attached[name] = make()
        return got

    def attached(self, name):
        return self._attached.get(name)

    def depend(self, runtime):
        """``runtime`` uses this state: told by ``runtime.comm_freed(reason)`` when it goes.
        Held weakly; ``release`` keeps the state while a dependent lives on some rank."""
        self._dependents[next(self._dependent_serial)] = runtime

    def independent(self, runtime):
        """``runtime`` no longer uses this state (a plan the cache dropped)."""
        for key, rt in list(self._dependents.items()):
            if rt is runtime:
                self._dependents.pop(key, None)

    def dependents(self):
        return len(self._dependents)

    # -- teardown ----------------------------------------------------------------------------

    def teardown(self, collective, reason):
        """Free everything, in the module docstring's order: with ``collective`` the MPI
        objects too (every rank here alike), else only Python's references (the counts of
        ``live`` go down either way: MPI_Finalize frees the objects). Returns ``Released``."""
        if self.freed is not None:
            return Released(0, 0, 0, 0, "")
        before = Counter(_counts)
        plans = 0
        for obj in reversed(list(self._attached.values())):
            plans += obj.teardown(collective) or 0
        self._attached.clear()
        self.freed = reason
        for rt in list(self._dependents.values()):
            rt.comm_freed(reason)
        self._dependents.clear()
        resources = [got for _, got in reversed(list(self._resources.items()))]
        if self._private is not None:
            resources.append(((self._private,), _free_comms))
        self._resources.clear()
        self._private = None
        if collective:
            with guard("the teardown of burstmpi's objects of a freed communicator (collective: every rank frees "
                       "it)", self.timeout):
                for obj, free in resources:
                    free(obj, True)
        else:
            for obj, free in resources:
                free(obj, False)
        with _lock:
            _STATES.pop(self.serial, None)
        gone = {k: before.get(k, 0) - _counts[k] for k in ("communicators", "windows", "nccl")}
        return Released(plans, gone["communicators"], gone["windows"], gone["nccl"], "")


def _free_comms(comms, collective):
    """Free burstmpi's communicators ``comms`` (collective), or with ``collective`` False
    only forget them."""
    for c in comms:
        if collective and c != MPI.COMM_NULL:
            c.Free()
    count("communicators", -len(comms))


def _mark(comm, state, name):
    global _MADE_KEYVAL
    if _MADE_KEYVAL is None:
        _MADE_KEYVAL = MPI.Comm.Create_keyval()
    comm.Set_attr(_MADE_KEYVAL, (state, name))


def owner(comm):
    """``(CommState, name)`` of a communicator burstmpi made (a private duplicate: name
    "private"; a split), or None."""
    return None if _MADE_KEYVAL is None else comm.Get_attr(_MADE_KEYVAL)


def _deleted(comm, keyval, state):
    """MPI's delete callback: the caller frees its communicator (every rank, collectively),
    or MPI_Finalize deletes COMM_WORLD's attributes. Nothing may escape into MPI."""
    try:
        state.teardown(collective=not _exiting and not MPI.Is_finalized(),
                       reason="was freed (MPI_Comm_free)")
    except Exception as e:  # pragma: no cover - printed, never raised into MPI
        sys.stderr.write(f"burstmpi: freeing what it kept for a communicator failed: {type(e).__name__}: {e}\n")
    return MPI.SUCCESS


def state_of(comm, create=True):
    """The ``CommState`` of the caller's communicator ``comm`` (made, with no MPI call but
    setting an attribute, where ``create``), or None where ``comm`` cannot hold one (not an
    intracommunicator, or ``MPI.COMM_NULL``)."""
    global _KEYVAL
    if not isinstance(comm, MPI.Intracomm) or comm == MPI.COMM_NULL:
        return None
    with _lock:
        if _KEYVAL is None:
            _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_deleted)
        state = comm.Get_attr(_KEYVAL)
        if state is not None and state.freed is not None:  # released: a later call starts afresh
            comm.Delete_attr(_KEYVAL)
            state = None
        if state is None and create:
            _hook_finalize()
            state = CommState(comm)
            comm.Set_attr(_KEYVAL, state)
            _STATES[state.serial] = state
    return state


def _live(fn, comm):
    """``comm``'s state, or TypeError/ValueError naming ``fn`` where it cannot have one."""
    if not isinstance(comm, MPI.Intracomm):
        raise TypeError(f"{fn}: comm: expected an mpi4py intracommunicator, got {type(comm).__name__}")
    if comm == MPI.COMM_NULL:
        raise ValueError(f"{fn}: comm: expected a live intracommunicator, got MPI.COMM_NULL (a freed one?)")
    return state_of(comm)


def private_comm(comm, timeout=DEFAULT_TIMEOUT, fn="burstmpi"):
    """burstmpi's duplicate of ``comm``: library traffic on it never matches the caller's.
    Made once per communicator (collective on the first call, within ``timeout`` seconds)
    and freed with it; ``fn`` names the caller in errors."""
    return _live(fn, comm).private(timeout)


def split_once(comm, purpose, colors, timeout=DEFAULT_TIMEOUT):
    """``CommState.split`` of the state that made ``comm`` (a private duplicate)."""
    made = owner(comm)
    if made is None:
        raise ValueError(f"split_once: comm: expected a communicator burstmpi made (private_comm), got {comm!r}")
    return made[0].split(purpose, colors, timeout)


def resource(comm, key, make, free):
    """``CommState.resource`` of the state that made ``comm``, keyed also by ``comm``'s
    name in it (a window of the private duplicate, an NCCL communicator over a split)."""
    made = owner(comm)
    if made is None:
        raise ValueError(f"resource: comm: expected a communicator burstmpi made (private_comm), got {comm!r}")
    state, name = made
    return state.resource((key[0], name) + tuple(key[1:]), make, free)


def release(comm, timeout=DEFAULT_TIMEOUT):
    """Free what burstmpi keeps for ``comm`` (collective over it): see the module docstring.
    Where a plan the caller made on ``comm`` is still alive on some rank, the attached
    objects (the cached plans) and the memory of the resources (a shared window, made again
    by the next call that needs it) go, the communicators stay, and ``Released.kept`` says
    why. Returns ``Released``."""
    _live("release_cached", comm)
    state = state_of(comm, create=False)
    if state is None or state.freed is not None:
        return Released(0, 0, 0, 0, "")
    before = Counter(_counts)  # what the cached plans' release frees counts too
    plans = 0
    for obj in reversed(list(state._attached.values())):
        plans += obj.teardown(True) or 0
    gc.collect()  # plans dropped just now, in a reference cycle, are no longer in use
    mine = state.dependents()
    private = state._private
    alive = [mine] if private is None or state.size == 1 else allgather(
        private, mine, timeout, "release_cached: the count of every rank's live plans")
    if any(alive):
        for obj, _ in reversed(list(state._resources.values())):
            if getattr(obj, "arena", None) is not None:  # a shared window: collective, as this call
                with guard("release_cached: the release of the ring buffers' shared window (collective)", timeout):
                    obj.free()
        return Released(plans, 0, before["windows"] - _counts["windows"], 0,
                        f"{sum(alive)} plan(s) made on this communicator are still alive (by rank: {alive}): "
                        "its duplicate, splits and NCCL communicators stay until it is freed")
    done = state.teardown(True, "was released (burstmpi.release_cached)")
    return Released(plans + done.plans, *(before[k] - _counts[k] for k in ("communicators", "windows", "nccl")), "")


def states():
    """The live states, in the order they were made."""
    with _lock:
        return list(_STATES.values())


def release_all(timeout=DEFAULT_TIMEOUT):
    """``release`` of every state, in the order they were made: ``[(handle, Released)]``."""
    return [(s.handle, release(MPI.Intracomm.f2py(s.handle), timeout)) for s in states() if s.freed is None]


def _local_teardown(reason):
    """Every state torn down with local frees only (``CommState.teardown``)."""
    for state in states():
        try:
            state.teardown(collective=False, reason=reason)
            if _KEYVAL is not None and not MPI.Is_finalized():
                MPI.Intracomm.f2py(state.handle).Delete_attr(_KEYVAL)  # its callback then has nothing to do
        except Exception:  # pragma: no cover - nothing at exit may raise
            pass


@atexit.register
def _at_exit():
    """At exit: local frees only (the module docstring). mpi4py finalizes MPI after Python's
    exit handlers (this module is imported after it, so its handler runs first). A process
    started without a launcher (a singleton: ``python prog.py``) also drops the name of its
    own node segment, which Open MPI 5 leaves in /dev/shm (no peer can need it)."""
    global _exiting
    _exiting = True
    _local_teardown("was dropped at exit")
    try:
        if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() == 1:
            unlink_node_segments(ending=False, attached=True)
    except Exception:  # pragma: no cover - nothing at exit may raise
        pass


def _at_finalize(comm, keyval, value):
    """``MPI_Finalize`` deletes COMM_SELF's attributes first: the last resort, where a
    program finalizes MPI itself before it exits."""
    global _exiting
    _exiting = True
    try:
        _local_teardown("was dropped at MPI_Finalize")
    except Exception:  # pragma: no cover - nothing may escape into MPI_Finalize
        pass
    return MPI.SUCCESS


def _hook_finalize():
    global _finalize_hooked
    if not _finalize_hooked:
        _finalize_hooked = True
        MPI.COMM_SELF.Set_attr(MPI.Comm.Create_keyval(delete_fn=_at_finalize), True)
