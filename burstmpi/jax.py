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

**Plans.** The traced functions hold the plan cache's key (communicator and options), not a
plan: each call looks its plan up in ``burstmpi._plan_cache`` (``plan_cache.run``), so the
cache's bounds and ``release_cached`` hold for them.

**One device per rank; MPI_THREAD_MULTIPLE.** Inside ``shard_map`` or ``pmap`` over several
devices of one process XLA would run the call on each at once, on one rank's ring: refused
when traced (and when lowered). A ``jax.jit`` of arrays sharded over this process's devices
runs the call once, on the gathered arrays. XLA runs the callbacks on threads of its own, so
below ``MPI_THREAD_MULTIPLE`` the call is refused when traced (``docs/guide/frameworks.md``).

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
import math
import warnings

import numpy as np
from mpi4py import MPI

from . import _plan_cache as plan_cache
from ._transport import watchdog
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


# -- what the ring needs of the program: one device per rank, MPI from XLA's threads -------


def _refuse_devices(n, how):
    """Refuse a program that calls burstmpi on ``n`` > 1 devices of this process at once."""
    if n <= 1:
        return
    raise NotImplementedError(
        f"{_NAME}: devices per call: expected 1, got {n}: {how} runs this call on each of {n} devices of "
        "this process, at once, on one rank's ring. burstmpi's ring is over MPI ranks, one process per device "
        "(not JAX's one process per host owning all its devices). Run one MPI rank per device, each seeing "
        "one: on GPUs set CUDA_VISIBLE_DEVICES per rank (e.g. from its local rank), on the CPU "
        "XLA_FLAGS=--xla_force_host_platform_device_count=1; or call it outside shard_map/pmap (under "
        "jax.jit, arrays sharded over this process's devices are gathered to one device for the call)")


def _devices_per_call(axis_context):
    """How many of this process's devices run each call of the program being lowered: one,
    except inside ``shard_map`` (and ``pmap``, which JAX 0.10 lowers as one), whose manual
    axes run it once per device of the mesh."""
    manual = getattr(axis_context, "manual_axes", None)
    mesh = getattr(axis_context, "mesh", None)
    if not manual or mesh is None:
        # JAX releases that lower pmap the older way give a replica context: one call per replica.
        replicas = getattr(getattr(axis_context, "axis_env", None), "nreps", 1) or 1
        return min(int(replicas), jax.local_device_count())
    per_call = math.prod(mesh.shape[a] for a in manual)
    try:
        devices = np.ravel(mesh.devices)  # a concrete mesh's: count this process's own
    except (AttributeError, ValueError):
        return min(per_call, jax.local_device_count())  # an abstract mesh's: at most the local ones
    mine = jax.process_index()
    return min(per_call, sum(d.process_index == mine for d in devices))


def _devices_of_program(axis_context):
    """How many devices the program being lowered spans (its partitions)."""
    mesh = getattr(axis_context, "mesh", None)
    if mesh is not None:
        return math.prod(mesh.shape.values())
    return getattr(axis_context, "num_devices", 1) or 1


def _refuse_other_processes(axis_context):
    """A jit over devices of several processes (``jax.distributed``) runs a callback on the
    first device only, in one process: the other ranks' rings would wait for it forever."""
    processes = {d.process_index for d in (getattr(axis_context, "device_assignment", None) or ())}
    if len(processes) > 1:
        raise NotImplementedError(
            f"{_NAME}: processes of the program's devices: expected this process only, got {sorted(processes)}: "
            "XLA would run the call on one device of one process, and the other ranks would wait for it. "
            "burstmpi's ring is over MPI ranks, each calling it on its own arrays: one process per device")


def _check_devices_at_trace():
    """``_refuse_devices`` where the trace shows it: inside ``shard_map`` or ``pmap``, whose
    manual mesh axes are in the abstract mesh (the buffer path's lowering checks it again,
    with the mesh's devices; a sharded ``jax.jit`` shows only there, and is allowed)."""
    get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
    if get_mesh is None:
        return
    mesh = get_mesh()
    manual = getattr(mesh, "manual_axes", ()) or ()
    per_call = math.prod(mesh.shape[a] for a in manual)
    _refuse_devices(min(per_call, jax.local_device_count()), "jax.shard_map or jax.pmap")


def _check_thread_level():
    """Refuse, when the program is traced, an MPI below ``MPI_THREAD_MULTIPLE``. XLA runs the
    callbacks (both paths, eagerly and under jit) on this thread or on threads of its own,
    as it dispatches: any call whose program is dispatched before the one before it has
    finished (measured with JAX 0.10: ``tests/adapters/test_adapter_threads.py``), while
    this thread goes on and may itself call MPI. Only ``MPI_THREAD_MULTIPLE`` allows that;
    and no error then comes from inside XLA."""
    watchdog.require_multiple(_NAME, "XLA runs the callbacks that make burstmpi's MPI calls on threads of its own, "
                                     "while this thread goes on")


