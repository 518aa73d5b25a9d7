"""``burstmpi.torch``: burstmpi's attention as a differentiable PyTorch function.

    import burstmpi.torch as bt
    out = bt.attention(q, k, v, causal=True, layout="zigzag")   # this rank's tokens
    loss = out.float().square().sum(); loss.backward()          # every rank: collective

``attention`` is a ``torch.autograd.Function`` over the plan cache (``burstmpi._plan_cache``):
the forward runs the ring's forward on the cached plan of (communicator, options) and saves
q, k, v, out and lse, and the key, never the plan (the backward looks the plan up again, so
the cache's bounds and ``release_cached`` hold for a graph waiting for its backward); the backward
runs burstmpi's own backward (every rank calls it: the loss's backward is collective, as
in any data-parallel step). Any subset of q, k, v may require grad, and they may be
non-leaf tensors (projections). CPU tensors run on the CPU backend through zero-copy
NumPy views; CUDA tensors on the CUDA backend through DLPack, on the tensor's current
stream. Gradients come back in the inputs' dtype and device. Below ``MPI_THREAD_MULTIPLE`` a
forward or backward on a thread other than MPI's main one is refused, and so is a forward on
CUDA tensors that require grad (torch runs their backward on its autograd thread).

Importing ``burstmpi`` never imports torch; importing this module without torch raises an
ImportError that says so.
"""

import contextlib

try:
    import torch
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("burstmpi.torch needs PyTorch (pip install torch); `import burstmpi` alone "
                      "does not") from e

from mpi4py import MPI

from . import _plan_cache as plan_cache
from ._transport import watchdog

__all__ = ["attention"]

_NAME = "burstmpi.torch.attention"


def _check_thread(what, cuda_backward=False):
    """Refuse, before any MPI call, what MPI forbids below ``MPI_THREAD_MULTIPLE``: a call
    from a thread other than the one that initialised MPI. ``cuda_backward``: the backward
    will need MPI on another thread, as torch's autograd engine runs the backward of CUDA
    tensors on a thread of its own per device (that of CPU tensors on the thread that calls
    ``backward()``: measured by ``tests/adapters/test_adapter_threads.py``), so the forward
    refuses it early."""
    if cuda_backward:
        watchdog.require_multiple(_NAME, "the backward of CUDA tensors that require grad runs on torch's autograd "
                                         "thread of the device, not on the thread that initialised MPI")
    watchdog.check_caller_thread(_NAME, what)


def _options(causal, window, softmax_scale, layout, bwd_comm, mask, head_parallel, topology, timeout, balance):
    """The plan cache's options (``plan_cache.run``) of a call."""
    return dict(causal=causal, window=window, softmax_scale=softmax_scale, layout=layout, bwd_comm=bwd_comm,
                balance=balance, mask=mask, head_parallel=head_parallel, topology=topology, timeout=timeout)


def _stream(t):
    """Run CuPy on ``t``'s current CUDA stream (a no-op context for CPU tensors)."""
    if not t.is_cuda:
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.ExternalStream(torch.cuda.current_stream(t.device).cuda_stream)


class _Attention(torch.autograd.Function):
    """The ring's forward and backward on the cached plan of (``comm``, ``options``), looked
    up in the plan cache at each (``plan_cache.run``): the autograd graph holds the cache's
    key, never a plan, so the cache's bounds and ``release_cached`` hold for the plans a
    graph waiting for its backward would use."""

    @staticmethod
    def forward(ctx, q, k, v, comm, options, cu_seqlens):
        with _stream(q):
            out, lse = plan_cache.run(_NAME, comm, options, lambda plan: plan.forward(
                q.detach(), k.detach(), v.detach(), cu_seqlens=cu_seqlens))
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.comm, ctx.options, ctx.cu_seqlens = comm, options, cu_seqlens
        ctx.mark_non_differentiable(lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        _check_thread("the backward")
        q, k, v, out, lse = ctx.saved_tensors
        with _stream(q):
            dq, dk, dv = plan_cache.run(_NAME, ctx.comm, ctx.options, lambda plan: plan.backward(
                dout.contiguous(), q.detach(), k.detach(), v.detach(), out, lse, cu_seqlens=ctx.cu_seqlens))
        return dq, dk, dv, None, None, None


def attention(q, k, v, *, comm=None, causal=False, window=None, softmax_scale=None, layout=None,
              cu_seqlens=None, bwd_comm="auto", mask=None, head_parallel=1, topology="flat", balance="auto",
              timeout=None):
    """``burstmpi.attention`` as a differentiable function of torch tensors q, k, v.

    Shapes, masks (``mask=``: ``burstmpi.masks``), ``head_parallel``, ``topology``, ``balance``, documents and
    layouts as in ``burstmpi.attention`` (this rank's part of
    the sequence; ``cu_seqlens`` a list, NumPy array or CPU tensor of global offsets).
    ``layout`` is required as there: over several ranks with ``causal``, ``window``,
    ``mask`` or ``cu_seqlens``, left out it raises on every rank. ``timeout`` (seconds;
    None takes ``BURSTMPI_TIMEOUT``, default 300): every wait on other ranks has this
    deadline; on expiry the job is aborted with exit code 75 and a ``burstmpi watchdog:``
    line naming who it waited for; see ``docs/guide/configuration.md``.
    Returns out like q. Collective over ``comm`` in the forward and in the backward."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{_NAME}: {name}: expected a torch.Tensor, got {type(x).__name__}")
    _check_thread("the forward", cuda_backward=q.is_cuda and torch.is_grad_enabled()
                  and any(x.requires_grad for x in (q, k, v)))
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    options = _options(causal, window, softmax_scale, layout, bwd_comm, mask, head_parallel, topology, timeout,
                       balance)
    # The plan is the functional API's cache's (``burstmpi._plan_cache``: per communicator,
    # dropped with it), so its ring buffers are reused from step to step.
    return _Attention.apply(q, k, v, MPI.COMM_WORLD if comm is None else comm, options, cu_seqlens)
