"""A deadline on the few blocking calls MPI has no nonblocking form of.

Splitting or duplicating a communicator, allocating or freeing a shared window: these run
inside ``guard(what, timeout)`` while one monitor thread per process holds their deadlines.
It sleeps until the earliest one or a change, so a guard costs a lock and a notify, and
nothing while it waits. The monitor never calls MPI itself below MPI_THREAD_MULTIPLE
(``identity``): when a deadline passes it prints the line from what ``identity`` read and
``expiry.end_job`` hands the abort to the caller's thread, which takes it when the blocking
call returns (the end of the guard), or ends the process.
"""

import contextlib
import threading
import time

from . import expiry, identity
from .deadline import DEFAULT_TIMEOUT


class _Monitor:
    """One thread per process holding the deadlines of the guarded blocking calls in
    progress (a stack: guards nest). It sleeps until the earliest deadline or a change."""

    def __init__(self):
        self.cond = threading.Condition()
        self.stack = []
        self.thread = identity.helper(threading.Thread(target=self._run, name="burstmpi-watchdog", daemon=True))
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
        while True:
            deadline, what, start = self._next()
            # Outside the lock: the guard whose call returns meanwhile must be able to end
            # (and take over the abort, ``expiry.checkpoint``).
            expiry.expire(f"{what} did not complete within {time.monotonic() - start:.0f} s (a rank or a link "
                          "stopped answering, or a rank did not make the same call)",
                          wait=expiry.linger(deadline - start))

    def _next(self):
        """The first deadline to pass, once it has (taken off the stack: it fires once;
        ``expire`` returns only where a test replaced it)."""
        with self.cond:
            while True:
                if not self.stack:
                    self.cond.wait()
                    continue
                entry = min(self.stack)
                now = time.monotonic()
                if now < entry[0]:
                    self.cond.wait(entry[0] - now)
                    continue
                self.stack.remove(entry)
                return entry


_monitor = None
_monitor_lock = threading.Lock()


@contextlib.contextmanager
def guard(what, timeout=DEFAULT_TIMEOUT):
    """Run the body (a blocking MPI call) with a deadline of ``timeout`` seconds held by
    the monitor thread; ``what`` names it in the watchdog's line."""
    global _monitor
    identity.remember()  # on the caller's thread, for the monitor's line (it may not call MPI)
    if _monitor is None:
        with _monitor_lock:
            if _monitor is None:
                _monitor = _Monitor()
    entry = _monitor.push(what, timeout)
    try:
        yield
    finally:
        _monitor.pop(entry)
        expiry.checkpoint()  # an abort the monitor handed over while the body blocked
