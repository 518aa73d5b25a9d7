"""KVCache: prefill, then decode steps over the sharded cache, against float64 dense attention.

Runs alone and under mpiexec (tests/test_mpi.py). Every decode result is compared with the
rows of dense causal attention over the whole sequence (prompt and every decoded token) at
the same positions, under flash-attn's rule, and must be bitwise identical on every rank.
"""

import tracemalloc
import zlib

import numpy as np
import pytest

import burstmpi
from burstmpi import reference as ref
from conftest import COMM, DTYPES, NRANKS, RANK, check_close, dtype_of, needs_ranks
from decode_harness import problem as _problem, run_cache


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_then_decode_every_dtype(dtype):
    cache = run_cache(dtype=dtype, N0=2 * NRANKS + 3, Ts=(1,) * 5 + (3, 1))
    assert cache.seqlen == 2 * NRANKS + 12 and cache.dtype == dtype_of(dtype)
    # The last call went back from T = 3 to T = 1: one more allgather at the new size.
    assert cache.last_stats.tokens == 1 and cache.last_stats.collectives == 2


@pytest.mark.parametrize("Z,Zkv", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_heads_and_layouts(Z, Zkv, layout):
    cache = run_cache(Z=Z, Zkv=Zkv, layout=layout, N0=3 * NRANKS + 1, Ts=(1, 2, 1, 4), B=2, dv=8)
    assert cache.heads == Z and cache.seqlen == 3 * NRANKS + 9


def test_hundred_steps_float32():
    cache = run_cache(N0=5 * NRANKS + 2, Ts=(1,) * 100, Z=4, Zkv=2, d=16)
    st = cache.last_stats
    # Steady state: one collective per call, moving a message that does not grow with the cache.
    assert st.collectives == 1 and st.cached == 5 * NRANKS + 102
    assert st.bytes_moved == (NRANKS - 1) * st.message_bytes and st.message_bytes == 32 + 16 + 4 * 16 * 4


@pytest.mark.parametrize("N0", [0, 1])
def test_from_an_empty_or_tiny_cache(N0):
    # N0 = 0: no prefill at all; N0 = 1: every rank but one holds nothing after it.
    cache = run_cache(N0=N0, Ts=(1, 1, 2, 1, 5))
    assert cache.heads == 4


@pytest.mark.parametrize("window", [(0, 0), (3, 0), (5, -1)])
def test_windows_reuse_slots(window):
    # capacity = the window's left + the largest T: slots of tokens no query sees any more
    # are reused, here many times over.
    Ts = (1,) * 12 + (2, 1, 2)
    cache = run_cache(window=window, N0=4 * NRANKS + 3, Ts=Ts, capacity=window[0] + 2)
    assert cache.seqlen == 4 * NRANKS + 3 + sum(Ts) > cache.capacity


def test_softmax_scale_applies_to_prefill_and_decode():
    cache = run_cache(softmax_scale=0.7, window=(6, 0), N0=3 * NRANKS + 2, Ts=(1, 2, 1))
    assert cache.scale == 0.7


def test_chunked_prefill_is_decode_with_many_tokens():
    cache = run_cache(N0=2 * NRANKS, Ts=(9, 1, 17, 1))
    assert cache.seqlen == 2 * NRANKS + 28


# -- errors: every rank raises the same, and the cache is left as it was --------------------


def _cache(**kw):
    opts = dict(capacity=8, batch=1, kv_heads=2, head_dim=16)
    opts.update(kw)
    return burstmpi.KVCache(**opts)


def test_full_cache_raises_and_keeps_state():
    cache = _cache(capacity=3)
    cache.decode(*_problem(T=2))
    with pytest.raises(ValueError, match=r"KVCache.decode: the cache is full: capacity=3 tokens, 2 cached"):
        cache.decode(*_problem(T=2, seed=4))
    assert cache.seqlen == 2
    cache.decode(*_problem(T=1, seed=5))
    assert cache.seqlen == 3
    with pytest.raises(ValueError, match="full"):
        cache.decode(*_problem(T=1, seed=6))


def test_window_capacity_too_small():
    cache = _cache(capacity=4, window=(3, 0))
    cache.decode(*_problem(T=4))
    with pytest.raises(ValueError, match=r"with window=\(3, 0\) a call needs the last 3 tokens and its 2 new"):
        cache.decode(*_problem(T=2, seed=4))
    cache.decode(*_problem(T=1, seed=5))
    assert cache.seqlen == 5


@pytest.mark.parametrize("what,exc,match", [
    ("batch", ValueError, r"q.shape\[0\]: expected the cache's batch = 1, got 2"),
    ("dtype", TypeError, r"q.dtype: expected the cache's dtype float32, got float16"),
    ("heads", ValueError, r"k.shape\[2\]: expected a divisor of the 3 query heads"),
    ("head_dim", ValueError, r"q.shape\[3\]: expected the cache's head_dim = 16, got 8"),
    ("empty", ValueError, r"expected T >= 1 new tokens, got 0"),
])
def test_bad_shapes_raise_everywhere(what, exc, match):
    cache = _cache()
    cache.decode(*_problem())
    args = {"batch": lambda: _problem(B=2), "dtype": lambda: _problem(dtype=np.float16),
            "heads": lambda: _problem(Z=3), "head_dim": lambda: _problem(d=8),
            "empty": lambda: _problem(T=0)}[what]()
    with pytest.raises(exc, match=match):
        cache.decode(*args)
    assert cache.seqlen == 1
    cache.decode(*_problem(seed=9))
    assert cache.seqlen == 2


def test_heads_fixed_by_the_first_call():
    cache = _cache()
    cache.decode(*_problem(Z=4))
    with pytest.raises(ValueError, match=r"q.shape\[2\]: expected the 4 query heads of the cache's earlier calls, got 2"):
        cache.decode(*_problem(Z=2))


@needs_ranks(2)
def test_different_inputs_on_one_rank_raise_everywhere():
    cache = _cache()
    cache.decode(*_problem())
    q, k, v = _problem(seed=4)
    if RANK == NRANKS - 1:
        q = q + 1
    with pytest.raises(ValueError, match=r"KVCache.decode: ranks disagree on q: rank 0 has"):
        cache.decode(q, k, v)
    assert cache.seqlen == 1
    cache.decode(*_problem(seed=4))


@needs_ranks(2)
@pytest.mark.parametrize("where", ["first", "later"])
def test_different_T_on_one_rank_raises_everywhere(where):
    # Without a prefill the first call also fixes the heads: both paths of the protocol.
    cache = _cache()
    if where == "later":
        cache.decode(*_problem(T=2))
    T = 3 if RANK == 0 else 1
    with pytest.raises(ValueError, match=r"ranks disagree on T: rank 0 has 3, rank 1 has 1"):
        cache.decode(*_problem(T=T, seed=4))
    cache.decode(*_problem(T=2, seed=5))
    assert cache.seqlen == (4 if where == "later" else 2)


@needs_ranks(2)
def test_one_rank_failing_makes_every_rank_raise():
    cache = _cache()
    args = _problem(B=2) if RANK == 1 else _problem()
    with pytest.raises(ValueError, match=r"rank 1: KVCache.decode: q.shape\[0\]"):
        cache.decode(*args)


# -- the argument check: q, k, v fingerprinted where they live, no trips through the host ----


def _one_ulp(x, at):
    """``x`` (a copy) with element ``at`` (flat, C order) one ULP larger in magnitude."""
    y = x.copy()
    y.view(np.dtype(f"u{x.dtype.itemsize}")).reshape(-1)[at] += 1
    return y


@pytest.mark.parametrize("dtype", DTYPES)
def test_device_fingerprint_the_same_bits_the_same_value_one_ulp_differs(dtype, monkeypatch):
    """validate.device_fingerprint: the same on every rank for the same bits, read through
    strides or in chunks alike; one ULP in any one element of q, k or v changes it."""
    from burstmpi import _validate

    q, k, v = _problem(T=3, seed=11, dtype=dtype_of(dtype))
    fp = _validate.device_fingerprint(np, [q, k, v])
    assert fp.shape == (1,) and fp.dtype == np.uint64
    assert len(set(COMM.allgather(int(fp[0])))) == 1
    wide = np.zeros((1, 6) + q.shape[2:], q.dtype)
    wide[:, ::2] = q
    assert wide[:, ::2].strides != q.strides
    assert _validate.device_fingerprint(np, [wide[:, ::2], k, v]) == fp
    monkeypatch.setattr(_validate, "FINGERPRINT_CHUNK", 7)  # chunks that split every array
    assert _validate.device_fingerprint(np, [q, k, v]) == fp
    seen = {int(fp[0])}
    for i in range(3):
        for at in (0, 5, (q, k, v)[i].size - 1):
            args = [q, k, v]
            args[i] = _one_ulp(args[i], at)
            seen.add(int(_validate.device_fingerprint(np, args)[0]))
    assert len(seen) == 1 + 3 * 3, "an element's ULP left the fingerprint unchanged"
    assert np.array_equal(q, _problem(T=3, seed=11, dtype=dtype_of(dtype))[0])  # inputs untouched


@needs_ranks(2)
@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_one_ulp_on_one_rank_is_named_everywhere(name):
    """With the argument check on, one ULP in one element on one rank makes every rank raise,
    naming the argument; the cache is left as it was."""
    cache = _cache()
    cache.decode(*_problem())
    args = _problem(seed=4)
    if RANK == NRANKS - 1:
        i = "qkv".index(name)
        args[i] = _one_ulp(args[i], 7)
    with pytest.raises(ValueError, match=rf"KVCache.decode: ranks disagree on {name}: rank 0 has"):
        cache.decode(*args)
    assert cache.seqlen == 1
    cache.decode(*_problem(seed=4))
    assert cache.seqlen == 2


def test_check_off_computes_no_fingerprint_and_the_same_bits(monkeypatch):
    """check=False (BURSTMPI_CHECK=0): no fingerprint at all; check on: one on the device per
    call and none on the host. The results are bitwise the same either way, and right
    against float64."""
    from burstmpi._decode import cache as cache_module

    calls = {"device": 0, "host": 0}
    real_device, real_host = cache_module.device_fingerprint, cache_module.fingerprint

    def on_device(xp, arrays):
        calls["device"] += 1
        return real_device(xp, arrays)

    def on_host(a):
        calls["host"] += 1
        return real_host(a)

    monkeypatch.setattr(cache_module, "device_fingerprint", on_device)
    monkeypatch.setattr(cache_module, "fingerprint", on_host)
    Ts = (2, 1, 1, 3)
    steps = [_problem(T=T, seed=20 + i) for i, T in enumerate(Ts)]
    results = {}
    for check in (True, False):
        calls.update(device=0, host=0)
        cache = _cache(check=check)
        results[check] = [cache.decode(*step, return_lse=True) for step in steps]
        assert calls == {"device": len(Ts) if check else 0, "host": 0}, (check, calls)
    for (o1, l1), (o0, l0) in zip(results[True], results[False]):
        assert np.array_equal(o1.view(np.uint8), o0.view(np.uint8)) and np.array_equal(l1, l0)
    q, k, v = (np.concatenate([step[i] for step in steps], axis=1) for i in range(3))
    o64, l64 = ref.forward(q, k, v, causal=True)
    op, lp = ref.forward(q, k, v, causal=True, precision="plain")
    out = np.concatenate([o for o, _ in results[False]], axis=1)
    lse = np.concatenate([l for _, l in results[False]], axis=2)
    check_close("decode check off out", out, o64, op, "float32")
    check_close("decode check off lse", lse, l64, lp, "float32")


def test_a_decode_reads_only_the_headers_on_the_host(monkeypatch):
    """Per call the host reads the gathered headers alone (P x 32 bytes, however large the
    partials), and the device gets the header's words and the owner's token indices:
    nothing the size of q, k, v or of the gathered messages (NumPy arrays here, so
    burstmpi._transfers sees the calls but counts nothing: the copies are recorded here)."""
    from burstmpi._decode import cache as cache_module, exchange, slots

    log = {"to_host": [], "to_device": []}

    def spy(module, name):
        real = getattr(module, name)

        def wrapper(*args, **kw):
            a = args[0] if name == "to_host" else args[1]
            log[name].append(np.asarray(a).nbytes)
            return real(*args, **kw)
        monkeypatch.setattr(module, name, wrapper)

    for module in (exchange, slots, cache_module):
        for name in ("to_host", "to_device"):
            if hasattr(module, name):
                spy(module, name)
    Z, d = 16, 32
    cache = _cache(head_dim=d, capacity=4 * NRANKS + 4)
    cache.decode(*_problem(Z=Z, d=d))
    for i in range(2 * NRANKS):
        log["to_host"].clear(), log["to_device"].clear()
        cache.decode(*_problem(Z=Z, d=d, seed=30 + i))
        owner = (cache.seqlen - 1) % NRANKS == RANK
        assert log["to_host"] == [NRANKS * 32], log
        assert sorted(log["to_device"]) == ([3 * 8] if owner else []) + [32], log  # token, slot, position
    q_bytes = Z * d * 4
    assert cache.last_stats.message_bytes > q_bytes > max(log["to_device"])


def test_prefill_on_a_filled_cache_says_use_decode():
    cache = _cache()
    cache.decode(*_problem())
    q, k, v = (burstmpi.shard(x) for x in _problem(T=2 * NRANKS))
    with pytest.raises(ValueError, match=r"already holds 1 tokens; prefill fills an empty cache \(append a chunk with decode"):
        cache.prefill(q, k, v, layout="contiguous")


def test_prompt_longer_than_the_capacity():
    q, k, v = (burstmpi.shard(x) for x in _problem(T=9))
    with pytest.raises(ValueError, match=r"a prompt of 9 tokens .* does not fit capacity=8"):
        _cache().prefill(q, k, v, layout="contiguous")


def test_released_cache():
    cache = _cache()
    cache.decode(*_problem())
    cache.release()
    assert cache.nbytes == 0
    with pytest.raises(RuntimeError, match="KVCache.decode: the cache was released"):
        cache.decode(*_problem())


@pytest.mark.parametrize("kw,exc,match", [
    (dict(capacity=0), ValueError, r"KVCache: capacity: expected an integer >= 1, got 0"),
    (dict(window=(4, 2)), ValueError, r"KVCache: window: with causal=True the right bound must be 0 or -1"),
    (dict(dtype="int8"), TypeError, r"KVCache: dtype: expected one of"),
    (dict(batch=True), ValueError, r"KVCache: batch: expected an integer >= 1, got True"),
    (dict(softmax_scale="0.1"), TypeError, r"KVCache: softmax_scale"),
])
def test_bad_constructor_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        _cache(**kw)


def test_memory_is_the_share_plus_per_call_buffers():
    cap, B, Zkv, d = 10_000, 1, 2, 16
    cache = _cache(capacity=cap)
    per_token = B * Zkv * (d + d) * 4 + 4  # keys, values and the int32 position
    cache.decode(*_problem())
    slots = -(-cap // NRANKS) + (1 if NRANKS > 1 else 0)
    assert cache.nbytes == slots * per_token


def test_a_decode_allocates_nothing_proportional_to_the_cache(monkeypatch):
    # Peak host allocation of one decode call on a 1K-token and a 4K-token shard: the same
    # bound (a chunk of scores, here made smaller than both shards), not 4x.
    from burstmpi._backends.cpu import decode as numpy_decode

    monkeypatch.setattr(numpy_decode, "_MAX_CHUNK", 256)
    peaks = []
    for n in (1024, 4096):
        n_global = n * NRANKS
        cache = _cache(capacity=n_global + 2, head_dim=8)
        _, k, v = _problem(T=n_global, d=8)
        cache.load(burstmpi.shard(k), burstmpi.shard(v), layout="contiguous")
        cache.decode(*_problem(d=8, seed=1))
        tracemalloc.start()
        cache.decode(*_problem(d=8, seed=2))
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
        cache.release()
    assert peaks[1] < 1.5 * peaks[0] + 65536, peaks


@pytest.mark.parametrize("window", [None, (7, 0), (40, 0)])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_load_in_pieces_equals_load_at_once(window, layout):
    """A cache loaded in pieces (appended from ``seqlen`` on) decodes as exactly as one loaded
    at once (each rank then holds other tokens: the bits may differ, float64 decides), the
    same on every rank; a windowed one keeps only the live tail either way."""
    N, Ts = 37, (1, 3, 1)
    pieces = (2 * NRANKS, NRANKS, N - 3 * NRANKS)  # multiples of P but the last
    total = N + sum(Ts)
    q, k, v, _ = ref.random_problem(1, total, 4, 2, 16, seed=3)
    cap = total if window is None else window[0] + max(Ts)
    results = []
    for split in ((N,), pieces):
        cache = burstmpi.KVCache(capacity=cap, batch=1, kv_heads=2, head_dim=16, window=window)
        S = 0
        for n in split:
            sh = lambda x: burstmpi.shard(x[:, S:S + n], layout=layout)
            cache.load(sh(k), sh(v), layout=layout)
            S += n
            assert cache.seqlen == S
        if window is not None:  # the loads kept only the live tail
            assert (cache.shard()[2] >= N - window[0]).all()
        outs, S = [], N
        for T in Ts:
            outs.append(cache.decode(*(x[:, S:S + T] for x in (q, k, v))))
            S += T
        results.append(np.concatenate(outs, axis=1))
    o64, _ = ref.forward(q, k, v, causal=True, window=window)
    op, _ = ref.forward(q, k, v, causal=True, window=window, precision="plain")
    for out in results:
        check_close("decode out", out, o64[:, N:], op[:, N:], "float32")
        assert len(set(COMM.allgather(zlib.crc32(out.tobytes())))) == 1


def test_windowed_load_after_decodes_that_wrapped_the_slots():
    """load, decodes that reuse slots (the ring buffer wraps), load again, decode: against
    float64; a piece whose live tail exceeds the capacity raises on every rank."""
    window, Ts, N1, N2 = (7, 0), (1, 2, 1, 2, 1, 2), 20, 13
    total = N1 + sum(Ts) + N2 + 2
    q, k, v, _ = ref.random_problem(1, total, 4, 2, 16, seed=5)
    cache = burstmpi.KVCache(capacity=window[0] + 2, batch=1, kv_heads=2, head_dim=16, window=window)
    outs, S = [], 0
    for what, n in [("load", N1)] + [("decode", T) for T in Ts] + [("load", N2), ("decode", 2)]:
        if what == "load":
            sh = lambda x: burstmpi.shard(x[:, S:S + n])
            cache.load(sh(k), sh(v), layout="contiguous")
        else:
            outs.append((S, cache.decode(*(x[:, S:S + n] for x in (q, k, v)))))
        S += n
    o64, _ = ref.forward(q, k, v, causal=True, window=window)
    op, _ = ref.forward(q, k, v, causal=True, window=window, precision="plain")
    for start, out in outs:
        n = out.shape[1]
        check_close("decode out", out, o64[:, start:start + n], op[:, start:start + n], "float32")
    small = burstmpi.KVCache(capacity=5, batch=1, kv_heads=2, head_dim=16, window=(20, 0))
    small.load(burstmpi.shard(k[:, :5]), burstmpi.shard(v[:, :5]), layout="contiguous")
    with pytest.raises(ValueError, match=r"KVCache.load: capacity: expected at least the window's 20 tokens"):
        small.load(burstmpi.shard(k[:, 5:10]), burstmpi.shard(v[:, 5:10]), layout="contiguous")


def test_load_past_the_capacity_or_a_rank_s_slots_raises_everywhere():
    cache = _cache(capacity=4 * NRANKS)
    _, k, v = _problem(T=3 * NRANKS)
    cache.load(burstmpi.shard(k), burstmpi.shard(v), layout="contiguous")
    _, k, v = _problem(T=2 * NRANKS)
    with pytest.raises(ValueError, match=rf"a prompt of {2 * NRANKS} tokens .* after the {3 * NRANKS} cached "
                                         rf"does not fit capacity={4 * NRANKS}"):
        cache.load(burstmpi.shard(k), burstmpi.shard(v), layout="contiguous")
    if NRANKS > 1:  # pieces that split unevenly would fill the first ranks long before the cache:
        uneven = _cache(capacity=8 * NRANKS)  # the load that would do it says so, on every rank
        _, k, v = _problem(T=NRANKS + 1)
        with pytest.raises(ValueError, match=r"KVCache.load: k.shape\[1\]: after this piece rank 0 would hold "
                                             rf"\d+ tokens, and the decode deals it .* multiple of {NRANKS} tokens"):
            while True:
                assert uneven.seqlen + NRANKS + 1 <= uneven.capacity
                uneven.load(burstmpi.shard(k), burstmpi.shard(v), layout="contiguous")
    if NRANKS > 1:  # three tokens on rank 0: more than its 2 free slots, though the capacity has room
        _, k, v = _problem(T=3)
        mine = [x if RANK == 0 else x[:, :0] for x in (k, v)]
        with pytest.raises(ValueError, match=r"rank 0: KVCache.load: k.shape\[1\]: this rank has 2 free slots"):
            cache.load(*mine, layout="contiguous")


def _held_positions(cache):
    """Every position the cache holds, over all ranks (each held once)."""
    held = np.concatenate(COMM.allgather(cache.shard()[2]))
    assert len(held) == len(set(held.tolist())), "a position held twice"
    return set(held.tolist())


def _assert_streaming(cache, sinks, left, Z=4):
    """After a run: the sinks and the window's live tail are held, no more than the sinks
    and the window's slots, and a call moved what it moves without sinks: a header and
    one partial (out and lse) per row."""
    S = cache.seqlen
    held = _held_positions(cache)
    assert set(range(min(sinks, S))) <= held and set(range(max(sinks, S - left), S)) <= held, (S, sorted(held))
    assert len(held) <= sinks + NRANKS * cache.slots
    acc = 8 if cache.dtype == np.float64 else 4
    st = cache.last_stats
    assert st.message_bytes == 32 + cache.batch * st.tokens * Z * (cache.v_head_dim + 1) * acc
    assert st.bytes_moved == (NRANKS - 1) * st.message_bytes


@pytest.mark.parametrize("N0,layout", [(0, "contiguous"), (3, "zigzag"), (41, "contiguous"), (41, "striped")])
def test_sinks_and_a_window_forever(N0, layout):
    """StreamingLLM: capacity = sinks + left + T serves decode calls indefinitely; a prompt
    longer than the capacity prefills and keeps only the sinks and the window's tail."""
    sinks, left = 3, 6
    cache = run_cache(N0=N0, Ts=(1,) * 40 + (2, 1, 2), window=(left, 0), sinks=sinks, capacity=sinks + left + 2,
                      layout=layout, tag="decode sinks ")
    assert cache.seqlen == N0 + 45
    _assert_streaming(cache, sinks, left)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_every_dtype(dtype):
    cache = run_cache(N0=17, Ts=(1, 3, 1, 1), window=(4, 0), sinks=2, capacity=2 + 4 + 3, dtype=dtype,
                      tag="decode sinks ")
    assert cache.seqlen == 23 and cache.dtype == dtype_of(dtype)
    _assert_streaming(cache, 2, 4)


def test_sinks_memory_and_errors():
    with pytest.raises(ValueError, match=r"KVCache: sinks: expected window=\(left, 0\) with left >= 0 beside sinks=2"):
        _cache(sinks=2)
    with pytest.raises(ValueError, match=r"KVCache: sinks: expected an integer >= 0, got -1"):
        _cache(sinks=-1, window=(3, 0))
    with pytest.raises(ValueError, match=r"KVCache: capacity: expected more than sinks=8"):
        burstmpi.KVCache(capacity=8, batch=1, kv_heads=2, head_dim=16, window=(3, 0), sinks=8)
    cache = burstmpi.KVCache(capacity=4 + 8 + 1, batch=1, kv_heads=2, head_dim=16, window=(8, 0), sinks=4)
    q, k, v = _problem(T=1)
    cache.decode(q, k, v)
    # The sinks' storage is this rank's share of them, never reused by the window.
    assert cache._sk.shape[2] == len(range(RANK, 4, NRANKS))
    k_shard, _, pos = cache.shard()
    assert len(pos) == k_shard.shape[1] == (1 if RANK == 0 else 0)


def test_windowed_prefill_with_more_kv_heads_than_slots():
    """The live tail's slot check counts tokens (a windowed cache of few slots, many KV heads)."""
    cache = run_cache(N0=9 * NRANKS, Ts=(1, 1), Zkv=8, Z=8, window=(3, 0), capacity=5, tag="decode ")
    assert set(range(9 * NRANKS - 1, 9 * NRANKS + 2)) <= _held_positions(cache)
    cache = run_cache(N0=9 * NRANKS, Ts=(1, 1), Zkv=8, Z=8, window=(3, 0), sinks=1, capacity=6,
                      tag="decode sinks ")
    _assert_streaming(cache, 1, 3, Z=8)
