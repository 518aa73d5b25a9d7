"""``burstmpi.torch``: burstmpi's attention as a differentiable PyTorch function.

    import burstmpi.torch as bt
    out = bt.attention(q, k, v, causal=True, layout="zigzag")   # this rank's tokens
    loss = out.float().square().sum(); loss.backward()          # every rank: collective

``attention`` is a ``torch.autograd.Function`` over a cached ``BurstAttention`` plan: the
forward runs the ring's forward and saves q, k, v, out and lse (nothing else); the backward
runs burstmpi's own backward (every rank calls it: the loss's backward is collective, as
in any data-parallel step). Any subset of q, k, v may require grad, and they may be
non-leaf tensors (projections). CPU tensors run on the CPU backend through zero-copy
NumPy views; CUDA tensors on the CUDA backend through DLPack, on the tensor's current
stream. Gradients come back in the inputs' dtype and device.

Importing ``burstmpi`` never imports torch; importing this module without torch raises an
ImportError that says so.
"""

import contextlib

try:
    import torch
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("burstmpi.torch needs PyTorch (pip install torch); `import burstmpi` alone "
                      "does not") from e


from . import _plan_cache as plan_cache

__all__ = ["attention"]

def _plan(comm, causal, window, softmax_scale, layout, bwd_comm, mask, head_parallel, topology, timeout):
    """The plan for these options, kept by the functional API's cache (``burstmpi._plan_cache``:
    per communicator, dropped with it) so its ring buffers are reused from step to step."""
    options = dict(causal=causal, window=window, softmax_scale=softmax_scale, layout=layout, bwd_comm=bwd_comm,
                   mask=mask, head_parallel=head_parallel, topology=topology, timeout=timeout)
    return plan_cache.run("burstmpi.torch.attention", comm, options, lambda plan: plan)


def _stream(t):
    """Run CuPy on ``t``'s current CUDA stream (a no-op context for CPU tensors)."""
    if not t.is_cuda:
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.ExternalStream(torch.cuda.current_stream(t.device).cuda_stream)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, cu_seqlens):
        with _stream(q):
            out, lse = plan.forward(q.detach(), k.detach(), v.detach(), cu_seqlens=cu_seqlens)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.cu_seqlens = plan, cu_seqlens
        ctx.mark_non_differentiable(lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with _stream(q):
            dq, dk, dv = ctx.plan.backward(dout.contiguous(), q.detach(), k.detach(), v.detach(), out, lse,
                                           cu_seqlens=ctx.cu_seqlens)
        return dq, dk, dv, None, None


def attention(q, k, v, *, comm=None, causal=False, window=None, softmax_scale=None, layout=None,
              cu_seqlens=None, bwd_comm="auto", mask=None, head_parallel=1, topology="flat", timeout=None):
    """``burstmpi.attention`` as a differentiable function of torch tensors q, k, v.

    Shapes, masks (``mask=``: ``burstmpi.masks``), ``head_parallel``, ``topology``, documents and layouts as in ``burstmpi.attention`` (this rank's part of
    the sequence; ``cu_seqlens`` a list, NumPy array or CPU tensor of global offsets).
    ``layout`` is required as there: over several ranks with ``causal``, ``window``,
    ``mask`` or ``cu_seqlens``, left out it raises on every rank. ``timeout`` (seconds;
    None takes ``BURSTMPI_TIMEOUT``, default 300): every wait on other ranks has this
    deadline; on expiry the job is aborted with exit code 75 and a ``burstmpi watchdog:``
    line naming who it waited for; see ``docs/guide/configuration.md``.
    Returns out like q. Collective over ``comm`` in the forward and in the backward."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"burstmpi.torch.attention: {name}: expected a torch.Tensor, got {type(x).__name__}")
    if isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.detach().cpu().numpy()
    plan = _plan(comm, causal, window, softmax_scale, layout, bwd_comm, mask, head_parallel, topology, timeout)
    return _Attention.apply(q, k, v, plan, cu_seqlens)
