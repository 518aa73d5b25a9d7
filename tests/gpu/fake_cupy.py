"""A fake CuPy (and NCCL) that runs burstmpi's "cuda" path on the CPU and counts every trip
through the host: the ground truth that ``burstmpi._transfers``' counters are checked
against (tests/gpu/test_host_transfers.py).

Device arrays are :class:`DeviceArray`, a ``numpy.ndarray`` subclass, so the emulated
kernels (tests/kernel_harness.py) get real addresses through ``a.data.ptr`` as CuPy's
kernels do. Everything real CuPy does with a copy through the host (or a wait for the
device) is counted in :data:`COUNTS` (a ``burstmpi._transfers.Transfers``):

- ``get()`` / ``asnumpy``: one copy to the host, its bytes; so are ``float()``, ``int()``,
  ``bool()``, ``item()`` and ``tolist()`` (CuPy copies and waits there);
- ``asarray``/``array`` of a NumPy array: one copy to the device, its bytes; so is a NumPy
  index array in ``a[idx]`` or a NumPy value in ``a[...] = value`` (CuPy copies it
  implicitly: burstmpi must not rely on that, and the counts tell if it does);
- ``synchronize()`` of a stream, an event or a device, and the ``done`` query of an event
  (``NCCLTransport.finish`` polls it, with a deadline, where it would synchronise): one wait.

And what real CuPy refuses, this refuses: NumPy functions on device arrays
(``__array_function__``: "implicit conversion to a NumPy array is not allowed") and
ufuncs mixing device arrays with NumPy arrays. A reduction or a scalar index gives a 0-d
device array, not a NumPy scalar, so reading its value is a counted copy as in CuPy.

Why a subclass, and what that costs. The kernels need pointers into real memory, and the
ring's code treats device arrays with ndarray methods (views, reshapes, slices,
in-place arithmetic) that a subclass gets for free. But burstmpi decides "host or device"
with ``isinstance(x, numpy.ndarray)`` in a few places (``_interop.is_host``,
``_transfers._on_host``), which a subclass passes: :func:`install` patches those two
(only for :class:`DeviceArray`) for the test's duration. What a subclass cannot show is
NumPy reading a device array without asking (``np.asarray(dev)``, the buffer protocol):
NumPy takes an ndarray subclass as an ndarray, so such a read is neither refused nor
counted. burstmpi's GPU paths read device arrays on the host only through
``burstmpi._transfers.to_host`` (which calls ``get``); a new ``np.asarray`` on a device
array would slip past this fake, and real CuPy would raise on it.

``DeviceArray.__module__`` starts with "cupy" so that ``_interop.like`` takes it for a CuPy
array (it asks the array's module).

The device is asynchronous (tests/gpu/fake_device.py): kernels and array operations run on
the current stream (a stack: ``with stream``, ``ExternalStream``), after the waits queued
on it; NCCL's comm streams queue their work; the stream sanitizer checks every access.
A new array's bytes are 0xFF (NaN in every float dtype: a read of bytes nobody wrote
shows), as a pool's memory holds whatever was there.

NCCL: :class:`FakeNccl` (the ``nccl`` module's group calls, unique id, communicator
constructor and constants) and :class:`FakeNcclComm` (a communicator: ``send``/``recv``
collected in a group, queued on their stream when it closes and posted over MPI, on a
communicator of their own, when the stream gets there; ``allGather`` likewise), which read
and write device memory through its addresses, never through a host copy. The first
transfer with a peer connects to it on the host, as NCCL does. burstmpi makes its
communicators as with CuPy's NCCL (``nccl.communicator``: the unique id's broadcast, the
set-up under the deadline, kept by ``lifetime``).

A peer that stops answering (:func:`stop_peer`), for the deadline tests
(tests/gpu/test_nccl_deadline.py): one rank stops (SIGSTOP: a frozen host, which prints
and answers nothing until the launcher kills it) at its n-th NCCL set-up or group of
transfers, and the other ranks see what NCCL would show them:

- a set-up it never joins, or a first transfer with it (NCCL connects then): their
  ``NcclCommunicator`` blocks forever in an MPI call, and ``groupEnd`` in the connection's
  wait, both releasing the GIL as CuPy's NCCL calls do (``with nogil``), so the watchdog's
  thread can end the job;
- a transfer once connected: ``groupEnd`` returns (NCCL only queues the work) and the
  transfer never completes: the events recorded on its stream afterwards are never done,
  so only ``NCCLTransport.finish``'s polled deadline can see it (the kernels waiting for
  them run on, as the host would not block there).

The others know when the stopped rank stopped by counting alike: every rank's k-th group
of transfers pairs with its neighbours' k-th (as NCCL needs of the ring's groups).
"""

