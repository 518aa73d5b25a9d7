"""``KVCache``: exact decode over a key/value cache sharded across the ranks.

Prefill is the ring's causal forward (``BurstAttention``); each rank then keeps the keys
and values it holds. A decode call takes the T new tokens, the same on every rank; the
owner of each new position stores its key and value (round-robin by position, so shards
stay within a token or two of each other as the cache grows), every rank attends the new
queries to its own shard (``backend.decode``: a split-KV flash-decoding pass giving a
normalised partial ``(out, lse)``), and the partials are merged with the log-sum-exp
identity. A ring would need P dependent hops per token and move the whole cache; this
moves B x T x heads x (dv + 1) numbers per rank, whatever the cached length.

One collective per decode call. Its message is a small header (a status, a checksum of
the call's arguments and T, with the argument check on also a fingerprint of q, k, v
computed on the device, and the call's shape) followed by the rank's partial; one
allgather gives every rank every partial, and every rank merges them in rank order
(``backend.combine``), so the result is bitwise the same on every rank. The message size
must be the same on every rank before the collective starts, so it is the size of the
last agreed shape (T new tokens, query heads): a call of another T announces it in its
header and, when every rank announces the same, a second allgather of the new size
follows (only on the call that changes T). Any error, a checksum that differs, or shapes
that do not match make every rank raise the same error (through ``validate.report``) and
leave the cache as it was.

With ``window=(left, 0)`` a query sees only the last left + 1 positions: each rank keeps
its slots as a ring buffer and reuses the slot of its oldest token once no future query
can see it, so ``capacity`` need only cover the window plus the tokens of one call. A
windowed prefill sends the live tail of the prompt round-robin over the ranks (one
all-to-all of at most ``left`` tokens) so that no rank holds more than its share.

``sinks=n`` (with a window: StreamingLLM) keeps the first n tokens for the life of the
cache, dealt round-robin like the rest but in storage of their own that the ring buffer
never reuses; every query sees them besides its window. The decode runs its split-KV
pass twice on each rank, over the window's slots and over the sinks (two disjoint sets),
and merges the two partials locally before the one collective, so a call still moves
only B x T x heads x (dv + 1) numbers per rank. ``capacity = n + left + T`` suffices for
calls of T tokens forever.
"""

import math
import time
from dataclasses import dataclass

import numpy as np

from .._gpu.device import abort_on_device_error
from .._interop import bfloat16, like
from ..masks import Sinks, Window
from ..masks._layout import LAYOUTS
from .._plan import BurstAttention
from .._runtime import Runtime
from .._transfers import to_device, to_host
from .._validate import (SUPPORTED_DTYPES, check_forward, check_layout_given, check_options, device_fingerprint,
                        fingerprint, global_layout, report)
from .exchange import FAILED, OK, RESHAPE, Exchange
from .slots import SlotStore

__all__ = ["KVCache", "DecodeStats"]


def _dtype(fn, dtype):
    if isinstance(dtype, str) and dtype == "bfloat16":
        if bfloat16 is None:
            raise TypeError(f"{fn}: dtype: bfloat16 needs ml_dtypes (pip install ml_dtypes)")
        return np.dtype(bfloat16)
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{fn}: dtype: expected one of {SUPPORTED_DTYPES}, got {dtype!r}") from None
    if dt.name not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: dtype: expected one of {SUPPORTED_DTYPES}, got {dt}")
    return dt


def _count(fn, name, value, minimum=1):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{fn}: {name}: expected an integer >= {minimum}, got {value!r}")
    return int(value)


@dataclass
class DecodeStats:
    """What this rank did in the last decode call.

    ``message_bytes`` is this rank's part of the merge collective (a header and its
    partial out and lse); an allgather moves ``(P - 1) * message_bytes`` per rank
    (``bytes_moved``), whatever the cached length. ``collectives`` is 1, or 2 on a call
    that changed the number of new tokens. ``compute_s`` is the local decode (the backend's
    kernels), ``merge_s`` the collective and the merge, ``wall_s`` the whole call.
    """

    tokens: int = 0
    cached: int = 0
    message_bytes: int = 0
    bytes_moved: int = 0
    collectives: int = 0
    compute_s: float = 0.0
    merge_s: float = 0.0
    wall_s: float = 0.0


