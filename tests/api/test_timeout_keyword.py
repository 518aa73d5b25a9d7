"""``timeout=`` reaches the runtime of every call that waits on other ranks (issue 44,
item 1): ``BurstAttention``, ``attention``, ``attention_backward``, ``KVCache`` and the
adapters pass it to ``Runtime``, and the adapters keep one plan per timeout. What the
runtime does with it (the watchdog) is tested with the runtime."""

import numpy as np
import pytest

import burstmpi
import burstmpi._decode.cache
import burstmpi._plan
from burstmpi import reference as ref

from conftest import COMM, NRANKS

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def runtimes(monkeypatch):
    """The ``timeout`` of every Runtime made from here on (plans and caches)."""
    seen = []
    for module in (burstmpi._plan, burstmpi._decode.cache):
        real = module.Runtime

        def spy(*args, _real=real, **kw):
            seen.append(kw.get("timeout", "not passed"))
            return _real(*args, **kw)

        monkeypatch.setattr(module, "Runtime", spy)
    return seen


def _shards():
    return [burstmpi.shard(x, layout="zigzag")
            for x in ref.random_problem(1, 8 * NRANKS, 2, 2, 16, dtype=np.float32, seed=0)]


def test_the_calls_pass_it_down(runtimes):
    burstmpi.release_cached()  # a plan an earlier test left in the functional API's cache makes no runtime
    q, k, v, do = _shards()
    opts = dict(causal=True, layout="zigzag")
    out, lse = burstmpi.attention(q, k, v, return_lse=True, timeout=30, **opts)
    burstmpi.attention_backward(do, q, k, v, out, lse, timeout=31.5, **opts)
    burstmpi.attention(q, k, v, **opts)
    plan = burstmpi.BurstAttention(timeout=32, **opts)
    plan.forward(q, k, v)
    cache = burstmpi.KVCache(capacity=8 * NRANKS, batch=1, kv_heads=2, head_dim=16, timeout=33)
    cache.prefill(q, k, v, layout="zigzag")  # its plan runs on the cache's runtime
    assert runtimes == [30, 31.5, None, 32, 33]


@pytest.mark.parametrize("make", [
    lambda: burstmpi.BurstAttention(timeout=0),
    lambda: burstmpi.BurstAttention(timeout=float("inf")),
    lambda: burstmpi.KVCache(capacity=8, batch=1, kv_heads=2, head_dim=16, timeout=-1),
], ids=["zero", "inf", "cache"])
def test_a_timeout_that_is_no_deadline_is_refused(make):
    with pytest.raises(ValueError, match=r"(BurstAttention|KVCache): timeout"):
        make()


@pytest.mark.extras
def test_the_torch_adapter_keeps_a_plan_per_timeout():
    torch = pytest.importorskip("torch")
    import burstmpi.torch as bt
    from burstmpi import _plan_cache as plan_cache

    q, k, v = (torch.from_numpy(x) for x in _shards()[:3])
    seen = []
    for timeout in (40, 41, 40):
        bt.attention(q, k, v, causal=True, layout="zigzag", timeout=timeout)
        seen.append(sorted(p.runtime.timeout for p in plan_cache.cached_plans(COMM) if p.runtime.timeout in (40, 41)))
    assert seen == [[40], [40, 41], [40, 41]]  # the third call found the first's plan


@pytest.mark.extras
def test_the_jax_adapter_keeps_a_function_per_timeout(runtimes):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import burstmpi.jax as bj

    q, k, v = (jnp.asarray(x) for x in _shards()[:3])
    first = bj.attention(q, k, v, causal=True, layout="zigzag", timeout=42)
    again = bj.attention(q, k, v, causal=True, layout="zigzag", timeout=42)
    bj.attention(q, k, v, causal=True, layout="zigzag", timeout=43)
    assert runtimes == [42, 43]  # one plan per timeout, reused for the same one
    np.testing.assert_array_equal(np.asarray(first), np.asarray(again))