import os
import signal
import sys
import time
import types
from collections import Counter

import numpy as np
from mpi4py import MPI

from burstmpi._transfers import Transfers
from fake_device import DEVICE, Event, Group, Stream
from stream_sanitizer import kernel_roles, where

__all__ = ["COUNTS", "DEVICE", "DeviceArray", "FakeCupy", "FakeNccl", "FakeNcclComm", "install", "emulated",
           "reset", "stop_peer"]

COUNTS = Transfers()
# Where each counted copy and wait came from, while ``TRACE`` is true: (kind, bytes, the
# caller's file:line in burstmpi) - to find an uncounted one.
TRACE = False
WHERE = []


def reset():
    """Zero :data:`COUNTS` (and forget :data:`WHERE`)."""
    for name in COUNTS.as_dict():
        setattr(COUNTS, name, 0)
    WHERE.clear()


def _trace(kind, nbytes):
    if TRACE:
        import traceback

        inside = [f"{f.filename.split('burstmpi/')[-1]}:{f.lineno}" for f in traceback.extract_stack()[:-2]
                  if "/burstmpi/" in f.filename and "/tests/" not in f.filename]
        WHERE.append((kind, int(nbytes), inside[-3:]))


def _d2h(nbytes):
    COUNTS.d2h += 1
    COUNTS.d2h_bytes += int(nbytes)
    _trace("d2h", nbytes)


def _h2d(nbytes):
    COUNTS.h2d += 1
    COUNTS.h2d_bytes += int(nbytes)
    _trace("h2d", nbytes)


def _is_host_array(x):
    return isinstance(x, np.ndarray) and not isinstance(x, DeviceArray)


def _base(x):
    """A device array as a plain ndarray view (for NumPy to work on), anything else as is."""
    return x.view(np.ndarray) if isinstance(x, DeviceArray) else x


def _dev(x):
    """NumPy's result as device arrays (0-d for scalars, as CuPy gives them)."""
    if isinstance(x, tuple):
        return tuple(_dev(y) for y in x)
    if isinstance(x, np.ndarray):
        return x if isinstance(x, DeviceArray) else x.view(DeviceArray)
    if isinstance(x, np.generic):
        return np.asarray(x).view(DeviceArray)
    return x


def _basic(key):
    """Whether an index (``_index``'s) is NumPy's basic indexing: a view, no copy."""
    parts = key if isinstance(key, tuple) else (key,)
    return all(p is None or p is Ellipsis or isinstance(p, (slice, int, np.integer)) for p in parts)


def _index(key):
    """``key`` with device arrays as plain views; a NumPy index array is copied to the
    device implicitly by CuPy: counted."""
    parts = key if isinstance(key, tuple) else (key,)
    out = []
    for p in parts:
        if _is_host_array(p) and p.ndim > 0:
            _h2d(p.nbytes)
        out.append(_base(p))
    return tuple(out) if isinstance(key, tuple) else out[0]


def _span(a):
    """The bytes an array (a view: any strides) touches, as (lo, hi)."""
    if a.size == 0:
        return 0, 0
    lo = hi = a.ctypes.data
    for n, st in zip(a.shape, a.strides):
        if st < 0:
            lo += st * (n - 1)
        else:
            hi += st * (n - 1)
    return lo, hi + a.itemsize


def _root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _touch(reads=(), writes=()):
    """(lo, hi, write) of the device arrays among ``reads`` and ``writes``."""
    return ([(*_span(a), False) for a in reads if isinstance(a, DeviceArray)]
            + [(*_span(a), True) for a in writes if isinstance(a, DeviceArray)])


def _new(x, *sources):
    """``x`` (NumPy's result) as device arrays; one with memory of its own (none of
    ``sources``') is a new allocation (``FakeDevice.allocated``)."""
    x = _dev(x)
    roots = {id(_root(a)) for a in sources if isinstance(a, np.ndarray)}
    for y in (x if isinstance(x, tuple) else (x,)):
        if isinstance(y, DeviceArray) and id(_root(y)) not in roots:
            DEVICE.allocated(y)
    return x


def _op(what, reads=(), writes=(), run=None):
    """An array operation on the current stream (its accesses checked by the sanitizer)."""
    return DEVICE.eager(_touch(reads, writes), what, run)


