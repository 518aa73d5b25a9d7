"""A plan and a cache used in turn from two streams (CuPy's null stream, then another
framework's, whose inputs are made on it): what burstmpi keeps between calls (packets,
workspaces, the cache's K/V, device copies of positions) is never touched by the second
stream before the first is done with it, by the stream sanitizer of the fake device
(tests/gpu/fake_device.py), and the results match float64. Runs alone and under mpiexec."""

import numpy as np
import pytest

import burstmpi
import fake_cupy as fake
import kernel_harness as kh
from burstmpi import reference as ref
from conftest import COMM, NRANKS, check_close

pytestmark = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")
D = 32
OTHER = 0x7777  # another framework's stream


@pytest.fixture(params=[("late", 0), ("early", 0), ("random", 1), ("random", 2)], ids=lambda p: f"{p[0]}{p[1] or ''}")
def gpu(monkeypatch, request):
    xp = fake.emulated(monkeypatch, COMM, [("float32", D, D)], *request.param)
    yield xp
    fake.DEVICE.sanitizer.check()


def plan_on_two_streams(xp, record=True):
    """One plan's forward and backward on the null stream, then on another framework's
    stream whose inputs are made there, both before the host reads any result: between them
    nothing but what burstmpi itself waits for orders the two streams. Each call's
    gradients checked against float64 (entered in the error table unless not ``record``:
    test_stream_order.py runs it with a line taken out). Returns how many gradients it
    checked."""
    q, k, v, do = ref.random_problem(1, 16 * NRANKS + 3, 4, 2, D, dtype=np.float32, seed=1)
    sh = lambda x: xp.asarray(burstmpi.shard(x, layout="zigzag"))
    plan = burstmpi.BurstAttention(layout="zigzag", causal=True)
    results = []
    for stream in (xp.cuda.get_current_stream(), xp.cuda.ExternalStream(OTHER, 0)):
        with stream:
            args = [sh(x) for x in (q, k, v, do)]  # made on this stream, as its framework would
            out, lse = plan.forward(*args[:3])
            results.append(plan.backward(args[3], *args[:3], out, lse))
    exact, plain = ref.backward(do, q, k, v, causal=True), ref.backward(do, q, k, v, causal=True, precision="plain")
    checked = 0
    for grads in results:
        with xp.cuda.ExternalStream(OTHER, 0):  # read where the last call ran
            for name, g, e, p in zip(("dq", "dk", "dv"), grads, exact, plain):
                check_close(f"two streams {name}", burstmpi.unshard(g.get(), layout="zigzag"), e, p, "float32",
                            record=record)
                checked += 1
    return checked


@pytest.mark.timeout(300)
def test_a_plan_used_from_two_streams_in_turn(gpu):
    assert plan_on_two_streams(gpu) == 6  # dq, dk, dv of each stream's call, against float64
    fake.DEVICE.sanitizer.check()  # and no stream race between the two calls


@pytest.mark.timeout(300)
def test_a_cache_used_from_two_streams_in_turn(gpu):
    xp = gpu
    S, T = 4 * NRANKS + 1, 2
    q, k, v, _ = ref.random_problem(1, S + 2 * T, 4, 2, D, dtype=np.float32, seed=6)
    cache = burstmpi.KVCache(capacity=S + 2 * T, batch=1, kv_heads=2, head_dim=D, dtype=np.float32)
    cache.prefill(*(xp.asarray(burstmpi.shard(x[:, :S], layout="zigzag")) for x in (q, k, v)), layout="zigzag")
    outs = []
    for t, stream in enumerate((xp.cuda.get_current_stream(), xp.cuda.ExternalStream(OTHER, 0))):
        with stream:
            outs.append(cache.decode(*(xp.asarray(x[:, S + t * T:S + (t + 1) * T]) for x in (q, k, v))))
    o64, _ = ref.forward(q, k, v, causal=True)
    op, _ = ref.forward(q, k, v, causal=True, precision="plain")
    with xp.cuda.ExternalStream(OTHER, 0):
        got = np.concatenate([o.get() for o in outs], axis=1)
    check_close("two streams decode", got, o64[:, S:], op[:, S:], "float32")
