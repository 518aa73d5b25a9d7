"""No silently wrong layout (issue 44, item 3).

Where the result depends on which tokens each rank holds (several ranks, with a causal
mask, a window, a mask or documents; the KV cache's prefill and load), ``layout=`` has no
default: left out, every rank raises a ValueError that names the call and says what to
pass, through the call's agreement collective, so also when only some ranks left it out.
Where it cannot matter (one rank; no mask of any kind) ``None`` means "contiguous".
Runs alone and under mpiexec (``tests/test_mpi.py``).
"""

import numpy as np
import pytest
from mpi4py import MPI

import burstmpi
from burstmpi import reference as ref
from burstmpi.masks import Sinks

from conftest import COMM, NRANKS, RANK, needs_ranks

pytestmark = pytest.mark.timeout(120)  # a hang fails here instead of stalling the run

N_PER_RANK = 8


def _global(N=None, seed=0):
    N = N_PER_RANK * NRANKS if N is None else N
    return ref.random_problem(1, N, 4, 2, 16, dtype=np.float32, seed=seed)


def _shards(layout="zigzag", N=None, cu_seqlens=None):
    """This rank's q, k, v."""
    return [burstmpi.shard(x, layout=layout, cu_seqlens=cu_seqlens) for x in _global(N)[:3]]


def _same_everywhere(message):
    """Every rank raised, and the same message (no rank went on into the ring)."""
    every = COMM.allgather(message)
    assert len(set(every)) == 1, every
    return message


def _expect_layout_error(info, fn, depends):
    msg = _same_everywhere(str(info.value))
    for words in (f"{fn}: layout: expected 'contiguous', 'zigzag' or 'striped' with {depends}",
                  f"over {NRANKS} ranks", "got None (not given)", "burstmpi.shard(x, layout=...)"):
        assert words in msg, f"{words!r} missing from: {msg}"
    assert msg.startswith("rank 0: "), msg  # every rank failed: the message names the first
    return msg


def test_the_trap_raises_or_is_exact():
    """The issue's trap: shards made with zigzag, ``attention(causal=True)`` without a
    layout. Before: no error and a largest error of 0.51 against float64 at 4 ranks. Now an
    error on every rank; on one rank, where every layout is the same, the exact result."""
    q, k, v, _ = _global()
    ql, kl, vl = _shards("zigzag")
    if NRANKS == 1:
        out = burstmpi.attention(ql, kl, vl, causal=True)
        o64, _ = ref.forward(q, k, v, causal=True)
        assert np.abs(out - o64).max() < 1e-5
        return
    with pytest.raises(ValueError) as info:
        burstmpi.attention(ql, kl, vl, causal=True)
    _expect_layout_error(info, "attention", "causal=True")
    out = burstmpi.attention(ql, kl, vl, causal=True, layout="zigzag")  # the fix the message names
    o64, _ = ref.forward(q, k, v, causal=True)
    assert np.abs(burstmpi.unshard(out, layout="zigzag") - o64).max() < 1e-5