class _Pointer:
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class DeviceArray(np.ndarray):
    """An array in (fake) device memory: see the module docstring."""

    def __dlpack_device__(self):
        return (2, 0)  # kDLCUDA, device 0

    def __array_finalize__(self, obj):
        # Every device array over an allocation counts: its memory goes back to the pool
        # when the last one goes (``FakeDevice.view_made``).
        DEVICE.view_made(self, _root(self))

    @property
    def data(self):
        """The address, as CuPy's ``a.data.ptr``; a kernel given it touches this array's
        bytes (the sanitizer's span of a pointer parameter)."""
        ptr = self.ctypes.data
        DEVICE.arrays[ptr] = _span(self)
        return _Pointer(ptr)

    @property
    def device(self):
        return FakeCupy.cuda.Device(0)

    # -- copies to the host (counted) ---------------------------------------------------

    def _to_host(self, nbytes, what, run, out=None):
        _d2h(nbytes)
        host = [(*_span(out), True)] if out is not None else []  # the stream writes host memory
        return DEVICE.host_read(_touch([self]) + host, what, run)

    def get(self, stream=None, order="C", out=None, blocking=True):
        base = self.view(np.ndarray)
        if out is None:
            return self._to_host(self.nbytes, "get()", lambda: np.array(base, order=order, copy=True))
        return self._to_host(self.nbytes, "get(out=)", lambda: out.__setitem__(Ellipsis, base) or out, out)

    def set(self, arr, stream=None):
        """A copy from host memory on the current stream: it reads ``arr`` there (from pinned
        memory CuPy's copy is asynchronous: the host must not refill ``arr`` before it ran)."""
        _h2d(np.asarray(arr).nbytes)
        host = [(*_span(arr), False)] if _is_host_array(arr) else []
        DEVICE.eager(_touch(writes=[self]) + host, "set() (a copy from the host)",
                     lambda: self.view(np.ndarray).__setitem__(Ellipsis, arr))

    def item(self, *args):
        return self._to_host(self.itemsize, "item()", lambda: self.view(np.ndarray).item(*args))

    def tolist(self):
        return self._to_host(self.nbytes, "tolist()", lambda: self.view(np.ndarray).tolist())

    def __float__(self):
        return self._to_host(self.itemsize, "float()", lambda: float(self.view(np.ndarray)))

    def __int__(self):
        return self._to_host(self.itemsize, "int()", lambda: int(self.view(np.ndarray)))

    def __index__(self):
        return self._to_host(self.itemsize, "an index", lambda: self.view(np.ndarray).__index__())

    def __bool__(self):
        return self._to_host(self.itemsize, "bool()", lambda: bool(self.view(np.ndarray)))

    def fill(self, value):
        _op("fill()", writes=[self], run=lambda: self.view(np.ndarray).fill(value))

    def copy(self, order="C"):
        return _new(_op("copy()", reads=[self], run=lambda: self.view(np.ndarray).copy(order)))

    def astype(self, dtype, order="K", casting="unsafe", subok=True, copy=True):
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        return _new(_op("astype()", reads=[self],
                        run=lambda: self.view(np.ndarray).astype(dtype, order=order, casting=casting)))

    def __repr__(self):  # no copy: tests print what failed
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype})"

    __str__ = __repr__

    # -- what CuPy refuses or copies implicitly -----------------------------------------

    def __array_function__(self, func, types, args, kwargs):
        raise TypeError(f"fake CuPy: numpy.{func.__name__} on a device array: implicit conversion to a "
                        "NumPy array is not allowed (use get())")

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        for x in inputs:
            if _is_host_array(x):
                raise TypeError(f"fake CuPy: {ufunc.__name__}: a NumPy array beside a device array "
                                "(implicit conversion is not allowed)")
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_base(o) for o in out)
        result = _op(f"numpy.{ufunc.__name__}", reads=inputs, writes=out or (),
                     run=lambda: getattr(ufunc, method)(*(_base(x) for x in inputs), **kwargs))
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _new(result)

    def __getitem__(self, key):
        key = _index(key)
        if _basic(key):  # a view (or one element's): nothing runs on the device
            return _dev(np.ndarray.__getitem__(self, key))
        return _new(_op("an indexed copy", reads=[self], run=lambda: np.ndarray.__getitem__(self, key)))

    def _copy_or_view(self, name, *args, **kwargs):
        """``reshape``, ``ravel``, ``flatten``: a view where NumPy can make one, else a copy
        that runs on the device (CuPy's likewise)."""
        run = lambda: getattr(self.view(np.ndarray), name)(*args, **kwargs)
        got = run()
        if name != "flatten" and _root(got) is _root(self):
            return _dev(got)
        # A copy: made again once the stream's queued waits are met (``_op``).
        return _new(_op(f"{name}() (a copy)", reads=[self], run=run))

    def reshape(self, *shape, order="C"):
        return self._copy_or_view("reshape", *shape, order=order)

    def ravel(self, order="C"):
        return self._copy_or_view("ravel", order)

    def flatten(self, order="C"):
        return self._copy_or_view("flatten", order)

    def __setitem__(self, key, value):
        if _is_host_array(value) and value.ndim > 0:
            _h2d(value.nbytes)
        key = _index(key)
        try:
            target = np.ndarray.__getitem__(self, key)
        except (IndexError, TypeError):
            target = self
        if not isinstance(target, np.ndarray) or _root(target) is not _root(self):
            target = self  # an element, or an advanced index: count the array written
        _op("an assignment", reads=[value], writes=[target],
            run=lambda: np.ndarray.__setitem__(self, key, _base(value)))