def _lower_ordered(ctx, *args, callback, host, result_avals):
    """JAX's buffer-callback custom call, with the ordering token in and out. On several
    devices (a ``jax.jit`` of arrays sharded over this process's devices) the call instead
    takes ``host`` (the same work on host arrays) through JAX's own host callback, with the
    sharding JAX gives its ``io_callback``: the whole arrays on the first device, once, which
    is what a call that is one rank's part of the ring needs. The buffer call cannot carry
    that sharding: XLA's Shardy partitioner drops it from any custom call but its own
    callbacks', and then fails ("Side-effect HLO must have sharding"). Per device (inside
    ``shard_map`` or ``pmap``) ``_refuse_devices`` refuses several devices of this process."""
    del result_avals
    platforms = tuple(ctx.module_context.platforms)
    if len(platforms) != 1 or platforms[0] not in _TARGETS:
        raise NotImplementedError(f"{_NAME}: buffer callbacks run on one CPU or GPU platform, got {platforms}")
    axis_context = ctx.module_context.axis_context
    _refuse_devices(_devices_per_call(axis_context), "jax.shard_map or jax.pmap")
    _refuse_other_processes(axis_context)
    token_in = ctx.tokens_in.get(_OrderedIOEffect)
    if _devices_of_program(axis_context) > 1:
        if platforms[0] != "cpu" and not _warned:
            _warned.append(True)
            warnings.warn(f"{_NAME}: arrays sharded over several devices of this process go through a host "
                          "callback (XLA gathers them to the first device and copies them to host memory) and "
                          "run on the CPU backend; for GPU speed run one MPI rank per GPU", stacklevel=2)
        sharding = _callback_op_sharding(axis_context, None, ctx.avals_out)
        results, token, _ = _emit_python_callback(ctx, host, token_in, list(args), ctx.avals_in, ctx.avals_out,
                                                  has_side_effect=True, returns_token=True, sharding=sharding)
    else:
        n = len(args)

        def run(exec_ctx, token_in, *buffers):  # (inputs..., token out, outputs...)
            callback(exec_ctx, buffers[n + 1:], *buffers[:n])
            return ()

        ctx.module_context.add_host_callback(run)
        index = np.uint64(len(ctx.module_context.host_callbacks) - 1)
        with_token = dataclasses.replace(ctx, avals_in=[_core.abstract_token, *ctx.avals_in],
                                         avals_out=[_core.abstract_token, *ctx.avals_out])
        token, *results = _ffi.ffi_lowering(_TARGETS[platforms[0]], has_side_effect=True)(
            with_token, token_in, *args, index=index)
    ctx.set_tokens_out(ctx.tokens_in.update_tokens(_mlir.TokenSet({_OrderedIOEffect: token})))
    return results


def _register():
    """The primitive of an ordered buffer call, or None where this JAX's internals differ."""
    try:
        p = _core.Primitive("burstmpi_ordered_buffer_callback")
        p.multiple_results = True
        _dispatch.simple_impl(p)
        p.def_effectful_abstract_eval(lambda *avals, callback, host, result_avals: (result_avals, {_OrderedIOEffect}))
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
    from jax._src.callback import _OrderedIOEffect, _callback_op_sharding, emit_python_callback as _emit_python_callback
    from jax._src.interpreters import ad as _ad, batching as _batching, mlir as _mlir
except ImportError:  # an older (or reorganised) JAX: the io_callback path
    _ordered_p = None
else:
    _ordered_p = _register()
# Whether calls run on XLA's buffers. Tests set it False to take the io_callback path (in
# what is traced after: JAX keeps a function's trace).
_BUFFERS = _ordered_p is not None


def _ordered_buffer_call(callback, host, shapes, *args):
    """``callback(ctx, outputs, *inputs)`` on XLA's buffers of ``args``, writing the results
    (``shapes``: ShapeDtypeStructs) into ``outputs``; ordered as ``io_callback(ordered=True)``.
    ``host(*arrays)``: the same on host arrays, returning the results, for a program over
    several devices (``_lower_ordered``)."""
    avals = tuple(_core.ShapedArray(s.shape, s.dtype) for s in shapes)
    return tuple(_ordered_p.bind(*args, callback=callback, host=host, result_avals=avals))


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


def _runners(cu, comm, options):
    """``run_forward`` and ``run_backward``: ``run(arrays, device)`` calls the forward or
    backward of the cached plan for ``options`` on ``comm``, looked up in the plan cache at
    every call (``plan_cache.run``): the adapter holds no plan, so the cache's bounds and
    ``release_cached`` hold for the plans its programs use. Host arrays (``device`` None) run
    on the CPU backend's plan, GPU buffers on the plan of the same options on the CUDA
    kernels of GPU ``device``."""

    def on(device, call):
        if device is not None:
            # Made (collectively) in the first call that brings GPU buffers: every rank
            # reaches it there, as the calls run in program order.
            return plan_cache.run(_NAME, comm, dict(options, backend="cuda", device=device), call)
        return plan_cache.run(_NAME, comm, options, call)

    def run_forward(arrays, device=None):
        return on(device, lambda plan: plan.forward(*arrays, cu_seqlens=cu))

    def run_backward(arrays, device=None):
        return on(device, lambda plan: plan.backward(*arrays, cu_seqlens=cu))

    return run_forward, run_backward


