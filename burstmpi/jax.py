"""``burstmpi.jax``: burstmpi's attention as a differentiable JAX function, eager or jitted.

    import burstmpi.jax as bj
    loss = lambda q, k, v: bj.attention(q, k, v, causal=True, layout="zigzag").sum()
    g = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)      # collective, every rank

``attention`` is a ``jax.custom_vjp`` whose forward and backward are burstmpi's own, run
inside XLA's program as callbacks. The residuals are q, k, v, out and lse.

**Buffers, not host copies.** Where JAX has ``jax.experimental.buffer_callback`` (checked
with JAX 0.10), the callbacks get XLA's own buffers: on the CPU, q, k and v reach burstmpi as
read-only NumPy views of the memory XLA holds them in (DLPack; no copy), and the results
are written into the buffers XLA allocated for them; on a GPU they reach burstmpi's CUDA
kernels as CuPy arrays (DLPack) and burstmpi runs on XLA's stream
(``cupy.cuda.ExternalStream``), so nothing goes through host memory. Older JAX (and a
GPU without CuPy) falls back to ``jax.experimental.io_callback``, which receives host arrays: XLA copies the arguments
for it, and GPU arrays are staged through host memory and run on the CPU backend (a
warning says so the first time). Both give the same bits on the CPU.

**Program order.** The ring's collectives must run in the same order on every rank, once
per call. A callback that XLA may reorder, merge or drop cannot carry them: an unordered
``pure_callback`` may be moved or removed, and ``buffer_callback(has_side_effect=True)``
is only kept (never removed or merged), not ordered: XLA schedules it wherever its inputs
are ready, so a call whose inputs are ready sooner runs before one written above it
(``tests/adapters/test_adapter_jax.py`` shows it). What orders JAX's side effects is its
ordering token: ``io_callback(..., ordered=True)`` threads one token through every ordered
callback of a program, each taking the token of the one before it and giving the next
one its own. Both paths here take their place in that chain: the fallback is such an
``io_callback``, and the buffer path is JAX's buffer-callback custom call given that token
as an extra operand and result (``_ordered_buffer_call``). So every call runs, once, in
program order, interleaved in order with the program's own ordered ``io_callback`` calls,
inside ``jax.jit``, ``jax.grad`` and ``jax.value_and_grad`` as eagerly.

Importing ``burstmpi`` never imports JAX; importing this module without JAX raises an
ImportError that says so.
"""

try:
    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError("burstmpi.jax needs JAX (pip install jax); `import burstmpi` alone does not") from e

import dataclasses
import functools
import warnings

import numpy as np

from . import _plan_cache as plan_cache
from ._validate import check_cu_seqlens, fingerprint

__all__ = ["attention"]

_NAME = "burstmpi.jax.attention"
_FUNCS = {}
_KEPT = 32
_warned = []
_KDLCPU = 1  # DLPack's device type of host memory

# -- an ordered buffer callback ---------------------------------------------------------
#
# JAX's public ``buffer_callback`` has no ordered form, so its custom call is lowered here
# with JAX's ordering token of ``io_callback(ordered=True)`` (``OrderedIOEffect``) as an
# extra operand and result: the FFI handler takes them as two more (empty) buffers, which
# the callback skips. That needs a few of JAX's internals; where they are missing or
# different, ``_BUFFERS`` is False and every call takes the ``io_callback`` path.
_TARGETS = {"cpu": "xla_buffer_python_cpu_callback", "cuda": "xla_buffer_python_gpu_callback",
            "rocm": "xla_buffer_python_gpu_callback"}


def _refuse(what):
    def rule(*args, **kwargs):
        raise ValueError(f"{_NAME}: {what}")
    return rule


def _lower_ordered(ctx, *args, callback, result_avals):
    """JAX's buffer-callback custom call, with the ordering token in and out."""
    del result_avals
    platforms = tuple(ctx.module_context.platforms)
    if len(platforms) != 1 or platforms[0] not in _TARGETS:
        raise NotImplementedError(f"{_NAME}: buffer callbacks run on one CPU or GPU platform, got {platforms}")
    n = len(args)

    def run(exec_ctx, token_in, *buffers):  # (inputs..., token out, outputs...)
        callback(exec_ctx, buffers[n + 1:], *buffers[:n])
        return ()

    ctx.module_context.add_host_callback(run)
    index = np.uint64(len(ctx.module_context.host_callbacks) - 1)
    with_token = dataclasses.replace(ctx, avals_in=[_core.abstract_token, *ctx.avals_in],
                                     avals_out=[_core.abstract_token, *ctx.avals_out])
    token, *results = _ffi.ffi_lowering(_TARGETS[platforms[0]], has_side_effect=True)(
        with_token, ctx.tokens_in.get(_OrderedIOEffect), *args, index=index)
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(_mlir.TokenSet({_OrderedIOEffect: token})))
    return results


