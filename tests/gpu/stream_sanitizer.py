"""A stream sanitizer for the fake GPU (tests/gpu/fake_device.py): every access to device
memory is checked against the earlier conflicting accesses of other streams, and one that
no event orders after them is a race, reported with the bytes, both streams and both
places in burstmpi's code.

Order is kept with vector clocks, as PyTorch's CUDA sanitizer keeps it with its stream
sync state: each stream counts its operations; recording an event copies the stream's
clock into it; ``wait_event`` joins the event's clock into the waiting stream's; a host
synchronisation joins into the host's clock, which every later enqueue joins in turn
(work queued after the host saw X complete starts after X). An access B on stream T is
ordered after an earlier access A on stream S (A's position p in S) when T's clock at B
has S >= p. The clocks are taken when the host queues the work, not when the fake runs it,
so a race is found whatever interleaving the fake picks.

What counts as an access (the ``what`` of each report):
- a kernel's pointer parameters, read if declared ``const`` in cuda/*.cu and written
  otherwise (:func:`kernel_roles`), over the bytes of the array the pointer was taken from
  (``DeviceArray.data``: a packet's view, not the arena it lies in);
- an array operation's inputs (read) and outputs (written), a new array's bytes (written:
  CuPy's memory pool may hand a stream memory that another stream still uses);
- an NCCL send (read), receive (written) and allgather (both), at the group's place in
  the comm stream.

Records of one (bytes, stream, kind) keep only the latest (a later access on the same
stream is ordered after the earlier ones); a write drops what it covers and is ordered
after; a host synchronisation drops what it has seen complete.
"""

import re
import sys
from pathlib import Path

__all__ = ["Race", "Sanitizer", "kernel_roles", "where"]

ROOT = Path(__file__).resolve().parents[2]
_GLOBAL = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(([^)]*)\)", re.S)


def kernel_roles(folder=ROOT / "cuda"):
    """{kernel name: (True for each pointer parameter the kernel only reads, in order)},
    parsed from the ``__global__`` signatures in ``folder``'s .cu files (``const`` is read)."""
    roles = {}
    for path in sorted(folder.glob("*.cu")):
        for name, params in _GLOBAL.findall(path.read_text()):
            ptrs = [p.strip() for p in params.split(",") if "*" in p]
            roles[name] = tuple(p.startswith("const ") for p in ptrs)
    return roles


_OURS = ("fake_cupy.py", "fake_device.py", "stream_sanitizer.py")  # the fake's own frames


def where(depth=3):
    """The innermost ``depth`` frames of burstmpi's own code on the stack (else the test's),
    as ``file:line (function)``, innermost first."""
    f, ours, other = sys._getframe(1), [], None
    while f is not None and len(ours) < depth:
        name = f.f_code.co_filename
        if "/burstmpi/" in name and "/tests/" not in name:
            ours.append(f"{name.split('/burstmpi/', 1)[1]}:{f.f_lineno} ({f.f_code.co_name})")
        elif other is None and "/tests/" in name and name.rsplit("/", 1)[-1] not in _OURS:
            other = f"tests/{name.split('/tests/', 1)[1]}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return " < ".join(ours) if ours else (other or "?")


class Race(AssertionError):
    """Two accesses to the same device bytes on different streams, not ordered by events."""


class _Access:
    __slots__ = ("lo", "hi", "stream", "pos", "write", "what", "where")

    def __init__(self, lo, hi, stream, pos, write, what, place):
        self.lo, self.hi, self.stream, self.pos, self.write = lo, hi, stream, pos, write
        self.what, self.where = what, place

    def describe(self):
        kind = "write" if self.write else "read"
        return f"{kind} by {self.what} on stream {self.stream.name} (its op #{self.pos}) at {self.where}"


class Sanitizer:
    """The access records of one process's fake device; ``races`` lists what it found
    (each a :class:`Race`'s message), ``checked`` counts the accesses checked."""

    LIMIT = 20  # races kept (the first ones tell; the rest follow from them)

    def __init__(self):
        self.records = []
        self.races = []
        self.checked = 0

    def reset(self):
        self.records.clear()
        self.races.clear()

    def access(self, stream, clock, lo, hi, write, what, place=None, record=True):
        """Check, then record (unless not ``record``), an access of bytes [lo, hi) on
        ``stream`` whose clock is ``clock`` (the stream's own entry is this operation's
        position)."""
        if hi <= lo:
            return
        self.checked += 1
        place = place or where()
        keep = []
        for r in self.records:
            if r.hi <= lo or hi <= r.lo:
                keep.append(r)
                continue
            ordered = r.stream is stream or clock.get(r.stream.id, 0) >= r.pos
            if not ordered and (write or r.write) and len(self.races) < self.LIMIT:
                new = _Access(lo, hi, stream, clock[stream.id], write, what, place)
                self.races.append(f"stream race on device bytes {lo:#x}..{hi:#x} ({hi - lo} B): {new.describe()} "
                                  f"is not ordered after the {r.describe()} (bytes {r.lo:#x}..{r.hi:#x}) by any "
                                  "event")
            # A write covering an older access, and ordered after it, stands for it; so does
            # a later access of the same bytes, kind and stream.
            covered = lo <= r.lo and r.hi <= hi and ordered
            same = (r.lo, r.hi, r.stream, r.write) == (lo, hi, stream, write)
            if not ((write and covered) or same):
                keep.append(r)
        if record:
            keep.append(_Access(lo, hi, stream, clock[stream.id], write, what, place))
        self.records = keep

    def forget(self, lo, hi):
        """Bytes [lo, hi) were freed and allocated anew: their records go."""
        self.records = [r for r in self.records if r.hi <= lo or hi <= r.lo]

    def host_saw(self, host_clock):
        """The host saw everything up to ``host_clock`` complete: those records are ordered
        before whatever is queued from now on."""
        self.records = [r for r in self.records if host_clock.get(r.stream.id, 0) < r.pos]

    def check(self):
        """Raise :class:`Race` with every race found (then forget them)."""
        if self.races:
            found, self.races = self.races, []
            raise Race(f"{len(found)} stream race(s) on the fake GPU:\n  " + "\n  ".join(found))
