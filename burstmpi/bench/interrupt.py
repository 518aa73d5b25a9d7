"""burstmpi-bench under SIGINT and SIGTERM: the rows measured so far are kept, and the job ends.

A launcher passes these signals to every rank: MPICH's hydra forwards a Ctrl-C (SIGINT)
and SIGTERM to each rank, which it starts in a process group of its own (measured with
MPICH 5.0.2: ``kill -TERM`` to mpiexec, or to its process group, reaches every rank within
10 ms); srun forwards them too, and Slurm sends SIGTERM to every process of a job at its
time limit (then SIGKILL, 30 s later by default: ``KillWait``). A second SIGINT to
hydra's mpiexec kills the ranks at once ("Press Ctrl-C again to force abort").

``Interrupts`` replaces the default actions (Python's KeyboardInterrupt, the kernel's
termination) while the rows run. The signal's number reaches a thread through a wakeup
pipe (``signal.set_wakeup_fd``), written by Python's C-level handler the moment the signal
arrives: Python's own handlers run only when the main thread returns to the interpreter,
and it may be inside a blocking MPI call or a compiled tile loop. Then:

- rank 0, which holds the rows, calls ``report(signal name)`` (the footer, the JSON and
  JUnit files of the rows done, and an ``# INTERRUPTED by SIGTERM after N rows`` line)
  and ends the job with ``MPI_Abort(128 + signal)``: 130 for SIGINT, 143 for SIGTERM, what
  a shell reports for a process the signal ended, and what mpiexec returns (measured);
- another rank waits ``GRACE_S`` for rank 0 to do so, then aborts by itself (rank 0 did
  not get the signal: someone signalled one rank), with the same code. It never returns
  to the bench: a rank that went on into the next row's collectives would wait there for
  ranks that left.

MPI_Abort, not an exit: an exit on one rank leaves the others in their collectives (or in
``MPI_Finalize``) until the watchdog's deadline, and hydra reports an exit by a signal's
code as "BAD TERMINATION" with exit 9 at times (measured); MPI_Abort ends every rank and
mpiexec returns its code.

The signal thread calls MPI itself only at MPI_THREAD_MULTIPLE (mpi4py asks for it, and
MPICH and Open MPI give it). Below it (``MPI4PY_RC_THREAD_LEVEL=funneled`` or
``serialized``; Cray MPICH's default is serialized) it hands the report and the abort to
the main thread (``watchdog.on_callers_thread``), which takes them at its next poll of a
transfer or collective (``watchdog.checkpoint``: within a millisecond while the rows run)
or after a row. Should the main thread not come within ``GRACE_S`` (inside one long compiled
loop, or a blocking MPI call), the rank ends by ``os._exit`` with the same code, without
the report: the launcher then ends the job, and hydra returns that code or 9
(``burstmpi._transport.watchdog.expiry``). The rank is read on the main thread beforehand.
"""

import os
import signal
import sys
import threading
import time

from .._transport import watchdog
from .._transport.watchdog import expiry

