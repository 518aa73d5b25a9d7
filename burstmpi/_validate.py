"""Argument checks at the API boundary, and agreement between ranks.

Every check names the function, the argument, what was expected and what came.
Because a ring stalls if one rank drops out, local errors are made collective:
``agree`` gathers three integers per rank on rank 0 and broadcasts them, once per call;
only when something is wrong does it gather the details, and then every rank raises the
same error, naming the rank that caused it. A rank that never arrives is named by the
watchdog (``transport.watchdog``).
"""

import builtins
import numbers
import zlib

import numpy as np

from .masks._layout import LAYOUTS
from .masks._patterns import Mask

__all__ = ["SUPPORTED_DTYPES", "BWD_MODES", "TOPOLOGIES", "check_window", "check_mask", "check_options",
           "check_forward", "check_backward", "check_cu_seqlens", "check_lengths", "check_out", "agree",
           "report", "checksum",
           "fingerprint", "device_fingerprint", "global_layout", "layout_dependence", "check_layout_given"]

SUPPORTED_DTYPES = ("float16", "bfloat16", "float32", "float64")
BWD_MODES = ("auto", "burst", "ring", "two-way")
TOPOLOGIES = ("flat", "two-level", "auto")
BALANCE = ("auto", "off") + LAYOUTS  # ``_ring.balance``


def _shape(x):
    return tuple(int(s) for s in x.shape)


def check_window(fn, window):
    if window is None:
        return
    ok = (isinstance(window, (tuple, list)) and len(window) == 2
          and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= -1
                  for w in window))
    if not ok:
        raise ValueError(f"{fn}: window: expected None or (left, right) with integers >= -1 "
                         f"(-1 = unbounded), got {window!r}")


def check_mask(fn, mask):
    """``mask`` must be None or a ``burstmpi.masks`` mask."""
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(f"{fn}: mask: expected None or a burstmpi.masks mask (Causal(), Window(left, right), "
                        f"Sinks(n), Chunked(size), BlockSparse(blocks, block_size), PerHead([...]), combined "
                        f"with & and |), got {type(mask).__name__}: {mask!r}"[:400])


def check_options(fn, *, causal, window, softmax_scale, layout, bwd_comm="auto", mask=None, head_parallel=1,
                  topology="flat", balance="auto"):
    check_mask(fn, mask)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"{fn}: causal: expected a bool, got {causal!r}")
    check_window(fn, window)
    if causal and window is not None and window[1] not in (-1, 0):
        raise ValueError(f"{fn}: window: with causal=True the right bound must be 0 or -1, "
                         f"got {tuple(window)!r}")
    if softmax_scale is not None:
        # A real number, never a string or a bool that float() would quietly accept.
        if not isinstance(softmax_scale, numbers.Real) or isinstance(softmax_scale, (bool, np.bool_)):
            raise TypeError(f"{fn}: softmax_scale: expected a finite real number or None, got "
                            f"{softmax_scale!r} ({type(softmax_scale).__name__})")
        if not np.isfinite(float(softmax_scale)):
            raise ValueError(f"{fn}: softmax_scale: expected a finite number or None, got {softmax_scale!r}")
    # None: not given. Accepted here; the call decides whether its result depends on the
    # layout (``check_layout_given``), collectively, once it knows the ranks and documents.
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout: expected one of {LAYOUTS}, got {layout!r}")
    if bwd_comm not in BWD_MODES:
        raise ValueError(f"{fn}: bwd_comm: expected one of {BWD_MODES}, got {bwd_comm!r}")
    if isinstance(head_parallel, (bool, np.bool_)) or not isinstance(head_parallel, numbers.Integral) \
            or head_parallel < 1:
        raise ValueError(f"{fn}: head_parallel: expected an integer >= 1, got {head_parallel!r}")
    if topology not in TOPOLOGIES:
        raise ValueError(f"{fn}: topology: expected one of {TOPOLOGIES}, got {topology!r}")
    if not isinstance(balance, str) or balance not in BALANCE:
        raise ValueError(f"{fn}: balance: expected one of {BALANCE}, got {balance!r}")


def _dtype_name(x):
    return np.dtype(x.dtype).name


