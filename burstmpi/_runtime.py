"""What every burstmpi plan runs on: a private communicator, a backend, a device, a transport
and buffers, with errors made collective.

``BurstAttention`` (the ring) and ``KVCache`` (decode over a sharded cache) are different
algorithms over the same machinery, so it lives here once. A ``Runtime`` is bound to one
MPI communicator; plans that share one (a cache's prefill plan and the cache itself) share
its backend, its NCCL communicator and its buffer arena, since their calls never overlap.

Where a call runs is decided per call from its arrays ("auto"), or fixed by the
``backend`` argument or ``BURSTMPI_BACKEND``. Switching to the GPU is collective (device,
CuPy backend and NCCL communicator are set up together on every rank), and every step of
it that can fail on one rank only is agreed on before the next collective, so a rank
without CuPy or without a GPU makes every rank raise instead of leaving the others waiting.
"""

import numpy as np
from mpi4py import MPI

from . import _transfers as transfers
from ._backends import CpuBackend
from ._backends.cupy_backend import CupyBackend
from ._backends.cpu.threads import node_masks, shares_cores, threads_per_rank
from ._config import Settings
from ._gpu.device import check_capability, import_cupy, node_rank, pick_device
from ._interop import cupyx_pinned, is_host, to_device, to_host
from ._ring import flat as ring
from ._transport import watchdog
from ._transport.lifetime import state_of
from ._transport import mpi_library
from ._transport.mpi import DeviceMPITransport, MPITransport, StagedMPITransport
from ._transport.nodes import nodes
from ._transport.node_memory import drop_segment_names
from ._transport.shm import NoRoom, transport_for
from ._transport.slowlinks import SlowLinksTransport, refuse_device_arrays
from ._validate import agree

__all__ = ["Runtime", "kernel_ready"]

BACKENDS = ("auto", "cpu", "cuda", "numpy")  # "numpy": the CPU backend's old name (a warning)
TRANSPORTS = ("auto", "nccl", "mpi", "shm")


def kernel_ready(xp, a):
    """``a`` as the CUDA kernels want it: C-contiguous and 16-byte aligned (they copy rows
    with 16-byte cp.async); a copy only for the odd strided or offset view."""
    if a.flags.c_contiguous and a.data.ptr % 16 == 0:
        return a
    return xp.array(a, copy=True, order="C")


