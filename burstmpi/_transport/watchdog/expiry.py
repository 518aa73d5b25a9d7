"""A deadline passed: one line on stderr, and the end of the job, from whichever thread.

``expire`` prints ``burstmpi watchdog: rank R (HOST) in CALL: WHAT; aborting the job
(MPI_Abort, exit 75)`` and ends the job with ``abort``: ``MPI_Abort``, so the launcher ends
every process on every host it can reach; a rank cut off from its launcher ends itself
``ABORT_GRACE_S`` later.

A deadline may pass on a helper thread (the monitor, ``monitor``; the bench's signal thread),
where MPI may be called only at ``MPI_THREAD_MULTIPLE`` (``identity``). Below it the helper
hands the abort to the caller's thread (``on_callers_thread``), which runs it at its next
``checkpoint``: each poll of ``complete``, the end of a ``guard``, the bench's rows. Where
that thread does not come within ``CALLER_GRACE_S`` (it is inside the blocking MPI call the
guard watches, which may never return) the only legal way out is ``os._exit``: the process
ends without MPI, and the launcher ends the others. Measured with MPICH 5.0.2's hydra
(``mpiexec -n 3``, ``MPI4PY_RC_THREAD_LEVEL=funneled`` and ``serialized``, rank 0 ending by
``os._exit(75)`` inside ``MPI_Comm_dup`` while the others sleep, sit in ``MPI_Barrier`` or
have finished; 24 runs): ``mpiexec`` returns within 0.1 s of the exit, every process gone,
with 75 and nothing of its own on stdout or stderr (13 runs), or with 9, the others'
``SIGKILL`` (11 runs), after this banner on stdout::

    ===================================================================================
    =   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
    =   PID 6933 RUNNING AT vm
    =   EXIT CODE: 9
    =   CLEANING UP REMAINING PROCESSES
    =   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
    ===================================================================================
    YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)
    This typically refers to a problem with your application.
    Please see the FAQ page for debugging suggestions

The watchdog's line, printed before, says why; only ``MPI_Abort`` makes the code sure.
"""

import os
import sys
import threading
import time

from mpi4py import MPI

from ..segments import unlink_node_segments
from . import hosts, identity

EXIT_TIMEOUT = 75     # sysexits' EX_TEMPFAIL: the job did not fail by itself; a rerun may pass
EXIT_EXCEPTION = 1    # an uncaught exception on one rank (``install_excepthook``), as Python exits
PREFIX = "burstmpi watchdog: "
# A rank that cannot reach its launcher (its host cut off) is not ended by MPI_Abort's
# message to mpiexec; it ends itself this long after asking.
ABORT_GRACE_S = 5.0
# How long a helper thread waits for the caller's thread to take the abort it handed over
# (``on_callers_thread``) before it ends the process by itself: a blocking call past its
# deadline rarely returns at all, and a polling thread takes it within a millisecond.
CALLER_GRACE_S = 1.0

_expiring = threading.Lock()  # the first thread to expire ends the job; a second one waits
_handed = []                  # [action, done event] pairs a helper thread handed to the caller's thread
_handing = threading.Lock()


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
        _wait_for_the_other(code)
    try:
        call = identity.current_call()
        call = f" in {call}" if call else ""
        sys.stderr.write(f"{PREFIX}{hosts._me()}{call}: {text}; aborting the job (MPI_Abort, exit {code})\n")
        sys.stderr.flush()
        unlink_node_segments()  # the job ends: MPICH leaves its node segment's name to MPI_Finalize
        time.sleep(wait)
        end_job(code)
    finally:  # reached only where a test replaced ``abort``
        _expiring.release()


def _wait_for_the_other(code):
    """A second expiry while the first ends the job: take over what it hands to this thread
    (``checkpoint``: the abort, where this is the caller's thread), else end after a while."""
    until = time.monotonic() + 2 * ABORT_GRACE_S
    while time.monotonic() < until:
        checkpoint()
        time.sleep(0.05)
    os._exit(code)


def end_job(code, comm=None):
    """``abort(code, comm)`` from a thread that may call MPI: this one, or, from a helper
    thread below MPI_THREAD_MULTIPLE, the caller's thread within ``CALLER_GRACE_S`` (else
    ``os._exit(code)``: see the module's notes on what the launcher then does). Does not
    return (but where a test replaced ``abort``)."""
    if not on_callers_thread(lambda: abort(code, comm), CALLER_GRACE_S):
        os._exit(code)  # the caller's thread stays inside MPI: MPI may not be called from this one


def abort(code, comm=None):
    """``MPI_Abort`` with exit status ``code`` on ``comm`` (default COMM_WORLD): the launcher
    ends every process of the job. Should the abort itself block (a launcher that cannot be
    reached), a timer ends this process. Does not return."""
    time.sleep(0.5)  # hydra drops output still in flight when an abort arrives (gpu/device.py)
    unlink_node_segments()  # an abort (the bench's interrupts too) skips MPI_Finalize, which would remove it
    if not identity.may_call_mpi():
        os._exit(code)  # MPI may not be called from this thread: the launcher sees a rank die
    timer = threading.Timer(ABORT_GRACE_S, os._exit, (code,))
    timer.daemon = True
    timer.start()
    try:
        (MPI.COMM_WORLD if comm is None else comm).Abort(code)
    finally:
        os._exit(code)


def on_callers_thread(action, wait):
    """Run ``action`` (it may call MPI) on a thread that may call MPI: at once where this one
    may (``identity.may_call_mpi``), else on the caller's thread at its next ``checkpoint``,
    waiting at most ``wait`` seconds for it to take it over. True once the action ran (where
    it returned: most end the job), False where no thread took it in time (it is then
    withdrawn, never run)."""
    if identity.may_call_mpi():
        action()
        return True
    entry = (action, threading.Event())
    with _handing:
        _handed.append(entry)
    if entry[1].wait(wait):
        return True
    with _handing:
        if entry in _handed:  # not taken: the caller's thread is inside MPI or compiled code
            _handed.remove(entry)
            return False
    entry[1].wait()  # taken at the last moment: it runs now
    return True


def checkpoint():
    """Run what helper threads handed to this thread (``on_callers_thread``), if it may call
    MPI. Cheap when there is nothing: ``complete`` calls it on every poll."""
    if not _handed or not identity.may_call_mpi():
        return
    with _handing:
        taken = list(_handed)
        _handed.clear()
    for action, done in taken:
        try:
            action()
        finally:
            done.set()
