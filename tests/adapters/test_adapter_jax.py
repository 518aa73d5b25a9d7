"""burstmpi.jax: JAX's own gradient check with x64, and a projection step whose weight
gradients, summed over ranks, equal dense attention's on the whole sequence, eager and under
jit. Runs alone and under mpiexec."""

import numpy as np
import pytest

import burstmpi
from adapters_common import B, D, E, H, HKV, LAYOUTS, MASKS, dense_weight_grad, docs_for, local_rows, split, step_problem
from conftest import COMM, NRANKS

HEAD_GROUPS = [u for u in (2, 4) if NRANKS % u == 0]  # head_parallel: divides the ranks and H = 4

pytestmark = pytest.mark.extras  # .ci/run's second phase, with the optional packages
jax = pytest.importorskip("jax")
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
from jax.experimental import io_callback  # noqa: E402
from jax.test_util import check_grads  # noqa: E402

bj = pytest.importorskip("burstmpi.jax")


def _gather(layout):
    """unshard as a differentiable JAX function (ordered callbacks); its adjoint is this
    rank's rows, and the adjoint of taking this rank's rows of a replicated global array is
    gathering every rank's gradient rows."""

    def host_unshard(x):
        return burstmpi.unshard(np.asarray(x), layout=layout)

    def gather(x, n):
        return io_callback(host_unshard, jax.ShapeDtypeStruct((x.shape[0], n) + x.shape[2:], x.dtype), x,
                           ordered=True)

    def make(n, rows):
        @jax.custom_vjp
        def unshard(x):
            return gather(x, n)

        unshard.defvjp(lambda x: (gather(x, n), None), lambda _, g: (g[:, rows],))

        @jax.custom_vjp
        def shard(x):
            return x[:, rows]

        shard.defvjp(lambda x: (x[:, rows], None), lambda _, g: (gather(g, n),))
        return shard, unshard

    return make


@pytest.mark.parametrize("causal,window,layout", [(True, None, "zigzag"), (False, (2, 1), "contiguous")])
def test_jax_check_grads_float64(causal, window, layout):
    rng = np.random.default_rng(1)
    N = 2 * NRANKS + 1
    q, k, v = (jnp.asarray(rng.standard_normal((1, N, h, 4))) for h in (2, 1, 1))
    shard, unshard = _gather(layout)(N, local_rows(N, layout, None))

    def f(q, k, v):
        parts = [shard(x) for x in (q, k, v)]
        return unshard(bj.attention(*parts, causal=causal, window=window, layout=layout))

    check_grads(f, (q, k, v), order=1, modes=["rev"], atol=1e-7, rtol=1e-7)


def _loss(layout, causal, window, cu, rows, pattern=None, head_parallel=1):
    def loss(W, x_local, target_local):
        q, k, v = split(x_local @ W)
        out = bj.attention(q, k, v, causal=causal, window=window, layout=layout, cu_seqlens=cu, mask=pattern,
                           head_parallel=head_parallel)
        return (out * target_local).sum()

    return loss


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", [m[0] for m in MASKS])
def test_projection_step_matches_dense(jit, layout, mask):
    err, value, shape = _projection_step(jit, layout, mask)
    assert err < 1e-12, err
    assert np.isfinite(value) and shape == (E, (H + 2 * HKV) * D)


@pytest.mark.skipif(not HEAD_GROUPS, reason="needs a rank count that 2 or 4 divides")
@pytest.mark.parametrize("mask", ["sinks-chunks-per-head"])
def test_projection_step_with_head_parallel(mask):
    """Groups of u ranks share the heads (u = 4 replicates the 2 K/V heads)."""
    for u in HEAD_GROUPS[-1:]:  # 4 where it divides the ranks: K/V heads replicated
        err, value, shape = _projection_step(True, "zigzag", mask, u)
        assert err < 1e-12, (u, err)
        assert np.isfinite(value) and shape == (E, (H + 2 * HKV) * D)


