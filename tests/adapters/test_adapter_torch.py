"""burstmpi.torch: gradcheck in float64 and a projection step whose weight gradients, summed
over ranks, equal dense attention's on the whole sequence. Runs alone and under mpiexec."""

import subprocess
import sys

import numpy as np
import pytest

import burstmpi
from adapters_common import (B, H, D, LAYOUTS, MASKS, dense_weight_grad, docs_for, local_rows,
                             split, step_problem)
from conftest import COMM, NRANKS, RANK

HEAD_GROUPS = [u for u in (2, 4) if NRANKS % u == 0]  # head_parallel: divides the ranks and H = 4

pytestmark = pytest.mark.extras  # .ci/run's second phase, with the optional packages
torch = pytest.importorskip("torch")
bt = pytest.importorskip("burstmpi.torch")


class _Shard(torch.autograd.Function):
    """This rank's rows of a replicated global tensor; the adjoint gathers every rank's
    gradient rows (every rank holds the same global tensor, so each needs all of them)."""

    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        return burstmpi.shard(x.detach(), layout=layout)

    @staticmethod
    def backward(ctx, g):
        return burstmpi.unshard(g.contiguous(), layout=ctx.layout), None


class _Unshard(torch.autograd.Function):
    """The global tensor from every rank's rows; the adjoint is this rank's rows."""

    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        return burstmpi.unshard(x.detach().contiguous(), layout=layout)

    @staticmethod
    def backward(ctx, g):
        return burstmpi.shard(g.contiguous(), layout=ctx.layout), None


@pytest.mark.parametrize("causal,window,layout", [(True, None, "zigzag"), (False, (2, 1), "contiguous")])
def test_gradcheck_float64(causal, window, layout):
    # The function of the *global* q, k, v (the same on every rank), so the check holds at
    # any rank count: cross-rank terms of the Jacobian included.
    rng = np.random.default_rng(1)
    N = 2 * NRANKS + 1
    q, k, v = (torch.tensor(rng.standard_normal((1, N, h, 4)), requires_grad=True) for h in (2, 1, 1))

    def f(q, k, v):
        parts = [_Shard.apply(x, layout) for x in (q, k, v)]
        return _Unshard.apply(bt.attention(*parts, causal=causal, window=window, layout=layout), layout)

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-8)


def _step(x, W, target, layout, causal, window, cu, pattern=None, head_parallel=1):
    """Each rank: its tokens -> projections -> burstmpi attention -> its share of the loss
    -> backward. Returns (the weight gradient summed over ranks, this rank's out)."""
    N = x.shape[1]
    rows = local_rows(N, layout, cu)
    Wt = torch.tensor(W, requires_grad=True)
    qkv = torch.tensor(x[:, rows]) @ Wt
    q, k, v = split(qkv)
    out = bt.attention(q, k, v, causal=causal, window=window, layout=layout, cu_seqlens=cu, mask=pattern,
                       head_parallel=head_parallel)
    (out * torch.tensor(target[:, rows])).sum().backward()
    grad = Wt.grad.numpy()
    total = np.empty_like(grad)
    from mpi4py import MPI

    COMM.Allreduce(grad, total, op=MPI.SUM)
    return total, out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", [m[0] for m in MASKS])
def test_projection_step_matches_dense(layout, mask):
    _, causal, window, docs, pattern = next(m for m in MASKS if m[0] == mask)
    N = 5 * NRANKS + 3
    cu = docs_for(N) if docs else None
    x, W, target = step_problem(N)
    total, out = _step(x, W, target, layout, causal, window, cu, pattern)
    dense = dense_weight_grad(x, W, target, causal, window, cu, pattern)
    err = np.abs(total - dense).max() / np.abs(dense).max()
    assert err < 1e-12, err
    assert out.dtype == torch.float64 and out.shape == (B, len(local_rows(N, layout, cu)), H, D)


