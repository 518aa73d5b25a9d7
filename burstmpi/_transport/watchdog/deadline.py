"""Nonblocking MPI requests completed by a loop that checks a deadline between polls.

The deadline is ``timeout`` seconds per wait (``BurstAttention(timeout=)``, the bench's
``--timeout``, default ``BURSTMPI_TIMEOUT`` or 300 s). The loop is also where the caller's
thread takes over what a helper thread may not do below ``MPI_THREAD_MULTIPLE``
(``expiry.checkpoint``).
"""

import time

from mpi4py import MPI

from ..._config import Settings, check_setting
from . import expiry, hosts

DEFAULT_TIMEOUT = Settings.timeout  # BURSTMPI_TIMEOUT's default


def check_timeout(fn, timeout):
    """``timeout`` as a float number of seconds > 0, or ValueError naming ``fn`` (the
    ``timeout`` keyword's check, ``config.check_setting``)."""
    return check_setting(fn, "timeout", timeout)


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
        if expiry._handed:  # a helper thread's abort, which MPI lets only this thread make
            expiry.checkpoint()
        if MPI.Request.Testall(requests):
            return
        now = time.monotonic()
        if now > deadline:
            pending = [i for i, r in enumerate(requests) if r and not r.Test()]
            if not pending:  # done at the last moment
                return
            if expired is not None:
                expired(pending, now - start)
            expiry.expire(f"{len(pending)} transfer(s) did not complete within {now - start:.0f} s",
                          wait=expiry.linger(timeout))


def peers_expired(comm, peers, where="a transfer"):
    """An ``expired`` callback for ``complete`` naming the ranks of ``comm`` that the
    pending requests wait for: ``peers[i]`` is ``("receive from", rank)`` or ``("send to",
    rank)`` for request i. Without peers (a collective) the line lingers (``linger``)."""
    def expired(pending, waited):
        parts = [f"{peers[i][0]} {hosts.who(comm, [peers[i][1]])}" for i in pending if i < len(peers) and peers[i]]
        if parts:
            expiry.expire(f"{where}: waited {waited:.0f} s to {'; '.join(dict.fromkeys(parts))}")
        expiry.expire(f"{where} did not complete within {waited:.0f} s (a rank or a link stopped answering, or a "
                      "rank did not make the same call)", wait=expiry.linger(waited))
    return expired


def collective(comm, requests, timeout=DEFAULT_TIMEOUT, what="a collective", idle=False):
    """Complete the requests of a collective on ``comm`` (``what`` names it) within
    ``timeout`` seconds: no peer to name, so the line lingers (``peers_expired``)."""
    complete(requests, idle, timeout, peers_expired(comm, (), what))