def _projection_step(jit, layout, mask, head_parallel=1):
    """One training step's weight gradient, summed over ranks, against dense attention's:
    (relative error, the loss, the gradient's shape)."""
    from mpi4py import MPI

    _, causal, window, docs, pattern = next(m for m in MASKS if m[0] == mask)
    N = 5 * NRANKS + 3
    cu = docs_for(N) if docs else None
    x, W, target = step_problem(N)
    rows = local_rows(N, layout, cu)
    grad = jax.value_and_grad(_loss(layout, causal, window, cu, rows, pattern, head_parallel))
    if jit:
        grad = jax.jit(grad)
    value, g = grad(jnp.asarray(W), jnp.asarray(x[:, rows]), jnp.asarray(target[:, rows]))
    total = np.empty_like(np.asarray(g))
    COMM.Allreduce(np.ascontiguousarray(g), total, op=MPI.SUM)
    dense = dense_weight_grad(x, W, target, causal, window, cu, pattern)
    return np.abs(total - dense).max() / np.abs(dense).max(), float(value), np.asarray(g).shape


def test_jit_runs_the_collectives_every_call_in_order():
    # Two attention calls in one jitted function, called twice: four forwards and four
    # backwards on every rank, in program order (a dropped or reordered callback would hang
    # the ring or mix the two calls' results).
    # Each call's gradient is checked against float64 attention on the whole sequence.
    from burstmpi import reference as ref

    rng = np.random.default_rng(3)
    N = 3 * NRANKS
    whole = [rng.standard_normal((B, N, h, D)) for h in (H, 2, 2)]
    q, k, v = (jnp.asarray(burstmpi.shard(x, layout="contiguous")) for x in whole)

    @jax.jit
    def two(q, k, v):
        a = bj.attention(q, k, v, causal=True, layout="contiguous")
        b = bj.attention(a, k, v, layout="contiguous")  # its output feeds the second call
        return (b ** 2).sum()

    # The loss is every rank's sum: its gradient by q, by the chain rule through both calls.
    a, _ = ref.forward(*whole, causal=True)
    b, _ = ref.forward(a, whole[1], whole[2])
    da = ref.backward(2 * b, a, whole[1], whole[2])[0]
    exact = burstmpi.shard(ref.backward(da, *whole, causal=True)[0], layout="contiguous")
    for call in range(2):
        g = np.asarray(jax.grad(two)(q, k, v))
        assert g.dtype == np.float64
        err = np.abs(g - exact).max() / np.abs(exact).max()
        assert err < 1e-12, f"call {call}: dq off float64 by {err:.1e} (relative)"


# -- XLA's buffers (jax.experimental.buffer_callback) and the io_callback fallback ---------

PATHS = [pytest.param(True, id="buffers"), pytest.param(False, id="io_callback")]


@pytest.fixture
def path(request, monkeypatch):
    """Run the test on XLA's buffers or on the io_callback fallback (``bj._BUFFERS``)."""
    if request.param and not bj._BUFFERS:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    monkeypatch.setattr(bj, "_BUFFERS", request.param)
    return request.param


@pytest.fixture
def plan_calls(monkeypatch):
    """Every call of a plan's forward and backward (the ring's collectives), in the order this
    rank runs them: (phase, causal, the arrays burstmpi was given)."""
    from burstmpi._plan import BurstAttention

    calls = []
    for phase in ("forward", "backward"):
        def spy(self, *arrays, _run=getattr(BurstAttention, phase), _phase=phase, **kwargs):
            calls.append((_phase, self.causal, arrays))
            return _run(self, *arrays, **kwargs)

        monkeypatch.setattr(BurstAttention, phase, spy)
    return calls


def _qkv(rng, N, dtype=np.float64):
    return tuple(jnp.asarray(burstmpi.shard(rng.standard_normal((B, N, h, D))), dtype=dtype) for h in (H, HKV, HKV))


def test_this_jax_runs_on_buffers():
    """JAX 0.10 has buffer_callback: the calls lower to the ordered buffer call, not to io_callback."""
    if not hasattr(__import__("jax.experimental", fromlist=["buffer_callback"]), "buffer_callback"):
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    assert bj._BUFFERS
    q, k, v = _qkv(np.random.default_rng(0), 2 * NRANKS)
    text = str(jax.make_jaxpr(jax.grad(lambda q: bj.attention(q, k, v, causal=True, layout="zigzag").sum()))(q))
    assert text.count("burstmpi_ordered_buffer_callback") == 2 and "io_callback" not in text, text


