"""``BurstAttention``: a reusable plan that owns its ring buffers and reports what it did."""

import math
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

import numpy as np

from ._gpu.device import abort_on_device_error
from . import _choices as choices
from ._heads import HeadParallel, check_head_parallel
from ._interop import like
from .masks._intervals import Bounds
from ._ring import flat as ring, twolevel, twolevel_backward, twoway
from ._ring.context import Call
from ._ring.geometry import geometry
from ._ring.stats import PhaseStats
from ._runtime import Runtime
from ._validate import (check_backward, check_cu_seqlens, check_forward, check_layout_given, check_options,
                       fingerprint, global_layout, layout_dependence)

__all__ = ["BurstAttention", "PhaseStats", "Stats"]


@dataclass
class Stats:
    """``last_stats`` of a plan: the latest forward and backward, and the choices made.

    ``buffer_bytes`` is the memory the plan keeps for ring buffers between calls.
    ``ring_layout`` is the layout the ring ran on: the caller's, or the balanced one the call
    re-sharded to (``balance``).
    ``rate_tflops`` is the (forward, backward) kernel rate a rank, in TFLOP/s, with which
    ``topology="auto"`` asked the performance model for the latest call, and
    ``rate_source`` where it came from: "setting" (``kernel_tflops``), "measured by
    burstmpi-gpucheck on DATE" (the rate file), or "nominal"; both None where the model
    was not asked (another topology, or one node).
    """

    forward: Optional[PhaseStats] = None
    backward: Optional[PhaseStats] = None
    bwd_mode: Optional[str] = None
    topology: str = "flat"
    backend: str = "cpu"
    transport: str = "mpi"
    buffer_bytes: int = 0
    rate_tflops: Optional[Tuple[float, float]] = None
    rate_source: Optional[str] = None
    ring_layout: Optional[str] = None

    def as_dict(self):
        return asdict(self)


def _short(text, most=60):
    return text if len(text) <= most else text[:most - 3] + "..."


