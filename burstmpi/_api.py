"""The functional API: ``attention``, ``attention_backward``, ``shard``, ``unshard``,
``shard_indices``, and ``release_cached`` for the plans the first two keep
(``burstmpi._plan_cache``)."""

import numpy as np
from mpi4py import MPI

from ._interop import like, to_host
from .masks._layout import LAYOUTS, layout_of
from . import _plan_cache as plan_cache
from ._config import settings
from ._plan_cache import release_cached
from ._transport.lifetime import private_comm
from ._transport.watchdog import check_caller_thread, check_timeout, collective
from ._validate import agree, check_cu_seqlens, fingerprint, global_layout

__all__ = ["attention", "attention_backward", "shard", "unshard", "shard_indices", "release_cached"]


def attention(q, k, v, *, comm=None, causal=False, window=None, softmax_scale=None,
              layout=None, cu_seqlens=None, return_lse=False, mask=None, head_parallel=1,
              topology="flat", balance="auto", timeout=None):
    """Exact softmax attention over a sequence spread across the ranks of ``comm``.

    Collective: every rank of ``comm`` calls it with its own part of the sequence.

    Parameters
    ----------
    q : array (batch, seqlen_local, heads, head_dim)
    k : array (batch, seqlen_local, kv_heads, head_dim); ``heads % kv_heads == 0``
        (grouped-query and multi-query attention without copying K/V).
    v : array (batch, seqlen_local, kv_heads, head_dim_v)
        Any DLPack producer (NumPy, PyTorch, JAX, ...), float16, bfloat16, float32 or
        float64, all three of one dtype. Inputs are never modified. ``seqlen_local`` is
        what ``shard`` gives this rank: the global length (the sum over ranks) may be any
        N >= 1, and a rank may hold no token when N is below the number of ranks.
    comm : mpi4py intracommunicator, default ``MPI.COMM_WORLD``
    causal : bool
        Global causal mask: the query at global position i sees keys j <= i.
    window : (left, right), optional
        Sliding window on global positions (flash-attn convention): keys
        ``i - left <= j <= i + right``, -1 unbounded. With ``causal`` right must be 0 or -1.
    softmax_scale : float, default ``1/sqrt(head_dim)``
    layout : {"contiguous", "zigzag", "striped"}, optional
        Which global positions each rank's rows hold: the layout you sharded with
        (``shard(x, layout=...)``). Required over several ranks with ``causal``,
        ``window``, ``mask`` or ``cu_seqlens``, where the result depends on it: left out
        there, every rank raises a ValueError saying so (no default that could be silently
        wrong). Elsewhere None means "contiguous".
    cu_seqlens : 1-D integer array, optional
        Packed documents, flash-attn's convention: global offsets ``0 = c[0] <= c[1] <=
        ... <= c[-1] = N``; document i is tokens ``c[i]:c[i+1]`` (empty documents are
        allowed). The same on every rank and for every batch row. A query then sees a key
        only inside its own document, combined with ``causal`` and ``window``. With
        ``layout="zigzag"`` it also decides where tokens live: pass the same offsets to
        ``shard``/``unshard``/``shard_indices``.
    return_lse : bool
        Also return the log-sum-exp of the scores.
    mask : burstmpi.masks.Mask, optional
        Sinks, chunks, block-sparse and per-head patterns, and their ``&``/``|``
        (``burstmpi.masks``), ANDed with ``causal``, ``window`` and the document rule.
    head_parallel : int, default 1
        Groups of this many consecutive ranks of one node share the heads, and the ring
        runs over the groups (``burstmpi._heads``); the arrays in and out are unchanged.
    topology : {"flat", "two-level", "auto"}
        One ring, or a ring in each node and one between nodes (``burstmpi._ring.twolevel``; see
        ``BurstAttention``).
    balance : {"auto", "off", "contiguous", "zigzag", "striped"}
        "auto": where ``layout`` leaves the ranks' work unbalanced (causal on contiguous
        shards), the ring runs on a balanced layout and the results come back in yours;
        "off" keeps your layout; a layout name forces that one (``BurstAttention``).
    timeout : float, optional
        Seconds; None takes ``BURSTMPI_TIMEOUT`` (default 300). Every wait on other ranks
        has this deadline; on expiry the job is aborted with exit code 75 and a
        ``burstmpi watchdog:`` line naming who it waited for; see
        ``docs/guide/configuration.md``.

    Returns
    -------
    out : array (batch, seqlen_local, heads, head_dim_v), the dtype and kind of ``q``.
    lse : array (batch, heads, seqlen_local), float32 (float64 for float64 inputs);
        only with ``return_lse``. Rows that see no key give ``out = 0`` and ``lse = -inf``.

    Notes
    -----
    The call runs on a ``BurstAttention`` plan kept for ``comm`` and the arguments that
    shape it (all but the arrays and ``cu_seqlens``), shared with ``attention_backward``:
    only a communicator's first call with them pays the set-up collectives, and the ring
    buffers and the CPU backend's working arrays are reused. At most 8 plans per
    communicator and about 1 GiB of their memory are kept (``burstmpi._plan_cache``);
    ``burstmpi.release_cached()`` frees them. The arrays returned are the caller's: later
    calls never write into them.
    """
    options = dict(causal=causal, window=window, softmax_scale=softmax_scale, layout=layout, bwd_comm="auto",
                   balance=balance, mask=mask, head_parallel=head_parallel, topology=topology, timeout=timeout)
    out, lse = plan_cache.run("attention", comm, options, lambda plan: plan.forward(q, k, v, cu_seqlens=cu_seqlens))
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, comm=None, causal=False, window=None,
                       softmax_scale=None, layout=None, cu_seqlens=None, bwd_comm="auto", mask=None,
                       head_parallel=1, topology="flat", balance="auto", timeout=None):
    """Gradients ``(dq, dk, dv)`` of ``attention`` with respect to this rank's q, k, v.

    ``out`` and ``lse`` are the forward's results (``return_lse=True``); the other
    arguments (``cu_seqlens``, ``mask``, ``head_parallel``, ``topology`` and ``balance`` included) must match
    the forward call. ``bwd_comm`` chooses
    what circulates: "burst" (Q, dO, dQ), "ring" (K, V, dK, dV) or "auto" (fewer bytes).
    Gradients are accumulated in float32 (float64 for float64 inputs) across every ring
    step and returned in the dtype and kind of the inputs.

    ``layout`` is required as in ``attention``: over several ranks with ``causal``,
    ``window``, ``mask`` or ``cu_seqlens``, left out it raises on every rank. ``timeout``
    (seconds; None takes ``BURSTMPI_TIMEOUT``, default 300): every wait on other ranks has
    this deadline; on expiry the job is aborted with exit code 75 and a
    ``burstmpi watchdog:`` line naming who it waited for; see
    ``docs/guide/configuration.md``.

    Runs on the plan kept for ``comm`` and the same arguments: the one ``attention`` used
    where ``bwd_comm`` is "auto" (the default); ``burstmpi.release_cached()`` frees it.
    """
    options = dict(causal=causal, window=window, softmax_scale=softmax_scale, layout=layout, bwd_comm=bwd_comm,
                   balance=balance, mask=mask, head_parallel=head_parallel, topology=topology, timeout=timeout)
    return plan_cache.run("attention_backward", comm, options,
                          lambda plan: plan.backward(dout, q, k, v, out, lse, cu_seqlens=cu_seqlens))