@pytest.mark.parametrize("dtype", [np.float64, np.float32, jnp.bfloat16])
@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_buffers_hand_burstmpi_xla_memory_without_a_copy(dtype, jit, plan_calls):
    """On the CPU, the q, k, v (and, in the backward, dout, out, lse) that burstmpi gets are
    read-only views of the memory XLA holds: q, k and v are at the JAX arrays' own addresses."""
    if not bj._BUFFERS:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    q, k, v = _qkv(np.random.default_rng(1), 3 * NRANKS, dtype)
    grad = jax.value_and_grad(lambda q, k, v: bj.attention(q, k, v, causal=True, layout="zigzag")
                              .astype(jnp.float32).sum(), argnums=(0, 1, 2))
    value, grads = (jax.jit(grad) if jit else grad)(q, k, v)
    assert np.isfinite(float(value)) and all(np.isfinite(np.asarray(g, dtype=np.float64)).all() for g in grads)
    (fwd, _, f_arrays), (bwd, _, b_arrays) = plan_calls
    assert (fwd, bwd) == ("forward", "backward")
    mine = [x.unsafe_buffer_pointer() for x in (q, k, v)]
    assert [a.ctypes.data for a in f_arrays] == mine          # forward: q, k, v
    assert [a.ctypes.data for a in b_arrays[1:4]] == mine     # backward: dout, q, k, v, out, lse
    for a in f_arrays + b_arrays:
        assert isinstance(a, np.ndarray) and not a.flags.writeable and a.dtype in (q.dtype, np.float32)


def _two_layers(log):
    """A program with two attention calls and one ordered io_callback collective of its own
    between them, written in the order (1) attention, causal, on inputs computed first; (2)
    the program's own allreduce; (3) attention, not causal, on the arguments, ready at once.
    Unordered, XLA would run (3) and (2) first: their inputs are ready sooner."""
    from mpi4py import MPI

    def allreduce(x):
        log.append(("allreduce", None, ()))
        return np.asarray(COMM.allreduce(float(x), op=MPI.SUM), dtype=x.dtype)

    def program(w, q, k, v, q2):
        h = q
        for _ in range(3):
            h = jnp.tanh(h @ w)  # the first call's input comes late
        a = bj.attention(h, k, v, causal=True, layout="contiguous")
        total = io_callback(allreduce, jax.ShapeDtypeStruct((), q.dtype), jax.lax.stop_gradient(q2.sum()),
                            ordered=True)
        b = bj.attention(q2, k, v, layout="contiguous")
        return (a * b).sum() + total

    return program


@pytest.mark.parametrize("path", PATHS, indirect=True)
@pytest.mark.parametrize("how", ["jit", "grad", "value_and_grad", "jit(value_and_grad)"])
def test_collectives_run_in_program_order_on_every_rank(how, path, plan_calls):
    """What every rank runs, in which order, inside jit, grad and value_and_grad: the
    forwards in the order written, with the program's own ordered io_callback between them,
    then the backwards in reverse; twice (a compiled program runs its callbacks every call);
    the same on every rank."""
    rng = np.random.default_rng(4)
    N = 3 * NRANKS
    w = jnp.asarray(np.eye(D) + 0.1 * rng.standard_normal((D, D)))
    q, k, v = _qkv(rng, N)
    q2 = _qkv(rng, N)[0]
    program = _two_layers(plan_calls)
    argnums = (0, 1, 2, 3, 4)
    run = {"jit": jax.jit(program), "grad": jax.grad(program, argnums=argnums),
           "value_and_grad": jax.value_and_grad(program, argnums=argnums),
           "jit(value_and_grad)": jax.jit(jax.value_and_grad(program, argnums=argnums))}[how]
    ran = str(jax.make_jaxpr(run)(w, q, k, v, q2))
    assert ran.count("burstmpi_ordered_buffer_callback") == (0 if not path else 2 if how == "jit" else 4), ran
    for _ in range(2):
        result = run(w, q, k, v, q2)
        assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(result))
    names = {True: "first attention", False: "second attention", None: ""}
    order = [(phase, names[causal]) for phase, causal, _ in plan_calls]
    once = [("forward", "first attention"), ("allreduce", ""), ("forward", "second attention")]
    if how != "jit":
        once += [("backward", "second attention"), ("backward", "first attention")]
    assert order == once * 2, order
    assert all(theirs == order for theirs in COMM.allgather(order))


