"""NCCL for the ring: communicators bootstrapped over MPI, and a stream-ordered transport.

Bootstrap: rank 0 creates the NCCL unique id and MPI broadcasts it, so no TCP store and
no listening port are involved; one NCCL communicator per (MPI communicator, device),
cached as an attribute of burstmpi's private MPI communicator and destroyed when that
communicator is freed (at the latest, at MPI_Finalize).

Transport: transfers run on a dedicated comm stream. When a ring step's group opens, the
comm stream waits for an event recorded on the compute stream (so NCCL never reads a
buffer before the kernel that produced it has finished, and never overwrites one a kernel
still reads); the step's sends and receives are issued between ncclGroupStart and
ncclGroupEnd; closing the group records a "received" event that ``wait`` makes the
compute stream wait for. No host synchronisation happens inside the ring loop.
``finish`` waits at the end of a phase with the deadline, polling NCCL's asynchronous error
state, so a peer that died ends the job with the watchdog's line instead of a hang.
"""

import contextlib
import time

from mpi4py import MPI

from .._gpu.device import rank_prefix
from .._transfers import waited
from .watchdog import DEFAULT_TIMEOUT, bcast, collective, expire

__all__ = ["unique_id", "communicator", "NCCLTransport", "available", "choose_transport"]

_KEYVAL = None


def available():
    """True if CuPy's NCCL bindings can be loaded (no GPU needed to say so)."""
    try:
        from cupy.cuda import nccl
    except ImportError:
        return False
    return bool(getattr(nccl, "available", True))


def choose_transport(fn, requested, nccl_ok, shared_gpu):
    """"nccl" or "mpi" for GPU buffers: NCCL when asked for or, under "auto", when it is
    installed and no two ranks share a GPU (NCCL refuses that); MPI otherwise."""
    if requested == "auto":
        return "nccl" if nccl_ok and not shared_gpu else "mpi"
    if requested == "nccl":
        if not nccl_ok:
            raise NotImplementedError(f"{fn}: transport: 'nccl' needs NCCL for CuPy "
                                      "(pip install nvidia-nccl-cu12 or nvidia-nccl-cu13)")
        if shared_gpu:
            raise ValueError(f"{fn}: transport: 'nccl' needs one GPU per rank, but ranks share "
                             "GPUs here; use transport='mpi'")
    return requested


def unique_id(comm, timeout=DEFAULT_TIMEOUT):
    """The NCCL unique id of rank 0, broadcast to every rank of ``comm`` (collective,
    within ``timeout`` seconds)."""
    from cupy.cuda import nccl

    uid = nccl.get_unique_id() if comm.Get_rank() == 0 else None
    return bcast(comm, uid, 0, timeout, "the broadcast of NCCL's unique id")


def _destroy(comm, keyval, cached):
    for nc in cached.values():
        try:
            nc.destroy()
        except Exception:  # the process is going down; nothing useful to do
            pass
    return MPI.SUCCESS


def communicator(comm, device_id, timeout=DEFAULT_TIMEOUT):
    """The NCCL communicator of ``comm`` on ``device_id``, created once (collective; the
    bootstrap's broadcast within ``timeout`` seconds)."""
    global _KEYVAL
    from cupy.cuda import nccl

    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_destroy)
    cached = comm.Get_attr(_KEYVAL)
    if cached is None:
        cached = {}
        comm.Set_attr(_KEYVAL, cached)
    if device_id not in cached:
        uid = unique_id(comm, timeout)
        import cupy

        with cupy.cuda.Device(device_id):
            try:
                cached[device_id] = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
            except Exception as e:
                raise RuntimeError(f"{rank_prefix(comm)}NCCL communicator on device {device_id}: {e} "
                                   "(NCCL needs one GPU per rank; use transport='mpi' to share a GPU)") from e
    return cached[device_id]


class _Request:
    """A transfer queued in a group; ``event`` is set when the group closes."""

    __slots__ = ("event",)

    def __init__(self):
        self.event = None