def _comm(comm):
    return MPI.COMM_WORLD if comm is None else comm


def _check_layout(fn, layout):
    if layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout: expected one of {LAYOUTS}, got {layout!r}")


def shard_indices(n, *, comm=None, layout="contiguous", cu_seqlens=None):
    """Global token indices this rank holds, in local order (int64, increasing).

    For a global sequence of ``n`` tokens: use it to shard labels or build position ids
    (RoPE) exactly as ``shard`` shards the inputs. Contiguous and striped split ``n`` as
    evenly as possible (chunk sizes differ by at most one token, larger chunks first);
    zigzag cuts 2P chunks, or with ``cu_seqlens`` zigzags each document of at least 2P
    tokens and keeps shorter ones whole (see ``burstmpi.masks._layout``). Local; no communication.

    ``layout`` defaults to "contiguous" here (where tokens go is the caller's choice), but
    the calls do not guess: pass the same ``layout=`` to ``attention`` and the others
    wherever their result depends on it (several ranks with a causal mask, a window, a
    mask or documents; ``docs/guide/sharding.md``).
    """
    fn = "shard_indices"
    _check_layout(fn, layout)
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"{fn}: n: expected the global length, an integer >= 1, got {n!r}")
    comm = _comm(comm)
    cu = check_cu_seqlens(fn, cu_seqlens, int(n))
    return layout_of(layout, comm.Get_size(), int(n), cu).positions(comm.Get_rank()).copy()