def _register():
    """The primitive of an ordered buffer call, or None where this JAX's internals differ."""
    try:
        p = _core.Primitive("burstmpi_ordered_buffer_callback")
        p.multiple_results = True
        _dispatch.simple_impl(p)
        p.def_effectful_abstract_eval(lambda *avals, callback, result_avals: (result_avals, {_OrderedIOEffect}))
        _ad.primitive_jvps[p] = _refuse("its callbacks are differentiated through its custom_vjp only")
        _ad.primitive_transposes[p] = _refuse("its callbacks are differentiated through its custom_vjp only")
        _batching.primitive_batchers[p] = _refuse(
            "cannot be vmapped: its ring's collectives run once per call, in program order (as an ordered "
            "io_callback, which jax.vmap refuses too); put the batch in q's first axis")
        _mlir.register_lowering(p, _lower_ordered, cacheable=False)
    except (AttributeError, TypeError):
        return None
    return p


try:
    import jax.experimental.buffer_callback  # noqa: F401 - the public feature this path stands on
    from jax._src import core as _core, dispatch as _dispatch, ffi as _ffi
    from jax._src.callback import _OrderedIOEffect
    from jax._src.interpreters import ad as _ad, batching as _batching, mlir as _mlir
except ImportError:  # an older (or reorganised) JAX: the io_callback path
    _ordered_p = None
else:
    _ordered_p = _register()
# Whether calls run on XLA's buffers. Tests set it False to take the io_callback path (in
# what is traced after: JAX keeps a function's trace).
_BUFFERS = _ordered_p is not None


def _ordered_buffer_call(callback, shapes, *args):
    """``callback(ctx, outputs, *inputs)`` on XLA's buffers of ``args``, writing the results
    (``shapes``: ShapeDtypeStructs) into ``outputs``; ordered as ``io_callback(ordered=True)``."""
    avals = tuple(_core.ShapedArray(s.shape, s.dtype) for s in shapes)
    return tuple(_ordered_p.bind(*args, callback=callback, result_avals=avals))


# -- from XLA's buffers to burstmpi's arrays and back ----------------------------------


def _host_view(buf):
    """A read-only NumPy view of an input buffer on the CPU: DLPack, or (bfloat16, which
    NumPy's DLPack lacks) ``__array__``; never a copy."""
    try:
        return np.from_dlpack(buf)
    except (BufferError, RuntimeError, TypeError):
        a = np.asarray(buf)
        a.flags.writeable = False  # XLA's input: burstmpi never writes it, and now cannot
        return a


def _cupy():
    try:
        import cupy
    except ImportError as e:
        raise NotImplementedError(f"{_NAME}: GPU arrays need CuPy to reach burstmpi's CUDA kernels: pip install "
                                  f"'burstmpi[cuda12]' (CUDA 12) or 'burstmpi[cuda13]' (CUDA 13); {e}") from None
    return cupy


def _device_view(cupy, buf):
    """A CuPy view of a GPU buffer: DLPack, or the CUDA array interface."""
    try:
        return cupy.from_dlpack(buf)
    except (BufferError, RuntimeError, TypeError, ValueError):
        return cupy.asarray(buf)


def _on_host(run, *arrays):
    """``run`` on the host arrays ``io_callback`` gives."""
    return tuple(np.asarray(r) for r in run([np.asarray(a) for a in arrays]))


def _on_buffers(run, ctx, outs, *ins):
    """``run(arrays, device)`` (device: None on the CPU, else the GPU's ordinal) on the input
    buffers ``ins``, its results written into the output buffers ``outs``."""
    if ins[0].__dlpack_device__()[0] == _KDLCPU:
        for dst, result in zip(outs, run([_host_view(b) for b in ins], None)):
            np.copyto(np.asarray(dst), result)
        return
    cupy = _cupy()
    device = ins[0].__dlpack_device__()[1]
    # XLA's stream is current: burstmpi's kernels and the NCCL transport's waits are
    # ordered on it after XLA's producers of the inputs, and before XLA's consumers.
    with cupy.cuda.Device(device), cupy.cuda.ExternalStream(ctx.stream, device):
        results = run([_device_view(cupy, b) for b in ins], device)
        for dst, result in zip(outs, results):
            _device_view(cupy, dst)[...] = result


# -- the function -------------------------------------------------------------------------


def _lse_dtype(dtype):
    return jnp.float64 if np.dtype(dtype) == np.float64 else jnp.float32


def _runners(plan, cu, comm, options):
    """``run_forward`` and ``run_backward``: ``run(arrays, device)`` calls the plan's forward or
    backward on ``arrays``, on ``plan`` (host arrays: ``device`` None) or on the cached plan of
    the same options on the CUDA kernels of GPU ``device``."""

    def plan_on(device):
        if device is None:
            return plan
        # Made (collectively) in the first call that brings GPU buffers: every rank reaches
        # it there, as the calls run in program order.
        gpu = dict(options, backend="cuda", device=device)
        return plan_cache.run(_NAME, comm, gpu, lambda p: p)

    def run_forward(arrays, device=None):
        return plan_on(device).forward(*arrays, cu_seqlens=cu)

    def run_backward(arrays, device=None):
        return plan_on(device).backward(*arrays, cu_seqlens=cu)

    return run_forward, run_backward


