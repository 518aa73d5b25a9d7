"""An MPI transport with NCCL's ordering and none of MPI's slack, for tests on CPUs.

NCCL runs a rank's transfers in the order they were queued, one group after another, and
a large send completes only when the receiver's matching receive runs. ``InOrderTransport``
does the same over MPI: transfers must be posted inside ``group()``; when the group closes
they start together (sends in synchronous mode, ``Issend``, which completes only once the
receive is matched) and the group is waited for before anything else happens. A ring whose
groups do not pair up across ranks deadlocks here as it could with NCCL, so the tests that
use it run with a timeout. There is no overlap of transfers with compute; it checks order,
not speed.

NCCL has no tags either: a send from rank a meets rank b's next receive from a on that
communicator, in the order each side queued them. So every message here travels with one
MPI tag (MPI's non-overtaking rule then matches first in, first out per peer, as NCCL
does), behind a header with the tag and size the sender meant; a receive that meets a
message meant as another raises ``MisPaired`` on its rank instead of delivering the wrong
buffer. Over plain MPI the tags would hide such a mis-pairing (an inner-ring packet taken
for an outer one, or for a gradient partial: the bug MindSpeed's double ring had).
"""

import contextlib

import numpy as np
from mpi4py import MPI

from burstmpi._transport.mpi import MPITransport

__all__ = ["InOrderTransport", "MisPaired"]

ONE_TAG = 7  # every message travels with this MPI tag
_HEADER = 16  # bytes: the tag the sender meant and the payload's size, two int64


class MisPaired(AssertionError):
    """A receive met a message meant as another: two ranks queue their transfers in
    different orders."""


class InOrderTransport(MPITransport):
    name = "in-order"
    eager = False  # as NCCL: nothing is sent outside its step's group

    def __init__(self, comm):
        super().__init__(comm)
        self._queued = None
        self.groups = 0

    @contextlib.contextmanager
    def group(self):
        if self._queued is not None:
            raise RuntimeError("InOrderTransport.group: groups do not nest")
        self._queued = []
        try:
            yield
            ops = self._queued
        finally:
            self._queued = None
        if ops:
            started = [op() for op in ops]
            MPI.Request.Waitall([req for req, _ in started])
            for _, check in started:
                check()
            self.groups += 1

    def _queue(self, what, op):
        if self._queued is None:
            raise RuntimeError(f"InOrderTransport.{what}: transfers must be posted inside group()")
        self._queued.append(op)
        return MPI.REQUEST_NULL  # complete by the time anyone waits for it

    def isend(self, buf, dest, tag):
        def start():
            payload = np.asarray(buf).reshape(-1).view(np.uint8)
            message = np.empty(_HEADER + payload.size, np.uint8)
            message[:_HEADER].view(np.int64)[...] = (tag, payload.size)
            message[_HEADER:] = payload
            return self.comm.Issend([message, MPI.BYTE], dest=dest, tag=ONE_TAG), lambda: message
        return self._queue("isend", start)

    def irecv(self, buf, source, tag):
        into = np.asarray(buf).reshape(-1).view(np.uint8)

        def start():
            # Room for twice the message expected: a larger one is reported from its header
            # (past twice, by MPI's truncation error).
            message = np.empty(_HEADER + 2 * into.size + 4096, np.uint8)
            return self.comm.Irecv([message, MPI.BYTE], source=source, tag=ONE_TAG), lambda: deliver(message)

        def deliver(message):
            sent_as, size = (int(x) for x in message[:_HEADER].view(np.int64))
            if (sent_as, size) != (tag, into.size):
                raise MisPaired(f"rank {self.comm.Get_rank()}: a receive from rank {source} expecting tag {tag} "
                                f"({into.size} bytes) met the message sent as tag {sent_as} ({size} bytes): the "
                                "two ranks queue their transfers in different orders")
            into[...] = message[_HEADER:_HEADER + size]
        return self._queue("irecv", start)