def check_forward(fn, q, k, v):
    """Check q, k, v (NumPy views of the caller's arrays); return the problem dims."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{fn}: {name}: expected 4 dims (batch, seqlen_local, heads, head_dim), "
                             f"got shape {_shape(x)}")
        if _dtype_name(x) not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: {name}.dtype: expected one of {SUPPORTED_DTYPES}, got {x.dtype}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{fn}: {name}.dtype: expected {q.dtype} (the dtype of q), got {x.dtype}")
    B, C, Z, d = _shape(q)
    if _shape(k) != (B, C, k.shape[2], d):
        raise ValueError(f"{fn}: k.shape: expected ({B}, {C}, kv_heads, {d}) to match q {_shape(q)}, "
                         f"got {_shape(k)}")
    Zkv = k.shape[2]
    if _shape(v)[:3] != (B, C, Zkv):
        raise ValueError(f"{fn}: v.shape: expected ({B}, {C}, {Zkv}, head_dim_v) to match k {_shape(k)}, "
                         f"got {_shape(v)}")
    # seqlen_local may be 0: a rank holds no token when the global length is below the
    # number of ranks (the layout check says whether 0 is right for this rank).
    if min(B, Z, d, Zkv, v.shape[3]) == 0:
        raise ValueError(f"{fn}: q, k, v: batch, heads and head dims must be non-empty, got q {_shape(q)}, "
                         f"k {_shape(k)}, v {_shape(v)}")
    if Z % Zkv:
        raise ValueError(f"{fn}: k.shape[2]: expected a divisor of the {Z} query heads, got {Zkv} kv heads")
    return B, C, Z, Zkv, d, int(v.shape[3])


def check_backward(fn, dout, q, k, v, out, lse, lse_dtype):
    dims = check_forward(fn, q, k, v)
    B, C, Z, Zkv, d, dv = dims
    for name, x in (("dout", dout), ("out", out)):
        if _shape(x) != (B, C, Z, dv):
            raise ValueError(f"{fn}: {name}.shape: expected {(B, C, Z, dv)}, got {_shape(x)}")
        if x.dtype != q.dtype:
            raise TypeError(f"{fn}: {name}.dtype: expected {q.dtype} (the dtype of q), got {x.dtype}")
    if _shape(lse) != (B, Z, C):
        raise ValueError(f"{fn}: lse.shape: expected (batch, heads, seqlen_local) = {(B, Z, C)}, "
                         f"got {_shape(lse)}")
    if _dtype_name(lse) not in ("float32", "float64"):
        raise TypeError(f"{fn}: lse.dtype: expected {lse_dtype} (as returned by the forward), got {lse.dtype}")
    return dims


def check_out(fn, out, shape, dtype):
    """An ``out`` array given to ``fn`` must be what it writes there: ``shape`` of ``dtype``
    (``None``: ``fn`` makes its own)."""
    if out is not None and (_shape(out) != tuple(shape) or out.dtype != np.dtype(dtype)):
        raise ValueError(f"{fn}: out: expected shape {tuple(shape)} and dtype {np.dtype(dtype)}, "
                         f"got shape {_shape(out)} and dtype {out.dtype}")


def check_cu_seqlens(fn, cu_seqlens, seqlen=None):
    """Validate document offsets (flash-attn's ``cu_seqlens``); return them as int64.

    A 1-D integer array starting at 0, non-decreasing (empty documents are allowed), and
    ending at ``seqlen`` when that is known here (``shard`` knows it; the ring learns the
    global length in its agreement collective and checks the end there).
    """
    if cu_seqlens is None:
        return None
    from ._interop import to_numpy

    cu = to_numpy(cu_seqlens, "cu_seqlens", fn)
    if cu.ndim != 1:
        raise ValueError(f"{fn}: cu_seqlens: expected a 1-D array of document offsets, got shape {_shape(cu)}")
    if cu.dtype.kind not in "iu":
        raise TypeError(f"{fn}: cu_seqlens.dtype: expected an integer dtype (int32 or int64 offsets), got {cu.dtype}")
    if cu.size == 0 or cu[0] != 0:
        raise ValueError(f"{fn}: cu_seqlens: expected offsets starting at 0, got "
                         f"{'an empty array' if cu.size == 0 else f'cu_seqlens[0] = {int(cu[0])}'}")
    cu = cu.astype(np.int64)
    step = np.diff(cu)
    if (step < 0).any():
        i = int(np.nonzero(step < 0)[0][0])
        raise ValueError(f"{fn}: cu_seqlens: expected non-decreasing offsets, got "
                         f"cu_seqlens[{i}] = {int(cu[i])} > cu_seqlens[{i + 1}] = {int(cu[i + 1])}")
    if seqlen is not None and cu[-1] != seqlen:
        raise ValueError(f"{fn}: cu_seqlens[-1]: expected the global length {seqlen}, got {int(cu[-1])}")
    return cu


def fingerprint(a):
    """A cheap checksum of an array's bytes, for the agreement signature."""
    return None if a is None else (int(a.size), zlib.crc32(np.ascontiguousarray(a).view(np.uint8)))


# Elements per step of ``device_fingerprint``: its temporaries (the weights and the weighted
# words, uint64) stay within 16 MB however many tokens a call brings.
FINGERPRINT_CHUNK = 1 << 20


def device_fingerprint(xp, arrays):
    """A 64-bit fingerprint of the bits of ``arrays`` (``xp``'s: NumPy or CuPy), computed
    where they live and returned there as a 1-element uint64 array: no copy to the host, no
    wait for the device, so a GPU call can check its arguments without a round trip (the
    decode folds it into its message's header on the device).

    Each element's bits, read as an unsigned integer of its width, are weighted by the odd
    number 2i + 1 (i: its position, in C order whatever the strides, counting on across the
    arrays) and summed modulo 2**64. An odd weight is invertible modulo 2**64, so a change
    to any one element, in any of its bits, changes the sum; several changes are missed only
    if their weighted differences cancel. Integer addition modulo 2**64 does not depend on
    the order of the additions: every rank, and both backends, get the same value for the
    same bits. Shapes are not in it (the signatures carry them)."""
    total = xp.zeros(1, np.uint64)
    start = 0
    for a in arrays:
        words = a.view(np.dtype(f"u{a.dtype.itemsize}")).reshape(-1)  # a copy only if a is strided
        for lo in range(0, words.size, FINGERPRINT_CHUNK):
            part = words[lo:lo + FINGERPRINT_CHUNK]
            first = 2 * (start + lo) + 1
            weights = xp.arange(first, first + 2 * part.size, 2, dtype=np.uint64)
            # Array arithmetic wraps modulo 2**64 silently (scalar arithmetic would warn).
            xp.add(total, xp.multiply(part, weights).sum(dtype=np.uint64), out=total)
        start += words.size
    return total


def check_lengths(fn, name, layout, lengths):
    """Every rank's local length must be what ``layout`` gives for the global length.

    ``lengths`` are all ranks' local lengths, the same on every rank (from ``agree``),
    so every rank raises the same error."""
    lengths = np.asarray(lengths)
    if not np.array_equal(lengths, layout.counts):
        bad = [r for r in range(len(lengths)) if lengths[r] != layout.counts[r]]
        raise ValueError(
            f"{fn}: {name}: expected the local lengths that layout={layout.name!r} gives a global length "
            f"of {layout.seqlen} (the sum) over {layout.nranks} ranks, {layout.describe_counts()}, "
            f"got {lengths.tolist() if len(lengths) <= 16 else '...'} (rank {bad[0]} has {int(lengths[bad[0]])}, "
            f"expected {int(layout.counts[bad[0]])}); make the parts with burstmpi.shard or shard_indices")


def checksum(signature):
    """The 31-bit checksum of a signature that ``agree`` (and the decode's merge) compares."""
    return zlib.crc32(repr(signature).encode()) & 0x7FFFFFFF


def agree(comm, fn, error, signature, length=0, idle=False, timeout=None):
    """Raise on every rank if any rank has ``error`` or the ranks' signatures differ;
    return every rank's ``length`` (its local sequence length), in rank order.

    ``signature`` is a tuple of (name, value) pairs that must match on all ranks; local
    lengths may differ (the layout decides) and travel beside it.

    Each rank sends rank 0 a record of three integers, and rank 0 broadcasts them all: so
    when a rank never arrives, rank 0 knows which, and names it (``watchdog``: "ranks [1, 2]
    did not call ... within 300 s"); the others name rank 0 a little later, should it be
    the one missing. Every wait sleeps between tests where ranks take turns on cores
    (``idle``) and ends within ``timeout`` seconds (default ``BURSTMPI_TIMEOUT``).
    """
    from ._config import settings
    from ._transport.watchdog import gather_on_root

    timeout = settings().timeout if timeout is None else timeout
    h = checksum(signature)
    every = gather_on_root(comm, [1 if error else 0, h, int(length)], timeout, f"call {fn}", idle)
    if not every[:, 0].any() and (every[:, 1] == h).all():
        return every[:, 2]
    report(comm, fn, error, signature, timeout)


def report(comm, fn, error, signature, timeout=None):
    """The slow path of a failed agreement, collective: gather every rank's error and
    signature and raise the same exception on every rank, naming the first rank that
    failed or the first argument on which the ranks differ."""
    from ._config import settings
    from ._transport.watchdog import allgather

    mine = (None if error is None else (type(error).__name__, str(error)), signature)
    everyone = allgather(comm, mine, settings().timeout if timeout is None else timeout,
                         f"{fn}: the allgather of every rank's error and arguments")
    failed = [(r, e) for r, (e, _) in enumerate(everyone) if e is not None]
    if failed:
        rank, (kind, msg) = failed[0]
        others = [r for r, _ in failed[1:]]
        also = f" (ranks {others} failed too)" if others else ""
        exc = getattr(builtins, kind, None)
        if not (isinstance(exc, type) and issubclass(exc, Exception)):
            exc = RuntimeError
        raise exc(f"rank {rank}: {msg}{also}")
    sigs = [dict(s) for _, s in everyone]
    for key in sigs[0]:
        values = [s.get(key) for s in sigs]
        if any(v != values[0] for v in values):
            seen = ", ".join(f"rank {r} has {v!r}" for r, v in enumerate(values))
            raise ValueError(f"{fn}: ranks disagree on {key}: {seen}")
    raise ValueError(f"{fn}: ranks disagree on their arguments")  # pragma: no cover


def global_layout(fn, name, layout, nranks, lengths, cu_seqlens):
    """The layout of a collective call, from every rank's local length (``agree``'s
    result, the same everywhere): the global length is their sum, ``cu_seqlens`` must end
    there, and each rank must hold what the layout gives it. Every rank raises alike."""
    from .masks._layout import layout_of

    n = int(np.sum(lengths))
    if n < 1:
        raise ValueError(f"{fn}: {name}: expected a global sequence of at least 1 token, got 0 on every rank")
    if cu_seqlens is not None and cu_seqlens[-1] != n:
        raise ValueError(f"{fn}: cu_seqlens[-1]: expected the global length {n} (the sum of the ranks' "
                         f"local lengths), got {int(cu_seqlens[-1])}")
    lay = layout_of(layout, nranks, n, cu_seqlens)
    check_lengths(fn, name, lay, lengths)
    return lay


def layout_dependence(causal=False, window=None, mask=None, cu_seqlens=None):
    """What makes a call's result depend on which tokens each rank holds, in words for an
    error (None: nothing does). Without a causal mask, a window, a mask or documents every
    query sees every key, and attention does not care where a key sits; with any of them
    the global positions decide what is seen, and they come from the layout."""
    from .masks._intervals import Bounds

    what = []
    if causal:
        what.append("causal=True")
    if window is not None and not Bounds(False, window).dense:
        what.append(f"window={tuple(window)!r}")
    if mask is not None:
        what.append("a mask")
    if cu_seqlens is not None:
        what.append("cu_seqlens")
    return " and ".join(what) or None


def check_layout_given(fn, layout, nranks, depends,
                       why="the result depends on which tokens each rank holds"):
    """``layout=None`` (not given) is refused where the result depends on it: over several
    ranks with ``depends`` (``layout_dependence``'s words, or the caller's). A default
    there would be silently wrong for shards made with another layout, so the caller must
    say which one it sharded with. Local: callers raise it through their agreement
    collective, so every rank raises, also when only some ranks left it out."""
    if layout is None and nranks > 1 and depends:
        raise ValueError(f"{fn}: layout: expected {', '.join(map(repr, LAYOUTS[:-1]))} or {LAYOUTS[-1]!r} "
                         f"with {depends} over {nranks} ranks ({why}), got None (not given); pass the layout "
                         "you sharded with (burstmpi.shard(x, layout=...))")
