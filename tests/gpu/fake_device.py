"""An asynchronous fake GPU for the fake CuPy (tests/gpu/fake_cupy.py): streams that queue
work, events that mark a point in a queue, and a choice of when the queued work runs, with
the stream sanitizer (tests/gpu/stream_sanitizer.py) checking every access.

The shape (one thread, so it cannot deadlock on itself):

- **Eager streams** (the null stream, external streams: where burstmpi's kernels and array
  operations run) run each operation when it is issued, after what their queue holds
  (waits for events of other streams; a wait not yet met runs the other stream first).
- **Deferred streams** (``cupy.cuda.Stream()``: NCCL's comm streams) queue their work:
  waits, event records and NCCL groups. A group is posted (sends from a snapshot of the
  device bytes taken then, receives into staging) and later completed (staging copied into
  the device bytes) in stream order; a record is reached when the work before it is done.
- **When deferred work runs** is the policy's choice, between what the queue allows and what
  the host forces: ``late`` runs it only when something needs it (an eager stream's wait,
  a synchronisation, an event query, a host wait of the watchdog's), ``early`` after every
  call into the fake, ``random`` (with a seed) a random stream by a random number of
  entries after every call. Every host wait pumps every stream (posts what can be posted,
  completes what has arrived), so a rank waiting for its peer also moves its own sends on.
- **NCCL matching**: a send and its peer's receive are MPI messages on the NCCL
  communicator's own MPI communicator, posted when each side's stream reaches them, so
  they pair in the order NCCL pairs them (each rank's t-th group with its peers' t-th).

Ordering is the sanitizer's business (it works on the clocks taken when work is queued),
values are the interleaving's: a missing wait shows as a race report, and under ``late``
or a seed also as a wrong value.
"""

import bisect
import ctypes
import random
import time
import weakref
from collections import deque

import numpy as np
from mpi4py import MPI

from stream_sanitizer import Sanitizer, where

__all__ = ["DEVICE", "Event", "FakeDevice", "POLICIES", "Stream"]

POLICIES = ("late", "early", "random")


def _join(into, other):
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _memory(ptr, nbytes):
    """Device memory at ``ptr`` as a NumPy view (no copy)."""
    return np.frombuffer((ctypes.c_ubyte * nbytes).from_address(ptr), np.uint8)


class _Record:
    """An event's point in a stream's queue."""

    __slots__ = ("stream", "clock", "done", "counted", "lost")

    def __init__(self, stream, clock, lost=False):
        self.stream, self.clock, self.done, self.counted = stream, clock, False, False
        self.lost = lost  # behind a stopped peer's transfers: never reached


class _Wait:
    __slots__ = ("record",)

    def __init__(self, record):
        self.record = record


class Group:
    """NCCL operations of one group on one stream: ``ops`` are (kind, args...), kinds
    "send" (comm, peer, ptr, n), "recv" (comm, peer, ptr, n) and "allgather" (comm, send
    ptr, recv ptr, n). ``lost``: with a peer that stopped (never posted, never complete)."""

    __slots__ = ("ops", "lost", "posted", "reqs", "held", "land", "keep")

    def __init__(self, ops, lost=False):
        self.ops, self.lost, self.posted = ops, lost, False
        self.reqs, self.held, self.land, self.keep = [], [], [], []

    def post(self):
        from mpi4py import MPI as _MPI

        self.posted = True
        for kind, comm, *rest in self.ops:
            if kind == "send":
                peer, ptr, n = rest
                if n:
                    snap = _memory(ptr, n).copy()
                    self.held.append(snap)
                    self.reqs.append(comm.mpi.Isend([snap, _MPI.BYTE], dest=peer, tag=comm.TAG))
            elif kind == "recv":
                peer, ptr, n = rest
                if n:
                    staging = np.empty(n, np.uint8)
                    self.land.append((ptr, staging))
                    self.reqs.append(comm.mpi.Irecv([staging, _MPI.BYTE], source=peer, tag=comm.TAG))
            else:
                send, recv, n = rest
                snap, staging = _memory(send, n).copy(), np.empty(n * comm.mpi.Get_size(), np.uint8)
                self.held.append(snap)
                self.land.append((recv, staging))
                self.reqs.append(comm.mpi.Iallgather([snap, _MPI.BYTE], [staging, _MPI.BYTE]))

    def test(self):
        return not self.reqs or MPI.Request.Testall(self.reqs)

    def complete(self):
        for ptr, staging in self.land:
            _memory(ptr, staging.nbytes)[...] = staging
        self.held = self.land = self.reqs = self.keep = None