def test_the_side_effect_flag_alone_does_not_keep_program_order():
    """Why the buffer path carries JAX's ordering token: with ``has_side_effect=True`` only,
    XLA keeps every buffer_callback but runs each where its inputs are ready, here the
    second and third (inputs ready at once) before the first (its input computed first).
    The same program through burstmpi.jax runs in the order written (the test above)."""
    if not bj._BUFFERS:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    from jax.experimental.buffer_callback import buffer_callback

    ran = []

    def named(name):
        def copy(ctx, outs, x):
            ran.append(name)
            np.copyto(np.asarray(outs[0]), np.asarray(x))
        return copy

    def program(w, x, y):
        h = x
        for _ in range(3):
            h = jnp.tanh(h @ w)
        one = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
        return [buffer_callback(named(n), one, has_side_effect=True)(a)[0] for n, a in (("1", h), ("2", y), ("3", x))]

    x = jnp.ones((64, 64)) / 64
    jax.jit(program)(x, x, x)
    assert sorted(ran) == ["1", "2", "3"] and ran != ["1", "2", "3"], ran


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("mask", ["causal", "docs"])
def test_buffers_and_io_callback_give_the_same_bits(dtype, mask, monkeypatch):
    """The buffer path changes where burstmpi reads and writes, not what it computes: the
    forward eagerly and a jitted training step give bitwise the same values, loss and weight
    gradients on both paths."""
    if not bj._BUFFERS:
        pytest.skip("this JAX has no jax.experimental.buffer_callback")
    _, causal, window, docs, pattern = next(m for m in MASKS if m[0] == mask)
    N = 5 * NRANKS + 3
    cu = docs_for(N) if docs else None
    x, W, target = step_problem(N)
    rows = local_rows(N, "zigzag", cu)
    args = [jnp.asarray(a, dtype=dtype) for a in (W, x[:, rows], target[:, rows])]
    got = {}
    for buffers in (True, False):
        monkeypatch.setattr(bj, "_BUFFERS", buffers)
        # a new function for each path: JAX reuses a function's trace, and the path is traced in
        step = jax.value_and_grad(_loss("zigzag", causal, window, cu, rows, pattern))
        ran = str(jax.make_jaxpr(step)(*args))
        assert ("burstmpi_ordered_buffer_callback" in ran) == buffers and ("io_callback" in ran) != buffers
        q, k, v = split(args[1] @ args[0])
        out = bj.attention(q, k, v, causal=causal, window=window, layout="zigzag", cu_seqlens=cu, mask=pattern)
        value, g = jax.jit(step)(*args)
        got[buffers] = [np.asarray(out), np.asarray(value), np.asarray(g)]
    for a, b in zip(got[True], got[False]):
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
    assert np.isfinite(got[True][2]).all()


