"""``burstmpi.jax``: burstmpi's attention as a differentiable JAX function, eager or jitted.

    import burstmpi.jax as bj
    loss = lambda q, k, v: bj.attention(q, k, v, causal=True, layout="zigzag").sum()
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)      # collective, every rank

``attention`` is a ``jax.custom_vjp`` whose forward and backward are burstmpi's own, run
as *ordered* host callbacks (``jax.experimental.io_callback(..., ordered=True)``): XLA keeps
them in program order on every rank and never drops, duplicates or reorders them, so the
ring's collectives match across ranks inside ``jax.jit``, ``jax.grad`` and
``jax.value_and_grad`` as they do eagerly (an unordered ``pure_callback`` could be moved or
removed, and one rank's ring would then wait for another's forever). The residuals are q,
k, v, out and lse.

Memory: a host callback receives host arrays. CPU arrays pass through without a copy to the
CPU backend. Arrays on a GPU are staged through host memory by XLA (and then run on the
CPU backend): that is slow, so it says so with a warning the first time; for GPU arrays use
the torch adapter or call ``burstmpi.attention`` on the arrays (DLPack, zero-copy) outside
``jit``.

Importing ``burstmpi`` never imports JAX; importing this module without JAX raises an
ImportError that says so.
"""

try:
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("burstmpi.jax needs JAX (pip install jax); `import burstmpi` alone does not") from e

import warnings

import numpy as np

from . import _plan_cache as plan_cache
from ._validate import check_cu_seqlens, fingerprint

__all__ = ["attention"]

_FUNCS = {}
_KEPT = 32
_warned = []


def _lse_dtype(dtype):
    return jnp.float64 if np.dtype(dtype) == np.float64 else jnp.float32


def _build(plan, cu):
    """The custom_vjp function of one plan and one document packing."""

    def host_forward(q, k, v):
        out, lse = plan.forward(np.asarray(q), np.asarray(k), np.asarray(v), cu_seqlens=cu)
        return np.asarray(out), np.asarray(lse)

    def host_backward(dout, q, k, v, out, lse):
        return tuple(np.asarray(g) for g in plan.backward(*(np.asarray(a) for a in (dout, q, k, v, out, lse)),
                                                           cu_seqlens=cu))

    def forward(q, k, v):
        B, C, Z, _ = q.shape
        shapes = (jax.ShapeDtypeStruct(q.shape[:3] + (v.shape[3],), q.dtype),
                  jax.ShapeDtypeStruct((B, Z, C), _lse_dtype(q.dtype)))
        return io_callback(host_forward, shapes, q, k, v, ordered=True)

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(q, k, v)[0]

    def attend_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def attend_bwd(res, dout):
        q, k, v, out, lse = res
        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        return io_callback(host_backward, shapes, dout.astype(q.dtype), q, k, v, out, lse, ordered=True)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def _on_gpu(x):
    try:
        return any(d.platform != "cpu" for d in x.devices())
    except Exception:  # a tracer: its placement is XLA's business
        return False


def attention(q, k, v, *, comm=None, causal=False, window=None, softmax_scale=None, layout=None,
              cu_seqlens=None, bwd_comm="auto", mask=None, head_parallel=1, topology="flat", timeout=None):
    """``burstmpi.attention`` as a differentiable function of JAX arrays q, k, v (eager, or
    inside ``jax.jit``/``jax.grad``). Shapes, masks, ``head_parallel``, ``topology``, documents and layouts as in
    ``burstmpi.attention`` (this rank's part of the sequence; ``cu_seqlens`` a list or
    NumPy array, and ``mask`` a ``burstmpi.masks`` mask: static, like a shape). Returns out like q. Collective over ``comm`` in the
    forward and in the backward; every rank must trace and run the same program.

    ``layout`` is required as in ``burstmpi.attention``: over several ranks with
    ``causal``, ``window``, ``mask`` or ``cu_seqlens``, left out it raises on every rank
    (when the forward runs). ``timeout`` (seconds; None takes ``BURSTMPI_TIMEOUT``, default
    300): every wait on other ranks has this deadline; on expiry the job is aborted with
    exit code 75 and a ``burstmpi watchdog:`` line naming who it waited for; see
    ``docs/guide/configuration.md``."""
    cu = check_cu_seqlens("burstmpi.jax.attention", cu_seqlens)
    options = dict(causal=causal, window=window, softmax_scale=softmax_scale, layout=layout, bwd_comm=bwd_comm,
                   mask=mask, head_parallel=head_parallel, topology=topology, timeout=timeout, backend="cpu")
    # The plan is the functional API's cache's (``burstmpi._plan_cache``: per communicator,
    # dropped with it); the traced function is kept per plan and documents (a function
    # holds its plan, so the plan's id is not reused while the entry lives).
    plan = plan_cache.run("burstmpi.jax.attention", comm, options, lambda plan: plan)
    key = (id(plan), fingerprint(cu))
    fn = _FUNCS.get(key)
    if fn is None:
        if len(_FUNCS) >= _KEPT:
            _FUNCS.pop(next(iter(_FUNCS)))
        fn = _FUNCS[key] = _build(plan, cu)
    if not _warned and any(_on_gpu(x) for x in (q, k, v)):
        _warned.append(True)
        warnings.warn("burstmpi.jax.attention: GPU arrays go through host callbacks (XLA copies them to "
                      "host memory and back) and run on the CPU backend; for GPU speed call "
                      "burstmpi.attention on the arrays outside jit, or use burstmpi.torch", stacklevel=2)
    return fn(q, k, v)