class KVCache(SlotStore, Exchange):
    """A key/value cache of up to ``capacity`` global tokens, sharded over ``comm``'s ranks.

    Parameters
    ----------
    comm : mpi4py.MPI.Intracomm, optional
        The ranks holding the cache (default ``MPI.COMM_WORLD``); a private duplicate
        carries burstmpi's traffic.
    capacity : int
        Global tokens the cache can hold. Each rank preallocates its share once,
        ``ceil(capacity / P) + 1`` slots (one slot of slack for the round-robin placement
        after an uneven prefill). With a window, tokens no query can see any more free
        their slots, so ``capacity`` need only be ``left`` + the tokens of one call.
    batch, kv_heads, head_dim : int
        The shapes of the cached keys, ``(batch, tokens, kv_heads, head_dim)``.
    v_head_dim : int, optional
        The values' head dim (default ``head_dim``).
    sinks : int
        With a window: keep the first ``sinks`` tokens for the life of the cache; every
        query sees them and its window (StreamingLLM's attention sinks). Count them in
        ``capacity``: ``sinks + left + T`` serves calls of T tokens forever.
    dtype : float16, bfloat16, float32 or float64 (CPU backend only), or its name
        The dtype of the cache and of every q, k, v passed to it.
    softmax_scale : float, optional
        Default ``1 / sqrt(head_dim)``; the prefill's and every decode's.
    window : (left, right), optional
        flash-attn's sliding window, causal: ``right`` must be 0 or -1. The query at
        position i sees positions ``i - left .. i`` (``left = -1``: all earlier ones).
    backend : {"auto", "cpu", "cuda"}
        Where the cache lives. "auto" decides on the first call from its arrays (host
        arrays: NumPy; GPU arrays: the CUDA kernels), and the cache stays there: host
        arrays given to a GPU cache are copied to the device and their results come back
        as host arrays; GPU arrays given to a host cache raise.
    device : int, optional
        The CUDA device of this rank (default: node-local rank modulo the visible GPUs).
    timeout : float, optional
        Seconds; None takes ``BURSTMPI_TIMEOUT`` (default 300). Every wait on other ranks
        has this deadline; on expiry the job is aborted with exit code 75 and a
        ``burstmpi watchdog:`` line naming who it waited for; see
        ``docs/guide/configuration.md``.
    transport : {"auto", "nccl", "mpi", "shm"}
        How the decode's messages travel, as ``BurstAttention`` takes it.
    tile_q, tile_k, cpu_kernels, cpu_gemm, threads, check, cuda_aware_mpi, ranks_per_node, link_gbps,
    kernel_tflops : optional
        Settings, as ``BurstAttention`` takes them (``docs/guide/configuration.md``): None
        takes the ``BURSTMPI_*`` variable of the same name, else the default.

    Notes
    -----
    Calls (collective over ``comm``): ``prefill(q, k, v, layout=...)`` fills an empty
    cache from a prompt sharded like ``burstmpi.shard`` makes it and returns this rank's
    out; ``load(k, v, layout=...)`` fills it with a prompt's keys and values (called again:
    appends a piece) without computing attention (a prefill done elsewhere); both need
    ``layout=`` over several ranks, where the prompt's tokens sit decides the result and
    the cached positions;
    ``decode(q, k, v, return_lse=False)``
    appends T new tokens and returns their out, the same on every rank; ``seqlen`` is the
    number of tokens cached; ``release()`` frees the memory (the cache cannot be used
    afterwards). Local: ``shard()`` gives this rank's cached keys, values and positions,
    ``nbytes`` their memory, ``last_stats`` what the last decode did (``DecodeStats``).
    """

    def __init__(self, comm=None, *, capacity, batch, kv_heads, head_dim, v_head_dim=None,
                 dtype=np.float32, softmax_scale=None, window=None, sinks=0, backend="auto", device=None,
                 timeout=None, transport="auto", tile_q=None, tile_k=None, cpu_kernels=None, cpu_gemm=None,
                 threads=None, check=None, cuda_aware_mpi=None, ranks_per_node=None, link_gbps=None,
                 kernel_tflops=None):
        fn = "KVCache"
        self.capacity = _count(fn, "capacity", capacity)
        if self.capacity >= 2 ** 31:
            raise ValueError(f"{fn}: capacity: expected fewer than 2**31 tokens (int32 positions), got {capacity}")
        self.batch = _count(fn, "batch", batch)
        self.kv_heads = _count(fn, "kv_heads", kv_heads)
        self.head_dim = _count(fn, "head_dim", head_dim)
        self.v_head_dim = self.head_dim if v_head_dim is None else _count(fn, "v_head_dim", v_head_dim)
        self.dtype = _dtype(fn, dtype)
        check_options(fn, causal=True, window=window, softmax_scale=softmax_scale, layout=None)
        self.softmax_scale = softmax_scale
        self.window = None if window is None else tuple(int(w) for w in window)
        self.left = -1 if window is None else self.window[0]
        self.scale = 1.0 / math.sqrt(self.head_dim) if softmax_scale is None else float(softmax_scale)
        self.sinks = _count(fn, "sinks", sinks, 0)
        if self.sinks and self.left < 0:
            raise ValueError(f"{fn}: sinks: expected window=(left, 0) with left >= 0 beside sinks={sinks} (without "
                             f"a window every token is kept and seen), got window={window!r}")
        if self.sinks and self.capacity <= self.sinks:
            raise ValueError(f"{fn}: capacity: expected more than sinks={self.sinks} tokens (the sinks, the window "
                             f"and one call's tokens), got {self.capacity}")
        self.runtime = Runtime(fn, comm, backend=backend, transport=transport, device=device, timeout=timeout,
                               tile_q=tile_q, tile_k=tile_k, cpu_kernels=cpu_kernels, cpu_gemm=cpu_gemm,
                               threads=threads, check=check, cuda_aware_mpi=cuda_aware_mpi,
                               ranks_per_node=ranks_per_node, link_gbps=link_gbps, kernel_tflops=kernel_tflops)
        P = self.runtime.nranks
        # The window's ring buffer: its share of what is not a sink.
        self.slots = -(-(self.capacity - self.sinks) // P) + (1 if P > 1 else 0)
        self._sink_slots = len(range(self.runtime.rank, self.sinks, P))  # positions p < sinks with p % P == rank
        self._sk = self._sv = self._skpos = None
        self._ns = 0  # sinks stored on this rank
        self.seqlen = 0
        self.heads = None  # query heads, fixed by the first call
        self._shape = (1, None)  # the agreed (T, heads) that sizes the decode's message
        self._k = self._v = self._kpos = self._kpos_host = None
        self._n = self._head = 0  # filled slots; the oldest slot once the ring buffer wraps
        self._held = np.zeros(P, np.int64)  # tokens each rank holds (without a window: never dropped)
        self._plans, self._message = {}, None
        self._released = False
        self.last_stats = DecodeStats()
        self._signature = (("capacity", self.capacity), ("batch", self.batch), ("kv_heads", self.kv_heads),
                           ("head_dim", self.head_dim), ("v_head_dim", self.v_head_dim),
                           ("dtype", self.dtype.name), ("softmax_scale", softmax_scale),
                           ("window", self.window), ("sinks", self.sinks), ("backend", self.runtime.backend_name))
        if self.runtime.backend_name != "auto":
            self.runtime.begin(fn, self.runtime.backend_name, self._signature)
            error = None
            try:
                self._allocate(fn)
            except (TypeError, ValueError, MemoryError, RuntimeError) as e:
                error = e
            self.runtime.agree(fn, error, self._signature)

    # -- state ----------------------------------------------------------------------------

    @property
    def nbytes(self):
        """Bytes this rank's share of the cache takes (keys, values and positions)."""
        return sum(int(a.nbytes) for a in (self._k, self._v, self._kpos, self._sk, self._sv, self._skpos)
                   if a is not None)

    def shard(self):
        """This rank's cached keys (batch, n, kv_heads, head_dim), values and their global
        positions (n,), in slot order: views of the cache (do not modify them); with sinks,
        copies with this rank's sinks first."""
        n = self._n
        k, v = self._k[:, :, :n].transpose(0, 2, 1, 3), self._v[:, :, :n].transpose(0, 2, 1, 3)
        pos = self._kpos_host[:n].astype(np.int64)
        if self._ns:
            xp, m = self.runtime.backend.xp, self._ns
            k = xp.concatenate([self._sk[:, :, :m].transpose(0, 2, 1, 3), k], axis=1)
            v = xp.concatenate([self._sv[:, :, :m].transpose(0, 2, 1, 3), v], axis=1)
            pos = np.concatenate([to_host(self._skpos[:m]).astype(np.int64), pos])
        return k, v, pos

    def release(self):
        """Free this rank's share and the call buffers; the cache cannot be used after.
        Collective where the ranks share a node's memory (``burstmpi._transport.shm``: it frees a window
        every rank maps), as the calls are."""
        self._k = self._v = self._kpos = self._kpos_host = None
        self._sk = self._sv = self._skpos = None
        self._plans.clear()
        self._message = None
        self.runtime.release()
        self._released = True

    def _allocate(self, fn):
        if self._k is not None:
            return
        be = self.runtime.backend
        try:
            be.acc_dtype(self.dtype)  # raises where the backend lacks the dtype (float64 on GPUs)
        except ValueError as e:
            raise ValueError(f"{fn}: dtype: a cache of {self.dtype} cannot live on backend "
                             f"{be.name!r} ({e}); float64 caches run on backend='cpu'") from None
        xp = be.xp
        B, Zkv, S = self.batch, self.kv_heads, self.slots
        self._k = xp.zeros((B, Zkv, S, self.head_dim), self.dtype)
        self._v = xp.zeros((B, Zkv, S, self.v_head_dim), self.dtype)
        self._kpos_host = np.full(S, -1, np.int32)
        self._kpos = self._kpos_host if xp is np else to_device(xp, self._kpos_host)
        if self.sinks:
            ns = self._sink_slots
            self._sk = xp.zeros((B, Zkv, ns, self.head_dim), self.dtype)
            self._sv = xp.zeros((B, Zkv, ns, self.v_head_dim), self.dtype)
            self._skpos = to_device(xp, np.full(ns, -1, np.int32))

    def _kind(self, arrays):
        be = self.runtime.backend
        if self._k is not None:
            return be.name  # the cache stays where it was allocated
        return self.runtime.kind(arrays)

    def _begin(self, fn, arrays):
        """Be on the cache's backend: collective the first time, and then it raises alike
        on every rank if they disagree (``Runtime.begin``)."""
        self.runtime.begin(fn, self._kind(arrays), self._signature)

    def _local(self, fn, arrays):
        """This rank's part of a call's set-up (its errors go into the call's collective):
        the storage, and the arrays in the cache's memory."""
        if self._released:
            raise RuntimeError(f"{fn}: the cache was released")
        self._allocate(fn)
        return self.runtime.convert(fn, arrays)

    def _check(self, fn, h, decoding):
        """This call's (tokens, query heads) after checking its arrays against the cache."""
        if "q" not in h:  # load: keys and values only
            for name, x, e in (("k", h["k"], self.head_dim), ("v", h["v"], self.v_head_dim)):
                want = (self.batch, h["k"].shape[1] if h["k"].ndim == 4 else None, self.kv_heads, e)
                if x.ndim != 4 or tuple(x.shape) != want:
                    raise ValueError(f"{fn}: {name}.shape: expected (batch, tokens, kv_heads, head_dim) = "
                                     f"{want} for this cache, got {tuple(x.shape)}")
                if x.dtype != self.dtype:
                    raise TypeError(f"{fn}: {name}.dtype: expected the cache's dtype {self.dtype}, got {x.dtype}")
            return h["k"].shape[1], self.heads
        B, C, Z, Zkv, d, dv = check_forward(fn, h["q"], h["k"], h["v"])
        for name, got, want in (("batch", B, self.batch), ("kv_heads", Zkv, self.kv_heads),
                                ("head_dim", d, self.head_dim), ("v_head_dim", dv, self.v_head_dim)):
            if got != want:
                axis = {"batch": "q.shape[0]", "kv_heads": "k.shape[2]", "head_dim": "q.shape[3]",
                        "v_head_dim": "v.shape[3]"}[name]
                raise ValueError(f"{fn}: {axis}: expected the cache's {name} = {want}, got {got}")
        if h["q"].dtype != self.dtype:
            raise TypeError(f"{fn}: q.dtype: expected the cache's dtype {self.dtype}, got {h['q'].dtype}")
        if self.heads is not None and Z != self.heads:
            raise ValueError(f"{fn}: q.shape[2]: expected the {self.heads} query heads of the cache's "
                             f"earlier calls, got {Z}")
        if decoding and C < 1:
            raise ValueError(f"{fn}: q.shape[1]: expected T >= 1 new tokens, got {C}")
        return C, Z

    # -- prefill ----------------------------------------------------------------------------

    def prefill(self, q, k, v, *, layout=None):
        """Fill the empty cache from a prompt: ``q``, ``k``, ``v`` are this rank's part
        (``burstmpi.shard(x, layout=layout)``). Runs the ring's causal forward (with the
        cache's window and scale), keeps the keys and values, returns this rank's out.

        ``layout`` is the one the prompt was sharded with: required over several ranks
        (the causal forward and the positions kept depend on it; left out, every rank
        raises), optional on one (None: "contiguous").

        Chunked prefill (a prompt after cached tokens) is ``decode`` with the chunk: it
        takes any number of new tokens, the same on every rank, and attends them to
        everything cached. ``prefill`` on a non-empty cache raises and says so."""
        fn = "KVCache.prefill"
        h, lay, Z = self._admit(fn, {"q": q, "k": k, "v": v}, layout)
        layout = lay.name  # None (one rank) runs as "contiguous"
        plan = self._plans.get(layout)
        if plan is None:
            # With sinks a query sees them or its window: the union, not the window alone.
            window, mask = ((None, Sinks(self.sinks) | Window(self.left, 0)) if self.sinks
                            else (self.window, None))
            plan = self._plans[layout] = BurstAttention(
                causal=True, window=window, softmax_scale=self.softmax_scale, layout=layout,
                runtime=self.runtime, mask=mask)
        out, _ = plan.forward(q, k, v)
        self._keep(fn, h, lay, Z)
        return out

    def load(self, k, v, *, layout=None):
        """Put a prompt's keys and values in the cache (this rank's part, as
        ``burstmpi.shard(x, layout=layout)`` gives it) without computing attention: for a
        prefill done elsewhere, or a benchmark. Collective.

        On a cache that holds tokens it appends the next positions, ``seqlen`` onwards, the
        piece sharded by ``layout`` as if it were a sequence of its own: a cache too large to
        hold twice (once in the caller's arrays, once in the cache) is loaded in pieces. The
        pieces must spread evenly over the ranks (a multiple of P tokens each; the last may
        be shorter): a piece that would leave a rank without room for the tokens the decode
        deals it later raises, on every rank. With a window only the live tail is kept.

        ``layout`` is required over several ranks, as in ``prefill`` (the cached positions
        depend on it), and optional on one."""
        fn = "KVCache.load"
        h, lay, _ = self._admit(fn, {"k": k, "v": v}, layout, append=True)
        self._keep(fn, h, lay, self.heads)

    def _admit(self, fn, arrays, layout, append=False):
        """Check a prompt (``append``: or a piece after the cached tokens) on every rank (one
        collective): its arrays in the cache's memory, the global layout its parts make,
        its query heads."""
        rt = self.runtime
        error, h, C, Z = None, None, 0, None
        self._begin(fn, arrays)
        try:
            if layout is not None and layout not in LAYOUTS:
                raise ValueError(f"{fn}: layout: expected one of {LAYOUTS}, got {layout!r}")
            # The cache is causal and keeps each token at its global position: no default
            # over several ranks (raised through the agreement below, on every rank).
            check_layout_given(fn, layout, rt.nranks, "a causal KV cache",
                               why=("the positions it keeps" if append else "the prefill's result and the positions "
                                    "it keeps") + " depend on which tokens each rank holds")
            h = self._local(fn, arrays)
            C, Z = self._check(fn, h, decoding=False)
            if append and self.left < 0 and rt.nranks > 1 and C > self.slots - self._n:
                raise ValueError(f"{fn}: k.shape[1]: this rank has {self.slots - self._n} free slots of its "
                                 f"{self.slots} (capacity={self.capacity} over {rt.nranks} ranks), got {C} "
                                 "tokens: load pieces whose tokens spread evenly over the ranks")
            if self.seqlen and not append:
                raise ValueError(f"{fn}: the cache already holds {self.seqlen} tokens; {fn.split('.')[1]} fills "
                                 "an empty cache (append a chunk with decode(q, k, v): any number of new "
                                 "tokens, the same on every rank)")
        except (TypeError, ValueError, NotImplementedError, RuntimeError, MemoryError) as e:
            error = e
        lengths = rt.agree(fn, error, [("layout", layout), ("heads", Z)] + list(self._signature), C)
        lay = global_layout(fn, "k.shape[1]", layout or "contiguous", rt.nranks, lengths, None)
        N = lay.seqlen
        if self.left < 0 and self.seqlen + N > self.capacity:
            held = f" after the {self.seqlen} cached" if self.seqlen else ""
            raise ValueError(f"{fn}: k: a prompt of {N} tokens (the sum over ranks){held} does not fit "
                             f"capacity={self.capacity}")
        if self.left >= 0 and min(self.seqlen + N, self.left) > self.capacity - self.sinks:  # the live tail
            raise ValueError(f"{fn}: capacity: expected at least the window's {self.left} tokens "
                             f"(window={self.window}) and sinks={self.sinks}, got {self.capacity}")
        if append and self.seqlen and self.left < 0:
            self._check_room(fn, lay)
        return h, lay, Z

    def _check_room(self, fn, lay):
        """A piece appended by ``load`` must leave every rank room for the tokens the decode
        will deal it round-robin up to the capacity: else the cache would be full on one rank
        long before it is full (pieces that split unevenly pile up on the first ranks). Raised
        at the load, the same on every rank (the lengths are agreed)."""
        P = self.runtime.nranks
        r = np.arange(P)
        held = self._held + [lay.count(i) for i in r]
        upto = lambda x: np.maximum(0, (x - r + P - 1) // P)  # positions < x that fall to each rank
        future = upto(self.capacity) - upto(self.seqlen + lay.seqlen)
        over = np.nonzero(held + future > self.slots)[0]
        if over.size:
            i = int(over[0])
            raise ValueError(f"{fn}: k.shape[1]: after this piece rank {i} would hold {held[i]} tokens, and the "
                             f"decode deals it {future[i]} more up to capacity={self.capacity}: more than its "
                             f"{self.slots} slots. Load pieces of a multiple of {P} tokens (the last may be "
                             "shorter), or a larger capacity")

    def _keep(self, fn, h, lay, Z):
        """Store the prompt's keys and values: where they are, or (windowed) the live tail
        round-robin."""
        rt = self.runtime
        with abort_on_device_error(rt.comm):
            if self.left < 0:
                self._store(h["k"], h["v"], self.seqlen + lay.positions(rt.rank))
                self._held += [lay.count(i) for i in range(rt.nranks)]
            else:
                self._drop_older_than(self.seqlen + lay.seqlen - self.left)
                self._store_window_tail(fn, h["k"], h["v"], lay)
        self.seqlen, self.heads = self.seqlen + lay.seqlen, Z
        self._shape = (1, Z)

    # -- decode ----------------------------------------------------------------------------

    def decode(self, q, k, v, *, return_lse=False):
        """Append T new tokens and return their attention over the whole cache.

        ``q`` (batch, T, heads, head_dim), ``k`` (batch, T, kv_heads, head_dim) and ``v``
        (batch, T, kv_heads, v_head_dim), the same on every rank, for global positions
        ``seqlen .. seqlen + T - 1``. Token t sees every cached token and new tokens
        0..t (within the window). Returns ``out`` (batch, T, heads, v_head_dim), the kind
        and dtype of ``q``, bitwise identical on every rank; with ``return_lse`` also
        ``lse`` (batch, heads, T) float32 (float64 for float64 caches), natural log.
        """
        fn = "KVCache.decode"
        rt = self.runtime
        t_start = time.perf_counter()
        self._compute_s, self._calls = 0.0, 0
        error, h, T, Z, written, sig, fp = None, None, 0, 0, None, [], None
        arrays = {"q": q, "k": k, "v": v}
        self._begin(fn, arrays)
        try:
            h = self._local(fn, arrays)
            T, Z = self._check(fn, h, decoding=True)
            sig = [("T", T), ("heads", Z), ("seqlen", self.seqlen)]
            # q, k, v must be the same on every rank. With the argument check on, their
            # fingerprint is computed where they live and folded into the header on the
            # device (``Exchange``): no copy to the host, no wait. BURSTMPI_CHECK=0: none.
            if rt.check:
                fp = device_fingerprint(rt.backend.xp, [h["q"], h["k"], h["v"]])
            tokens, slots, old, n, head, sink_tokens = self._slots_for(fn, T)
            with abort_on_device_error(rt.comm):
                self._write(h["k"], h["v"], tokens, slots)
                ns = self._ns
                if sink_tokens:
                    t = np.asarray(sink_tokens)
                    idx = to_device(rt.backend.xp, t)
                    self._store_sinks(h["k"][:, idx], h["v"][:, idx], self.seqlen + t)
            written = (slots, old, n, head, (self.seqlen + np.asarray(sink_tokens, np.int64)) // rt.nranks, ns)
        except (TypeError, ValueError, NotImplementedError, RuntimeError, MemoryError) as e:
            error = e
        sig = list(self._signature) + sig
        with abort_on_device_error(rt.comm):
            status = FAILED if error is not None else (OK if (T, Z) == self._shape else RESHAPE)
            n = written[2] if written else 0
            parts = self._exchange(h, status, sig, T, Z, self._shape, n, fp)
            if parts is None:  # every rank announced the same new shape: once more, at that size
                self._shape = (T, Z)
                parts = self._exchange(h, OK, sig, T, Z, self._shape, n, fp)
            if isinstance(parts, str):
                self._undo(written)
                if fp is not None:  # the slow path: host fingerprints, so the error names q, k or v
                    sig += [(name, fingerprint(to_host(h[name]))) for name in ("q", "k", "v")]
                report(rt.comm, fn, error, sig)
            out, lse = self._merge(parts, T, Z)
        self._n, self._head = written[2], written[3]
        self._held += np.bincount((self.seqlen + np.arange(T)) % rt.nranks, minlength=rt.nranks)
        self.seqlen += T
        self.heads = Z
        wall = time.perf_counter() - t_start
        size = self._message[1][0][0].nbytes
        self.last_stats = DecodeStats(tokens=T, cached=self.seqlen, message_bytes=size,
                                      bytes_moved=(rt.nranks - 1) * size, collectives=self._calls,
                                      compute_s=self._compute_s, merge_s=wall - self._compute_s, wall_s=wall)
        out = like(out, q)
        return (out, like(lse, q)) if return_lse else out