def test_gpu_buffers_reach_the_cuda_plan_on_xlas_stream(monkeypatch):
    """Without a GPU: buffers on a CUDA device reach CuPy through DLPack with XLA's stream
    and that device current, and the cached plan of the same options with backend "cuda"
    on that device; the results are written into XLA's output buffers, on that stream."""
    current, made = [], []

    class Buffer:  # what buffer_callback hands a callback on a GPU, as far as burstmpi looks
        def __init__(self, value):
            self.value = value

        def __dlpack_device__(self):
            return (2, 3)  # kDLCUDA, device 3

    class Current:
        def __init__(self, what):
            self.what = what

        def __enter__(self):
            current.append(self.what)

        def __exit__(self, *exc):
            current.remove(self.what)

    class FakeCupy:
        class cuda:
            Device = staticmethod(lambda dev: Current(("device", dev)))
            ExternalStream = staticmethod(lambda ptr, dev: Current(("stream", ptr, dev)))

        @staticmethod
        def from_dlpack(buf):
            assert current == [("device", 3), ("stream", 0xABC, 3)], current
            return buf.value

    class Plan:
        def forward(self, q, k, v, cu_seqlens=None):
            assert current == [("device", 3), ("stream", 0xABC, 3)] and cu_seqlens == [0, 2]
            return q + k, v

    def run(caller, comm, options, call):
        made.append((caller, comm, options["backend"], options["device"], options["causal"]))
        return call(Plan())

    monkeypatch.setattr(bj, "_cupy", lambda: FakeCupy)
    monkeypatch.setattr(bj.plan_cache, "run", run)
    run_forward, _ = bj._runners([0, 2], "comm", dict(causal=True, backend="cpu"))
    ctx = type("ExecutionContext", (), {"stream": 0xABC})()
    outs = (Buffer(np.zeros(2)), Buffer(np.zeros(2)))
    bj._on_buffers(run_forward, ctx, outs, *(Buffer(np.full(2, float(i))) for i in (1, 2, 3)))
    assert made == [(bj._NAME, "comm", "cuda", 3, True)] and current == []
    np.testing.assert_array_equal(outs[0].value, [3.0, 3.0])
    np.testing.assert_array_equal(outs[1].value, [3.0, 3.0])


# -- the adapter holds no plan: the plan cache's bounds and release_cached hold for it ------


def test_holds_no_plan_and_runs_after_release_cached():
    """A jitted step and an eager call keep the plan cache's key, not its plans: after
    ``release_cached()`` the plans they used are gone (weakly referenced: collected) while
    the step is alive, and its next call makes a plan again and gives the same bits."""
    import gc
    import weakref

    from burstmpi import _plan_cache as plan_cache

    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, 3 * NRANKS)
    step = jax.jit(jax.grad(lambda q, k, v: bj.attention(q, k, v, causal=True, layout="zigzag").sum(),
                            argnums=(0, 1, 2)))
    eager = bj.attention(q, k, v, layout="contiguous")
    burstmpi.release_cached()
    first = step(q, k, v)
    used = [weakref.ref(p) for p in plan_cache.cached_plans(COMM)]
    assert len(used) == 1
    burstmpi.release_cached()
    gc.collect()
    assert [r() for r in used] == [None]  # nothing of the adapter's kept it: not _FUNCS, not the step
    again = step(q, k, v)
    assert len(plan_cache.cached_plans(COMM)) == 1 and plan_cache.cached_plans(COMM)[0] is not None
    for a, b in zip(first, again):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert np.asarray(bj.attention(q, k, v, layout="contiguous")).tobytes() == np.asarray(eager).tobytes()


def test_the_cache_bounds_the_plans_of_adapter_calls(monkeypatch):
    """With room for one plan, two adapter functions of different options evict each other's
    plan at every call (the adapter cannot keep one alive beside the cache), and both stay exact."""
    from burstmpi import _plan_cache as plan_cache

    monkeypatch.setattr(plan_cache, "MAX_PLANS", 1)
    rng = np.random.default_rng(6)
    q, k, v = _qkv(rng, 3 * NRANKS)
    burstmpi.release_cached()
    causal = jax.jit(lambda q, k, v: bj.attention(q, k, v, causal=True, layout="contiguous"))
    full = jax.jit(lambda q, k, v: bj.attention(q, k, v, layout="contiguous"))
    results = [np.asarray(f(q, k, v)) for f in (causal, full, causal, full)]
    assert plan_cache.stats(COMM).plans == 1 and plan_cache.stats(COMM).evictions >= 3
    assert results[0].tobytes() == results[2].tobytes() and results[1].tobytes() == results[3].tobytes()
    assert results[0].tobytes() != results[1].tobytes()
    burstmpi.release_cached()
