"""burstmpi-bench --decode: decode over a KV cache sharded across the ranks (``KVCache``).

    mpiexec -n 4 burstmpi-bench --decode -b 16K -e 256K -f 4 -H 32 -K 8 -D 128 -d bfloat16

-b/-e/-f sweep the cached length N (global tokens), ``-T`` is the new tokens per decode
call. For each row the cache is filled with random keys and values (``KVCache.load``:
the prefill is not what is measured), then ``-w`` untimed and ``-n`` timed decode calls run,
each after a barrier; one more call is checked against float64. Columns:

  cached, T, B, heads, kvh, hdim, dtype   the configuration (cached: tokens before the call)
  decode ms, min/max ms   one decode call, reduced over ranks by -a, and its fastest and
                          slowest rank
  tok/s                   B x T / decode time
  KB/call                 what one rank moves per call: (P - 1) x its message (a header and
                          its partial out and lse, ``KVCache.last_stats``): independent of N
  comp ms, coll ms        the local decode kernel alone (max over ranks), and an allgather of
                          the same message alone: a call costs about comp + coll + the merge
  ring ms, ring MB/call   the same decode done the way ring-attention peers do it: every
                          rank's K/V shard travels around the ring (P - 1 double-buffered
                          hops), each rank attending the queries to each shard as it passes;
                          its bytes per call grow with N (copying a rank's own shard into its
                          first packet is not timed: a peer sends its own tensors)
  vs ring                 ring ms / decode ms (above 1: we are faster)
  1rk ms, vs 1rk          rank 0 alone holding the whole cache (a KVCache on MPI.COMM_SELF),
                          when it fits in half of the free memory; 1rk ms / decode ms
  cache MB/rk, peak MB/rk this rank's share of the cache (``KVCache.nbytes``, max over ranks)
                          and the process's peak (GPUs: CuPy's pool)
  #wrong                  out and lse of the checked call outside the dtype's tolerance
                          against float64 (each rank's shard in float64, merged in float64)
"""

import os

import numpy as np
from mpi4py import MPI

from ..cache import KVCache
from ..comm import Channel
from ..layout import layout_of
from .common import DTYPES, REDUCE, TOLERANCE, choices, idle_barrier, np_dtype, resolve_device, seqlens, sweep, timed

__all__ = ["COLUMNS", "CONFIG_KEYS", "run_config", "ring_prepare", "ring_decode", "main"]

COLUMNS = [
    ("seqlen", "cached", "(tok)", 8, "d"), ("tokens", "T", "", 3, "d"), ("batch", "B", "", 3, "d"),
    ("heads", "heads", "", 5, "d"), ("kv_heads", "kvh", "", 4, "d"), ("head_dim", "hdim", "", 4, "d"),
    ("dtype", "dtype", "", 8, "s"),
    ("decode_ms", "decode", "(ms)", 9, ".3f"), ("decode_ms_min", "min", "ms", 8, ".3f"),
    ("decode_ms_max", "max", "ms", 8, ".3f"), ("tokens_per_s", "tok/s", "", 9, ".1f"),
    ("kb_per_call", "KB", "/call", 8, ".1f"), ("compute_ms", "comp", "ms", 8, ".3f"),
    ("collective_ms", "coll", "ms", 8, ".3f"),
    ("ring_ms", "ring", "(ms)", 9, ".3f"), ("ring_mb_per_call", "ring", "MB/call", 8, ".1f"),
    ("vs_ring", "vs", "ring", 6, ".2f"), ("one_rank_ms", "1rk", "(ms)", 9, ".3f"),
    ("vs_one_rank", "vs", "1rk", 6, ".2f"), ("cache_mb", "cache", "MB/rk", 8, ".1f"),
    ("peak_mb", "peak", "MB/rk", 7, ".0f"), ("wrong", "#wrong", "", 6, "d"),
]
CONFIG_KEYS = ("mode", "seqlen", "tokens", "batch", "heads", "kv_heads", "head_dim", "dtype", "window", "ranks")
TAG_RING = 31


