"""Shared by the decode tests (tests/decode/, tests/gpu/test_gpu_runtime.py): a cache run
end to end against float64, and a decode call's random inputs."""

import zlib

import numpy as np

import burstmpi
from burstmpi import reference as ref
from burstmpi.masks import Sinks, Window
from conftest import COMM, check_close, dtype_of


def run_cache(*, B=1, N0=13, Ts=(1,) * 6, Z=4, Zkv=2, d=16, dv=None, dtype="float32", window=None,
              layout="contiguous", capacity=None, backend=None, transport=None, seed=0, tag="decode ",
              softmax_scale=None, sinks=0):
    """Prefill ``N0`` tokens, decode ``Ts`` tokens per call; check every result. Returns the cache.

    ``backend``: a backend object to run on; ``transport``: a transport class to build the
    cache's transport from (its communicator as argument)."""
    total = N0 + sum(Ts)
    q, k, v, _ = ref.random_problem(B, total, Z, Zkv, d, dv, dtype=dtype_of(dtype), seed=seed)
    cache = burstmpi.KVCache(capacity=total if capacity is None else capacity, batch=B, kv_heads=Zkv,
                             head_dim=d, v_head_dim=dv, dtype=dtype_of(dtype), window=window,
                             softmax_scale=softmax_scale, sinks=sinks, backend="auto" if backend is None else backend,
                             transport="auto" if transport is None else transport)
    opts = dict(causal=True, window=window, softmax_scale=softmax_scale)
    if sinks:  # StreamingLLM: the sinks or the window
        opts.update(window=None, mask=Sinks(sinks) | Window(window[0], 0))
    o64, l64 = ref.forward(q, k, v, **opts)
    op, lp = ref.forward(q, k, v, precision="plain", **opts)
    if N0:
        sh = lambda x: burstmpi.shard(x[:, :N0], layout=layout)
        out = cache.prefill(sh(q), sh(k), sh(v), layout=layout)
        check_close(tag + "out", burstmpi.unshard(out, layout=layout), o64[:, :N0], op[:, :N0], dtype)
    outs, lses, S = [], [], N0
    for T in Ts:
        new = slice(S, S + T)
        inputs = [x[:, new].copy() for x in (q, k, v)]
        o, lse = cache.decode(*inputs, return_lse=True)
        for x, y in zip(inputs, (q, k, v)):
            assert np.array_equal(x.view(np.uint8), y[:, new].view(np.uint8))  # inputs untouched
        assert o.dtype == q.dtype and o.shape == (B, T, Z, v.shape[3]) and lse.shape == (B, Z, T)
        outs.append(o)
        lses.append(lse)
        S += T
        assert cache.seqlen == S
    if Ts:
        out, lse = np.concatenate(outs, axis=1), np.concatenate(lses, axis=2)
        check_close(tag + "out", out, o64[:, N0:], op[:, N0:], dtype)
        check_close(tag + "lse", lse, l64[..., N0:], lp[..., N0:], dtype)
        # Bitwise the same on every rank.
        digest = zlib.crc32(np.ascontiguousarray(out).view(np.uint8)) ^ zlib.crc32(lse.tobytes())
        assert len(set(COMM.allgather(digest))) == 1
    return cache


def problem(T=1, B=1, Z=4, Zkv=2, d=16, seed=3, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, T, h, d)).astype(dtype) for h in (Z, Zkv, Zkv)]
