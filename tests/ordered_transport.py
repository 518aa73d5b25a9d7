"""An MPI transport with NCCL's ordering and none of MPI's slack, for tests on CPUs.

NCCL runs a rank's transfers in the order they were queued, one group after another, and
a large send completes only when the receiver's matching receive runs. ``InOrderTransport``
does the same over MPI: transfers must be posted inside ``group()``; when the group closes
they start together (sends in synchronous mode, ``Issend``, which completes only once the
receive is matched) and the group is waited for before anything else happens. A ring whose
groups do not pair up across ranks deadlocks here as it could with NCCL, so the tests that
use it run with a timeout. There is no overlap of transfers with compute; it checks order,
not speed.
"""

import contextlib

from mpi4py import MPI

from burstmpi.transport.comm import MPITransport


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
            MPI.Request.Waitall([op() for op in ops])
            self.groups += 1

    def _queue(self, what, op):
        if self._queued is None:
            raise RuntimeError(f"InOrderTransport.{what}: transfers must be posted inside group()")
        self._queued.append(op)
        return MPI.REQUEST_NULL  # complete by the time anyone waits for it

    def isend(self, buf, dest, tag):
        return self._queue("isend", lambda: self.comm.Issend([buf, MPI.BYTE], dest=dest, tag=tag))

    def irecv(self, buf, source, tag):
        return self._queue("irecv", lambda: self.comm.Irecv([buf, MPI.BYTE], source=source, tag=tag))
