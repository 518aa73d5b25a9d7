"""Counted copies between host and device memory, and counted waits for the device.

A GPU call should cost kernels and transfers between GPUs, not trips through the host: a
copy to the host or a synchronisation stalls the device and the CPU alike, and one that
grows with the sequence or the cache is a bug. So every copy the GPU paths make between
host and device goes through :func:`to_host` or :func:`to_device`, and every wait for the
device through :func:`synchronize`; each adds to this process's counters. :func:`counting`
reads them around a piece of code (tests bound them, ``burstmpi-gpucheck`` and the decode
bench print them). Host arrays (NumPy) pass through uncounted: nothing crosses a bus.

The counters are per process and guarded by a lock (the watchdog's monitor thread may
run beside the main one); counting costs a few hundred nanoseconds a copy.
"""

import threading
from contextlib import contextmanager
from dataclasses import dataclass, fields

import numpy as np

__all__ = ["Transfers", "to_host", "to_device", "copied_to_host", "copied_to_device", "waited", "synchronize", "snapshot", "counting", "Staging"]


@dataclass
class Transfers:
    """Copies device -> host (``d2h``, and their bytes), host -> device (``h2d``), and
    waits for the device (``syncs``)."""

    d2h: int = 0
    d2h_bytes: int = 0
    h2d: int = 0
    h2d_bytes: int = 0
    syncs: int = 0

    def __sub__(self, other):
        return Transfers(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def as_dict(self):
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def __str__(self):
        return (f"{self.d2h} to host ({self.d2h_bytes} B), {self.h2d} to device ({self.h2d_bytes} B), "
                f"{self.syncs} synchronisations")


_counts = Transfers()
_lock = threading.Lock()


def _add(**delta):
    with _lock:
        for name, n in delta.items():
            setattr(_counts, name, getattr(_counts, name) + n)


def _on_host(a):
    return isinstance(a, np.ndarray) or not hasattr(a, "get")


def to_host(a, out=None):
    """``a`` (a CuPy array) copied into host memory (``out``, a NumPy array, if given);
    a NumPy array is returned as it is. The copy waits for the work queued before it."""
    if _on_host(a):
        if out is None:
            return np.asarray(a)
        out[...] = a
        return out
    _add(d2h=1, d2h_bytes=int(a.nbytes))
    return a.get() if out is None else a.get(out=out)


def to_device(xp, a):
    """``a`` as an array of ``xp`` (CuPy): a host array is copied to the current device
    (counted); an array already there, or any array when ``xp`` is NumPy, is returned as
    ``xp.asarray`` gives it."""
    if xp is not np and isinstance(a, np.ndarray):
        _add(h2d=1, h2d_bytes=int(a.nbytes))
    return xp.asarray(a)


class Staging:
    """Arrays of ``xp`` handed to code that moves arrays of ``on`` (an all-to-all over MPI
    moves host arrays): ``out`` copies to the host and ``back`` to ``xp`` where the two
    differ, counted; where they agree (NumPy, or CuPy over NCCL) both pass arrays through."""

    def __init__(self, xp, on):
        self.xp, self.staged = xp, on is not xp

    def out(self, x):
        return to_host(x) if self.staged else x

    def back(self, x):
        return to_device(self.xp, x) if self.staged else x


def copied_to_host(nbytes):
    """Count a copy to the host made another way (torch's ``.cpu()``, JAX's ``__array__``):
    burstmpi asked for it, so it is burstmpi's cost too."""
    _add(d2h=1, d2h_bytes=int(nbytes))


def copied_to_device(nbytes):
    """Count a copy to the device made another way (into an existing buffer: CuPy's
    ``ndarray.set``)."""
    _add(h2d=1, h2d_bytes=int(nbytes))


def waited():
    """Count a wait for the device that the caller makes itself (polling an event, with a
    deadline, where ``synchronize`` would block without one)."""
    _add(syncs=1)


def synchronize(waitable):
    """Wait for ``waitable`` (a CUDA stream, event or device: anything with
    ``synchronize()``), counted."""
    _add(syncs=1)
    waitable.synchronize()


def snapshot():
    """The counters so far (a copy)."""
    with _lock:
        return Transfers(**_counts.as_dict())


@contextmanager
def counting():
    """``with counting() as t:`` ... ``t`` holds what the block copied and waited for
    (filled in when the block ends, also when it raises)."""
    start, box = snapshot(), Transfers()
    try:
        yield box
    finally:
        for name, n in (snapshot() - start).as_dict().items():
            setattr(box, name, n)