__all__ = ["Interrupts", "SIGNALS", "GRACE_S", "exit_code"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
GRACE_S = 10.0  # rank 0 writes a few files, in well under a second; Slurm's KillWait is 30 s


def exit_code(signum):
    """The status a shell gives a process that ``signum`` ended: 128 + its number."""
    return 128 + int(signum)


def _ignore(signum, frame):
    """Python's handler: nothing (the watcher thread acts). Its presence makes Python's C
    handler write the signal's number to the wakeup pipe, and keeps the default action
    (KeyboardInterrupt in the main thread, or the kernel's termination) from happening."""


_installed = []  # the Interrupts whose handlers are in place (one at most)


class Interrupts:
    """``with Interrupts(comm, report) as guard:`` run the rows; SIGINT or SIGTERM meanwhile
    calls ``report(name)`` on rank 0 (under ``guard.lock``) and aborts the job with
    ``exit_code(signal)``. Hold ``guard.lock`` while changing what ``report`` reads; call
    ``guard.finish()`` (holding it) before writing the run's own results, after which a
    signal no longer interrupts. Outside the main thread (where Python cannot take
    signals) it does nothing.

    Nested inside another (the bench's ``main`` holds one from its start, for a signal
    during the preamble, and each sweep one for its rows) it is that one, with ``report``
    in place of its own until the inner block ends."""

    def __init__(self, comm, report):
        self.comm, self.report = comm, report
        self.lock = threading.RLock()
        self.finished = False
        self.rank = None  # read on the main thread (``__enter__``): the signal thread calls no MPI
        self._active = False
        self._outer = None

    def finish(self):
        self.finished = True

    def __enter__(self):
        watchdog.remember()  # this rank's name and MPI's thread level, read here where MPI may be called
        self.rank = self.comm.Get_rank()
        if _installed:
            outer = self._outer = _installed[0]
            with outer.lock:
                self._saved, outer.report = outer.report, self.report
            return outer
        if threading.current_thread() is not threading.main_thread():
            return self
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)  # Python's C handler must never block
        self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._old = {s: signal.signal(s, _ignore) for s in SIGNALS}
        self._thread = watchdog.helper(threading.Thread(target=self._watch, name="burstmpi-bench signals",
                                                        daemon=True))
        self._thread.start()
        self._active = True
        _installed.append(self)
        return self

    def __exit__(self, *exc):
        watchdog.checkpoint()  # a signal whose report and abort were handed to this thread
        if self._outer is not None:
            with self._outer.lock:
                self._outer.report = self._saved
            self._outer = None
            return False
        if not self._active:
            return False
        _installed.remove(self)
        for s, handler in self._old.items():
            signal.signal(s, handler)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._write)  # the watcher reads end-of-file and returns
        self._thread.join(1.0)
        if not self._thread.is_alive():  # else it waits out GRACE_S, sees ``finished`` and returns
            os.close(self._read)
        self._active = False
        return False

    def _watch(self):
        while True:
            data = os.read(self._read, 64)
            if not data:
                return
            for signum in data:  # other signals with Python handlers (SIGALRM of a test timer) pass by
                if signum in SIGNALS:
                    self._interrupted(signal.Signals(signum))

    def _interrupted(self, sig):
        code = exit_code(sig)
        if self.rank == 0:
            # Here at MPI_THREAD_MULTIPLE, else on the main thread at its next poll.
            if watchdog.on_callers_thread(lambda: self._report_and_abort(sig, code), GRACE_S) or self.finished:
                return  # it found the run writing its own results (else it ended the job)
            self._exit(code, f"got {sig.name}, and the main thread, the one that may call MPI "
                             f"({watchdog.identity.level_name()}), did not come back from a compiled loop or a "
                             f"blocking MPI call within {GRACE_S:.0f} s: ending without writing the rows")
        time.sleep(GRACE_S)
        if self.finished:
            return
        sys.stderr.write(f"# burstmpi-bench: rank {self.rank} got {sig.name}, and rank 0 did not end "
                         f"the job within {GRACE_S:.0f} s (did it get the signal?): aborting (exit {code})\n")
        sys.stderr.flush()
        if not watchdog.on_callers_thread(lambda: expiry.abort(code, self.comm), watchdog.ABORT_GRACE_S):
            self._exit(code, f"the main thread ({watchdog.identity.level_name()}) did not come back from a "
                             f"compiled loop or a blocking MPI call within {watchdog.ABORT_GRACE_S:.0f} s")

    def _report_and_abort(self, sig, code):
        """Rank 0: the rows so far (``report``) and the end of the job, unless the run is
        writing its own results already. On a thread that may call MPI."""
        with self.lock:
            if self.finished:  # the run's own results are being written: it ends by itself
                return
            self.finished = True
            try:
                self.report(sig.name)
            except BaseException as e:  # the abort must happen whatever went wrong
                sys.stderr.write(f"# burstmpi-bench: writing the rows measured before {sig.name} failed: "
                                 f"{type(e).__name__}: {e}\n")
            sys.stdout.flush()
            sys.stderr.flush()
            # Still holding the lock: a row the main thread finishes meanwhile is neither
            # printed nor kept after the report that leaves it out.
            expiry.abort(code, self.comm)

    def _exit(self, code, why):
        """End this process without MPI (the launcher ends the others): the way out of a
        thread that may not call MPI."""
        sys.stderr.write(f"# burstmpi-bench: rank {self.rank}: {why}; exit {code}\n")
        sys.stderr.flush()
        os._exit(code)

