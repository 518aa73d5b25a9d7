"""NCCL for the ring: communicators bootstrapped over MPI, and a stream-ordered transport.

Bootstrap: rank 0 creates the NCCL unique id and MPI broadcasts it, so no TCP store and
no listening port are involved; one NCCL communicator per (MPI communicator, device),
kept by the state of the caller's communicator (``lifetime``) and destroyed when the
caller frees it (before the MPI communicator it was made over).

Transport: transfers run on a dedicated comm stream. When a ring step's group opens, the
comm stream waits for an event recorded on the compute stream (so NCCL never reads a
buffer before the kernel that produced it has finished, and never overwrites one a kernel
still reads); the step's sends and receives are issued between ncclGroupStart and
ncclGroupEnd; closing the group records a "received" event that ``wait`` makes the
compute stream wait for. No host synchronisation happens inside the ring loop.

Deadlines. Every NCCL call that can wait on a peer runs under the call's deadline (the
plan's ``timeout``), and on expiry ends the job as the MPI path does: the watchdog's one
line naming the NCCL step, then ``MPI_Abort`` with exit 75 (``watchdog.expire``):

- a communicator's set-up (``ncclCommInitRank``: NCCL's bootstrap waits for every rank),
  for the flat ring's communicator and for those ``on`` makes (the two-level rings',
  head parallelism's);
- every ``ncclGroupEnd``: NCCL connects to a peer on its first transfer there, waiting
  on the host for the peer's side, and later blocks the host when its queue of work is
  full; the decode's ``ncclAllGather`` likewise;
- ``finish``, the one host wait of a phase: it polls the last transfers' event and
  NCCL's asynchronous error state against the deadline.

The blocking calls run under ``watchdog.guard``: a monitor thread holds the deadline and,
when it passes, prints the line and ends the job while the main thread still sits in
NCCL. That works only because CuPy's bindings release the GIL around those calls (in
CuPy 14.2's ``cupy_backends/cuda/libs/nccl.pyx``, ``NcclCommunicator.__init__``,
``groupEnd``, ``send``, ``recv``, ``allGather``, ``abort``, ``destroy`` and
``check_async_error`` call NCCL inside ``with nogil``; only ``NcclCommunicator.initAll``,
unused here, holds it). The other way, NCCL's nonblocking communicators
(``ncclCommInitRankConfig`` with ``blocking=0``, then polling ``ncclCommGetAsyncError``
and ``ncclCommAbort`` on expiry), was not taken: CuPy's ``NcclConfig`` sets only
``splitShare``, so ``blocking=0`` needs NCCL's C API through ctypes (``ncclConfig_t``
is versioned by NCCL's header), and on such a communicator every call may return
``ncclInProgress``, which CuPy's wrappers raise as an error: the whole transport would
have to move to ctypes, for one gain, aborting NCCL and going on, that burstmpi does not
want (an expired deadline ends the job on the MPI path too). A guard costs a lock and a
notify per group (about 11 us on a busy 2-core CPU, against a ring step's transfer and
kernels); the process's end frees NCCL and stops its kernels.
tests/gpu/test_nccl_deadline.py runs each case on a fake NCCL (tests/gpu/fake_cupy.py).
"""

import contextlib
import time

from .._gpu.device import rank_prefix
from .._transfers import waited
from .lifetime import count, resource
from .watchdog import DEFAULT_TIMEOUT, bcast, collective, expire, guard, who

__all__ = ["unique_id", "communicator", "NCCLTransport", "available", "choose_transport"]

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


def unique_id(comm, timeout=DEFAULT_TIMEOUT, *, _nccl=None):
    """The NCCL unique id of rank 0, broadcast to every rank of ``comm`` (collective,
    within ``timeout`` seconds)."""
    if _nccl is None:
        from cupy.cuda import nccl as _nccl

    uid = _nccl.get_unique_id() if comm.Get_rank() == 0 else None
    return bcast(comm, uid, 0, timeout, "the broadcast of NCCL's unique id")


