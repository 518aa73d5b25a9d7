"""Who this rank is, which call it is in, and which threads may call MPI.

The watchdog's line names this rank by its ``MPI.COMM_WORLD`` rank and processor name, and
it is printed from the monitor thread too (``monitor``), as the bench's signal thread
(``burstmpi.bench.interrupt``) acts from its own. MPI may be called from such a thread only
at ``MPI_THREAD_MULTIPLE``: at ``FUNNELED`` only the thread that initialised MPI may call it,
at ``SERIALIZED`` one thread at a time, and the caller's thread may be inside MPI right then
(Cray MPICH's default level is ``SERIALIZED``). So the rank, the processor name and the
thread level are read once, on a thread that may call MPI (the main thread at import where
mpi4py has initialised MPI, else the caller's thread at its first guard or call), and the
helper threads read only that copy (``remember``, ``may_call_mpi``).
"""

import threading
import weakref

from mpi4py import MPI

_known = None        # (COMM_WORLD rank, processor name, thread level), read once by ``remember``
_helpers = weakref.WeakSet()  # the threads that must not call MPI below MULTIPLE (``helper``)
_call = [None]       # the burstmpi call in progress on this rank


def is_helper():
    """Is this thread one of the helpers (the watchdog's monitor, the bench's signal thread)?"""
    return threading.current_thread() in _helpers


def helper(thread):
    """Mark ``thread`` (a ``threading.Thread``) as a helper: below MPI_THREAD_MULTIPLE it
    never calls MPI, and hands what needs MPI to the caller's thread
    (``expiry.on_callers_thread``)."""
    _helpers.add(thread)
    return thread


def remember():
    """This rank's (COMM_WORLD rank, processor name, thread level), read from MPI once, on
    the first call from a thread that may call MPI once MPI is initialised; None before
    that (or after ``MPI_Finalize``, where nothing was read)."""
    global _known
    # MPI_Initialized and MPI_Finalized may be called from any thread at any time.
    if _known is None and not is_helper() and MPI.Is_initialized() and not MPI.Is_finalized():
        _known = (MPI.COMM_WORLD.Get_rank(), MPI.Get_processor_name(), MPI.Query_thread())
    return _known


def thread_level():
    """MPI's thread level (``MPI.THREAD_SINGLE`` .. ``MPI.THREAD_MULTIPLE``) as read by
    ``remember``; None where it was not read yet."""
    known = remember()
    return None if known is None else known[2]


def level_name(level=None):
    """``MPI_THREAD_SERIALIZED``, ...: ``level`` (default: the level read) by its name."""
    level = thread_level() if level is None else level
    names = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
             MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED", MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
    return names.get(level, "a thread level not read yet")


def may_call_mpi():
    """May this thread call MPI now? At MPI_THREAD_MULTIPLE every thread may; below it,
    not a helper; at FUNNELED only the main thread. A level not read yet counts as below
    MULTIPLE (a helper then hands its MPI calls over, which is legal at every level)."""
    level = thread_level()
    if level is not None and level >= MPI.THREAD_MULTIPLE:
        return True
    if is_helper():
        return False
    return level != MPI.THREAD_FUNNELED or threading.current_thread() is threading.main_thread()


# How a program asks for MPI_THREAD_MULTIPLE (every refusal below says it).
ASK_MULTIPLE = ("ask for it before MPI starts: mpi4py.rc.thread_level = \"multiple\" before `from mpi4py import MPI`, "
                "or MPI4PY_RC_THREAD_LEVEL=multiple in the environment (mpi4py's default); an MPI that gives less "
                "when asked lacks thread support")


def require_multiple(fn, why):
    """Raise RuntimeError naming ``fn`` where MPI's thread level is below
    ``MPI_THREAD_MULTIPLE``: ``why`` says which thread would call MPI. Local, and before any
    MPI call: a collective from such a thread is what would be wrong."""
    if not MPI.Is_initialized() or MPI.Is_finalized():
        return  # the call's own checks say what is wrong
    level = MPI.Query_thread()  # MPI_Query_thread may be called from any thread
    if level < MPI.THREAD_MULTIPLE:
        raise RuntimeError(f"{fn}: MPI thread level: expected MPI_THREAD_MULTIPLE, got {level_name(level)}: {why}, "
                           f"which MPI allows only at MPI_THREAD_MULTIPLE; {ASK_MULTIPLE}")


def check_caller_thread(fn, what="the call"):
    """``require_multiple`` where this thread is not the one that initialised MPI (at
    ``MPI_THREAD_SERIALIZED`` another thread may call, but only where no other one calls
    meanwhile, which burstmpi cannot know of the caller's threads)."""
    if MPI.Is_initialized() and not MPI.Is_finalized() and not MPI.Is_thread_main():
        require_multiple(fn, f"{what} runs on thread {threading.current_thread().name!r}, not on the thread that "
                             "initialised MPI")


def entering(name):
    """This rank enters the burstmpi call ``name`` (``BurstAttention.forward``,
    ``KVCache.decode``, ...; ``Runtime.begin``), named in the watchdog's line until
    ``leaving``."""
    _call[0] = name


def leaving():
    """The call's last wait is done (``Runtime.finish``)."""
    _call[0] = None


def current_call():
    """The burstmpi call this rank is in (``entering``), or None."""
    return _call[0]


if threading.current_thread() is threading.main_thread():
    remember()  # ``from mpi4py import MPI`` initialised MPI on this thread (mpi4py's default)