class Stream:
    """A stream of the fake device (``cupy.cuda.Stream``, ``ExternalStream``)."""

    def __init__(self, null=False, non_blocking=False, ptr=None, device_id=None, *, _eager=None, _name=None,
                 _register=True):
        d = DEVICE
        d.count += 1
        self.id = d.count
        self.ptr = 0 if null else (int(ptr) if ptr is not None else 0x5000 + self.id)
        self.eager = (null or ptr is not None) if _eager is None else _eager
        self.name = _name or ("null" if null else f"{'external' if ptr is not None else 'comm'}#{self.id}")
        self.clock = {self.id: 0}
        self.queue = deque()
        self.stalled = False  # queued work with a stopped peer: what follows never completes
        if _register:
            d.streams[self.ptr] = self

    def __repr__(self):
        return f"<fake stream {self.name}>"

    # -- CuPy's interface -------------------------------------------------------------------

    def record(self, event=None):
        event = Event() if event is None else event
        event._record = DEVICE.record(self)
        return event

    def wait_event(self, event):
        DEVICE.wait(self, event._record)

    def synchronize(self):
        DEVICE.sync(self)

    @property
    def done(self):
        return DEVICE.pump(self) and not self.queue

    def use(self):
        DEVICE.current[-1] = self
        return self

    def __enter__(self):
        DEVICE.current.append(self)
        return self

    def __exit__(self, *exc):
        DEVICE.current.pop()
        return False


class Event:
    """``cupy.cuda.Event``: complete until recorded, then when its stream reaches it."""

    def __init__(self, block=False, disable_timing=False, interprocess=False):
        self._record = None

    def record(self, stream=None):
        (stream or DEVICE.current[-1]).record(self)

    @property
    def done(self):
        return DEVICE.query(self._record)

    def synchronize(self):
        DEVICE.sync_record(self._record)