def _new_tokens(cfg, seed, i):
    """The i-th call's q, k, v: the same on every rank."""
    B, T, Z, Zkv, d = cfg["batch"], cfg["tokens"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    rng = np.random.default_rng([seed, 7, cfg["seqlen"], i])
    dt = np_dtype(cfg["dtype"])
    return [rng.standard_normal(s, dtype=np.float32).astype(dt) for s in ((B, T, Z, d), (B, T, Zkv, d), (B, T, Zkv, d))]


def _filled_cache(comm, cfg, seed, dev, window, extra, N=None):
    """A KVCache over ``comm`` holding N random tokens (contiguous), room for ``extra`` more."""
    N = cfg["seqlen"] if N is None else N
    P, rank = comm.Get_size(), comm.Get_rank()
    B, Zkv, d = cfg["batch"], cfg["kv_heads"], cfg["head_dim"]
    dt = np_dtype(cfg["dtype"])
    cap = N + extra if window is None else min(N, window[0]) + extra
    cache = KVCache(comm, capacity=cap, batch=B, kv_heads=Zkv, head_dim=d, dtype=dt, window=window,
                    backend=dev.backend)
    C = layout_of("contiguous", P, N).count(rank)
    rng = np.random.default_rng([seed, rank, N])
    k, v = (dev.put(rng.standard_normal((B, C, Zkv, d), dtype=np.float32).astype(dt)) for _ in range(2))
    cache.load(k, v)
    return cache


def ring_prepare(cache):
    """The ring way's buffers, with this rank's shard in the packet to send first: what a
    ring-attention peer holds before a call (it sends its own K/V tensors; the copy here is
    not timed). Returns the state ``ring_decode`` takes; prepare again before each call
    (a call leaves another rank's shard in the packet)."""
    rt = cache.runtime
    xp = rt.backend.xp
    k, v, pos = cache.shard()
    ns = rt.comm.allgather(int(pos.size))
    B, Zkv, d, dv, S = cache.batch, cache.kv_heads, cache.head_dim, cache.v_head_dim, max(ns)
    fields = [("k", (B, Zkv, S, d), cache.dtype), ("v", (B, Zkv, S, dv), cache.dtype), ("kpos", (S,), np.int32)]
    (chan,) = rt.channels("decode-ring", [(Channel, fields, TAG_RING, +1)])
    cur = chan.current
    cur["k"][:, :, :pos.size] = k.transpose(0, 2, 1, 3)
    cur["v"][:, :, :pos.size] = v.transpose(0, 2, 1, 3)
    cur["kpos"][:pos.size] = xp.asarray(pos.astype(np.int32))
    return chan, ns


def ring_decode(cache, q, state):
    """Decode as ring-attention peers do: each rank's K/V shard travels the whole ring
    (double-buffered, P - 1 hops) and every rank attends ``q`` (B, T, heads, d; the same
    everywhere) to each shard as it passes; the partials merge in rank order. ``state``
    comes from ``ring_prepare``. Returns (out, bytes this rank sent). Reads the cache
    without changing it."""
    rt = cache.runtime
    be, P, me = rt.backend, rt.nranks, rt.rank
    xp = be.xp
    chan, ns = state
    chan.begin()  # this rank's own shard current, byte counts from zero
    cur = chan.current
    B, T, Z, d = q.shape
    Zkv, dv = cache.kv_heads, cache.v_head_dim
    g = Z // Zkv
    acc = be.acc_dtype(cache.dtype)
    R = B * T * Z
    parts_out, parts_lse = xp.empty((P, R, dv), acc), xp.empty((P, R), acc)
    qg = q.reshape(B, T, Zkv, g, d).transpose(0, 2, 1, 3, 4)
    for step in range(P):
        owner = (me - step) % P
        more = step < P - 1
        with rt.transport.group():
            if more:
                chan.post(send=True, recv=True)
        be.decode(qg, cur["k"], cur["v"], cur["kpos"], ns[owner], cache.seqlen, cache.left, cache.scale,
                  parts_out[owner].reshape(B, T, Zkv, g, dv).transpose(0, 2, 1, 3, 4),
                  parts_lse[owner].reshape(B, T, Zkv, g).transpose(0, 2, 1, 3))
        if more:
            chan.wait()
            cur = chan.current
    rt.finish()
    out, lse = xp.empty((R, dv), cache.dtype), xp.empty(R, acc)
    be.combine(parts_out, parts_lse, out, lse)
    return out.reshape(B, T, Z, dv), chan.bytes_sent


def _float64_decode(comm, cache, q, window):
    """The exact result of the last call over everything cached: each rank's shard in
    float64 (dense, written from the definition), merged in float64: (out, lse) on every rank."""
    k, v, pos = cache.shard()
    host = lambda a: np.asarray(a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a, np.float64)
    k, v, qh = host(k), host(v), host(q)
    B, T, Z, d = qh.shape
    Zkv = k.shape[2]
    g = Z // Zkv
    S = cache.seqlen - T  # the call's first query position
    qpos = S + np.arange(T)
    seen = pos[None, :] <= qpos[:, None]
    if window is not None and window[0] >= 0:
        seen &= pos[None, :] >= qpos[:, None] - window[0]
    s = np.einsum("btkgd,bnkd->btkgn", qh.reshape(B, T, Zkv, g, d), k) * cache.scale
    s = np.where(seen[None, :, None, None, :], s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m_safe[..., None])
    l = p.sum(axis=-1)
    o = np.einsum("btkgn,bnkd->btkgd", p, v)
    parts = comm.allgather((o, l, m_safe))
    mx = np.max([np.where(pl > 0, pm, -np.inf) for _, pl, pm in parts], axis=0)
    mx = np.where(np.isfinite(mx), mx, 0)
    num = sum(po * np.exp(pm - mx)[..., None] for po, _, pm in parts)
    den = sum(pl * np.exp(pm - mx) for _, pl, pm in parts)
    out = (num / np.where(den > 0, den, 1)[..., None]).reshape(B, T, Z, -1)
    with np.errstate(divide="ignore"):
        lse = np.where(den > 0, mx + np.log(np.where(den > 0, den, 1)), -np.inf).reshape(B, T, Z)
    return out, lse.transpose(0, 2, 1)


def _count_wrong(comm, cfg, cache, q, out, lse, window, dev):
    ref_out, ref_lse = _float64_decode(comm, cache, q, window)
    atol, rtol = TOLERANCE[cfg["dtype"]]
    bad = 0
    for ours, ref in ((dev.host(out), ref_out), (dev.host(lse), ref_lse)):
        ours = np.asarray(ours, np.float64)
        finite = np.isfinite(ref)
        bad += int((~(np.abs(ours[finite] - ref[finite]) <= atol + rtol * np.abs(ref[finite]))).sum())
        bad += int((ours[~finite] != ref[~finite]).sum())
    return bad  # the same on every rank: the result is


def _collective_s(cache, size, iters, dev):
    """Seconds of an allgather of ``size`` bytes per rank alone on the cache's transport."""
    rt = cache.runtime
    send, recv = rt.backend.alloc(size), rt.backend.alloc(size * rt.nranks)
    best = float("inf")
    for _ in range(max(1, iters) + 1):
        t, _ = timed(rt.comm, lambda: rt.transport.allgather(send, recv), dev)
        best = min(best, t)
    return best


def _free_bytes(dev):
    if dev.cupy is not None:
        return dev.cupy.cuda.runtime.memGetInfo()[0]
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _one_rank_s(comm, cfg, *, iters, warmup, seed, dev, window):
    """Rank 0 alone with the whole cache (when it fits in half the free memory): seconds
    per decode call, or None. The other ranks wait without spinning."""
    N, B, Zkv, d = cfg["seqlen"], cfg["batch"], cfg["kv_heads"], cfg["head_dim"]
    need = N * B * Zkv * 2 * d * np.dtype(np_dtype(cfg["dtype"])).itemsize
    result = None
    if comm.Get_rank() == 0 and need < 0.5 * _free_bytes(dev):
        one = _filled_cache(MPI.COMM_SELF, cfg, seed, dev, window, (warmup + iters) * cfg["tokens"])
        times = []
        for i in range(warmup + iters):
            args = [dev.put(x) for x in _new_tokens(cfg, seed, 1000 + i)]
            t, _ = timed(MPI.COMM_SELF, lambda: one.decode(*args), dev)
            if i >= warmup:
                times.append(t)
        one.release()
        result = float(np.mean(times))
    if comm.Get_size() > 1:
        idle_barrier(comm)
    return comm.bcast(result, root=0)


def run_config(comm, cfg, *, iters, warmup, check, reduce, seed, dev, window=None):
    """Benchmark one decode configuration; return its row (identical on every rank)."""
    P = comm.Get_size()
    _, red = REDUCE[reduce]
    calls = warmup + iters + 1
    cache = _filled_cache(comm, cfg, seed, dev, window, calls * cfg["tokens"])
    times, compute = [], []
    for i in range(warmup + iters):
        args = [dev.put(x) for x in _new_tokens(cfg, seed, i)]
        t, _ = timed(comm, lambda: cache.decode(*args), dev)
        if i >= warmup:
            times.append(t)
            compute.append(cache.last_stats.compute_s)
    st = cache.last_stats
    q, k, v = (dev.put(x) for x in _new_tokens(cfg, seed, 999_999))
    out, lse = cache.decode(q, k, v, return_lse=True)
    wrong = _count_wrong(comm, cfg, cache, q, out, lse, window, dev) if check else -1
    # The ring way, on the same cache and queries (after the checked call's tokens).
    ring_t, ring_sent = [], 0
    for i in range(warmup + iters):
        state = ring_prepare(cache)
        t, (_, ring_sent) = timed(comm, lambda: ring_decode(cache, q, state), dev)
        if i >= warmup:
            ring_t.append(t)
    coll = _collective_s(cache, st.message_bytes, iters, dev)
    cache_mb = comm.allreduce(cache.nbytes, op=MPI.MAX) / 1e6
    cache.release()
    one = _one_rank_s(comm, cfg, iters=iters, warmup=warmup, seed=seed, dev=dev, window=window)
    all_t = comm.allgather(float(np.mean(times)))
    t_s = float(red(all_t))
    ring_s = float(red(comm.allgather(float(np.mean(ring_t)))))
    row = dict(cfg, mode="decode", ranks=P, backend=dev.backend, window=window,
               transport=cache.runtime.transport.name,
               decode_ms=1e3 * t_s, decode_ms_min=1e3 * min(all_t), decode_ms_max=1e3 * max(all_t),
               tokens_per_s=cfg["batch"] * cfg["tokens"] / t_s,
               message_bytes=st.message_bytes, kb_per_call=comm.allreduce(st.bytes_moved, op=MPI.MAX) / 1e3,
               compute_ms=1e3 * comm.allreduce(float(np.mean(compute)), op=MPI.MAX),
               collective_ms=1e3 * coll, ring_ms=1e3 * ring_s,
               ring_mb_per_call=comm.allreduce(ring_sent, op=MPI.MAX) / 1e6, vs_ring=ring_s / t_s,
               one_rank_ms=None if one is None else 1e3 * one,
               vs_one_rank=None if one is None else one / t_s,
               cache_mb=cache_mb, peak_mb=comm.allreduce(dev.peak_mb(), op=MPI.MAX), wrong=wrong)
    return row


def main(comm, ctx, o):
    """The decode mode of ``burstmpi-bench``: ``o`` holds the command line's options."""
    import click

    source = lambda name: ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
    inapplicable = [f for f in ("mask", "layout", "docs", "bwd_comm", "use_torch", "trace_memory", "preset",
                                "transport") if source(f)]
    if inapplicable:
        raise click.UsageError(f"--decode does not take {', '.join(inapplicable)} (decode is causal over a "
                               "contiguous cache; see burstmpi-bench --help)")
    window = o["window"]
    if window is not None and window[1] not in (0, -1):
        raise click.BadParameter(f"--decode is causal: the window's right bound must be 0 or -1, got {window}")
    heads = o["heads"]
    kv_heads = heads if o["kv_heads"] is None else o["kv_heads"]
    if heads % kv_heads:
        raise click.BadParameter(f"--kv-heads must divide --heads ({heads}), got {kv_heads}")
    dev = resolve_device(comm, o["backend"])
    configs = [dict(seqlen=n, tokens=o["tokens"], batch=o["batch"], heads=heads, kv_heads=kv_heads,
                    head_dim=o["head_dim"], dtype=dt)
               for n in seqlens(o["minseq"], o["maxseq"], o["stepfactor"])
               for dt in choices(o["dtype"], DTYPES)
               if not (dev.backend == "cuda" and dt == "float64")]
    params = dict(mode="decode", minseq=o["minseq"], maxseq=o["maxseq"], stepfactor=o["stepfactor"],
                  tokens=o["tokens"], iters=o["iters"], warmup=o["warmup"], check=o["check"], dtype=o["dtype"],
                  average=REDUCE[o["reduce"]][0], batch=o["batch"], heads=heads, kv_heads=kv_heads,
                  head_dim=o["head_dim"], window=window, seed=o["seed"], backend=dev.backend,
                  baseline=o["baseline"], tolerance=o["tolerance"] if o["baseline"] else None)

    def run_one(cfg):
        return run_config(comm, cfg, iters=o["iters"], warmup=o["warmup"], check=o["check"], reduce=o["reduce"],
                          seed=o["seed"], dev=dev, window=window)

    def footer(rows):
        return [f"# Avg decode ms per call : {float(np.mean([r['decode_ms'] for r in rows])):.4f}",
                f"# Avg speedup over the ring way : {float(np.mean([r['vs_ring'] for r in rows])):.2f}",
                f"# Bytes per call per rank (KB) : {sorted({round(r['kb_per_call'], 3) for r in rows})}"]

    show = (len(configs) > 1) if o["progress"] is None else o["progress"]
    sweep(comm, mode="decode", params=params, dev=dev, columns=COLUMNS, configs=configs, run_one=run_one,
          work=[float(c["seqlen"]) for c in configs], footer=footer, config_keys=CONFIG_KEYS,
          metric="decode_ms", check=o["check"], show_progress=show, json_path=o["json_path"],
          junit_path=o["junit_path"], baseline=o["baseline"], tolerance=o["tolerance"], bind=o["bind"])