@pytest.mark.parametrize("what,kw,words", [
    ("causal", dict(causal=True), "causal=True"),
    ("window", dict(window=(4, 0)), "window=(4, 0)"),
    ("one-sided window", dict(window=(-1, 2)), "window=(-1, 2)"),
    ("mask", dict(mask=Sinks(2)), "a mask"),
    ("documents", dict(cu_seqlens="docs"), "cu_seqlens"),
    ("several", dict(causal=True, mask=Sinks(2)), "causal=True and a mask"),
])
def test_each_thing_that_makes_the_layout_matter(what, kw, words):
    N = N_PER_RANK * NRANKS
    if kw.get("cu_seqlens") == "docs":
        kw = dict(cu_seqlens=np.array([0, N // 2, N]))
    ql, kl, vl = _shards("contiguous")
    if NRANKS == 1:  # one rank: nothing to choose, None runs as "contiguous"
        np.testing.assert_array_equal(burstmpi.attention(ql, kl, vl, **kw),
                                      burstmpi.attention(ql, kl, vl, layout="contiguous", **kw))
        return
    with pytest.raises(ValueError) as info:
        burstmpi.attention(ql, kl, vl, **kw)
    _expect_layout_error(info, "attention", words)


@pytest.mark.parametrize("kw", [dict(), dict(window=(-1, -1)), dict(softmax_scale=0.3)],
                         ids=["plain", "unbounded window", "scale"])
def test_none_is_contiguous_where_the_layout_cannot_matter(kw):
    """No causal mask, window, mask or documents: every query sees every key, wherever it
    sits. None is accepted and gives the bits of layout="contiguous", forward and backward."""
    ql, kl, vl = _shards("contiguous")
    do = burstmpi.shard(_global(seed=1)[3])
    out, lse = burstmpi.attention(ql, kl, vl, return_lse=True, **kw)
    ref_out, ref_lse = burstmpi.attention(ql, kl, vl, return_lse=True, layout="contiguous", **kw)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(lse, ref_lse)
    grads = burstmpi.attention_backward(do, ql, kl, vl, out, lse, **kw)
    for a, b in zip(grads, burstmpi.attention_backward(do, ql, kl, vl, out, lse, layout="contiguous", **kw)):
        np.testing.assert_array_equal(a, b)


def test_none_checks_the_lengths_as_contiguous():
    """None where it cannot matter is "contiguous", also for the local lengths: parts of
    another layout that split unevenly are refused by the usual lengths error."""
    N = 3 * NRANKS + 1  # zigzag and contiguous split this differently from 2 ranks on
    ql, kl, vl = _shards("zigzag", N=N)
    contiguous = burstmpi.shard_indices(N, layout="contiguous").size
    if COMM.allreduce(int(ql.shape[1] != contiguous), op=MPI.SUM) == 0:
        out = burstmpi.attention(ql, kl, vl)
        assert out.shape == ql.shape
        return
    with pytest.raises(ValueError, match=r"expected the local lengths that layout='contiguous' gives"):
        burstmpi.attention(ql, kl, vl)


def test_a_plan_without_a_layout_refuses_documents_per_call():
    """A plan without a layout and without a mask runs; the same plan given documents
    (``cu_seqlens`` is per call) raises on every rank, naming the plan's call."""
    N = N_PER_RANK * NRANKS
    cu = np.array([0, 3, N])
    plan = burstmpi.BurstAttention()
    ql, kl, vl = _shards("contiguous")
    out, _ = plan.forward(ql, kl, vl)
    assert out.shape == ql.shape
    if NRANKS == 1:
        plan.forward(ql, kl, vl, cu_seqlens=cu)
        return
    with pytest.raises(ValueError) as info:
        plan.forward(ql, kl, vl, cu_seqlens=cu)
    _expect_layout_error(info, "BurstAttention.forward", "cu_seqlens")


# -- every entry point ---------------------------------------------------------------------


def _functional_backward(layout):
    ql, kl, vl = _shards("contiguous")
    do = burstmpi.shard(_global(seed=1)[3])
    out, lse = burstmpi.attention(ql, kl, vl, causal=True, layout="contiguous", return_lse=True)
    return burstmpi.attention_backward(do, ql, kl, vl, out, lse, causal=True, layout=layout)[0]


def _plan_forward(layout):
    return burstmpi.BurstAttention(causal=True, layout=layout).forward(*_shards("contiguous"))[0]


def _plan_backward(layout):
    ql, kl, vl = _shards("contiguous")
    do = burstmpi.shard(_global(seed=1)[3])
    out, lse = burstmpi.BurstAttention(window=(3, 0), layout="contiguous").forward(ql, kl, vl)
    return burstmpi.BurstAttention(window=(3, 0), layout=layout).backward(do, ql, kl, vl, out, lse)[0]


def _torch(layout):
    torch = pytest.importorskip("torch")
    import burstmpi.torch as bt

    q, k, v = (torch.from_numpy(x).requires_grad_() for x in _shards("contiguous"))
    out = bt.attention(q, k, v, causal=True, layout=layout)
    out.sum().backward()  # the backward is collective too
    return out.detach().numpy()


def _jax(layout):
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import burstmpi.jax as bj

    q, k, v = (jnp.asarray(x) for x in _shards("contiguous"))
    return np.asarray(bj.attention(q, k, v, causal=True, layout=layout))


def _cache():
    return burstmpi.KVCache(capacity=N_PER_RANK * NRANKS + 4, batch=1, kv_heads=2, head_dim=16)


def _prefill(layout):
    return _cache().prefill(*_shards("contiguous"), layout=layout)


def _load(layout):
    cache = _cache()
    cache.load(*_shards("contiguous")[1:], layout=layout)
    return cache.shard()[2]  # the positions kept


ENTRY_POINTS = {  # name in the error: (call, what makes the layout matter, in the message)
    "attention": (lambda layout: burstmpi.attention(*_shards("contiguous"), causal=True, layout=layout),
                  "causal=True"),
    "attention_backward": (_functional_backward, "causal=True"),
    "BurstAttention.forward": (_plan_forward, "causal=True"),
    "BurstAttention.backward": (_plan_backward, "window=(3, 0)"),
    "burstmpi.torch.attention": (_torch, "causal=True"),
    "burstmpi.jax.attention": (_jax, "causal=True"),
    "KVCache.prefill": (_prefill, "a causal KV cache"),
    "KVCache.load": (_load, "a causal KV cache"),
}


# The adapters' cases need torch or JAX: .ci/run's second phase (``-m extras``) runs them.
@pytest.mark.parametrize("fn", [pytest.param(fn, marks=pytest.mark.extras) if fn.startswith("burstmpi.")
                                else fn for fn in ENTRY_POINTS])
def test_every_entry_point_requires_the_layout(fn):
    """Each public call refuses a missing layout on every rank where it matters, naming
    itself; given the layout (or on one rank, without it) it runs as before."""
    call, depends = ENTRY_POINTS[fn]
    given = call("contiguous")
    if NRANKS == 1:
        np.testing.assert_array_equal(call(None), given)
        return
    # The JAX adapter runs the plan in a host callback: XLA re-raises its error as its own
    # exception type, with the ValueError's text in it.
    with pytest.raises(Exception if fn.startswith("burstmpi.jax") else ValueError) as info:
        call(None)
    msg = str(info.value)
    assert COMM.allreduce(1, op=MPI.SUM) == NRANKS  # every rank is back: no hang
    for words in (f"{fn}: layout: expected 'contiguous', 'zigzag' or 'striped' with {depends}",
                  "got None (not given)", "burstmpi.shard(x, layout=...)"):
        assert words in msg, f"{words!r} missing from: {msg}"


# -- only some ranks forgot --------------------------------------------------------------


@needs_ranks(2)
def test_only_rank_0_forgets_the_layout_of_a_call():
    """Rank 0 leaves the layout out, the others give it: the ranks disagree on an argument,
    and every rank raises saying so, with rank 0's None (the first collective of a plan
    compares the options), not one rank raising while the others wait in the ring. The
    functional API's plans are dropped first: a plan that rank 0 kept from an earlier call
    (the adapters' tests make one with layout=None) would let rank 0 check its own
    arguments first, and every rank would then raise rank 0's "layout: ... got None (not
    given)" instead (as clear, but another message)."""
    burstmpi.release_cached()
    ql, kl, vl = _shards("zigzag")
    layout = None if RANK == 0 else "zigzag"
    with pytest.raises(ValueError) as info:
        burstmpi.attention(ql, kl, vl, causal=True, layout=layout)
    msg = _same_everywhere(str(info.value))
    assert msg.startswith("BurstAttention.forward: ranks disagree on layout: rank 0 has None, rank 1 has 'zigzag'"), msg
    # Also where the layout could not matter: the ranks must still pass the same arguments.
    with pytest.raises(ValueError, match=r"ranks disagree on layout: rank 0 has None"):
        burstmpi.attention(ql, kl, vl, layout=layout)
    # And the ranks go on together afterwards.
    out = burstmpi.attention(ql, kl, vl, causal=True, layout="zigzag")
    assert out.shape == ql.shape


@needs_ranks(2)
def test_only_rank_0_forgets_the_layout_of_a_prefill():
    """A KV cache agrees on its own options first (no layout among them): rank 0's missing
    layout is its local error, raised on every rank through the prefill's agreement, naming
    rank 0; the cache stays empty and takes a prefill with the layout afterwards."""
    cache = _cache()
    shards = _shards("zigzag")
    with pytest.raises(ValueError) as info:
        cache.prefill(*shards, layout=None if RANK == 0 else "zigzag")
    msg = _same_everywhere(str(info.value))
    assert msg.startswith("rank 0: KVCache.prefill: layout: expected") and "got None (not given)" in msg, msg
    assert "failed too" not in msg  # the other ranks gave it
    assert cache.seqlen == 0
    out = cache.prefill(*shards, layout="zigzag")
    q, k, v, _ = _global()
    o64, _ = ref.forward(q, k, v, causal=True)
    assert np.abs(burstmpi.unshard(out, layout="zigzag") - o64).max() < 1e-5


def test_shard_keeps_contiguous_as_its_default():
    """Sharding is where the layout is chosen; it keeps its default (the calls check)."""
    x = np.arange(4 * NRANKS)[None, :, None]
    np.testing.assert_array_equal(burstmpi.shard(x), burstmpi.shard(x, layout="contiguous"))
    np.testing.assert_array_equal(burstmpi.shard_indices(4 * NRANKS),
                                  burstmpi.shard_indices(4 * NRANKS, layout="contiguous"))
    np.testing.assert_array_equal(burstmpi.unshard(burstmpi.shard(x)), x)