def _destroy(nc, collective):
    """Destroy an NCCL communicator at its state's teardown (``lifetime``); at exit drop
    burstmpi's reference only (CuPy's destructor then destroys it, once nothing is in
    flight: an explicit destroy here could wait for peers that already left)."""
    if collective:
        try:
            nc.destroy()
        except Exception:  # pragma: no cover - a communicator NCCL already tore down
            pass
    count("nccl", -1)


def _over(comm):
    """The ranks of ``comm`` for the watchdog's line: named (``who``) when few, else counted."""
    if comm is None:  # a transport on fakes alone (tests) has no communicator to name
        return "every rank"
    n = comm.Get_size()
    return who(comm, range(n)) if n <= 8 else f"{n} ranks"


def communicator(comm, device_id, timeout=DEFAULT_TIMEOUT, *, _cupy=None, _nccl=None):
    """The NCCL communicator of ``comm`` (a communicator burstmpi made: its private
    duplicate or a split of it) on ``device_id``, created once (collective, within
    ``timeout`` seconds: the bootstrap's broadcast, and NCCL's set-up under the watchdog's
    guard) and destroyed with ``comm``'s state (``lifetime``: when the caller frees its
    communicator, before ``comm`` is freed). ``_cupy``, ``_nccl``: stand-ins for CuPy
    and its NCCL module (tests' fakes), whose communicators are kept apart from NCCL's."""
    # A stand-in's communicators under a key of their own: a test's fake never serves a
    # later call with CuPy's NCCL on the same communicator.
    key = ("nccl", device_id) if _nccl is None else ("nccl", device_id, _nccl)
    if _nccl is None:
        import cupy as _cupy
        from cupy.cuda import nccl as _nccl

    def make():
        uid = unique_id(comm, timeout, _nccl=_nccl)
        with _cupy.cuda.Device(device_id):
            try:
                # NCCL's bootstrap waits for every rank of ``comm``: a rank that never
                # comes would hold this one here forever (CuPy releases the GIL inside,
                # so the guard's thread can end the job).
                with guard(f"ncclCommInitRank, NCCL's communicator set-up over {_over(comm)} on device "
                           f"{device_id}", timeout):
                    nc = _nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
            except Exception as e:
                raise RuntimeError(f"{rank_prefix(comm)}NCCL communicator on device {device_id}: {e} "
                                   "(NCCL needs one GPU per rank; use transport='mpi' to share a GPU)") from e
        count("nccl")
        return nc

    return resource(comm, key, make, _destroy)


class _Request:
    """A transfer queued in a group; ``event`` is set when the group closes."""

    __slots__ = ("event",)

    def __init__(self):
        self.event = None