def _build(plan, cu, comm, options, buffers):
    """The custom_vjp function of one plan and one document packing, on XLA's buffers
    (``buffers``) or on host arrays (``io_callback``)."""
    run_forward, run_backward = _runners(plan, cu, comm, options)
    # One callback object each, made once: JAX caches what it compiled for a call (eagerly,
    # every call) by the callback among its parameters.
    wrap = _on_buffers if buffers else _on_host
    on_forward, on_backward = functools.partial(wrap, run_forward), functools.partial(wrap, run_backward)

    def call(callback, shapes, *args):
        if buffers:
            return _ordered_buffer_call(callback, shapes, *args)
        return io_callback(callback, shapes, *args, ordered=True)

    def forward(q, k, v):
        B, C, Z, _ = q.shape
        shapes = (jax.ShapeDtypeStruct(q.shape[:3] + (v.shape[3],), q.dtype),
                  jax.ShapeDtypeStruct((B, Z, C), _lse_dtype(q.dtype)))
        return call(on_forward, shapes, q, k, v)

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(q, k, v)[0]

    def attend_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def attend_bwd(res, dout):
        q, k, v, out, lse = res
        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        return tuple(call(on_backward, shapes, dout.astype(q.dtype), q, k, v, out, lse))

    attend.defvjp(attend_fwd, attend_bwd)
    return attend


def _on_gpu(x):
    try:
        return any(d.platform != "cpu" for d in x.devices())
    except Exception:  # a tracer: its placement is XLA's business
        return False


def _use_buffers(arrays):
    """Whether this call runs on XLA's buffers: where JAX has buffer callbacks, and, for a
    GPU, CuPy is there to take them (else the io_callback path stages them, with a warning)."""
    if not _BUFFERS:
        return False
    if any(_on_gpu(x) for x in arrays) or jax.default_backend() != "cpu":
        try:
            _cupy()
        except NotImplementedError:
            return False
    return True


def attention(q, k, v, *, comm=None, causal=False, window=None, softmax_scale=None, layout=None,
              cu_seqlens=None, bwd_comm="auto", mask=None, head_parallel=1, topology="flat", timeout=None):
    """``burstmpi.attention`` as a differentiable function of JAX arrays q, k, v (eager, or
    inside ``jax.jit``/``jax.grad``). Shapes, masks, ``head_parallel``, ``topology``, documents and layouts as in
    ``burstmpi.attention`` (this rank's part of the sequence; ``cu_seqlens`` a list or
    NumPy array, and ``mask`` a ``burstmpi.masks`` mask: static, like a shape). Returns out like q. Collective over ``comm`` in the
    forward and in the backward; every rank must trace and run the same program.

    CPU arrays reach the CPU backend without a copy, GPU arrays burstmpi's CUDA kernels on
    XLA's stream (with CuPy installed), where JAX has ``jax.experimental.buffer_callback``;
    older JAX runs the calls as ordered host callbacks (see the module's docstring).

    ``layout`` is required as in ``burstmpi.attention``: over several ranks with
    ``causal``, ``window``, ``mask`` or ``cu_seqlens``, left out it raises on every rank
    (when the forward runs). ``timeout`` (seconds; None takes ``BURSTMPI_TIMEOUT``, default
    300): every wait on other ranks has this deadline; on expiry the job is aborted with
    exit code 75 and a ``burstmpi watchdog:`` line naming who it waited for; see
    ``docs/guide/configuration.md``."""
    cu = check_cu_seqlens(_NAME, cu_seqlens)
    options = dict(causal=causal, window=window, softmax_scale=softmax_scale, layout=layout, bwd_comm=bwd_comm,
                   mask=mask, head_parallel=head_parallel, topology=topology, timeout=timeout, backend="cpu")
    # The plan is the functional API's cache's (``burstmpi._plan_cache``: per communicator,
    # dropped with it); the traced function is kept per plan, documents and path (a
    # function holds its plan, so the plan's id is not reused while the entry lives).
    plan = plan_cache.run(_NAME, comm, options, lambda plan: plan)
    buffers = _use_buffers((q, k, v))
    key = (id(plan), fingerprint(cu), buffers)
    fn = _FUNCS.get(key)
    if fn is None:
        if len(_FUNCS) >= _KEPT:
            _FUNCS.pop(next(iter(_FUNCS)))
        fn = _FUNCS[key] = _build(plan, cu, comm, options, buffers)
    if not buffers and not _warned and any(_on_gpu(x) for x in (q, k, v)):
        _warned.append(True)
        warnings.warn(f"{_NAME}: GPU arrays go through host callbacks (XLA copies them to host memory and "
                      "back) and run on the CPU backend: this JAX has no jax.experimental.buffer_callback, or "
                      "CuPy is missing; for GPU speed install CuPy and a JAX with buffer_callback, or use "
                      "burstmpi.torch",
                      stacklevel=2)
    return fn(q, k, v)