def shard(x, *, comm=None, layout="contiguous", axis=1, cu_seqlens=None):
    """Return this rank's part of the global array ``x`` along ``axis``: the rows at
    ``shard_indices(x.shape[axis], layout=..., cu_seqlens=...)``. Any length works.
    Local; no communication.

    ``layout`` defaults to "contiguous", but ``attention`` and the other calls have no
    default where the layout changes their result: pass them the layout used here.
    """
    fn = "shard"
    comm = _comm(comm)
    _check_layout(fn, layout)
    h = to_host(x, "x", fn)
    axis = _axis(fn, h, axis)
    if h.shape[axis] < 1:
        raise ValueError(f"{fn}: x.shape[{axis}]: expected a global length >= 1, got 0")
    cu = check_cu_seqlens(fn, cu_seqlens, h.shape[axis])
    lay = layout_of(layout, comm.Get_size(), h.shape[axis], cu)
    part = np.take(h, lay.positions(comm.Get_rank()), axis=axis)
    return like(part, x)


def unshard(x_local, *, comm=None, layout="contiguous", axis=1, cu_seqlens=None, timeout=None):
    """Return the global array on every rank, from each rank's ``x_local`` (the inverse of
    ``shard`` with the same ``layout`` and ``cu_seqlens``). Collective; each of its waits
    ends within ``timeout`` seconds (default ``BURSTMPI_TIMEOUT``), as ``attention``'s.

    ``layout`` defaults to "contiguous" as in ``shard``; give the one the parts were made
    with (the calls require it where it matters: ``shard``'s docstring)."""
    fn = "unshard"
    timeout = settings().timeout if timeout is None else check_timeout(fn, timeout)
    check_caller_thread(fn)
    comm = private_comm(_comm(comm), timeout, fn)
    error, h, cu = None, None, None
    try:
        _check_layout(fn, layout)
        h = to_host(x_local, "x_local", fn)
        axis = _axis(fn, h, axis)
        cu = check_cu_seqlens(fn, cu_seqlens)
    except (TypeError, ValueError) as e:
        error = e
    shape = None if h is None else tuple(None if i == axis else int(s) for i, s in enumerate(h.shape))
    sig = (("layout", layout), ("axis", axis), ("x_local.shape (but the sequence axis)", shape),
           ("x_local.dtype", None if h is None else str(h.dtype)), ("cu_seqlens", fingerprint(cu)))
    length = 0 if h is None or not isinstance(axis, int) else h.shape[axis]
    lengths = agree(comm, fn, error, sig, length, timeout=timeout)
    P = comm.Get_size()
    lay = global_layout(fn, f"x_local.shape[{axis}]", layout, P, lengths, cu)
    mine = np.ascontiguousarray(np.moveaxis(h, axis, 0))
    row = int(np.prod(mine.shape[1:], dtype=np.int64)) * mine.dtype.itemsize
    counts = [int(n) * row for n in lengths]
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
    gathered = np.empty((lay.seqlen,) + mine.shape[1:], dtype=mine.dtype)
    collective(comm, [comm.Iallgatherv([mine.view(np.uint8).reshape(-1), MPI.BYTE],
                                       [gathered.view(np.uint8).reshape(-1), (counts, displs), MPI.BYTE])],
               timeout, f"{fn}: the allgather of every rank's part")
    full = np.empty_like(gathered)
    full[lay.all_positions()] = gathered
    return like(np.moveaxis(full, 0, axis), x_local)


def _axis(fn, h, axis):
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, (int, np.integer)) or not -h.ndim <= axis < h.ndim:
        raise ValueError(f"{fn}: axis: expected an integer in [{-h.ndim}, {h.ndim}), got {axis!r}")
    return int(axis) % h.ndim