def _reduction(name):
    def method(self, *args, **kwargs):
        return _new(_op(f"{name}()", reads=[self], run=lambda: getattr(self.view(np.ndarray), name)(*args, **kwargs)))
    method.__name__ = name
    return method


# ndarray methods that would return NumPy scalars: 0-d device arrays, as CuPy's
for _name in ("all", "any", "sum", "min", "max", "mean", "prod", "argmax", "argmin"):
    setattr(DeviceArray, _name, _reduction(_name))
del _name

DeviceArray.__module__ = "cupy_fake"  # ``_interop._is_cupy`` asks the module's name


# -- the array module --------------------------------------------------------------------------

def _refuse_host(fn, args):
    for a in args:
        if _is_host_array(a):
            raise TypeError(f"fake CuPy: {fn}: expected device arrays, got a NumPy array (implicit "
                            "conversion is not allowed)")


def asarray(a, dtype=None, order=None):
    if isinstance(a, DeviceArray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    host = np.asarray(a, dtype=dtype, order=order)
    if _is_host_array(a):
        _h2d(host.nbytes)  # lists and scalars also travel, but burstmpi hands arrays
    return _new(np.array(host, copy=True))


def array(a, dtype=None, copy=True, order="K"):
    if isinstance(a, DeviceArray):
        return _new(_op("array()", reads=[a],
                        run=lambda: np.array(a.view(np.ndarray), dtype=dtype, copy=True, order=order)))
    if _is_host_array(a):
        _h2d(a.nbytes)
    return _new(np.array(a, dtype=dtype, copy=True, order=order))


def ascontiguousarray(a, dtype=None):
    _refuse_host("ascontiguousarray", [a])
    return _new(_op("ascontiguousarray()", reads=[a], run=lambda: np.ascontiguousarray(_base(a), dtype=dtype)), a)


def asnumpy(a, stream=None, order="C", out=None):
    if isinstance(a, DeviceArray):
        return a.get(out=out)
    return np.asarray(a)


def _poisoned(x):
    """New memory as CuPy's pool hands it out: whatever was there. Here all bytes 0xFF (NaN
    in every float dtype), so a read of bytes nobody wrote shows in the results."""
    x.reshape(-1, order="A").view(np.uint8)[...] = 0xFF  # a fresh array is contiguous: a view
    return x


def _maker(name):
    def make(*args, **kwargs):
        got = getattr(np, name)(*args, **kwargs)
        return _new(_poisoned(got) if name == "empty" and got.size else got)
    make.__name__ = name
    return make


def _on_device(name):
    """A NumPy function over device arrays only (CuPy's refuses NumPy arrays)."""
    def run(*args, **kwargs):
        flat = [y for x in args for y in (x if isinstance(x, (list, tuple)) else [x])]
        _refuse_host(name, flat)
        conv = [[_base(y) for y in x] if isinstance(x, (list, tuple)) else _base(x) for x in args]
        run = lambda: getattr(np, name)(*conv, **{k: _base(v) for k, v in kwargs.items()})
        if name in _VIEWS:
            return _dev(run())
        out = kwargs.get("out")
        outs = list(out) if isinstance(out, tuple) else [out] if out is not None else []
        result = _op(f"cupy.{name}", reads=flat + [v for k, v in kwargs.items() if k != "out"], writes=outs, run=run)
        return out if out is not None else _new(result, *flat)
    run.__name__ = name
    return run


_VIEWS = ("broadcast_to", "moveaxis", "flip")  # views: nothing runs on the device


def _like(name):
    def make(a, *args, **kwargs):
        got = getattr(np, name)(_base(a), *args, **kwargs)
        return _new(_poisoned(got) if name == "empty_like" and got.size else got)
    make.__name__ = name
    return make


# -- streams, events, devices ------------------------------------------------------------------

def _sync():
    COUNTS.syncs += 1
    _trace("sync", 0)


DEVICE.on_sync = _sync  # every host wait of the fake device is counted


def _external(ptr, device_id=None):
    """``cupy.cuda.ExternalStream``: the stream of another framework (JAX's, torch's),
    one fake stream per pointer, eager as the null stream."""
    return DEVICE.streams.get(int(ptr)) or Stream(ptr=ptr)


class Device:
    """Device ``id`` (one per rank: ``pci_bus_id`` differs, so NCCL is chosen)."""

    def __init__(self, device=0):
        self.id = int(device)
        self.attributes = {"MaxSharedMemoryPerBlockOptin": 227 * 1024}
        self.compute_capability = "90"

    @property
    def pci_bus_id(self):
        return f"0000:{MPI.COMM_WORLD.Get_rank():02x}:00.0"

    def use(self):
        pass

    def synchronize(self):
        DEVICE.sync_all()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _Runtime:
    @staticmethod
    def getDeviceCount():
        return 1

    @staticmethod
    def getDeviceProperties(device):
        return {"name": b"fake GPU (CPU emulator)", "major": 9, "minor": 0}


def _pinned(nbytes):
    return np.empty(nbytes, np.uint8).data  # a buffer np.frombuffer takes (``_interop.cupyx_pinned``)


_cuda = types.SimpleNamespace(Device=Device, Stream=Stream, Event=Event, ExternalStream=_external, runtime=_Runtime,
                              get_current_stream=lambda device=None: DEVICE.current[-1],
                              alloc_pinned_memory=_pinned)


class _FakeCupy(types.ModuleType):
    """The fake ``cupy`` module: array functions return :class:`DeviceArray`; dtypes are
    NumPy's."""

    ndarray = DeviceArray
    cuda = _cuda

    def __init__(self):
        super().__init__("cupy_fake")
        for name in ("empty", "zeros", "ones", "full", "arange"):
            setattr(self, name, _maker(name))
        for name in ("empty_like", "zeros_like", "ones_like", "full_like"):
            setattr(self, name, _like(name))
        for name in ("stack", "concatenate", "where", "maximum", "minimum", "exp", "log", "isfinite",
                     "isnan", "take", "broadcast_to", "moveaxis", "flip", "searchsorted", "cumsum",
                     "nonzero", "argsort", "sort", "bitwise_xor", "count_nonzero"):
            setattr(self, name, _on_device(name))
        self.asarray, self.array, self.asnumpy = asarray, array, asnumpy
        self.ascontiguousarray = ascontiguousarray
        self.from_dlpack = lambda x: x if isinstance(x, DeviceArray) else asarray(x)

    def __getattr__(self, name):  # dtypes and constants: NumPy's
        value = getattr(np, name)
        if isinstance(value, type) and issubclass(value, np.generic) or name in ("dtype", "inf", "nan", "newaxis"):
            return value
        if isinstance(value, np.ufunc):  # on device arrays only, as CuPy's
            return _on_device(name)
        raise AttributeError(f"fake CuPy has no {name!r} (add it to tests/gpu/fake_cupy.py if burstmpi needs it)")


FakeCupy = _FakeCupy()


# -- NCCL -------------------------------------------------------------------------------------

STOP = None          # (world rank, "init" or "group", n): the rank that stops, where (``stop_peer``)
_REACHED = Counter()  # this process's NCCL set-ups and groups of transfers so far


def stop_peer(rank, at, n):
    """From now on, world rank ``rank`` stops answering at its ``n``-th ``at`` ("init":
    an NCCL communicator's set-up over 2+ ranks; "group": a group of transfers), and the
    other ranks see it as NCCL would (the module docstring). Call it on every rank alike."""
    global STOP
    if at not in ("init", "group") or n < 1:
        raise ValueError(f"stop_peer: expected at 'init' or 'group' and n >= 1, got {at!r}, {n!r}")
    STOP = (int(rank), at, int(n))
    _REACHED.clear()


def _reach(at):
    """Count this process's ``at`` ("init" or "group"); the stopping rank stops at its n-th.
    Returns the count."""
    _REACHED[at] += 1
    k = _REACHED[at]
    if STOP is not None and STOP[0] == MPI.COMM_WORLD.Get_rank() and STOP[1:] == (at, k):
        # The wall-clock time lets a test measure how long the job outlives its peer.
        sys.stderr.write(f"fake NCCL: rank {STOP[0]} stops answering (SIGSTOP) at its {at} #{k} at "
                         f"{time.time():.3f}\n")
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)
    return k