def _build(cu, comm, options, buffers):
    """The custom_vjp function of one communicator, options and document packing, on XLA's
    buffers (``buffers``) or on host arrays (``io_callback``)."""
    run_forward, run_backward = _runners(cu, comm, options)
    # One callback object each, made once: JAX caches what it compiled for a call (eagerly,
    # every call) by the callback among its parameters.
    host_forward, host_backward = functools.partial(_on_host, run_forward), functools.partial(_on_host, run_backward)
    buffer_forward = functools.partial(_on_buffers, run_forward)
    buffer_backward = functools.partial(_on_buffers, run_backward)

    def call(on_buffers, on_host, shapes, *args):
        if buffers:
            return _ordered_buffer_call(on_buffers, on_host, shapes, *args)
        return io_callback(on_host, shapes, *args, ordered=True)

    def forward(q, k, v):
        B, C, Z, _ = q.shape
        shapes = (jax.ShapeDtypeStruct(q.shape[:3] + (v.shape[3],), q.dtype),
                  jax.ShapeDtypeStruct((B, Z, C), _lse_dtype(q.dtype)))
        return call(buffer_forward, host_forward, shapes, q, k, v)

    @jax.custom_vjp
    def attend(q, k, v):
        return forward(q, k, v)[0]

    def attend_fwd(q, k, v):
        out, lse = forward(q, k, v)
        return out, (q, k, v, out, lse)

    def attend_bwd(res, dout):
        q, k, v, out, lse = res
        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        return tuple(call(buffer_backward, host_backward, shapes, dout.astype(q.dtype), q, k, v, out, lse))

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


def _function(cu, comm, options, buffers):
    """The traced function of these options, communicator, documents and path: made once and
    kept (``_KEPT`` of them), as JAX caches what it compiled for a call by the callback among
    its parameters. Keyed by the plan cache's key of the options and the communicator's
    handle, never by a plan: the function holds the communicator object (which does not keep
    MPI's communicator alive) and looks its plan up at every call. A freed communicator's
    object has the null handle, so an entry whose communicator was freed, and whose handle
    MPI gave to a new one, is made again for that one."""
    options_key = plan_cache._key(options)
    if options_key is None:  # an argument that cannot be hashed: a function for this call only
        return _build(cu, comm, options, buffers)
    key = (options_key, comm.py2f(), fingerprint(cu), buffers)
    held = _FUNCS.get(key)
    if held is not None and held[0] == comm:
        return held[1]
    if key not in _FUNCS and len(_FUNCS) >= _KEPT:
        _FUNCS.pop(next(iter(_FUNCS)))
    fn = _build(cu, comm, options, buffers)
    _FUNCS[key] = (comm, fn)
    return fn


def attention(q, k, v, *, comm=None, causal=False, window=None, softmax_scale=None, layout=None,
              cu_seqlens=None, bwd_comm="auto", mask=None, head_parallel=1, topology="flat", balance="auto",
              timeout=None):
    """``burstmpi.attention`` as a differentiable function of JAX arrays q, k, v (eager, or
    inside ``jax.jit``/``jax.grad``). Shapes, masks, ``head_parallel``, ``topology``, ``balance``, documents and
    layouts as in
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
    # Both refusals come now, on every rank, before XLA runs anything (the lowering of the
    # buffer path checks the devices again).
    _check_thread_level()
    _check_devices_at_trace()
    cu = check_cu_seqlens(_NAME, cu_seqlens)
    options = dict(causal=causal, window=window, softmax_scale=softmax_scale, layout=layout, bwd_comm=bwd_comm,
                   balance=balance, mask=mask, head_parallel=head_parallel, topology=topology, timeout=timeout,
                   backend="cpu")
    comm = MPI.COMM_WORLD if comm is None else comm
    # The plan is the functional API's cache's (``burstmpi._plan_cache``: per communicator,
    # dropped with it, bounded, freed by ``release_cached``). Made or found now, as every
    # rank traces, so wrong arguments raise here; each call looks it up again (``_runners``).
    plan_cache.run(_NAME, comm, options, lambda plan: None)
    buffers = _use_buffers((q, k, v))
    fn = _function(cu, comm, options, buffers)
    if not buffers and not _warned and any(_on_gpu(x) for x in (q, k, v)):
        _warned.append(True)
        warnings.warn(f"{_NAME}: GPU arrays go through host callbacks (XLA copies them to host memory and "
                      "back) and run on the CPU backend: this JAX has no jax.experimental.buffer_callback, or "
                      "CuPy is missing; for GPU speed install CuPy and a JAX with buffer_callback, or use "
                      "burstmpi.torch",
                      stacklevel=2)
    return fn(q, k, v)