class NCCLTransport:
    """Point-to-point transfers of CuPy buffers over NCCL, ordered by CUDA events; every
    wait on a peer within ``timeout_s`` seconds (the module docstring)."""

    name = "nccl"
    # Transfers run in the order their groups were queued, and every rank's t-th group
    # pairs with its neighbours' t-th: a packet is never sent on ahead of its step's group.
    eager = False
    # burstmpi-gpucheck's ordering check only: ("comm" or "compute", ns) holds that stream
    # back by ns (cuda/probe.cu's stream_delay), so that a missing wait between the two
    # streams changes the bits on silicon. The comm stream is held back after its wait for
    # the kernels, before each group's transfers and the allgather: they land late. The
    # compute stream is held back after the event the comm stream waits for, and after
    # each phase: the kernels that produce the next transfers' data run late. None otherwise.
    delay = None

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
        self._peers = []        # the open group's peers (ranks of ``comm``), as posted
        self._unfinished = {}   # peers of the transfers since the last ``finish``, in order
        self._named = {}        # peers -> how the watchdog's line names them

    def on(self, comm):
        """NCCL over another communicator: a communicator and a comm stream of its own, so
        transfers on the two never pair with each other (the two-level ring's inner and
        outer rings; every rank queues its groups on them in one order, as NCCL needs of
        communicators used side by side)."""
        return NCCLTransport(comm, self.device_id, self.timeout_s, _cupy=self._cupy, _nccl=self._nccl)

    def _name(self, peers):
        """``rank 1 (node-b)`` for the watchdog's line (None among ``peers``: an allgather's,
        every rank), worked out once per set of peers (``who`` asks MPI to translate ranks:
        not once per ring step)."""
        key = tuple(peers)
        got = self._named.get(key)
        if got is None:
            if None in key:
                got = _over(self.comm)
            elif len(key) > 8:
                got = f"{len(key)} ranks"
            else:
                got = who(self.comm, key) if key else "no peer"
            self._named[key] = got
        return got

    @contextlib.contextmanager
    def group(self):
        if self._open is not None:
            raise RuntimeError("NCCLTransport.group: groups do not nest")
        self._open, self._peers = [], []
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
            self._held_back("comm", compute)
            self._held_back("compute", compute)
            peers = tuple(dict.fromkeys(self._peers))
            # ncclGroupEnd waits on the host for a peer's side the first time it transfers
            # with it (NCCL connects then), and whenever NCCL's queue of work is full.
            with guard(f"ncclGroupEnd of NCCL's transfers with {self._name(peers)} (NCCL connects to a peer "
                       "at the first transfer)", self.timeout_s):
                self._nccl.groupEnd()
            reqs, self._open = self._open, None
            done = self.stream.record()
            for r in reqs:
                r.event = done
            if reqs:
                self._last = done
                self._unfinished.update(dict.fromkeys(peers))

    def _held_back(self, which, compute):
        """``delay``'s stream_delay on the ``which`` stream, if it asks for that one."""
        if self.delay is not None and self.delay[0] == which:
            from .._gpu import kernels

            with self.stream if which == "comm" else compute:
                kernels.delay(self.device_id, self.delay[1])

    def _queue(self, what, peer):
        if self._open is None:
            raise RuntimeError(f"NCCLTransport.{what}: transfers must be posted inside group()")
        r = _Request()
        self._open.append(r)
        self._peers.append(peer)
        return r

    def isend(self, buf, dest, tag):
        r = self._queue("isend", dest)
        self.nccl_comm.send(buf.data.ptr, buf.nbytes, self._nccl.NCCL_UINT8, dest, self.stream.ptr)
        return r

    def irecv(self, buf, source, tag):
        r = self._queue("irecv", source)
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
        kernels that wrote ``send`` and before any that read ``recv`` (no host wait; NCCL
        connects to the peers at the first one, under the deadline)."""
        compute = self._cupy.cuda.get_current_stream()
        self.stream.wait_event(compute.record())
        self._held_back("comm", compute)
        self._held_back("compute", compute)
        with guard(f"ncclAllGather over {self._name([None])} (NCCL connects to its peers at the first one)",
                   self.timeout_s):
            self.nccl_comm.allGather(send.data.ptr, recv.data.ptr, send.nbytes, self._nccl.NCCL_UINT8,
                                     self.stream.ptr)
        self._last = self.stream.record()
        self._unfinished[None] = None  # every rank of the communicator (``_name``)
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
        while not self._last.done:  # an event query: it never blocks, so the loop keeps the deadline
            self.nccl_comm.check_async_error()
            waited_s = time.monotonic() - start
            if waited_s > self.timeout_s:
                # No ncclCommAbort first: it can wait for a kernel stuck on the dead peer,
                # before the line is out; MPI_Abort ends the process, which frees NCCL.
                expire(f"the phase's NCCL transfers with {self._name(tuple(self._unfinished))} did not complete "
                       f"(waited {waited_s:.0f} s for their event on NCCL's stream: a peer or a link stopped "
                       "answering)")
            time.sleep(1e-4)
        self._last = None
        self._unfinished.clear()
        self._held_back("compute", self._cupy.cuda.get_current_stream())  # the next phase's producers
