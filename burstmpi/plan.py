"""``BurstAttention``: a reusable plan that owns its ring buffers and reports what it did."""

import math
import time
from dataclasses import asdict, dataclass
from typing import Optional

import numpy as np
from mpi4py import MPI

from . import ring, twoway
from .backends import get_backend
from .backends.cupy_backend import CupyBackend
from .comm import MPITransport, StagedMPITransport, private_comm
from .config import settings
from .device import abort_on_device_error, import_cupy, node_rank, pick_device
from .geometry import geometry
from .interop import cupyx_pinned, is_host, like, to_device, to_host
from .masks import Window
from .schedule import Schedule
from .validate import (agree, check_backward, check_cu_seqlens, check_forward, check_options,
                       fingerprint, global_layout)

__all__ = ["BurstAttention", "PhaseStats", "Stats"]


@dataclass
class PhaseStats:
    """What one rank did in one phase of the last call.

    ``bytes_sent``/``bytes_recv`` count payload bytes this rank moved;
    ``steps_computed + steps_skipped`` is the number of ranks (``steps_computed``: the ranks
    whose blocks this rank computed with); ``direction`` is +1 when packets go to rank+1,
    -1 when they go to rank-1, and 0 on the two-way ring (``burstmpi.twoway``). ``pairs``
    counts the visible (query token, key token) pairs this rank computed (times batch and
    heads for the work done; compare ranks to measure imbalance; in a two-way backward a
    remote pair's dQ half and dK/dV half each count, on their own ranks). ``compute_s`` is time inside local kernels and ``wait_s`` the
    exposed communication (time blocked on transfers); ``wall_s`` covers the whole phase.
    """

    bytes_sent: int = 0
    bytes_recv: int = 0
    steps_computed: int = 0
    steps_skipped: int = 0
    pairs: int = 0
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