class FakeDevice:
    """One process's fake GPU: its streams, the current-stream stack, the policy, the
    host's clock and the sanitizer. ``on_sync`` is called at each host wait (the fake CuPy
    counts them)."""

    def __init__(self):
        self.count = 0
        self.streams = {}
        self.policy, self.seed, self.rng = "late", 0, random.Random(0)
        self.host, self.hoststream = {}, None
        self.sanitizer = Sanitizer()
        self.on_sync = lambda: None
        self.arrays = {}    # pointer -> (lo, hi) of the array ``data`` last gave it for
        self.allocs = []    # sorted (lo, hi) of live allocations
        self.owners = {}    # lo -> a weak reference to the allocation's array
        self.views = {}     # lo -> [(lo, hi), the stream it was made on, device arrays over it]
        self.frees = []     # ((lo, hi), stream, place) freed since the last operation
        self.requests = {}  # id of an MPI request -> (it, the stream its transfer is on)
        self.null = None
        self.current = []
        self._pumping = set()

    def reset(self, policy="late", seed=0):
        """A test starts: ``policy`` (and ``seed``) from now on, no race found yet, the null
        stream current. Streams stay (a cached plan keeps its comm stream), with no work
        queued: every phase ends with ``finish``'s wait."""
        if policy not in POLICIES:
            raise ValueError(f"fake device: policy: expected one of {POLICIES}, got {policy!r}")
        self.policy, self.seed, self.rng = policy, seed, random.Random(seed)
        self.sanitizer.reset()
        if self.null is None:
            self.null = Stream(null=True)
            # The host as a stream of its own: its clock is the host's (every enqueue joins
            # it), so an access by the host is ordered after what it has seen complete.
            self.hoststream = Stream(_eager=True, _name="host", _register=False)
            self.hoststream.clock = self.host = {self.hoststream.id: 0}
        self.current = [self.null]

    # -- memory, for the sanitizer ----------------------------------------------------------

    def allocated(self, a):
        """A new array's bytes: its allocation is a write on the current stream (CuPy's
        pool hands out memory in the current stream's order). Its freeing is one too, on
        the same stream, when the last device array over it goes (``_view_gone``)."""
        root = a
        while isinstance(root.base, np.ndarray):
            root = root.base
        lo = root.ctypes.data
        hi = lo + root.nbytes
        if hi > lo:
            # Fresh from the pool: what earlier owners of these bytes did was checked when
            # they freed them (CuPy reuses memory on the stream that freed it; NumPy, under
            # the fake, on any).
            self._check_frees()
            self.sanitizer.forget(lo, hi)
            bisect.insort(self.allocs, (lo, hi))
            self.owners[lo] = weakref.ref(root)
            self.views[lo] = [(lo, hi), self.current[-1], 0]
            self.view_made(a, root)
            weakref.finalize(root, self._gone, (lo, hi))
            self.eager([(lo, hi, True)], "a new array (memory pool)")

    def view_made(self, a, root):
        """A device array ``a`` over ``root``'s memory: the memory goes back to the pool when
        the last such array goes (CuPy's rule), though queued work may hold ``root`` longer
        (the fake keeps what a queued transfer reads or writes alive)."""
        entry = self.views.get(root.ctypes.data)
        if entry is not None and self.owners[root.ctypes.data]() is root:
            entry[2] += 1
            weakref.finalize(a, self._view_gone, root.ctypes.data, entry)

    def _view_gone(self, lo, entry):
        entry[2] -= 1
        if entry[2] == 0 and self.views.get(lo) is entry:
            del self.views[lo]
            span, stream, _ = entry
            self.frees.append((span, stream, where()))

    def _gone(self, span):
        """The memory itself is NumPy's again (it may hand it out at once)."""
        i = bisect.bisect_left(self.allocs, span)
        if i < len(self.allocs) and self.allocs[i] == span:
            del self.allocs[i]
        self.owners.pop(span[0], None)
        entry = self.views.pop(span[0], None)
        if entry is not None:  # no device array was left to say so
            self.frees.append((span, entry[1], where()))

    def _check_frees(self):
        while self.frees:
            (lo, hi), stream, place = self.frees.pop()
            self.sanitizer.access(stream, stream.clock, lo, hi, True, "memory freed to the pool (a later "
                                  "allocation may reuse it)", place)

    def _allocation(self, ptr):
        """(lo, hi) of the live allocation holding ``ptr``, or None."""
        i = bisect.bisect_right(self.allocs, (ptr, float("inf"))) - 1
        return self.allocs[i] if i >= 0 and self.allocs[i][0] <= ptr < self.allocs[i][1] else None

    def owner(self, ptr):
        """The array whose memory holds ``ptr`` (None if none of ours): queued work keeps
        it alive, as CuPy's pool does not reuse memory before the stream gets there."""
        span = self._allocation(ptr)
        ref = self.owners.get(span[0]) if span else None
        return ref() if ref is not None else None

    def span_of(self, ptr):
        """The bytes a kernel's pointer parameter stands for: those of the array whose
        ``data`` gave it, else from it to the end of its allocation."""
        got = self.arrays.get(ptr)
        if got is not None:
            return got
        span = self._allocation(ptr)
        if span is not None:
            return ptr, span[1]
        raise AssertionError(f"fake GPU: a kernel got pointer {ptr:#x}, which is no device memory the "
                             "fake CuPy handed out (a host pointer?)")

    # -- issuing work -----------------------------------------------------------------------

    def _issue(self, stream):
        """A new operation on ``stream``: after what the host has seen, one more position."""
        self._check_frees()
        _join(stream.clock, self.host)
        stream.clock[stream.id] += 1
        return stream.clock

    def eager(self, accesses, what, run=None, stream=None, place=None):
        """An operation on the current stream (or ``stream``) that runs now: its queue first,
        then the accesses ((lo, hi, write) each) checked and recorded, then ``run()``,
        whose result it returns."""
        s = stream or self.current[-1]
        if s.queue:
            self._drain(s)
        clock = self._issue(s)
        for lo, hi, write in accesses:
            self.sanitizer.access(s, clock, lo, hi, write, what, place)
        out = run() if run is not None else None
        self.tick()
        return out

    def host_access(self, lo, hi, write, what):
        """The host itself (MPI on its behalf) reads or writes bytes [lo, hi): checked as an
        operation of the host's stream. Not recorded: whatever is queued later joins the
        host's clock, so nothing can race with it afterwards."""
        self._check_frees()
        self.host[self.hoststream.id] += 1
        self.sanitizer.access(self.hoststream, self.host, lo, hi, write, what, record=False)

    def mpi_posted(self, request, lo, hi, write, what):
        """MPI reads (a send) or writes (a receive) bytes [lo, hi) from the time ``request``
        is posted until the host waits for it (``mpi_waited``): an operation of a stream of
        its own, which starts after what the host has seen, and which the host sees done
        at the wait."""
        self._check_frees()
        r = Stream(_eager=True, _name="MPI's", _register=False)
        _join(r.clock, self.host)
        r.clock[r.id] += 1
        self.sanitizer.access(r, r.clock, lo, hi, write, what)
        self.requests[id(request)] = (request, r)

    def mpi_waited(self, request):
        got = self.requests.pop(id(request), None)
        if got is not None:
            self._saw(got[1].clock)

    def host_read(self, accesses, what, run):
        """A copy to the host on the current stream, which the host waits for (``get``,
        ``item``): ``run()``'s result."""
        out = self.eager(accesses, what, run)
        self._saw(self.current[-1].clock)
        return out

    def enqueue_group(self, stream, group, accesses):
        """NCCL's work on ``stream`` (a :class:`Group`), queued; ``accesses`` (lo, hi, write,
        what, place) checked at its place in the stream."""
        clock = self._issue(stream)
        for lo, hi, write, what, place in accesses:
            self.sanitizer.access(stream, clock, lo, hi, write, what, place)
            group.keep.append(self.owner(lo))
        if group.lost:
            stream.stalled = True
        stream.queue.append(group)
        if stream.eager:
            self._drain(stream)
        self.tick()

    def record(self, stream):
        _join(stream.clock, self.host)
        rec = _Record(stream, dict(stream.clock), lost=stream.stalled)
        if stream.eager and not stream.queue:
            rec.done = True
        else:
            stream.queue.append(rec)
        self.tick()
        return rec

    def wait(self, stream, rec):
        if rec is None:
            return  # never recorded: complete
        _join(stream.clock, rec.clock)
        if not rec.done:
            stream.queue.append(_Wait(rec))
        self.tick()

    # -- running queued work ----------------------------------------------------------------

    def pump(self, stream, most=None):
        """Run ``stream``'s queue as far as it can go without waiting (at most ``most``
        entries); True when it is empty."""
        if stream in self._pumping:  # a stream waiting on one that waits on it: stop here
            return not stream.queue
        self._pumping.add(stream)
        try:
            return self._pump(stream, most)
        finally:
            self._pumping.discard(stream)

    def _pump(self, stream, most):
        q, ran = stream.queue, 0
        while q and (most is None or ran < most):
            e = q[0]
            if isinstance(e, _Wait):
                r = e.record
                if not r.done and r.stream is not stream:
                    self.pump(r.stream)
                if not r.done and not r.lost:
                    return False
            elif isinstance(e, _Record):
                e.done = True
            else:
                if e.lost:
                    return False
                if not e.posted:
                    e.post()
                    ran += 1
                    if most is not None and ran >= most:
                        return False
                if not e.test():
                    return False
                e.complete()
            q.popleft()
            ran += 1
        return not q

    def pump_all(self):
        for s in list(self.streams.values()):
            self.pump(s)

    # A host wait of the fake that lasts this long is a deadlock (of the fake, or of a
    # program the fake runs): it fails the test instead of waiting for pytest's timeout.
    # Longer than any deadline a test sets for burstmpi's watchdog to fire first.
    STUCK_S = 120.0

    def idle(self, since, what):
        """One turn of a host wait that began at ``since`` (``time.monotonic()``): every
        stream moved on, then a pause; AssertionError naming ``what`` past ``STUCK_S``."""
        self.pump_all()
        waited = time.monotonic() - since
        # 20 us at first, then 0.5 ms: ranks outnumber cores in the tests, and a rank that
        # spins takes the core its peer needs to get here.
        time.sleep(2e-5 if waited < 0.01 else 5e-4)
        if waited > self.STUCK_S:
            queued = {s.name: len(s.queue) for s in self.streams.values() if s.queue}
            raise AssertionError(f"fake GPU: {what} waited {self.STUCK_S:.0f} s (a deadlock; queued: {queued})")

    def _drain(self, stream):
        """Block until ``stream``'s queue is empty (pumping every stream meanwhile). A wait
        for an event behind a stopped peer's transfer (``_Record.lost``) is passed over, and
        so is that transfer: the real host would not block here, and the job ends at
        ``finish``'s deadline."""
        since = time.monotonic()
        while not self.pump(stream):
            head = stream.queue[0]
            if stream.stalled and isinstance(head, Group) and head.lost:
                return
            self.idle(since, f"stream {stream.name}'s queue")

    def tick(self):
        """After each call into the fake: deferred work runs as the policy says."""
        if self.policy == "early":
            self.pump_all()
        elif self.policy == "random":
            busy = [s for s in self.streams.values() if s.queue]
            if busy and self.rng.random() < 0.5:
                self.pump(self.rng.choice(busy), most=self.rng.randint(1, 3))

    # -- the host waiting -------------------------------------------------------------------

    def _saw(self, clock):
        _join(self.host, clock)
        self.sanitizer.host_saw(self.host)

    def sync(self, stream):
        """``stream.synchronize()``: everything queued on it done."""
        self.on_sync()
        self._drain(stream)
        self._saw(stream.clock)

    def sync_all(self):
        """``Device.synchronize()``."""
        self.on_sync()
        for s in list(self.streams.values()):
            self._drain(s)
            self._saw(s.clock)

    def query(self, rec):
        """``Event.done``: never blocks; counted as a wait the first time it is asked."""
        if rec is None:
            return True
        if not rec.counted:
            rec.counted = True
            self.on_sync()
        if not rec.done:
            self.pump_all()
        if rec.done:
            self._saw(rec.clock)
        return rec.done

    def sync_record(self, rec):
        """``Event.synchronize()``."""
        if rec is None:
            return
        if not rec.counted:
            rec.counted = True
            self.on_sync()
        since = time.monotonic()
        while not rec.done:
            self.idle(since, f"an event of stream {rec.stream.name}")
        self._saw(rec.clock)


DEVICE = FakeDevice()
DEVICE.reset()