class NCCLTransport:
    """Point-to-point transfers of CuPy buffers over NCCL, ordered by CUDA events."""

    name = "nccl"
    # Transfers run in the order their groups were queued, and every rank's t-th group
    # pairs with its neighbours' t-th: a packet is never sent on ahead of its step's group.
    eager = False

    def __init__(self, comm, device_id, timeout_s=300.0, *, _cupy=None, _nccl=None, _nccl_comm=None):
        # The underscored arguments let tests drive the event protocol with fakes.
        if _cupy is None:
            import cupy as _cupy
            from cupy.cuda import nccl as _nccl
        self._cupy, self._nccl = _cupy, _nccl
        self.comm, self.device_id, self.timeout_s = comm, device_id, timeout_s
        self.nccl_comm = communicator(comm, device_id, timeout_s) if _nccl_comm is None else _nccl_comm
        with _cupy.cuda.Device(device_id):
            self.stream = _cupy.cuda.Stream(non_blocking=True)
        self._open = None
        self._last = None

    def on(self, comm):
        """NCCL over another communicator: a communicator and a comm stream of its own, so
        transfers on the two never pair with each other (the two-level ring's inner and
        outer rings; every rank queues its groups on them in one order, as NCCL needs of
        communicators used side by side)."""
        return NCCLTransport(comm, self.device_id, self.timeout_s, _cupy=self._cupy, _nccl=self._nccl)

    @contextlib.contextmanager
    def group(self):
        if self._open is not None:
            raise RuntimeError("NCCLTransport.group: groups do not nest")
        self._open = []
        self._nccl.groupStart()
        try:
            yield
        finally:
            # The transfers start after every kernel and copy queued so far, those queued
            # inside the group included (a packet passed on with fewer rows than it came
            # with is packed into a staging buffer there: ``comm.Channel``); NCCL launches
            # the group's transfers on its stream at groupEnd, behind this wait.
            compute = self._cupy.cuda.get_current_stream()
            self.stream.wait_event(compute.record())
            self._nccl.groupEnd()
            reqs, self._open = self._open, None
            done = self.stream.record()
            for r in reqs:
                r.event = done
            if reqs:
                self._last = done

    def _queue(self, what):
        if self._open is None:
            raise RuntimeError(f"NCCLTransport.{what}: transfers must be posted inside group()")
        r = _Request()
        self._open.append(r)
        return r

    def isend(self, buf, dest, tag):
        r = self._queue("isend")
        self.nccl_comm.send(buf.data.ptr, buf.nbytes, self._nccl.NCCL_UINT8, dest, self.stream.ptr)
        return r

    def irecv(self, buf, source, tag):
        r = self._queue("irecv")
        self.nccl_comm.recv(buf.data.ptr, buf.nbytes, self._nccl.NCCL_UINT8, source, self.stream.ptr)
        return r

    def wait(self, requests, peers=()):
        """Make the compute stream wait for the transfers (no host synchronisation)."""
        compute = self._cupy.cuda.get_current_stream()
        for r in {id(r.event): r for r in requests}.values():
            compute.wait_event(r.event)

    @staticmethod
    def progress(requests):
        return True  # NCCL progresses on its own: nothing for the host to poll

    @property
    def timeout(self):
        """The deadline of every wait, in seconds (as ``MPITransport.timeout``)."""
        return self.timeout_s

    @timeout.setter
    def timeout(self, seconds):
        self.timeout_s = seconds

    def complete(self, requests, where):
        """Complete MPI ``requests`` on the plan's communicator (a barrier around a link's
        timing) within the deadline."""
        collective(self.comm, requests, self.timeout_s, where)

    def allgather(self, send, recv):
        """Every rank's ``send`` bytes into ``recv`` on the comm stream, ordered after the
        kernels that wrote ``send`` and before any that read ``recv`` (no host wait)."""
        compute = self._cupy.cuda.get_current_stream()
        self.stream.wait_event(compute.record())
        self.nccl_comm.allGather(send.data.ptr, recv.data.ptr, send.nbytes, self._nccl.NCCL_UINT8,
                                 self.stream.ptr)
        self._last = self.stream.record()
        compute.wait_event(self._last)

    def finish(self):
        """Wait for the phase's last transfers on the host, with the deadline and NCCL's
        asynchronous error check: a dead peer ends the job with the watchdog's line
        (``watchdog.expire``), not a hang. The one host wait of a phase, counted as a
        synchronisation (``burstmpi._transfers``)."""
        if self._last is None:
            return
        waited()
        start = time.monotonic()
        while not self._last.done:
            self.nccl_comm.check_async_error()
            if time.monotonic() - start > self.timeout_s:
                self.nccl_comm.abort()
                expire(f"the phase's NCCL transfers did not complete within {self.timeout_s:.0f} s (a peer or "
                       "a link stopped answering); NCCL communicator aborted")
            time.sleep(1e-4)
        self._last = None