def _kernel_ready(xp, a):
    if a.flags.c_contiguous and a.data.ptr % 16 == 0:
        return a
    return xp.array(a, copy=True, order="C")


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
    bwd_comm : {"auto", "burst", "ring", "two-way"}
        What circulates in the backward: Q/dO/dQ ("burst"), K/V/dK/dV ("ring"), both K/V
        and Q/dO two ways with no gradient partial ("two-way", ``burstmpi.twoway``; from 3
        ranks), or whichever moves fewer bytes for the call ("auto"; recorded in
        ``last_stats``; it considers "two-way" only on backends where that costs no extra
        compute, i.e. the CUDA kernels). The forward takes the two-way ring by itself
        whenever it moves fewer bytes (``last_stats.forward.direction`` is then 0).
    backend : {"auto", "numpy", "cuda"}
        "auto" follows the arrays' device: GPU arrays (CuPy, or any DLPack producer on a
        CUDA device) run on burstmpi's CUDA kernels, host arrays on NumPy. "cuda" with
        host arrays copies them to the GPU and returns host arrays.
    transport : {"auto", "nccl", "mpi"}
        How GPU ring buffers travel: NCCL (one GPU per rank; bootstrapped over ``comm``),
        or MPI (host-staged, or straight from the GPU with ``BURSTMPI_CUDA_AWARE_MPI=1``;
        works with ranks sharing a GPU). "auto" takes NCCL when it is installed and every
        rank has a GPU of its own. Host arrays always use MPI. Reported in ``last_stats``.
    device : int, optional
        The CUDA device of this rank; default: node-local rank modulo the visible GPUs.

    ``forward(q, k, v, cu_seqlens=None)`` returns ``(out, lse)`` and ``backward(dout, q, k,
    v, out, lse, cu_seqlens=None)`` returns ``(dq, dk, dv)``; see ``burstmpi.attention``
    for shapes and documents (``cu_seqlens`` is per call: it changes with every batch).
    Both are collective over ``comm``. Double buffers are allocated on first use and kept for
    calls of the same shapes; ``release()`` frees them.
    """

    def __init__(self, comm=None, *, causal=False, window=None, softmax_scale=None,
                 layout="contiguous", bwd_comm="auto", backend="auto", transport="auto", device=None):
        fn = "BurstAttention"
        check_options(fn, causal=causal, window=window, softmax_scale=softmax_scale,
                      layout=layout, bwd_comm=bwd_comm)
        if backend not in ("auto", "numpy", "cuda"):
            raise ValueError(f"{fn}: backend: expected 'auto', 'numpy' or 'cuda', got {backend!r}")
        if transport not in ("auto", "nccl", "mpi"):
            raise ValueError(f"{fn}: transport: expected 'auto', 'nccl' or 'mpi', got {transport!r}")
        if transport == "nccl" and backend == "numpy":
            raise ValueError(f"{fn}: transport: 'nccl' moves GPU buffers; backend='numpy' needs 'mpi' or 'auto'")
        self.transport_name, self.device_arg = transport, device
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
        self._cuda_aware, self._nccl_timeout = cfg.cuda_aware_mpi, cfg.nccl_timeout
        self.backend = None
        self.transport = MPITransport(self.comm)
        self._channels = {}
        self._arena = None
        self.last_stats = Stats()

    # -- plumbing shared with burstmpi.ring ---------------------------------------------

    def schedule(self, mode, packet_bytes, partial_bytes):
        return Schedule(self.geometry.needs(mode), self.rank, packet_bytes, partial_bytes)

    def channels(self, phase, specs):
        """The channels of one phase, built on the plan's buffer arena.

        ``specs`` lists (class, fields, tag, direction): a channel sends to rank +
        direction and receives from rank - direction. Phases never run at the same time,
        so all of them share one arena as large as the largest phase needs (the forward's
        K/V double buffer and the backward's packets reuse the same memory). Channels are
        cached per phase while their shapes stay the same.
        """
        key = tuple((cls.__name__, tag, direction, tuple((f, tuple(s), np.dtype(d).str) for f, s, d in fields))
                    for cls, fields, tag, direction in specs)
        cached = self._channels.get(phase)
        if cached is None or cached[0] != key:
            single = self.nranks == 1
            need = sum(cls.copies(single) * ring.nbytes(fields) for cls, fields, *_ in specs)
            if self._arena is None or self._arena.nbytes < need:
                self._channels.clear()  # they view the old arena; let it go
                self._arena = None
                self._arena = self.backend.alloc(need)
            offset = [0]

            def carve(nbytes):
                view = self._arena[offset[0]:offset[0] + nbytes]
                offset[0] += nbytes
                return view

            chans = [cls(self.transport, fields, send_to=(self.rank + direction) % self.nranks,
                         recv_from=(self.rank - direction) % self.nranks, tag=tag, alloc=carve,
                         single=single)
                     for cls, fields, tag, direction in specs]
            cached = self._channels[phase] = (key, chans)
        for c in cached[1]:
            c.bytes_sent = c.bytes_recv = 0
        return cached[1]

    @property
    def buffer_bytes(self):
        """Bytes of ring buffers this plan holds (the double buffers and partials)."""
        return 0 if self._arena is None else int(self._arena.nbytes)

    def phase_stats(self, chans, owners, pairs, direction, timer, t_start):
        """A phase's ``PhaseStats``. ``owners``: the ranks whose blocks this rank computed
        with; ``pairs``: the visible pairs of those computations."""
        computed = len(set(owners))
        return PhaseStats(bytes_sent=sum(c.bytes_sent for c in chans),
                          bytes_recv=sum(c.bytes_recv for c in chans),
                          steps_computed=computed, steps_skipped=self.nranks - computed,
                          pairs=int(pairs), direction=direction, wall_s=time.perf_counter() - t_start,
                          compute_s=timer.compute, wait_s=timer.wait)

    def _finish(self):
        """End of a phase: a transport that runs asynchronously (NCCL) checks that its
        transfers completed, with a timeout, so a dead peer is an error and not a hang."""
        finish = getattr(self.transport, "finish", None)
        if finish is not None:
            finish()

    def release(self):
        """Free the ring buffers (they are re-allocated on the next call)."""
        self._channels.clear()
        self._arena = None

    # -- the calls --------------------------------------------------------------------

    def _options(self):
        return (("causal", self.causal), ("window", self.window_arg),
                ("softmax_scale", self.softmax_scale), ("layout", self.layout_name),
                ("bwd_comm", self.bwd_comm), ("backend", self.backend_name),
                ("transport", self.transport_name))

    def _kind(self, arrays):
        """The backend this call runs on: "cuda" or "numpy"."""
        if self.backend is not None and self.backend.name not in ("numpy", "cuda"):
            return self.backend.name  # injected by a test
        if self.backend_name != "auto":
            return self.backend_name
        return "numpy" if all(is_host(a) for a in arrays.values()) else "cuda"

    def _prepare(self, fn, arrays, check, cu_seqlens):
        """Convert and check the arguments, agree across ranks, set up per-shape state.

        One collective (``agree``) compares every rank's arguments and tells each the
        others' local lengths; from those every rank derives the same global layout (or
        raises the same error)."""
        error, conv, dims, cu = None, None, None, None
        kind = self._kind(arrays)
        if getattr(self.backend, "name", None) != kind:
            # A first call, or a switch between host and GPU: agree on where to run before
            # the GPU set-up's collectives (a rank that disagrees then raises, not hangs).
            agree(self.comm, fn, None, [("runs on", kind)] + list(self._options()))
            if kind == "cuda":
                self._use_cuda(fn)
        try:
            if kind == "cuda" and getattr(self.backend, "xp", np) is not np:
                # The kernels copy rows with 16-byte cp.async: give them contiguous, aligned
                # arrays (a copy only for the odd strided or offset view).
                conv = {name: _kernel_ready(self.backend.xp, to_device(a, name, fn, self.backend.xp))
                        for name, a in arrays.items()}
            else:
                conv = {name: to_host(a, name, fn) for name, a in arrays.items()}
            dims = check(conv)
            cu = check_cu_seqlens(fn, cu_seqlens)
        except (TypeError, ValueError, NotImplementedError, RuntimeError) as e:
            error = e
        sig = [("nranks", self.nranks), ("runs on", kind)] + list(self._options())
        if conv is not None:
            # Local lengths may differ between ranks: the sequence axis (1, or 2 for lse)
            # is left out here and checked against the layout below.
            seq_axis = lambda n: 2 if n == "lse" else 1
            sig += [(f"{n}.shape (but the sequence axis)",
                     tuple(None if i == seq_axis(n) else int(s) for i, s in enumerate(a.shape)))
                    for n, a in conv.items()]
            sig += [(f"{n}.dtype", str(a.dtype)) for n, a in conv.items()]
        sig.append(("cu_seqlens", fingerprint(cu)))
        # BURSTMPI_CHECK=0 leaves the fingerprint out; the collective itself always runs,
        # since it carries the local lengths the layout is built from.
        lengths = agree(self.comm, fn, error, sig if self._check else [],
                        0 if dims is None else dims[1])
        if error is not None:  # only reachable with BURSTMPI_CHECK=0
            raise error
        if self.backend is None or (kind == "numpy" and self.backend.name == "cuda"):
            if self.backend is not None:  # back from the GPU: host buffers, MPI
                self.release()
                self.transport = MPITransport(self.comm)
            self.backend = get_backend("numpy")
            self.backend.tile_q, self.backend.tile_k = self._tiles
        self.last_stats.backend, self.last_stats.transport = self.backend.name, self.transport.name
        lay = global_layout(fn, "q.shape[1]", self.layout_name, self.nranks, lengths, cu)
        self.geometry = geometry(self.layout_name, self.nranks, lay.seqlen, self.window, cu)
        self.layout = self.geometry.layout
        d = dims[4]
        self.scale = 1.0 / math.sqrt(d) if self.softmax_scale is None else float(self.softmax_scale)
        return conv, dims

    def _use_cuda(self, fn):
        """Switch this plan to the GPU: device, CuPy backend and transport (collective).

        Every step that can fail on one rank only is agreed on before the next
        collective, so a rank without CuPy or without a GPU makes every rank raise
        instead of leaving the others waiting."""
        error, cupy = None, None
        try:
            cupy = import_cupy(fn)
        except (NotImplementedError, RuntimeError) as e:
            error = e
        agree(self.comm, fn, error, [])
        local = node_rank(self.comm)
        error, dev = None, None
        try:
            dev = pick_device(fn, local, cupy.cuda.runtime.getDeviceCount(), self.device_arg)
            cupy.cuda.Device(dev).use()
        except (ValueError, RuntimeError) as e:
            error = e
        agree(self.comm, fn, error, [])
        self.release()
        self.backend = CupyBackend(cupy, dev)
        self.transport = self._gpu_transport(fn, cupy, dev)

    def _gpu_transport(self, fn, cupy, dev):
        """NCCL when asked for, or when available and no two ranks share a GPU; else MPI."""
        from . import nccl

        everyone = self.comm.allgather((MPI.Get_processor_name(), cupy.cuda.Device(dev).pci_bus_id,
                                        nccl.available()))
        shared = len({(host, bus) for host, bus, _ in everyone}) < self.nranks
        ok = all(has_nccl for _, _, has_nccl in everyone)
        if nccl.choose_transport(fn, self.transport_name, ok, shared) == "nccl":
            return nccl.NCCLTransport(self.comm, dev, timeout_s=self._nccl_timeout)
        if self._cuda_aware:
            return MPITransport(self.comm)

        def to_host(buf, out):
            cupy.cuda.get_current_stream().synchronize()  # the producing kernels are done
            buf.get(out=out)

        def to_dev(host, buf):
            buf.set(host)
            cupy.cuda.get_current_stream().synchronize()  # host buffer free for the next receive

        return StagedMPITransport(self.comm, to_host, to_dev,
                                  alloc_host=lambda n: cupyx_pinned(cupy, n))

    def forward(self, q, k, v, *, cu_seqlens=None):
        """Attention of this rank's queries over the whole ring's keys: ``(out, lse)``."""
        fn = "BurstAttention.forward"
        h, dims = self._prepare(fn, {"q": q, "k": k, "v": v},
                                lambda h: check_forward(fn, h["q"], h["k"], h["v"]), cu_seqlens)
        run = twoway.forward if self._forward_two_way(dims, h["q"].dtype) else ring.forward
        with abort_on_device_error(self.comm):
            out, lse, st = run(self, h["q"], h["k"], h["v"], dims)
            self._finish()
        self.last_stats.forward, self.last_stats.buffer_bytes = st, self.buffer_bytes
        return like(out, q), like(lse, q)

    def _packet_bytes(self, mode, dims, dtype):
        acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
        packet, partial = ring.packet_fields(mode, ring.packet_dims(self, dims, ring.ROLE[mode]), dtype, acc)
        return ring.nbytes(packet), ring.nbytes(partial)

    def _forward_two_way(self, dims, dtype):
        """Does the two-way ring move fewer forward bytes than the one-way ring?"""
        if self.nranks < 3:
            return False
        packet, _ = self._packet_bytes("forward", dims, dtype)
        needs = self.geometry.needs("forward")
        return twoway.two_way_bytes(needs, packet) < self.schedule("forward", packet, 0).ring_bytes

    def choose_bwd_mode(self, dims, dtype):
        """The backward mode a call with these dims and dtype uses: fewest bytes moved."""
        if self.bwd_comm == "two-way" and self.nranks < 3:
            return "burst"  # both directions would reach the same neighbour
        if self.bwd_comm != "auto":
            return self.bwd_comm
        cost = {}
        for mode in ("burst", "ring"):
            packet, partial = self._packet_bytes(mode, dims, dtype)
            # Ties (one rank: nothing moves) go to the smaller full step, then to "burst".
            cost[mode] = (self.schedule(mode, packet, partial).ring_bytes, packet + partial)
        if self.nranks >= 3 and getattr(self.backend, "split_backward_free", False):
            kv, _ = self._packet_bytes("forward", dims, dtype)
            qp, _ = self._packet_bytes("burst", dims, dtype)
            geo = self.geometry
            cost["two-way"] = (twoway.two_way_bytes(geo.needs("forward"), kv)
                               + twoway.two_way_bytes(geo.needs("burst"), qp), kv + qp)
        return min(cost, key=lambda m: cost[m])  # dicts keep order: ties go to burst, ring

    def backward(self, dout, q, k, v, out, lse, *, cu_seqlens=None):
        """Gradients ``(dq, dk, dv)`` of this rank's q, k, v given ``dout``."""
        fn = "BurstAttention.backward"
        arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}

        def check(h):
            lse_dtype = "float64" if np.dtype(h["q"].dtype) == np.float64 else "float32"
            return check_backward(fn, h["dout"], h["q"], h["k"], h["v"], h["out"], h["lse"], lse_dtype)

        h, dims = self._prepare(fn, arrays, check, cu_seqlens)
        mode = self.choose_bwd_mode(dims, h["q"].dtype)
        args = (h["dout"], h["q"], h["k"], h["v"], h["out"], h["lse"], dims)
        with abort_on_device_error(self.comm):
            if mode == "two-way":
                dq, dk, dv, st = twoway.backward(self, *args)
            else:
                dq, dk, dv, st = ring.backward(self, mode, *args)
            self._finish()
        self.last_stats.backward, self.last_stats.bwd_mode = st, mode
        self.last_stats.buffer_bytes = self.buffer_bytes
        return like(dq, q), like(dk, k), like(dv, v)