class Runtime:
    """The communicator, backend, transport and buffers of one or more plans.

    ``fn`` names the constructor in errors; ``comm``, ``backend``, ``transport``, ``device``
    and the setting ``keywords`` (``config.FIELDS``: ``timeout``, ``threads``...) are the
    plan's arguments of the same names (see ``BurstAttention``), resolved once into
    ``settings`` (``config.Settings``) here. ``transport`` may also be a
    callable making a transport from a communicator, and ``backend`` a backend object:
    those run every call (tests inject emulated kernels and ordered transports this way).
    ``nodes``: the ranks' nodes where the caller knows them (head parallelism's ring of
    groups), else discovered by the first call. ``settings``: settings already resolved
    (another runtime's), in place of the keywords.
    """

    def __init__(self, fn, comm=None, *, backend="auto", transport="auto", device=None, nodes=None, settings=None,
                 **keywords):
        made = callable(transport)  # a transport factory (dependency injection)
        injected = None if isinstance(backend, str) else backend  # a backend object (dependency injection)
        if injected is None and backend not in BACKENDS:
            raise ValueError(f"{fn}: backend: expected 'auto', 'cpu' or 'cuda', got {backend!r}")
        if injected is not None and not isinstance(getattr(backend, "name", None), str):
            raise TypeError(f"{fn}: backend: expected 'auto', 'cpu', 'cuda' or a backend object, got {backend!r}")
        if not made and transport not in TRANSPORTS:
            raise ValueError(f"{fn}: transport: expected 'auto', 'nccl', 'mpi' or 'shm', got {transport!r}")
        # ``backend="auto"`` leaves the choice to BURSTMPI_BACKEND (itself "auto" by default).
        cfg = settings if settings is not None else Settings.resolve(
            fn, backend=backend if injected is None and backend != "auto" else None, **keywords)
        if transport == "nccl" and cfg.backend == "cpu":
            raise ValueError(f"{fn}: transport: 'nccl' moves GPU buffers; backend='cpu' needs 'auto', 'mpi' or 'shm'")
        if transport == "shm" and cfg.backend == "cuda":
            raise ValueError(f"{fn}: transport: 'shm' shares host buffers; backend='cuda' needs 'auto', 'nccl' or 'mpi'")
        self.user_comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(self.user_comm, MPI.Intracomm):
            raise TypeError(f"{fn}: comm: expected an mpi4py intracommunicator, got {type(comm).__name__}")
        if self.user_comm == MPI.COMM_NULL:
            raise ValueError(f"{fn}: comm: expected a live intracommunicator, got MPI.COMM_NULL (a freed one?)")
        watchdog.check_caller_thread(fn)
        self.settings = cfg
        # Every wait on other ranks ends within this many seconds (``transport.watchdog``).
        self.timeout = cfg.timeout
        if MPI.COMM_WORLD.Get_size() > 1:
            watchdog.install_excepthook()  # one rank's uncaught exception ends the job, not a hang
        # What burstmpi keeps for the caller's communicator, freed with it (``lifetime``).
        self.state = state_of(self.user_comm)
        self.comm = self.state.private(self.timeout)
        self.state.depend(self)
        self.rank, self.nranks = self.comm.Get_rank(), self.comm.Get_size()
        self.transport_name = "given" if made else transport
        self.device_arg = device
        self.backend_name = cfg.backend if injected is None else injected.name
        self.tiles, self.check = (cfg.tile_q, cfg.tile_k), cfg.check
        self.injected = injected  # a backend object that runs every call, or None
        self.backend = injected
        # Until the first call picks one (``_host_transport``); a given one is kept.
        # ``_host``: what host calls use, again after GPU ones.
        self._default = self._waiting(MPITransport(self.comm))
        self.transport = self._waiting(transport(self.comm)) if made else self._default
        self._host = self.transport if made else None
        self._channels = {}
        self._arena = None
        self._owned = {}  # what plans keep between calls besides the arena (``owned``)
        self.nodes = nodes  # burstmpi._transport.nodes.Nodes, from the first call on

    # -- where a call runs ----------------------------------------------------------------

    def kind(self, arrays):
        """The backend a call on ``arrays`` (a dict of name -> array) runs on."""
        if self.injected is not None:
            return self.injected.name
        if self.backend_name != "auto":
            return self.backend_name
        return "cpu" if all(is_host(a) for a in arrays.values()) else "cuda"

    def begin(self, fn, kind, options):
        """Be ready to run on ``kind`` (collective when that changes: a first call, or a
        switch between host and GPU). ``options`` are the plan's (name, value) pairs, agreed
        on before the GPU set-up's collectives so a rank that disagrees raises, not hangs."""
        self.state.check(fn)  # the caller freed the communicator: the same error on every rank
        watchdog.check_caller_thread(fn)
        watchdog.entering(fn)
        # Plans on one communicator share its shared-window transport: each call waits
        # with its own plan's deadline.
        self.transport.timeout = self.timeout
        if getattr(self.backend, "name", None) == kind and self.nodes is not None:
            self._follow_stream()
            return
        # The slowed links' setting picks the host transport and is refused with GPU arrays:
        # agreed on here for every caller (a plan, a KV cache). First of the call's
        # collectives, so a rank that did not make the call is named (``validate.agree``).
        # Its signature starts as the plan's per-call one (``BurstAttention._prepare``), so a
        # rank whose call skips this (a plan it already used, from the functional API's
        # cache) beside one that makes it is told which argument differs, not "nranks".
        agree(self.comm, fn, None, [("nranks", self.nranks), ("runs on", kind)] + list(options)
              + [("BURSTMPI_INTERNODE_GBPS", self.settings.internode_gbps)], timeout=self.timeout)
        if self.nodes is None:  # every rank's first call: collective
            self.nodes = nodes(self.comm, self.timeout, self.settings.ranks_per_node)
            watchdog.learn_hosts(self.comm, self.nodes.hosts)
            if self.nranks == MPI.COMM_WORLD.Get_size():  # so that an abort leaves nothing in /dev/shm
                drop_segment_names(self.comm, self.nodes.hosts, self.timeout)
        if kind == "cuda":
            if self.transport_name == "shm":  # the same on every rank: agreed on just above
                raise ValueError(f"{fn}: transport: 'shm' shares host buffers; GPU arrays need 'auto', "
                                 "'nccl' or 'mpi'")
            refuse_device_arrays(fn, self.nodes, self.settings.internode_gbps)  # the same on every rank (agreed above)
            self._use_cuda(fn)
            self._follow_stream()
        elif self.backend is None or self.backend.name == "cuda":
            if self.backend is not None:  # back from the GPU: host buffers, the host transport
                self.release()
                self.transport = self._default if self._host is None else self._host
            with watchdog.guard("the set-up of the CPU backend (its cores and transport)", self.timeout):
                masks, _ = node_masks(self.comm, self.timeout)  # collective
                if self.transport is self._default:
                    self.transport = self._waiting(self._host_transport(fn, one_node=len(masks) == self.nranks))
                self._host = self.transport
                self.transport.idle = shares_cores(masks)  # waits sleep if so
                threads = threads_per_rank(self.comm, self.settings.threads)  # collective
            error, backend = None, None
            cfg = self.settings
            try:  # BURSTMPI_CPU_KERNELS=numba without numba: every rank raises
                backend = CpuBackend(*self.tiles, threads=threads, kernels=cfg.cpu_kernels, gemm=cfg.cpu_gemm)
            except RuntimeError as e:
                error = e
            agree(self.comm, fn, error, [], timeout=self.timeout)
            self.backend = backend

    def _follow_stream(self):
        """On a GPU, order this call after the previous one where the caller's stream
        changed (``CupyBackend.follow``)."""
        follow = getattr(self.backend, "follow", None)
        if follow is not None:
            follow()

    def convert(self, fn, arrays):
        """The call's arrays in the backend's memory: CuPy arrays ready for the kernels on
        the GPU (zero-copy where they already are there), NumPy views on the host."""
        if getattr(self.backend, "xp", np) is not np:
            xp = self.backend.xp
            return {name: kernel_ready(xp, to_device(a, name, fn, xp)) for name, a in arrays.items()}
        return {name: to_host(a, name, fn) for name, a in arrays.items()}

    def agree(self, fn, error, signature, length=0):
        """``validate.agree`` on this runtime's communicator; ``BURSTMPI_CHECK=0`` leaves
        the signature out (errors still travel)."""
        return agree(self.comm, fn, error, signature if self.check else [], length,
                     idle=getattr(self.transport, "idle", False), timeout=self.timeout)

    def _waiting(self, transport):
        """``transport`` with this runtime's deadline on its waits."""
        transport.timeout = self.timeout
        return transport

    def _host_transport(self, fn, one_node):
        """How host buffers travel: read in place from a shared window when every rank is on
        one node (``one_node``, the same on every rank; ``burstmpi._transport.shm``), unless
        ``transport='mpi'``; else MPI."""
        gbps = self.settings.internode_gbps
        if gbps and self.nodes.count > 1:  # a simulation aid: slow links between (fake) nodes
            if self.transport_name == "shm":
                raise ValueError(f"{fn}: transport: 'shm' reads packets in place; BURSTMPI_INTERNODE_GBPS "
                                 "slows MPI transfers: use 'auto' or 'mpi'")
            return SlowLinksTransport(self.comm, self.nodes, gbps)
        if self.nranks == 1 or self.transport_name == "mpi":
            return MPITransport(self.comm)
        if one_node:
            return transport_for(self.comm)  # every plan on this communicator shares its window
        if self.transport_name == "shm":
            raise ValueError(f"{fn}: transport: 'shm' needs every rank on one node, but the ranks of "
                             "comm span several; use 'auto' or 'mpi'")
        return MPITransport(self.comm)

    # -- the GPU ----------------------------------------------------------------------------

    def _use_cuda(self, fn):
        """Switch to the GPU: device, CuPy backend and transport (collective)."""
        error, cupy = None, None
        try:
            cupy = import_cupy(fn)
        except (NotImplementedError, RuntimeError) as e:
            error = e
        agree(self.comm, fn, error, [], timeout=self.timeout)
        with watchdog.guard("the GPU set-up (which ranks share a node)", self.timeout):
            local = node_rank(self.comm)
        error, dev = None, None
        try:
            dev = pick_device(fn, local, cupy.cuda.runtime.getDeviceCount(), self.device_arg)
            check_capability(fn, cupy, dev)  # an old GPU: refused on every rank, before compiling
            cupy.cuda.Device(dev).use()
        except (ValueError, RuntimeError) as e:
            error = e
        agree(self.comm, fn, error, [], timeout=self.timeout)
        self.release()
        self.backend = CupyBackend(cupy, dev)
        with watchdog.guard("the GPU transport's set-up (NCCL's bootstrap)", self.timeout):
            self.transport = self._waiting(self._gpu_transport(fn, cupy, dev))

    def _gpu_transport(self, fn, cupy, dev):
        """NCCL when asked for, or when available and no two ranks share a GPU; else MPI."""
        from ._transport import nccl

        cuda_mpi = mpi_library.cuda_support() if self.settings.cuda_aware_mpi else None
        everyone = watchdog.allgather(self.comm, (MPI.Get_processor_name(), cupy.cuda.Device(dev).pci_bus_id,
                                                  nccl.available(), cuda_mpi), self.timeout,
                                      f"{fn}: which GPU each rank has")
        shared = len({(host, bus) for host, bus, _, _ in everyone}) < self.nranks
        ok = all(has_nccl for _, _, has_nccl, _ in everyone)
        if nccl.choose_transport(fn, self.transport_name, ok, shared) == "nccl":
            return nccl.NCCLTransport(self.comm, dev, timeout_s=self.timeout)
        # Every wait and copy below is counted (``burstmpi._transfers``): per ring step, by design.
        stream = cupy.cuda.get_current_stream
        if self.settings.cuda_aware_mpi:
            mpi_library.refuse_cuda_unaware(fn, [r for r, (*_, cuda) in enumerate(everyone) if cuda is False])
            return DeviceMPITransport(self.comm, lambda: transfers.synchronize(stream()))

        def to_host(buf, out):
            transfers.synchronize(stream())  # the producing kernels are done
            transfers.to_host(buf, out)

        def to_dev(host, buf):
            buf.set(host)
            transfers.copied_to_device(host.nbytes)
            transfers.synchronize(stream())  # host buffer free for the next receive

        return StagedMPITransport(self.comm, to_host, to_dev,
                                  alloc_host=lambda n: cupyx_pinned(cupy, n))

    # -- buffers ----------------------------------------------------------------------------

    def channels(self, phase, specs):
        """The channels of one phase, built on the runtime's buffer arena.

        ``specs`` lists (class, fields, tag, direction): a channel sends to rank +
        direction and receives from rank - direction. Phases never run at the same time,
        so all of them share one arena as large as the largest phase needs (the forward's
        K/V double buffer and the backward's packets reuse the same memory). Channels are
        cached per phase while their shapes stay the same. A transport may carry a class's
        traffic on its own kind of channel, in memory it allocates (``burstmpi._transport.shm``).
        """
        begin = getattr(self.transport, "begin", None)
        if begin is not None:
            begin()
        single = self.nranks == 1
        try:
            with watchdog.guard("the ring buffers' allocation (a shared window: collective)", self.timeout):
                specs, arena = self._carried(specs, single)
        except NoRoom:  # the same on every rank
            if self.transport_name == "shm":
                raise
            # "auto": the node's shared memory is full; copy through MPI instead, from now on.
            idle, self.transport = self.transport.idle, self._waiting(MPITransport(self.comm))
            self.transport.idle, self._host = idle, self.transport
            self._channels.clear()  # they viewed the freed window
            self._arena = None
            specs, arena = self._carried(specs, single)
        key = tuple((cls.__name__, tag, direction, tuple((f, tuple(s), np.dtype(d).str) for f, s, d in fields))
                    for cls, fields, tag, direction in specs)
        cached = self._channels.get(phase)
        if cached is None or cached[0] != key or cached[2] is not arena:
            offset = [0]

            def carve(nbytes):
                view = arena[offset[0]:offset[0] + nbytes]
                offset[0] += nbytes
                return view

            # A packet passed on with fewer rows than it came with is first packed into a
            # staging packet, on the backend's device, allocated on first use.
            chans = [cls(self.transport, fields, send_to=(self.rank + direction) % self.nranks,
                         recv_from=(self.rank - direction) % self.nranks, tag=tag, alloc=carve,
                         single=single, stage=self.backend.alloc)
                     for cls, fields, tag, direction in specs]
            cached = self._channels[phase] = (key, chans, arena)
        for c in cached[1]:
            c.begin()
        return cached[1]

    def _carried(self, specs, single):
        """``specs`` with the classes the transport carries them on, and the arena they
        are carved from (``_arena_of``)."""
        pick = getattr(self.transport, "channel_for", None)
        if pick is not None:
            specs = [(pick(cls), *rest) for cls, *rest in specs]
        return specs, self._arena_of(sum(cls.copies(single) * ring.nbytes(fields) for cls, fields, *_ in specs))

    def _arena_of(self, need):
        """The arena the channels are carved from, at least ``need`` bytes: the transport's
        (a shared window, which it grows) or the runtime's own (grown here)."""
        shared = getattr(self.transport, "arena", None)
        if shared is not None:
            self._arena = shared(need)
        elif self._arena is None or self._arena.nbytes < need:
            self._channels.clear()  # they view the old arena; let it go
            self._arena = None
            self._arena = self.backend.alloc(need)
        return self._arena

    def owned(self, key, make):
        """What a plan keeps between calls besides the arena (the two-level rings and their
        buffers, head parallelism's ring of groups): ``make()`` once per ``key``, which
        names everything it depends on (the arrays' kind and device, the transport, the
        shapes it was made for). Owned here so that ``release`` frees it and
        ``buffer_bytes`` counts it; it has ``nbytes`` and ``release()``."""
        got = self._owned.get(key)
        if got is None:
            got = self._owned[key] = make()
        return got

    @property
    def buffer_bytes(self):
        """Bytes of ring buffers held between calls: the arena (the double buffers and
        partials) and what ``owned`` keeps."""
        arena = 0 if self._arena is None else int(self._arena.nbytes)
        return arena + sum(int(o.nbytes) for o in self._owned.values())

    def finish(self):
        """End of a phase: a transport that runs asynchronously (NCCL) checks that its
        transfers completed, within the deadline, so a dead peer ends the job with the
        watchdog's line, not a hang; a shared window starts the fence the next phase
        completes before anyone writes."""
        self.transport.finish()
        watchdog.leaving()

    def release(self, window=True):
        """Free the ring buffers and the CPU backend's working arrays (they are allocated
        again on the next call). ``window``: the communicator's shared window too
        (collective; every plan on the communicator maps it); the plan cache's eviction
        keeps it, as the next plan would map it again."""
        self._channels.clear()
        self._arena = None
        free = getattr(self.transport, "free", None)  # collective (a shared window)
        if window and free is not None and self.state.freed is None:
            with watchdog.guard("the release of the ring buffers' shared window (collective)", self.timeout):
                free()
        for kept in self._owned.values():  # their communicators stay: remaking them is collective
            kept.release(window)
        free = getattr(self.backend, "release", None)
        if free is not None:
            free()

    def comm_freed(self, reason):
        """The caller's communicator went (``lifetime.CommState.teardown``): drop what was
        made over its communicators and the views of its freed buffers (local); a later
        call raises (``begin``)."""
        self._owned.clear()
        self.release(window=False)