def _world(comm, peer):
    return MPI.Group.Translate_ranks(comm.Get_group(), [peer], MPI.COMM_WORLD.Get_group())[0]


class FakeNccl:
    """The ``cupy.cuda.nccl`` names burstmpi uses: a group collects the communicators'
    sends and receives, run together when it closes; ``NcclCommunicator`` makes a
    :class:`FakeNcclComm` over the MPI communicator whose NCCL set-up is in progress
    (``bootstrap``: set by ``install``'s ``communicator``, as NCCL's bootstrap reaches the
    ranks that got the unique id)."""

    NCCL_UINT8 = 7
    _open = None
    bootstrap = None

    @staticmethod
    def get_unique_id():
        return bytes(range(128))

    @classmethod
    def NcclCommunicator(cls, ndev, uid, rank):
        comm = cls.bootstrap
        if comm is None or (comm.Get_size(), comm.Get_rank()) != (ndev, rank) or len(uid) != 128:
            raise RuntimeError(f"fake NCCL: NcclCommunicator({ndev}, <{len(uid)} bytes>, {rank}) outside "
                               "nccl.communicator's set-up (install the fake with install())")
        return FakeNcclComm(comm)

    @classmethod
    def groupStart(cls):
        if cls._open is not None:
            raise RuntimeError("fake NCCL: groups do not nest here")
        cls._open = []

    @classmethod
    def groupEnd(cls):
        """Connect to the peers met for the first time (on the host: both sides' k-th group
        meet), then queue the group's work on its streams (``fake_device.Group``)."""
        ops, cls._open = cls._open, None
        if not ops:
            return
        k = _reach("group")
        # Once connected to a peer that stopped, NCCL only queues the transfer: it never
        # completes, and nothing on the host blocks (``finish`` must see it).
        lost = {id(op) for op in ops if op[0] != "allgather" and STOP is not None and STOP[1] == "group"
                and k >= STOP[2] and _world(op[1].mpi, op[2]) == STOP[0] and op[2] in op[1].connected}
        _connect([(op[1], op[2]) for op in ops if op[0] != "allgather"])
        for stream in dict.fromkeys(op[-1] for op in ops):
            mine = [op for op in ops if op[-1] is stream]
            group = Group([op[:-2] for op in mine], lost=any(id(op) in lost for op in mine))
            DEVICE.enqueue_group(stream, group, [a for op in mine for a in _accesses(op)])