@pytest.mark.skipif(not HEAD_GROUPS, reason="needs a rank count that 2 or 4 divides")
@pytest.mark.parametrize("mask", ["sinks-chunks-per-head"])
def test_projection_step_with_head_parallel(mask):
    """Groups of u ranks share the heads (u = 4 replicates the 2 K/V heads)."""
    _, causal, window, docs, pattern = next(m for m in MASKS if m[0] == mask)
    N = 5 * NRANKS + 3
    x, W, target = step_problem(N)
    for u in HEAD_GROUPS[-1:]:  # 4 where it divides the ranks: K/V heads replicated
        total, _ = _step(x, W, target, "zigzag", causal, window, None, pattern, head_parallel=u)
        dense = dense_weight_grad(x, W, target, causal, window, None, pattern)
        assert np.abs(total - dense).max() / np.abs(dense).max() < 1e-12, u


def test_any_subset_requires_grad_and_half_precision():
    rng = np.random.default_rng(2)
    N = 3 * NRANKS
    q, k, v = (torch.tensor(burstmpi.shard(rng.standard_normal((1, N, h, 8)).astype(np.float32)))
               for h in (4, 2, 2))
    q.requires_grad_()
    out = bt.attention(q, k, v, causal=True, layout="contiguous")
    out.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape and k.grad is None and v.grad is None
    qb, kb, vb = (x.detach().to(torch.bfloat16).requires_grad_() for x in (q, k, v))
    out = bt.attention(qb, kb, vb, causal=True, layout="contiguous")
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in (qb, kb, vb))


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match=r"burstmpi.torch.attention: k: expected a torch.Tensor, got ndarray"):
        bt.attention(torch.zeros(1, 2, 1, 4), np.zeros((1, 2, 1, 4)), torch.zeros(1, 2, 1, 4))


@pytest.mark.skipif(NRANKS > 1, reason="spawns its own interpreter; once is enough")
def test_import_burstmpi_imports_neither_framework_and_missing_ones_say_so():
    code = ("import sys, burstmpi; print('torch' in sys.modules, 'jax' in sys.modules)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.stdout.split() == ["False", "False"], res.stdout + res.stderr
    for name, package in (("torch", "PyTorch"), ("jax", "JAX")):
        code = (f"import sys; sys.modules[{name!r}] = None\n"
                f"try:\n    import burstmpi.{name}\nexcept ImportError as e:\n    print(e)")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert f"burstmpi.{name} needs {package} (pip install {name})" in res.stdout, res.stdout + res.stderr
    assert RANK == 0


def test_holds_no_plan_and_runs_after_release_cached():
    """The autograd graph keeps the plan cache's key, not its plan: after ``release_cached()``
    between the forward and the backward, the plan the forward used is gone (weakly
    referenced: collected) while the graph is alive, and the backward makes a plan again
    and is exact (float64 against burstmpi.reference)."""
    import gc
    import weakref

    from burstmpi import _plan_cache as plan_cache
    from burstmpi import reference

    rng = np.random.default_rng(7)
    N = 4 * NRANKS
    q, k, v, w = (rng.standard_normal((1, N, 2, 8)) for _ in range(4))
    ts = [torch.tensor(burstmpi.shard(x, layout="zigzag"), requires_grad=True) for x in (q, k, v)]
    burstmpi.release_cached()
    out = bt.attention(*ts, causal=True, layout="zigzag")
    used = [weakref.ref(p) for p in plan_cache.cached_plans(COMM)]
    assert len(used) == 1
    burstmpi.release_cached()
    gc.collect()
    assert out.grad_fn is not None and [r() for r in used] == [None]
    (out * torch.tensor(burstmpi.shard(w, layout="zigzag"))).sum().backward()
    assert len(plan_cache.cached_plans(COMM)) == 1
    for t, exact in zip(ts, reference.backward(w, q, k, v, causal=True)):
        assert np.abs(t.grad.numpy() - burstmpi.shard(exact, layout="zigzag")).max() < 1e-12
