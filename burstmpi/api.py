"""The functional API: ``attention``, ``attention_backward``, ``shard``, ``unshard``."""

import numpy as np
from mpi4py import MPI

from .comm import private_comm
from .interop import like, to_host
from .layout import LAYOUTS, layout_for
from .plan import BurstAttention
from .validate import agree

__all__ = ["attention", "attention_backward", "shard", "unshard"]


def attention(q, k, v, *, comm=None, causal=False, window=None, softmax_scale=None,
              layout="contiguous", return_lse=False):
    """Exact softmax attention over a sequence spread across the ranks of ``comm``.

    Collective: every rank of ``comm`` calls it with its own part of the sequence.

    Parameters
    ----------
    q : array (batch, seqlen_local, heads, head_dim)
    k : array (batch, seqlen_local, kv_heads, head_dim); ``heads % kv_heads == 0``
        (grouped-query and multi-query attention without copying K/V).
    v : array (batch, seqlen_local, kv_heads, head_dim_v)
        Any DLPack producer (NumPy, PyTorch, JAX, ...), float16, bfloat16, float32 or
        float64, all three of one dtype. Inputs are never modified.
    comm : mpi4py intracommunicator, default ``MPI.COMM_WORLD``
    causal : bool
        Global causal mask: the query at global position i sees keys j <= i.
    window : (left, right), optional
        Sliding window on global positions (flash-attn convention): keys
        ``i - left <= j <= i + right``, -1 unbounded. With ``causal`` right must be 0 or -1.
    softmax_scale : float, default ``1/sqrt(head_dim)``
    layout : {"contiguous", "zigzag", "striped"}
        Which global positions each rank's rows hold (see ``shard``).
    return_lse : bool
        Also return the log-sum-exp of the scores.

    Returns
    -------
    out : array (batch, seqlen_local, heads, head_dim_v), the dtype and kind of ``q``.
    lse : array (batch, heads, seqlen_local), float32 (float64 for float64 inputs);
        only with ``return_lse``. Rows that see no key give ``out = 0`` and ``lse = -inf``.
    """
    plan = BurstAttention(comm, causal=causal, window=window, softmax_scale=softmax_scale,
                          layout=layout)
    out, lse = plan.forward(q, k, v)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, comm=None, causal=False, window=None,
                       softmax_scale=None, layout="contiguous", bwd_comm="auto"):
    """Gradients ``(dq, dk, dv)`` of ``attention`` with respect to this rank's q, k, v.

    ``out`` and ``lse`` are the forward's results (``return_lse=True``); the other
    arguments must match the forward call. ``bwd_comm`` chooses what circulates:
    "burst" (Q, dO, dQ), "ring" (K, V, dK, dV) or "auto" (fewer bytes). Gradients
    are accumulated in float32 (float64 for float64 inputs) across every ring step and
    returned in the dtype and kind of the inputs.
    """
    plan = BurstAttention(comm, causal=causal, window=window, softmax_scale=softmax_scale,
                          layout=layout, bwd_comm=bwd_comm)
    return plan.backward(dout, q, k, v, out, lse)


def _comm(comm):
    return MPI.COMM_WORLD if comm is None else comm


def shard(x, *, comm=None, layout="contiguous", axis=1):
    """Return this rank's part of the global array ``x`` along ``axis``.

    ``contiguous``: rank r takes chunk r of P; ``zigzag``: chunks r and 2P-1-r of 2P;
    ``striped``: every P-th token from r. The length along ``axis`` must split evenly
    (a clear error otherwise). Local; no communication.
    """
    comm = _comm(comm)
    if layout not in LAYOUTS:
        raise ValueError(f"shard: layout: expected one of {LAYOUTS}, got {layout!r}")
    h = to_host(x, "x", "shard")
    axis = _axis("shard", h, axis)
    lay = layout_for(layout, comm.Get_size(), h.shape[axis], argname=f"shard: x.shape[{axis}]")
    part = np.take(h, lay.positions(comm.Get_rank()), axis=axis)
    return like(part, x)


def unshard(x_local, *, comm=None, layout="contiguous", axis=1):
    """Return the global array on every rank, from each rank's ``x_local``. Collective."""
    user = _comm(comm)
    comm = private_comm(user)
    error, h = None, None
    try:
        if layout not in LAYOUTS:
            raise ValueError(f"unshard: layout: expected one of {LAYOUTS}, got {layout!r}")
        h = to_host(x_local, "x_local", "unshard")
        axis = _axis("unshard", h, axis)
    except (TypeError, ValueError) as e:
        error = e
    sig = (("layout", layout), ("axis", axis),
           ("x_local.shape", None if h is None else tuple(h.shape)),
           ("x_local.dtype", None if h is None else str(h.dtype)))
    agree(comm, "unshard", error, sig)
    P = comm.Get_size()
    lay = layout_for(layout, P, P * h.shape[axis], argname="unshard: x_local.shape")
    mine = np.ascontiguousarray(np.moveaxis(h, axis, 0))
    gathered = np.empty((P,) + mine.shape, dtype=mine.dtype)
    comm.Allgather([mine.view(np.uint8), MPI.BYTE], [gathered.view(np.uint8), MPI.BYTE])
    full = np.empty((P * mine.shape[0],) + mine.shape[1:], dtype=mine.dtype)
    full[lay.all_positions()] = gathered.reshape(full.shape)
    return like(np.moveaxis(full, 0, axis), x_local)


def _axis(fn, h, axis):
    if not isinstance(axis, (int, np.integer)) or not -h.ndim <= axis < h.ndim:
        raise ValueError(f"{fn}: axis: expected an integer in [{-h.ndim}, {h.ndim}), got {axis!r}")
    return int(axis) % h.ndim
