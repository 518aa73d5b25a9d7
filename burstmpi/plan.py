"""``BurstAttention``: a reusable plan that owns its ring buffers and reports what it did."""

import functools
import math
import time
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
from mpi4py import MPI

from . import ring
from .backends import get_backend
from .comm import MPITransport, private_comm
from .config import settings
from .interop import is_host, like, to_host
from .layout import Layout
from .masks import Window
from .schedule import Schedule, interaction_matrix
from .validate import agree, check_backward, check_forward, check_options

__all__ = ["BurstAttention", "PhaseStats", "Stats"]


@dataclass
class PhaseStats:
    """What one rank did in one phase of the last call.

    ``bytes_sent``/``bytes_recv`` count payload bytes this rank moved;
    ``steps_computed + steps_skipped`` is the number of ranks; ``direction`` is +1 when
    packets go to rank+1. ``compute_s`` is time inside local kernels and ``wait_s`` the
    exposed communication (time blocked on transfers); ``wall_s`` covers the whole phase.
    """

    bytes_sent: int = 0
    bytes_recv: int = 0
    steps_computed: int = 0
    steps_skipped: int = 0
    direction: int = 1
    wall_s: float = 0.0
    compute_s: float = 0.0
    wait_s: float = 0.0


@dataclass
class Stats:
    """``last_stats`` of a plan: the latest forward and backward, and the choices made.

    ``buffer_bytes`` is the memory the plan keeps for ring buffers between calls.
    """

    forward: Optional[PhaseStats] = None
    backward: Optional[PhaseStats] = None
    bwd_mode: Optional[str] = None
    backend: str = "numpy"
    transport: str = "mpi"
    buffer_bytes: int = 0

    def as_dict(self):
        return asdict(self)


@functools.lru_cache(maxsize=64)
def _interactions(layout_name, nranks, seqlen_local, lo, hi):
    """The (cached) rank interaction matrix; the schedule of every phase derives from it."""
    return interaction_matrix(Layout(layout_name, nranks, seqlen_local), Window.from_bounds(lo, hi))


