"""Host memory the CPU backend keeps from call to call: working arrays, scratch, results.

An 8K-token forward (8 heads x 128, one rank) allocates ~130 MB: the converted K and V,
the fp32 accumulator and the output; a backward ~260 MB. glibc maps every array of 32 MB
or more straight from the kernel and unmaps it on free, so allocated afresh on every call
each of those bytes is a page fault the first time it is touched: a fresh 32 MB costs
about ten times as long to fault in as reused memory takes to write, and with all of them
reused (glibc's ``MALLOC_MMAP_THRESHOLD_`` raised) an 8K causal forward ran about a fifth
faster. So, as the GPU backend gets its memory from CuPy's pool:

- ``Workspace``: named arrays the backend works in (the converted K/V blocks, the
  accumulators; a worker's tile scratch), allocated on first use, grown when a call needs
  more, kept until ``clear()``;
- ``OutputPool``: the storage of the arrays handed to the caller, taken back only when
  the caller has dropped every array that uses it, for the next call's results.

``BurstAttention.release()`` (through the backend's ``release``) frees both.
"""

import collections
import threading

import numpy as np

__all__ = ["Workspace", "OutputPool", "aligned"]

ALIGN = 64  # bytes: a cache line, and an AVX-512 vector


def _nbytes(shape, dtype):
    nbytes = dtype.itemsize
    for n in shape:
        nbytes *= n
    return nbytes


def aligned(nbytes):
    """``nbytes`` of new uint8 storage starting on a cache line. NumPy only promises 16 bytes
    (a large array comes from mmap at a page plus 16), and a tile whose every row starts 16
    bytes into a cache line splits its vector loads and stores across two."""
    raw = np.empty(nbytes + ALIGN, np.uint8)
    skip = -raw.ctypes.data % ALIGN
    return raw[skip:skip + nbytes]


class Workspace:
    """Named, cache-line aligned host arrays reused from call to call.

    ``array(slot, shape, dtype)`` returns a C-contiguous view of the slot's storage, which
    is reallocated only when a call needs more bytes than it holds. Two arrays of one slot
    are the same memory: a slot is one role at a time (the converted K of the current
    block; the query side's accumulator, the forward's and then the backward's dq), and
    whoever asks for it again is done with what it held."""

    def __init__(self):
        self._slots = {}

    def array(self, slot, shape, dtype, fill=None):
        """``shape`` of ``dtype`` in ``slot``'s storage; set to ``fill`` when given."""
        dtype = np.dtype(dtype)
        nbytes = _nbytes(shape, dtype)
        held = self._slots.get(slot)
        if held is None or held.nbytes < nbytes:
            self._slots[slot] = held = None  # the old storage goes before the new is made
            held = self._slots[slot] = aligned(max(nbytes, 1))
        x = held[:nbytes].view(dtype).reshape(shape)
        if fill is not None:
            x.fill(fill)
        return x

    @property
    def nbytes(self):
        """Bytes held."""
        return sum(x.nbytes for x in list(self._slots.values()))

    def clear(self):
        """Free everything (slots are allocated again on their next use)."""
        self._slots.clear()


class _Lease:
    """Owns one output's storage while the caller holds it: arrays made from it keep it
    alive (as their base), and when the last of them is gone the storage goes back to the
    pool it came from."""

    __slots__ = ("mem", "pool")

    def __init__(self, mem, pool):
        self.mem, self.pool = mem, pool

    @property
    def __array_interface__(self):
        return {"shape": (self.mem.nbytes,), "typestr": "|u1", "data": (self.mem.ctypes.data, False), "version": 3}

    def __del__(self):
        self.pool._give_back(self.mem)


class OutputPool:
    """Storage for the arrays the CPU backend returns (out, dq, dk, dv), recycled once the
    caller drops them.

    A caller that runs attention in a loop drops the last call's results as the next call
    makes its own; without this pool every result is fresh memory from the kernel (see the
    module's docstring: the page faults of a fresh 32 MB output cost several times the copy
    into it). An array from ``empty`` is an ordinary writeable NumPy
    array whose base owns the storage; only when no array uses it any more does the
    storage return here, so nothing the caller can still see is ever reused. The pool
    holds at most ``keep`` free blocks in all (one call's results: out, or dq, dk and dv),
    the latest given back, and hands one out only for a result of exactly its size;
    ``clear()`` frees them. Blocks under ``smallest`` bytes come from NumPy as usual: glibc
    reuses those itself."""

    def __init__(self, keep=4, smallest=1 << 20):
        self.keep, self.smallest = max(1, keep), smallest
        self._free, self._lock = [], threading.Lock()  # oldest first; under the lock
        # Storage given back by ``_Lease.__del__``, which runs on any thread at any time (the
        # cyclic GC, inside this class's own locked code too), so it only appends here.
        self._returned = collections.deque()

    def empty(self, shape, dtype):
        """A new C-contiguous, cache-line aligned array; its contents are undefined."""
        dtype = np.dtype(dtype)
        nbytes = _nbytes(shape, dtype)
        if nbytes < max(self.smallest, 1):
            return np.empty(shape, dtype)
        mem = None
        with self._lock:
            self._sort()
            for i, held in enumerate(self._free):
                if held.nbytes == nbytes:
                    mem = self._free.pop(i)
                    break
        if mem is None:
            mem = aligned(nbytes)
        return np.asarray(_Lease(mem, self)).view(dtype).reshape(shape)

    def _give_back(self, mem):
        returned = self._returned
        returned.append(mem)
        while len(returned) > self.keep:  # what waits for the next call stays bounded too
            try:
                returned.popleft()
            except IndexError:
                break

    def _sort(self):
        """Move the storage given back to the free list, keeping the latest ``keep`` (with
        the lock held)."""
        while True:
            try:
                self._free.append(self._returned.popleft())
            except IndexError:
                break
        del self._free[:max(0, len(self._free) - self.keep)]

    @property
    def nbytes(self):
        """Bytes held, free for the next results."""
        with self._lock:
            self._sort()
            return sum(m.nbytes for m in self._free)

    def clear(self):
        """Free the blocks held (results still in use come back when they are dropped)."""
        with self._lock:
            self._returned.clear()
            self._free.clear()