def _accesses(op):
    """The sanitizer's accesses of an NCCL operation (lo, hi, write, what, place)."""
    kind, comm, *rest, place, stream = op
    if kind == "allgather":
        send, recv, n = rest
        return [(send, send + n, False, "ncclAllGather (its input)", place),
                (recv, recv + n * comm.mpi.Get_size(), True, "ncclAllGather (its output)", place)]
    peer, ptr, n = rest
    what = f"NCCL {kind} {'to' if kind == 'send' else 'from'} rank {peer}"
    return [(ptr, ptr + n, kind == "recv", what, place)]


def _connect(pairs):
    """NCCL connects to a peer at the first transfer with it, on the host: a handshake both
    sides' groups make, waited for while every stream moves on (a peer that never comes
    holds this forever, the GIL released in the pauses, as in ncclGroupEnd)."""
    new = [(c, p) for c, p in dict.fromkeys(pairs) if p not in c.connected]
    if not new:
        return
    token = np.zeros(1, np.uint8)
    reqs = [r for c, p in new for r in (c.mpi.Isend([token, 0, MPI.BYTE], dest=p, tag=c.TAG + 1),
                                        c.mpi.Irecv([np.zeros(1, np.uint8), 0, MPI.BYTE], source=p, tag=c.TAG + 1))]
    since = time.monotonic()
    while not MPI.Request.Testall(reqs):
        if STOP is None:
            DEVICE.idle(since, "NCCL's connection to a peer")
        else:  # a stopped peer holds this until the watchdog ends the job
            DEVICE.pump_all()
            time.sleep(2e-5)
    for c, p in new:
        c.connected.add(p)