class BurstAttention:
    """A reusable BurstAttention plan over the ranks of an MPI communicator.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The ranks of the ring, in rank order (default ``MPI.COMM_WORLD``). burstmpi talks
        on a private duplicate, created collectively the first time a communicator is used.
    causal : bool
        Mask keys after the query (global positions). Same as ``window=(-1, 0)``.
    window : (int, int), optional
        flash-attn sliding window ``(left, right)``: the query at global position i sees
        keys j with ``i - left <= j <= i + right``; -1 is unbounded.
    softmax_scale : float, optional
        Multiplies Q K^T; default ``1 / sqrt(head_dim)``.
    layout : {"contiguous", "zigzag", "striped"}
        How the global sequence is spread over ranks (see ``burstmpi.shard``).
    bwd_comm : {"auto", "burst", "ring"}
        What circulates in the backward: Q/dO/dQ ("burst"), K/V/dK/dV ("ring"), or
        whichever moves fewer bytes for the call ("auto"; recorded in ``last_stats``).
    backend : {"auto", "numpy", "cuda"}
        "auto" follows the arrays' device. Only "numpy" (host arrays) exists so far.

    ``forward(q, k, v)`` returns ``(out, lse)`` and ``backward(dout, q, k, v, out, lse)``
    returns ``(dq, dk, dv)``; see ``burstmpi.attention`` for shapes. Both are
    collective over ``comm``. Double buffers are allocated on first use and kept for
    calls of the same shapes; ``release()`` frees them.
    """

    def __init__(self, comm=None, *, causal=False, window=None, softmax_scale=None,
                 layout="contiguous", bwd_comm="auto", backend="auto"):
        fn = "BurstAttention"
        check_options(fn, causal=causal, window=window, softmax_scale=softmax_scale,
                      layout=layout, bwd_comm=bwd_comm)
        if backend not in ("auto", "numpy", "cuda"):
            raise ValueError(f"{fn}: backend: expected 'auto', 'numpy' or 'cuda', got {backend!r}")
        self.user_comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(self.user_comm, MPI.Intracomm):
            raise TypeError(f"{fn}: comm: expected an mpi4py intracommunicator, got {type(comm).__name__}")
        self.comm = private_comm(self.user_comm)
        self.rank, self.nranks = self.comm.Get_rank(), self.comm.Get_size()
        self.causal, self.window_arg = bool(causal), None if window is None else tuple(window)
        self.window = Window(causal, window)
        self.softmax_scale, self.layout_name = softmax_scale, layout
        self.bwd_comm, self.backend_name = bwd_comm, backend
        cfg = settings()
        if backend == "auto" and cfg.backend != "auto":
            self.backend_name = cfg.backend
        self._tiles, self._check = (cfg.tile_q, cfg.tile_k), cfg.check
        self.backend = None
        self.transport = MPITransport(self.comm)
        self._channels = {}
        self._arena = None
        self.last_stats = Stats()

    # -- plumbing shared with burstmpi.ring ---------------------------------------------

    def needs(self, mode):
        """needs[holder, owner]: does the holder compute with the owner's packet?

        The forward and "ring" bring keys to the holder's queries; "burst" brings
        queries to the holder's keys, so it reads the interaction matrix transposed.
        """
        if self.window.dense:
            return np.ones((self.nranks, self.nranks), dtype=bool)
        w = self.window
        a = _interactions(self.layout_name, self.nranks, self.layout.seqlen_local, w.lo, w.hi)
        return a.T if mode == "burst" else a

    def schedule(self, mode, packet_bytes, partial_bytes):
        return Schedule(self.needs(mode), self.rank, packet_bytes, partial_bytes)

    def channels(self, phase, direction, specs):
        """The channels of one phase, built on the plan's buffer arena.

        ``specs`` lists (class, fields, tag). Phases never run at the same time, so all
        of them share one arena as large as the largest phase needs (the forward's K/V
        double buffer and the backward's packets reuse the same memory). Channels are
        cached per phase while their shapes stay the same.
        """
        key = (direction, tuple((cls.__name__, tag, tuple((f, tuple(s), np.dtype(d).str) for f, s, d in fields))
                                for cls, fields, tag in specs))
        cached = self._channels.get(phase)
        if cached is None or cached[0] != key:
            single = self.nranks == 1
            need = sum(cls.copies(single) * ring.nbytes(fields) for cls, fields, _ in specs)
            if self._arena is None or self._arena.nbytes < need:
                self._channels.clear()  # they view the old arena; let it go
                self._arena = None
                self._arena = self.backend.alloc(need)
            offset = [0]

            def carve(nbytes):
                view = self._arena[offset[0]:offset[0] + nbytes]
                offset[0] += nbytes
                return view

            send_to = (self.rank + direction) % self.nranks
            recv_from = (self.rank - direction) % self.nranks
            chans = [cls(self.transport, fields, send_to=send_to, recv_from=recv_from, tag=tag,
                         alloc=carve, single=single)
                     for cls, fields, tag in specs]
            cached = self._channels[phase] = (key, chans)
        for c in cached[1]:
            c.bytes_sent = c.bytes_recv = 0
        return cached[1]

    @property
    def buffer_bytes(self):
        """Bytes of ring buffers this plan holds (the double buffers and partials)."""
        return 0 if self._arena is None else int(self._arena.nbytes)

    @staticmethod
    def phase_stats(sched, chan, part, timer, t_start):
        chans = [c for c in (chan, part) if c is not None]
        return PhaseStats(bytes_sent=sum(c.bytes_sent for c in chans),
                          bytes_recv=sum(c.bytes_recv for c in chans),
                          steps_computed=sched.steps_computed, steps_skipped=sched.steps_skipped,
                          direction=sched.direction, wall_s=time.perf_counter() - t_start,
                          compute_s=timer.compute, wait_s=timer.wait)

    def release(self):
        """Free the ring buffers (they are re-allocated on the next call)."""
        self._channels.clear()
        self._arena = None

    # -- the calls --------------------------------------------------------------------

    def _options(self):
        return (("causal", self.causal), ("window", self.window_arg),
                ("softmax_scale", self.softmax_scale), ("layout", self.layout_name),
                ("bwd_comm", self.bwd_comm), ("backend", self.backend_name))

    def _prepare(self, fn, arrays, check):
        """Convert and check the arguments, agree across ranks, set up per-shape state."""
        error, host, dims = None, None, None
        try:
            if self.backend_name == "cuda" or (self.backend_name == "auto"
                                               and not all(is_host(a) for a in arrays.values())):
                get_backend("cuda")
            host = {name: to_host(a, name, fn) for name, a in arrays.items()}
            dims = check(host)
        except (TypeError, ValueError, NotImplementedError) as e:
            error = e
        sig = [("nranks", self.nranks)] + list(self._options())
        if host is not None:
            sig += [(f"{n}.shape", tuple(int(s) for s in a.shape)) for n, a in host.items()]
            sig += [(f"{n}.dtype", str(a.dtype)) for n, a in host.items()]
        if self._check or error is not None:
            agree(self.comm, fn, error, sig)
        if error is not None:  # only reachable with BURSTMPI_CHECK=0
            raise error
        if self.backend is None:
            self.backend = get_backend("numpy")
            self.backend.tile_q, self.backend.tile_k = self._tiles
        self.layout = Layout(self.layout_name, self.nranks, dims[1])
        d = dims[4]
        self.scale = 1.0 / math.sqrt(d) if self.softmax_scale is None else float(self.softmax_scale)
        return host, dims

    def forward(self, q, k, v):
        """Attention of this rank's queries over the whole ring's keys: ``(out, lse)``."""
        fn = "BurstAttention.forward"
        h, dims = self._prepare(fn, {"q": q, "k": k, "v": v},
                                lambda h: check_forward(fn, h["q"], h["k"], h["v"], self.layout_name))
        out, lse, st = ring.forward(self, h["q"], h["k"], h["v"], dims)
        self.last_stats.forward, self.last_stats.buffer_bytes = st, self.buffer_bytes
        return like(out, q), like(lse, q)

    def choose_bwd_mode(self, dims, dtype):
        """The backward mode a call with these dims and dtype uses: fewest bytes moved."""
        if self.bwd_comm != "auto":
            return self.bwd_comm
        acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        cost = {}
        for mode in ("burst", "ring"):
            packet, partial = ring.packet_fields(mode, dims, dtype, acc)
            per_step = ring.nbytes(packet) + ring.nbytes(partial)
            # Ties (one rank: nothing moves) go to the smaller full step, then to "burst".
            cost[mode] = (self.schedule(mode, ring.nbytes(packet), ring.nbytes(partial)).ring_bytes,
                          per_step)
        return "burst" if cost["burst"] <= cost["ring"] else "ring"

    def backward(self, dout, q, k, v, out, lse):
        """Gradients ``(dq, dk, dv)`` of this rank's q, k, v given ``dout``."""
        fn = "BurstAttention.backward"
        arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}

        def check(h):
            lse_dtype = "float64" if np.dtype(h["q"].dtype) == np.float64 else "float32"
            return check_backward(fn, h["dout"], h["q"], h["k"], h["v"], h["out"], h["lse"],
                                  self.layout_name, lse_dtype)

        h, dims = self._prepare(fn, arrays, check)
        mode = self.choose_bwd_mode(dims, h["q"].dtype)
        dq, dk, dv, st = ring.backward(self, mode, h["dout"], h["q"], h["k"], h["v"],
                                       h["out"], h["lse"], dims)
        self.last_stats.backward, self.last_stats.bwd_mode = st, mode
        self.last_stats.buffer_bytes = self.buffer_bytes
        return like(dq, q), like(dk, k), like(dv, v)

