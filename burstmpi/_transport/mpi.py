"""The MPI transports: point-to-point transfers of a ring's buffers over mpi4py.

``MPITransport`` moves host buffers; ``DeviceMPITransport`` hands device buffers to a
CUDA-aware MPI; ``StagedMPITransport`` copies device buffers through host ones for an MPI
that is not CUDA-aware. Every wait has the transport's deadline (``watchdog.complete``). The
channels (``comm``) post their transfers on any of these.
"""

import contextlib

import numpy as np
from mpi4py import MPI

from .comm import _address
from .watchdog import DEFAULT_TIMEOUT, collective, complete, guard, peers_expired

__all__ = ["MPITransport", "DeviceMPITransport", "StagedMPITransport"]


class MPITransport:
    """Point-to-point transfers of host buffers over an mpi4py communicator.

    ``idle``: ranks take turns on this node's cores, so waits sleep (``watchdog.complete``);
    the runtime sets it on a plan's first call. ``timeout``: the seconds a wait may last
    before the watchdog ends the job (the runtime's ``timeout``)."""

    name = "mpi"
    idle = False
    timeout = DEFAULT_TIMEOUT
    # Messages match in any order, and a received buffer is the packet itself: a packet
    # may be sent on as soon as it arrives (``Channel.post(forward=)``).
    eager = True

    def __init__(self, comm):
        self.comm = comm

    def on(self, comm):
        """The same kind of transport over another communicator, waiting as this one does
        (the two-level ring's inner and outer rings run on sub-communicators of the plan's)."""
        return self._like(type(self)(comm))

    def _like(self, other):
        other.idle, other.timeout = self.idle, self.timeout
        return other

    @staticmethod
    def group():
        """The transfers of one ring step are posted inside this context. MPI matches
        messages whatever their order, so it is nothing here; a transport that runs its
        transfers in order (NCCL) starts them together when the context closes."""
        return contextlib.nullcontext()

    def isend(self, buf, dest, tag):
        return self.comm.Isend([buf, MPI.BYTE], dest=dest, tag=tag)

    def irecv(self, buf, source, tag):
        return self.comm.Irecv([buf, MPI.BYTE], source=source, tag=tag)

    def wait(self, requests, peers=()):
        """Complete ``requests`` within the deadline. ``peers[i]``: what request i waits
        for, ``("receive from", rank)`` or ``("send to", rank)``, named if it expires."""
        complete(requests, self.idle, self.timeout, peers_expired(self.comm, peers))

    def complete(self, requests, where):
        """Complete the requests of a collective (``where`` names it) within the deadline."""
        collective(self.comm, requests, self.timeout, where, self.idle)

    def allgather(self, send, recv):
        """Every rank's ``send`` bytes into ``recv`` (rank order): the decode's one
        collective per call (``burstmpi._decode.cache``)."""
        self.complete([self.comm.Iallgather([send, MPI.BYTE], [recv, MPI.BYTE])], "the allgather of every rank's part")

    @staticmethod
    def progress(requests):
        # Without an asynchronous progress thread MPI moves a large message only inside
        # MPI calls, so the compute loop pokes it between tiles to keep the overlap real.
        # True once all are complete.
        return MPI.Request.Testall(requests)

    def finish(self):
        """End of a phase. Every MPI transfer was waited for, so there is nothing to
        check; a transport that runs asynchronously (NCCL) checks its transfers here, with
        a timeout, and a shared window starts its fence."""


class DeviceMPITransport(MPITransport):
    """Device buffers handed to a CUDA-aware MPI (``BURSTMPI_CUDA_AWARE_MPI=1``). MPI does
    not order a send after the kernels and copies queued on a stream, so a send first waits
    for them (``synchronize``), and a received packet goes on only with its step's send."""

    eager = False

    def __init__(self, comm, synchronize):
        super().__init__(comm)
        self._synchronize = synchronize

    def on(self, comm):
        return self._like(DeviceMPITransport(comm, self._synchronize))

    def isend(self, buf, dest, tag):
        self._synchronize()
        return super().isend(buf, dest, tag)

    def allgather(self, send, recv):
        """Blocking (a CUDA-aware MPI may support device buffers in blocking collectives
        only), after the kernels that wrote ``send``, under the watchdog's monitor."""
        self._synchronize()
        with guard("the allgather of every rank's part (device buffers)", self.timeout):
            self.comm.Allgather([send, MPI.BYTE], [recv, MPI.BYTE])


class _Staged:
    """An MPI request on a host copy of a device buffer."""

    __slots__ = ("req", "host", "device")

    def __init__(self, req, host, device=None):
        self.req, self.host, self.device = req, host, device


class StagedMPITransport(MPITransport):
    """MPI transfers of device buffers through host copies, for MPIs that are not
    CUDA-aware (and for ranks that share a GPU, which NCCL refuses).

    ``to_host(buf, out)`` copies a device buffer into a host one after the producing
    kernels have finished; ``to_device(host, buf)`` copies back and returns once done.
    Host buffers are kept per device buffer, so a plan allocates them once.
    """

    name = "mpi-staged"
    eager = False  # a received packet reaches its device buffer only in ``wait``

    def __init__(self, comm, to_host, to_device, alloc_host=None):
        super().__init__(comm)
        self._to_host, self._to_device = to_host, to_device
        self._alloc_host = alloc_host or (lambda n: np.empty(n, dtype=np.uint8))
        self._hosts = {}

    def on(self, comm):
        return self._like(StagedMPITransport(comm, self._to_host, self._to_device, self._alloc_host))

    def _host(self, buf, role):
        """The host copy of ``buf``: one per (role, device address), grown to the largest
        message sent from that address (packets shrink on their way; ``Packet``)."""
        key = (role, _address(buf))
        host = self._hosts.get(key)
        if host is None or host.nbytes < buf.nbytes:
            host = self._hosts[key] = self._alloc_host(buf.nbytes)
        return host[:buf.nbytes]

    def isend(self, buf, dest, tag):
        host = self._host(buf, "send")
        self._to_host(buf, host)
        return _Staged(self.comm.Isend([host, MPI.BYTE], dest=dest, tag=tag), host)

    def irecv(self, buf, source, tag):
        host = self._host(buf, "recv")
        return _Staged(self.comm.Irecv([host, MPI.BYTE], source=source, tag=tag), host, buf)

    def wait(self, requests, peers=()):
        super().wait([r.req for r in requests], peers)
        for r in requests:
            if r.device is not None:
                self._to_device(r.host, r.device)

    @staticmethod
    def progress(requests):
        return MPI.Request.Testall([r.req for r in requests])

    def allgather(self, send, recv):
        host_send, host_recv = self._host(send, "gather-send"), self._host(recv, "gather-recv")
        self._to_host(send, host_send)
        super().allgather(host_send, host_recv)
        self._to_device(host_recv, recv)
