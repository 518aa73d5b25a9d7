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
    rng = np.random.default_rng(3)
    N = 3 * NRANKS
    q, k, v = (jnp.asarray(burstmpi.shard(rng.standard_normal((B, N, h, D)))) for h in (H, 2, 2))

    @jax.jit
    def two(q, k, v):
        a = bj.attention(q, k, v, causal=True, layout="contiguous")
        b = bj.attention(a, k, v, layout="contiguous")  # its output feeds the second call
        return (b ** 2).sum()

    g1 = jax.grad(two)(q, k, v)
    g2 = jax.grad(two)(q, k, v)
    assert np.array_equal(np.asarray(g1), np.asarray(g2)) and np.isfinite(np.asarray(g1)).all()