def _delegate(name, doc):
    """A plan attribute that is its runtime's."""
    return property(lambda self: getattr(self.runtime, name), doc=doc)


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
    mask : burstmpi.masks.Mask, optional
        Any mask of ``burstmpi.masks`` (sinks, chunks, block-sparse, per-head, and their
        ``&``/``|``), ANDed with ``causal``, ``window`` and the same-document rule. The ring
        skips the steps, transfers, rows and tiles it leaves invisible.
    softmax_scale : float, optional
        Multiplies Q K^T; default ``1 / sqrt(head_dim)``.
    layout : {"contiguous", "zigzag", "striped"}, optional
        How the global sequence is spread over ranks: the layout the inputs were sharded
        with (``burstmpi.shard(x, layout=...)``). Required where the result depends on it:
        over several ranks with ``causal``, ``window``, ``mask`` or ``cu_seqlens``; a call
        without it there raises on every rank rather than guessing. Left out (None) it
        means "contiguous", where the layout cannot change the result.
    bwd_comm : {"auto", "burst", "ring", "two-way"}
        What circulates in the backward: Q/dO/dQ ("burst"), K/V/dK/dV ("ring"), both K/V
        and Q/dO two ways with no gradient partial ("two-way", ``burstmpi._ring.twoway``; from 3
        ranks), or whichever moves fewer bytes for the call ("auto"; recorded in
        ``last_stats``; it considers "two-way" only on backends where that costs no extra
        compute, i.e. the CUDA kernels; with host arrays on one node, where bytes move
        through memory, it takes the other one-way mode when that leaves the busiest rank at
        least 2 % fewer pairs). The forward takes the two-way ring by itself
        whenever it moves fewer bytes (``last_stats.forward.direction`` is then 0).
    balance : {"auto", "off", "contiguous", "zigzag", "striped"}
        Where the call's layout leaves the ranks' work unbalanced (a causal mask on a
        contiguous shard: the last rank computes almost all its pairs, the first almost
        none), the ring runs on a balanced layout and the results come back in the caller's
        (``burstmpi._ring.balance``: one all-to-all of the inputs, one of the results; only
        the tokens that change rank move). "auto": the performance model's pick among the
        caller's layout, zigzag and striped from the call's exact pair counts and the
        exchange's bytes (``burstmpi.model.balance``); "off": the caller's layout always; a
        layout name forces that one. ``last_stats.ring_layout`` says which ran; the
        exchange's bytes count in ``bytes_sent``.
    backend : {"auto", "cpu", "cuda"}
        "auto" follows the arrays' device: GPU arrays (CuPy, or any DLPack producer on a
        CUDA device) run on burstmpi's CUDA kernels, host arrays on the CPU backend
        (numba's compiled tiles over BLAS; NumPy where numba is missing). "numpy", its
        old name, is taken as "cpu" with a FutureWarning. "cuda" with
        host arrays copies them to the GPU and returns host arrays.
    transport : {"auto", "nccl", "mpi", "shm"}
        How ring buffers travel. GPU arrays: NCCL (one GPU per rank; bootstrapped over
        ``comm``), or MPI (host-staged, or straight from the GPU with
        ``BURSTMPI_CUDA_AWARE_MPI=1``; works with ranks sharing a GPU); "auto" takes NCCL
        when it is installed and every rank has a GPU of its own. Host arrays: "shm", the
        ranks of one node reading each other's packets in place from an MPI-3 shared
        window (``burstmpi._transport.shm``; "auto" takes it when every rank is on one node), or
        "mpi", copied by MPI. Reported in ``last_stats``.
    device : int, optional
        The CUDA device of this rank; default: node-local rank modulo the visible GPUs.
    topology : {"flat", "two-level", "auto"}
        "flat": one ring in rank order. "two-level": a ring inside each node and one
        between nodes, linking the ranks of equal local rank, its transfer hidden behind
        a whole inner cycle (``burstmpi._ring.twolevel``; nodes of equal size, host or GPU
        arrays, every ``bwd_comm``; "auto" takes "burst" or "ring", whichever moves fewer
        bytes).
        "auto": where the ranks span several equal nodes of 2+ ranks, the performance
        model's choice for the call's shape at the links' speeds (``BURSTMPI_LINK_GBPS``,
        else measured once per plan and kind of arrays: a few MB each way between
        neighbours, by MPI on the host or by the plan's GPU transport on the GPU;
        ``burstmpi._transport.links``): two-level where it predicts it 5 % faster, which
        takes inter-node links slower than the node's; else flat. The model's kernel rate:
        ``kernel_tflops``, else the rate ``burstmpi-gpucheck`` measured on this GPU model
        (GPU arrays; the rate file of ``docs/guide/configuration.md``), else a nominal one
        (200 TFLOP/s a GPU, 0.05 a CPU rank); the slowest rank's where they differ.
        ``last_stats.topology`` says which ran, ``last_stats.rate_tflops`` and
        ``rate_source`` at which rate. Nodes: ``burstmpi._transport.nodes``
        (``BURSTMPI_RANKS_PER_NODE``).
    head_parallel : int, default 1
        u > 1: groups of u consecutive ranks of one node share the heads (an all-to-all
        inside each group), and the ring runs over the P/u groups (``burstmpi._heads``).
        Inputs and results stay each rank's sequence shard. u must divide the ranks and
        the query heads, and divide or be a multiple of the K/V heads.
    timeout : float, optional
        Seconds; None takes ``BURSTMPI_TIMEOUT`` (default 300). Every wait on other ranks
        has this deadline; on expiry the job is aborted with exit code 75 and a
        ``burstmpi watchdog:`` line naming who it waited for; see
        ``docs/guide/configuration.md``.
    tile_q, tile_k, cpu_kernels, cpu_gemm, threads, check, cuda_aware_mpi, ranks_per_node, link_gbps, kernel_tflops : optional
        Settings (``docs/guide/configuration.md`` has the table): None takes the
        ``BURSTMPI_*`` variable of the same name, else the default. Read once, here.
    runtime : burstmpi._runtime.Runtime, optional
        Run on another plan's runtime (``KVCache`` does, for its prefill) instead of
        building one from ``comm``, ``backend``, ``transport``, ``device`` and the settings.

    Notes
    -----
    ``forward(q, k, v, cu_seqlens=None)`` returns ``(out, lse)`` and ``backward(dout, q, k,
    v, out, lse, cu_seqlens=None)`` returns ``(dq, dk, dv)``; see ``burstmpi.attention``
    for shapes and documents (``cu_seqlens`` is per call: it changes with every batch).
    Both are collective over ``comm``. Double buffers are allocated on first use and kept for
    calls of the same shapes, and so are the CPU backend's working arrays (converted K/V
    blocks and fp32 accumulators: ~5x a rank's q with as many KV heads as heads, in
    float32) and the storage of up to four results the caller has dropped (the CPU
    backend's ``held_bytes``), as CuPy's memory pool keeps the GPU's: ``release()`` frees
    them (results dropped later return to the pool); with the "shm" transport it is
    collective, as the calls are (it frees a window every rank maps).
    """

    def __init__(self, comm=None, *, causal=False, window=None, softmax_scale=None,
                 layout=None, bwd_comm="auto", balance="auto", backend="auto", transport="auto", device=None,
                 runtime=None, mask=None, head_parallel=1, topology="flat", timeout=None,
                 tile_q=None, tile_k=None, cpu_kernels=None, cpu_gemm=None, threads=None, check=None,
                 cuda_aware_mpi=None, ranks_per_node=None, link_gbps=None, kernel_tflops=None):
        fn = "BurstAttention"
        check_options(fn, causal=causal, window=window, softmax_scale=softmax_scale, layout=layout,
                      bwd_comm=bwd_comm, mask=mask, head_parallel=head_parallel, topology=topology, balance=balance)
        self.topology = topology
        given = dict(tile_q=tile_q, tile_k=tile_k, cpu_kernels=cpu_kernels, cpu_gemm=cpu_gemm, threads=threads,
                     check=check, cuda_aware_mpi=cuda_aware_mpi, ranks_per_node=ranks_per_node, link_gbps=link_gbps,
                     kernel_tflops=kernel_tflops)
        self.runtime = runtime if runtime is not None else Runtime(
            fn, comm, backend=backend, transport=transport, device=device, timeout=timeout, **given)
        # What a ring of groups (head parallelism) builds its own runtime from: this plan's
        # settings as they were read, not the environment again.
        rt = self.runtime
        self._made_with = dict(backend=rt.injected or "auto", transport=transport, device=device,
                               settings=rt.settings)
        self.causal, self.window_arg = bool(causal), None if window is None else tuple(window)
        self.window = Bounds(causal, window)
        self.mask = mask
        # ``layout_arg``: as given (None: not given, agreed on and checked per call in
        # ``_prepare``); ``layout_name``: what runs, "contiguous" for None.
        self.layout_arg, self.layout_name = layout, "contiguous" if layout is None else layout
        self.softmax_scale, self.bwd_comm, self.balance = softmax_scale, bwd_comm, balance
        self._balancing = None  # the re-sharding (``_ring.balance.Balancing``), made by the first call
        self.caller = None  # the public function that made this plan, if not the user (its errors name it)
        self.head_parallel = int(head_parallel)
        self._kv_grads_accumulated = False  # dK/dV returned unrounded (``ring.finish_gradients``): ``_groups_ring``
        # topology="auto": link speeds and kernel rates per kind of arrays, choices per shape
        self._links, self._rates, self._auto = {}, {}, {}
        # bwd_comm="auto" on one node: the busiest rank's pairs per geometry (``_choices.balanced_mode``)
        self._loads = {}
        self.last_stats = Stats()
        self.last_call = None  # the ``ring.context.Call`` of the latest call, for inspection

    @classmethod
    def _groups_ring(cls, of, comm, nodes, layout_name, mask, runtime, kv_grads_accumulated):
        """The plan of head parallelism's ring of groups (``burstmpi._heads``): plan ``of``'s
        options over ``comm`` (the members of one index, group by group) on the groups'
        ``nodes``, with each group's tokens merged (layout ``NAME/u``), this member's share
        of ``mask``, and the runtime of the ring's other plans if there is one."""
        plan = cls(comm, causal=of.causal, window=of.window_arg, softmax_scale=of.softmax_scale,
                   layout=of.layout_name, bwd_comm=of.bwd_comm, balance="off", mask=mask, topology=of.topology,
                   runtime=runtime if runtime is not None else Runtime(
                       "BurstAttention", comm, nodes=nodes, **of._made_with))
        plan.layout_name = layout_name
        plan._kv_grads_accumulated = kv_grads_accumulated
        return plan

    comm = _delegate("comm", "burstmpi's private duplicate of the plan's communicator.")
    backend = _delegate("backend", "The backend of the last call (None before the first).")
    transport = _delegate("transport", "How ring buffers travel (``last_stats.transport``).")
    settings = _delegate("settings", "The plan's ``config.Settings``, read when it was made.")

    @property
    def rank(self):
        return self.runtime.rank

    @property
    def nranks(self):
        return self.runtime.nranks

    @property
    def buffer_bytes(self):
        """Bytes of ring buffers this plan's runtime holds between calls: the double buffers
        and partials, the two-level rings' and head parallelism's ring of groups'
        (``Runtime.owned``)."""
        return self.runtime.buffer_bytes

    def release(self):
        """Free the ring buffers and the CPU backend's working arrays (allocated again on the
        next call)."""
        self.runtime.release()

    # -- the calls --------------------------------------------------------------------

    def _options(self):
        rt = self.runtime
        return (("causal", self.causal), ("window", self.window_arg),
                ("softmax_scale", self.softmax_scale), ("layout", self.layout_arg),
                ("bwd_comm", self.bwd_comm), ("balance", self.balance), ("backend", rt.backend_name),
                ("transport", rt.transport_name), ("head_parallel", self.head_parallel),
                ("topology", self.topology),
                ("BURSTMPI_INTERNODE_GBPS", rt.settings.internode_gbps),  # it picks the transport
                ("mask", None if self.mask is None else f"{_short(repr(self.mask))} #{self.mask.digest()}"))

    def _prepare(self, fn, arrays, check, cu_seqlens):
        """Convert and check the arguments, agree across ranks, and make the call's context:
        ``(converted arrays, dims, Call)``.

        One collective (``agree``) compares every rank's arguments and tells each the
        others' local lengths; from those every rank derives the same global layout (or
        raises the same error)."""
        rt = self.runtime
        error, conv, dims, cu = None, None, None, None
        kind = rt.kind(arrays)
        rt.begin(fn, kind, self._options())
        try:
            conv = rt.convert(fn, arrays)
            dims = check(conv)
            cu = check_cu_seqlens(fn, cu_seqlens)
            # No default where the layout changes the result: shards made with another one
            # would be silently wrong. Raised through ``agree`` below, so on every rank.
            check_layout_given(self.caller or fn, self.layout_arg, self.nranks,
                               layout_dependence(self.causal, self.window_arg, self.mask, cu))
            if self.head_parallel > 1:
                check_head_parallel(fn, self.head_parallel, self.nranks, rt.nodes, dims[2], dims[3])
            elif self._ring_topology(kind) == "two-level":
                twolevel.check_two_level(fn, rt.nodes, kind, rt.settings.internode_gbps)
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
        lengths = rt.agree(fn, error, sig, 0 if dims is None else dims[1])
        if error is not None:  # only reachable with BURSTMPI_CHECK=0
            raise error
        self.last_stats.backend, self.last_stats.transport = self.backend.name, self.transport.name
        lay = global_layout(fn, "q.shape[1]", self.layout_name, self.nranks, lengths, cu)
        if self.mask is not None:  # the same global length and heads everywhere: the same error
            self.mask.check(fn, lay.seqlen, dims[2])
        geo = geometry(self.layout_name, self.nranks, lay.seqlen, self.window, cu, self.mask)
        source, ring_geo = None, self._rebalanced(geo, kind, dims, conv["q"].dtype, cu)
        if ring_geo is not None:  # the ring runs on a balanced layout (``_ring.balance``)
            source, geo = geo, ring_geo
        self.last_stats.ring_layout = geo.layout.name
        d = dims[4]
        scale = 1.0 / math.sqrt(d) if self.softmax_scale is None else float(self.softmax_scale)
        self.last_stats.rate_tflops = self.last_stats.rate_source = None  # set where the model is asked
        topology = "flat" if self.head_parallel > 1 else self._ring_topology(kind, dims, conv["q"].dtype, lay.seqlen,
                                                                               geo.layout.name)
        rings = None
        if topology == "two-level":  # the runtime's, per kind of arrays, device and transport
            rings = rt.owned(("two-level", kind, getattr(self.backend, "device", None), self.transport.name,
                              rt.nodes.node_of),
                             lambda: twolevel.Rings(self.comm, rt.nodes, self.transport, rt.timeout,
                                                    rt.settings.internode_gbps))
        call = self.last_call = Call(rank=self.rank, nranks=self.nranks, geometry=geo, scale=scale,
                                     backend=self.backend, transport=self.transport, channels=rt.channels,
                                     nodes=rt.nodes, timeout=rt.timeout,
                                     kv_grads_accumulated=self._kv_grads_accumulated, rings=rings, source=source)
        self.last_stats.topology = topology
        return conv, dims, call

    def _groups(self):
        """Head parallelism's side of this plan (``burstmpi._heads``): the runtime's, made by
        the first call (splitting the communicator is collective)."""
        rt = self.runtime
        make = lambda comm, nodes, layout_name, mask, runtime, accumulated: BurstAttention._groups_ring(
            self, comm, nodes, layout_name, mask, runtime, accumulated)
        return rt.owned(("head_parallel", self.head_parallel, self._options()),
                        lambda: HeadParallel(self.head_parallel, self.comm, rt.nodes, rt.timeout, make))

    def forward(self, q, k, v, *, cu_seqlens=None):
        """Attention of this rank's queries over the whole ring's keys: ``(out, lse)``."""
        fn = "BurstAttention.forward"
        h, dims, call = self._prepare(fn, {"q": q, "k": k, "v": v},
                                      lambda h: check_forward(fn, h["q"], h["k"], h["v"]), cu_seqlens)
        mover = self._mover(call)
        if mover is not None:  # to the balanced layout's rows
            h = {n: mover.forth(x) for n, x in h.items()}
            dims = (dims[0], h["q"].shape[1]) + tuple(dims[2:])
        if self.head_parallel > 1:
            groups = self._groups()
            out, lse, st = groups.forward(call, self.mask, call.geometry.layout.name, h, dims, cu_seqlens,
                                          self._xp())
            self._ring_of_groups_ran(groups)
        else:
            if call.rings is not None:
                run = twolevel.forward
            else:
                run = twoway.forward if call.forward_two_way(dims, h["q"].dtype) else ring.forward
            with abort_on_device_error(self.comm):
                out, lse, st = run(call, h["q"], h["k"], h["v"], dims)
                self._finish(call)
            self.last_stats.transport = self._transport_name(call)
        if mover is not None:  # and back to the caller's
            out, lse = mover.back(out), mover.back(lse, axis=2)
            mover.count(st, call.nodes)
        self.last_stats.forward, self.last_stats.buffer_bytes = st, self.buffer_bytes
        return like(out, q), like(lse, q)

    def _rebalanced(self, geo, kind, dims, dtype, cu):
        return choices.rebalanced(self, geo, kind, dims, dtype, cu)

    def _mover(self, call):
        """The re-sharding of a call that runs on a balanced layout (``_ring.balance.Mover``),
        else None."""
        return None if call.source is None else self._balancing.mover(call, self._xp())

    def _ring_of_groups_ran(self, groups):
        """``last_stats`` after head parallelism's ring of groups ran: the ring it took, and
        the kernel rate its ``topology="auto"`` asked the model with (its plan's stats)."""
        ran = groups._last.last_stats  # the ring's plan of this call (``HeadParallel.topology`` reads it too)
        self.last_stats.topology = groups.topology
        self.last_stats.rate_tflops, self.last_stats.rate_source = ran.rate_tflops, ran.rate_source

    def _finish(self, call):
        """End of a phase: every transport that runs asynchronously (NCCL) checks that its
        transfers completed, with a timeout (``Runtime.finish``), the two-level rings' too."""
        if call.rings is not None:  # first: the runtime's ends the call (``watchdog.leaving``)
            call.rings.finish()
        self.runtime.finish()

    def _ring_topology(self, kind, dims=None, dtype=None, seqlen=None, layout=None):
        """The ring this call runs: "two-level" or "flat". ``topology``'s "auto" is flat unless
        the ranks span several equal nodes of 2+ ranks; there the model chooses
        (``_auto_topology``) once the call's ``dims`` and global ``seqlen`` are agreed
        (without them, as in the argument checks, "auto" answers flat)."""
        if self.topology != "auto":
            return self.topology
        if not self.runtime.nodes.spread or dims is None:
            return "flat"
        return self._auto_topology("cuda" if kind == "cuda" else "host", dims, dtype, seqlen, layout)

    def _auto_topology(self, where, dims, dtype, seqlen, layout):
        return choices.auto_topology(self, where, dims, dtype, seqlen, layout)

    def _kernel_rate(self, where):
        return choices.kernel_rate(self, where)

    def _transport_name(self, call):
        """``last_stats.transport`` after a call: the call may have fallen back to MPI, and
        the two-level ring names its rings' transports."""
        return call.rings.name if call.rings is not None else self.transport.name

    def _xp(self):
        """The array module of the call's converted arrays (NumPy, or CuPy on the GPU)."""
        return getattr(self.backend, "xp", np)

    def choose_bwd_mode(self, call, dims, dtype):
        """The backward mode of a call with these dims and dtype (``_choices.bwd_mode``)."""
        return choices.bwd_mode(self, call, dims, dtype)

    def backward(self, dout, q, k, v, out, lse, *, cu_seqlens=None):
        """Gradients ``(dq, dk, dv)`` of this rank's q, k, v given ``dout``."""
        fn = "BurstAttention.backward"
        arrays = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse}

        def check(h):
            lse_dtype = "float64" if np.dtype(h["q"].dtype) == np.float64 else "float32"
            return check_backward(fn, h["dout"], h["q"], h["k"], h["v"], h["out"], h["lse"], lse_dtype)

        h, dims, call = self._prepare(fn, arrays, check, cu_seqlens)
        mover = self._mover(call)
        if mover is not None:  # to the balanced layout's rows (lse has its tokens last)
            h = {n: mover.forth(x, axis=2 if n == "lse" else 1) for n, x in h.items()}
            dims = (dims[0], h["q"].shape[1]) + tuple(dims[2:])
        if self.head_parallel > 1:
            groups = self._groups()
            dq, dk, dv, st, mode = groups.backward(call, self.mask, call.geometry.layout.name, h, dims, cu_seqlens,
                                                   self._xp())
            self._ring_of_groups_ran(groups)
        else:
            dtype = h["q"].dtype
            mode = (twolevel.choose_mode(self.bwd_comm, dims, dtype) if call.rings is not None
                    else self.choose_bwd_mode(call, dims, dtype))
            args = (h["dout"], h["q"], h["k"], h["v"], h["out"], h["lse"], dims)
            with abort_on_device_error(self.comm):
                if call.rings is not None:
                    dq, dk, dv, st = twolevel_backward.backward(call, mode, *args)
                elif mode == "two-way":
                    dq, dk, dv, st = twoway.backward(call, *args)
                else:
                    dq, dk, dv, st = ring.backward(call, mode, *args)
                self._finish(call)
            self.last_stats.transport = self._transport_name(call)
        if mover is not None:  # and back to the caller's
            dq, dk, dv = (mover.back(x) for x in (dq, dk, dv))
            mover.count(st, call.nodes)
        self.last_stats.backward, self.last_stats.bwd_mode = st, mode
        self.last_stats.buffer_bytes = self.buffer_bytes
        return like(dq, q), like(dk, k), like(dv, v)