class FakeNcclComm:
    """An NCCL communicator over ``comm`` (an MPI communicator: a duplicate of its own,
    so its messages never match burstmpi's). Transfers move device memory, queued on
    their stream (``fake_device``). Its set-up is collective over ``comm``, as NCCL's
    (blocking in MPI_Comm_dup for a rank that never comes, the GIL released)."""

    TAG = 7

    def __init__(self, comm):
        if comm.Get_size() > 1:
            _reach("init")
        self.mpi = comm.Dup()
        # The peers connected by a first transfer (None: every rank, by an allgather). Kept
        # per communicator: a set of ids would take a new communicator at a freed one's
        # address for connected, on one rank and not on its peer.
        self.connected = set()

    def _queued(self, op):
        if FakeNccl._open is None:
            FakeNccl.groupStart()
            FakeNccl._open.append(op)
            FakeNccl.groupEnd()
        else:
            FakeNccl._open.append(op)

    def send(self, ptr, nbytes, dtype, peer, stream):
        self._queued(("send", self, peer, ptr, nbytes, where(), DEVICE.streams[stream]))

    def recv(self, ptr, nbytes, dtype, peer, stream):
        self._queued(("recv", self, peer, ptr, nbytes, where(), DEVICE.streams[stream]))

    def allGather(self, send, recv, nbytes, dtype, stream):
        if None not in self.connected:  # connected to every rank at the first one
            req, since = self.mpi.Ibarrier(), time.monotonic()
            while not req.Test():
                DEVICE.idle(since, "NCCL's connection to every rank")
            self.connected.add(None)
        self._queued(("allgather", self, send, recv, nbytes, where(), DEVICE.streams[stream]))

    def check_async_error(self):
        pass

    def abort(self):
        pass

    destroyed = 0  # destroy() calls, over every communicator (NCCL's lifetime's test counts them)

    def destroy(self):
        """Free the duplicate, as NCCL frees its resources (collective over ``comm``: burstmpi
        destroys at its state's teardown, which every rank reaches alike)."""
        if self.mpi != MPI.COMM_NULL:
            self.mpi.Free()
            FakeNcclComm.destroyed += 1


# -- installing it where burstmpi looks ------------------------------------------------------------

ROLES = kernel_roles()  # kernel -> (True for a const pointer parameter, ...), from cuda/*.cu


def launched(spec, run):
    """A kernel launch on the current stream: each pointer parameter read (``const`` in
    cuda/*.cu) or written, over the bytes of the array it was taken from."""
    name = spec.kernel.split("<")[0]
    roles = ROLES.get(name)
    ptrs = [v for kind, v in spec.args if kind == "p"]
    if roles is None or len(roles) != len(ptrs):
        raise AssertionError(f"fake GPU: kernel {spec.kernel}: {len(ptrs)} pointer arguments, but cuda/*.cu "
                             f"declares {None if roles is None else len(roles)}")
    accesses = [(*DEVICE.span_of(p), not const) for p, const in zip(ptrs, roles) if p]
    DEVICE.eager(accesses, f"kernel {name}", run)


class _Pumping:
    """``MPI`` for the watchdog's waits: each test of their requests moves the fake
    device's streams on first, as a host wait of a real program leaves the GPU running."""

    class Request:
        @staticmethod
        def Testall(requests):
            DEVICE.pump_all()
            return MPI.Request.Testall(requests)

    def __getattr__(self, name):
        return getattr(MPI, name)


def _host_mpi(monkeypatch):
    """MPI's transfers read and write memory for the host: device buffers handed to a
    CUDA-aware MPI, and the host copies of the staged transport. A nonblocking transfer
    touches its buffer from its post until the host waits for it
    (``FakeDevice.mpi_posted``, ``mpi_waited``); a blocking collective, while it runs
    (``FakeDevice.host_access``): MPI must not read what a stream still writes, nor
    overwrite what a stream still reads (a copy from pinned memory), and no stream may
    touch a buffer MPI has not finished with."""
    from burstmpi._transport import mpi

    def wrap(cls, name, write):
        real = getattr(cls, name)

        def call(self, buf, peer, tag):
            req = real(self, buf, peer, tag)
            host = getattr(req, "host", buf)  # a staged request's host copy
            if isinstance(host, np.ndarray):
                DEVICE.mpi_posted(getattr(req, "req", req), *_span(host), write,
                                  f"MPI {'Irecv into' if write else 'Isend from'} "
                                  f"{'device' if isinstance(host, DeviceArray) else 'host'} memory")
            return req

        call.__wrapped__ = real  # a mutation test finds burstmpi's own function behind it
        monkeypatch.setattr(cls, name, call)

    for cls in (mpi.MPITransport, mpi.StagedMPITransport):
        wrap(cls, "isend", False)
        wrap(cls, "irecv", True)
    real_wait = mpi.MPITransport.wait

    def wait(self, requests, peers=()):
        done = real_wait(self, requests, peers)
        for r in requests:
            DEVICE.mpi_waited(r)
        return done

    wait.__wrapped__ = real_wait
    monkeypatch.setattr(mpi.MPITransport, "wait", wait)
    # A blocking collective (on host copies, or device buffers under CUDA-aware MPI, which
    # calls MPI itself): checked as of its return.
    for cls in (mpi.MPITransport, mpi.DeviceMPITransport):
        real_gather = cls.allgather

        def allgather(self, send, recv, _real=real_gather):
            done = _real(self, send, recv)
            for buf, write in ((send, False), (recv, True)):
                where = " of device memory" if isinstance(buf, DeviceArray) else ""
                DEVICE.host_access(*_span(buf), write, f"MPI's allgather{where} ({'output' if write else 'input'})")
            return done

        allgather.__wrapped__ = real_gather
        monkeypatch.setattr(cls, "allgather", allgather)


def install(monkeypatch, backend_class, policy="late", seed=0):
    """Make burstmpi's "cuda" path run on the fake, with ``backend_class(cupy, device)`` as
    its backend (a ``CupyBackend`` whose launches run on the emulator: each goes through
    the fake device, :func:`launched`) and the real ``NCCLTransport`` over
    :class:`FakeNccl` as its transport; device arrays count as device memory in
    ``_interop`` and ``_transfers``. The device starts over with ``policy`` and ``seed``
    (``fake_device.FakeDevice.reset``). Returns the fake ``cupy``."""
    from burstmpi import _interop, _runtime, _transfers
    from burstmpi._transport import mpi_library, nccl
    from burstmpi._transport.watchdog import deadline

    DEVICE.reset(policy, seed)
    monkeypatch.setattr(deadline, "MPI", _Pumping())
    _host_mpi(monkeypatch)

    class Launching(backend_class):
        def launch(self, spec):
            launched(spec, lambda: super(Launching, self).launch(spec))

    Launching.__name__ = backend_class.__name__
    backend_class = Launching

    real_is_host, real_on_host = _interop.is_host, _transfers._on_host
    is_host = lambda x: not isinstance(x, DeviceArray) and real_is_host(x)
    monkeypatch.setattr(_interop, "is_host", is_host)
    monkeypatch.setattr(_runtime, "is_host", is_host)
    monkeypatch.setattr(_transfers, "_on_host", lambda a: not isinstance(a, DeviceArray) and real_on_host(a))
    monkeypatch.setattr(_runtime, "import_cupy", lambda fn: FakeCupy)
    monkeypatch.setattr(_runtime, "CupyBackend", backend_class)
    monkeypatch.setattr(nccl, "available", lambda: True)
    monkeypatch.setattr(mpi_library, "cuda_support", lambda: True)  # the fake's MPI takes device memory
    real_communicator = getattr(nccl.communicator, "real", nccl.communicator)  # installed twice: not a fake's

    def communicator(comm, device_id, timeout=nccl.DEFAULT_TIMEOUT):
        """burstmpi's own ``communicator`` (the bootstrap, the deadline, ``lifetime``) on the fakes."""
        FakeNccl.bootstrap = comm
        try:
            return real_communicator(comm, device_id, timeout, _cupy=FakeCupy, _nccl=FakeNccl)
        finally:
            FakeNccl.bootstrap = None

    communicator.real = real_communicator
    monkeypatch.setattr(nccl, "communicator", communicator)
    real = nccl.NCCLTransport

    class Transport(real):
        def __init__(self, comm, device_id, timeout_s=300.0, *, _cupy=None, _nccl=None, _nccl_comm=None):
            super().__init__(comm, device_id, timeout_s, _cupy=FakeCupy, _nccl=FakeNccl, _nccl_comm=_nccl_comm)

    monkeypatch.setattr(nccl, "NCCLTransport", Transport)
    return FakeCupy


def emulated(monkeypatch, comm, configs, policy="late", seed=0):
    """:func:`install` with ``CupyBackend``'s launches run on the CPU emulator
    (tests/kernel_harness.py), whose library of the (dtype, d, dv) ``configs`` rank 0 of
    ``comm`` compiles once. Returns the fake ``cupy``."""
    import kernel_harness as kh
    from burstmpi._backends.cupy_backend import CupyBackend

    lib = kh.library_on_every_rank(comm, configs)

    class Emulated(CupyBackend):
        def launch(self, spec):
            kh.launch(lib, spec)

    return install(monkeypatch, Emulated, policy, seed)
