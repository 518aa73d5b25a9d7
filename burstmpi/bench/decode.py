"""burstmpi-bench --decode: decode over a KV cache sharded across the ranks (``KVCache``).

    mpiexec -n 4 burstmpi-bench --decode -b 16K -e 256K -f 4 -H 32 -K 8 -D 128 -d bfloat16

-b/-e/-f sweep the cached length N (global tokens), ``-T`` is the new tokens per decode
call. For each row the cache is filled with random keys and values (``KVCache.load``:
the prefill is not what is measured), then ``-w`` untimed and ``-n`` timed decode calls run,
each after a barrier; one more call is checked against float64. ``LEGEND`` defines every
column (``burstmpi-bench --legend --decode`` prints it): besides the decode itself, the same
decode the way ring-attention peers do it and by one rank holding the whole cache. The
last columns count what one decode call copied between host and device and waited for
(``burstmpi._transfers``): the most any rank did in one timed call, 0 with host arrays.

Memory (``burstmpi.bench.memory``): before each row the bench estimates what one rank
holds while the row runs (its cache share, a piece of the random fill, the check's chunk),
while the ring way runs (the cache and the ring's packets, a shard each), and rank 0's
whole cache for ``1rk``, sums them over each node's ranks and compares with what the node
has free: a baseline that does not fit is skipped with a ``#`` line (its columns ``-``), a
row that does not fit is refused (a ``#`` line; the bench exits 4). The cache is filled in
pieces (``KVCache.load`` appends), so a row needs little beyond the cache itself.
"""

import numpy as np
from mpi4py import MPI

from .._decode.cache import KVCache
from .._transfers import Transfers, counting
from ..masks._layout import layout_of
from .._transport import watchdog
from .._transport.comm import Channel
from .common import (DTYPES, REDUCE, TOLERANCE, budget_for, choices, idle_barrier, np_dtype, reads_in_place,
                     resolve_device, say, seqlens, sweep, timed)
from .estimates import CHECK_BYTES, ONE_RANK, capacity, decode_stages, piece_tokens
from .memory import peak_bytes, reset_peak

__all__ = ["COLUMNS", "LEGEND", "CONFIG_KEYS", "run_config", "ring_prepare", "ring_decode", "main"]

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
    ("est_mb", "est", "MB/rk", 7, ".0f"), ("peak_mb", "peak", "MB/rk", 7, ".0f"), ("wrong", "#wrong", "", 6, "d"),
    # Last, so that the columns before keep their places: a call's trips through the host.
    ("d2h", "d2h", "n/call", 6, "d"), ("d2h_bytes", "d2h", "B/call", 7, "d"), ("h2d", "h2d", "n/call", 6, "d"),
    ("h2d_bytes", "h2d", "B/call", 7, "d"), ("syncs", "syncs", "n/call", 6, "d"),
]
TRANSFERS = ("d2h", "d2h_bytes", "h2d", "h2d_bytes", "syncs")  # burstmpi._transfers.Transfers' fields
# One line per column for --legend (header and unit are the table's).
LEGEND = {
    "seqlen": "tokens in the cache before the call (global)",
    "tokens": "new tokens per decode call (-T)", "batch": "batch rows (-B)", "heads": "query heads (-H)",
    "kv_heads": "key/value heads (-K)", "head_dim": "head dim (-D)", "dtype": "the cache's and inputs' dtype",
    "decode_ms": "one decode call, mean over -n calls, reduced over ranks by -a (default: the slowest rank)",
    "decode_ms_min": "the fastest rank's decode call", "decode_ms_max": "the slowest rank's decode call",
    "tokens_per_s": "B x T / decode time",
    "kb_per_call": "bytes one rank moves per call, (P - 1) x its message (header, partial out and lse): "
                   "independent of the cached length",
    "compute_ms": "the local decode kernel alone (max over ranks)",
    "collective_ms": "an allgather of the same message alone: a call costs about comp + coll + the merge",
    "ring_ms": "the same decode the way ring-attention peers do it: every rank's K/V shard travels the ring "
               "(P - 1 double-buffered hops; - when it does not fit in memory)",
    "ring_mb_per_call": "bytes one rank sends per call the ring way (grows with the cache)",
    "vs_ring": "ring ms / decode ms (above 1: burstmpi is faster)",
    "one_rank_ms": "rank 0 alone holding the whole cache (a KVCache on MPI.COMM_SELF; - when it does not fit)",
    "vs_one_rank": "1rk ms / decode ms",
    "cache_mb": "this rank's share of the cache (KVCache.nbytes), max over ranks",
    "est_mb": "memory one rank was estimated to need before the row, max over ranks: its resident set then plus "
              "the largest part of the row that ran (GPUs: the GPU memory of that part)",
    "peak_mb": "the resident set's peak during the row (GPUs: CuPy's pool), max over ranks; shared-memory "
               "pages count in every rank that reads them",
    "wrong": "values of the checked call's out and lse outside the dtype's tolerance against float64",
    "d2h": "copies from the device to the host in one decode call (burstmpi._transfers; the most any rank made "
           "in one timed call): the gathered headers; 0 with host arrays (nothing crosses a bus)",
    "d2h_bytes": "bytes of those copies: ranks x the 32-byte header, whatever the heads or the cache",
    "h2d": "copies from the host to the device in one decode call: the header's words, and on the rank that "
           "stores a new token its indices (the caller's q, k, v are on the device already here)",
    "h2d_bytes": "bytes of those copies",
    "syncs": "explicit waits for the device in one decode call (burstmpi._transfers.synchronize; a copy to the "
             "host also waits for the work queued before it)",
}
CONFIG_KEYS = ("mode", "seqlen", "tokens", "batch", "heads", "kv_heads", "head_dim", "dtype", "window", "sinks",
               "ranks")
TAG_RING = 31
def _new_tokens(cfg, seed, i):
    """The i-th call's q, k, v: the same on every rank."""
    B, T, Z, Zkv, d = cfg["batch"], cfg["tokens"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    rng = np.random.default_rng([seed, 7, cfg["seqlen"], i])
    dt = np_dtype(cfg["dtype"])
    return [rng.standard_normal(s, dtype=np.float32).astype(dt) for s in ((B, T, Z, d), (B, T, Zkv, d), (B, T, Zkv, d))]


def _filled_cache(comm, cfg, seed, dev, window, extra, N=None, timeout=None):
    """A KVCache over ``comm`` holding N random tokens, room for ``extra`` more. Loaded in
    pieces (each contiguous over the ranks) so that the fill holds one piece at a time.
    ``timeout``: the cache's (``--timeout``; None: ``BURSTMPI_TIMEOUT``)."""
    N = cfg["seqlen"] if N is None else N
    P, rank = comm.Get_size(), comm.Get_rank()
    B, Zkv, d = cfg["batch"], cfg["kv_heads"], cfg["head_dim"]
    dt = np_dtype(cfg["dtype"])
    # The cache on a plain communicator with the bench's handle, as a user's program gives it:
    # its runtime's duplicate is then a plain one too (every wait of the cache has its own
    # deadline, ``timeout``; ``ring_prepare`` uses the watchdog's collectives on it).
    cache = KVCache(MPI.Intracomm(comm), capacity=capacity(cfg, window, extra, N), batch=B, kv_heads=Zkv, head_dim=d,
                    dtype=dt, window=window, sinks=cfg.get("sinks") or 0, backend=dev.backend, timeout=timeout)
    piece = piece_tokens(cfg, P)
    for i, start in enumerate(range(0, N, piece)):
        C = layout_of("contiguous", P, min(piece, N - start)).count(rank)
        rng = np.random.default_rng([seed, rank, N, i])
        k, v = (dev.put(rng.standard_normal((B, C, Zkv, d), dtype=np.float32).astype(dt, copy=False))
                for _ in range(2))
        cache.load(k, v, layout="contiguous")
        del k, v
    return cache


def ring_prepare(cache):
    """The ring way's buffers, with this rank's shard in the packet to send first: what a
    ring-attention peer holds before a call (it sends its own K/V tensors; the copy here is
    not timed). Returns the state ``ring_decode`` takes; prepare again before each call
    (a call leaves another rank's shard in the packet)."""
    rt = cache.runtime
    xp = rt.backend.xp
    k, v, pos = cache.shard()
    # The cache's own communicator is not the bench's guarded one: the watchdog's allgather,
    # with the cache's deadline (mpi4py's pickled one blocks where no deadline reaches it).
    ns = watchdog.allgather(rt.comm, int(pos.size), rt.timeout, "burstmpi-bench --decode: the ring way's shard sizes")
    B, Zkv, d, dv, S = cache.batch, cache.kv_heads, cache.head_dim, cache.v_head_dim, max(ns)
    fields = [("k", (B, Zkv, S, d), cache.dtype), ("v", (B, Zkv, S, dv), cache.dtype), ("kpos", (S,), np.int32)]
    (chan,) = rt.channels("decode-ring", [(Channel, fields, TAG_RING, +1)])
    sinks = watchdog.allgather(rt.comm, int(np.count_nonzero(pos < cache.sinks)), rt.timeout,
                               "burstmpi-bench --decode: the ring way's sink counts")
    ns = list(zip(ns, sinks))  # (rows, sinks first)
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
    # With sinks a shard is two partials, its sinks (seen from any distance) and the rest.
    parts = 2 if cache.sinks else 1
    parts_out, parts_lse = xp.empty((parts * P, R, dv), acc), xp.empty((parts * P, R), acc)
    qg = q.reshape(B, T, Zkv, g, d).transpose(0, 2, 1, 3, 4)
    for step in range(P):
        owner = (me - step) % P
        more = step < P - 1
        with rt.transport.group():
            if more:
                chan.post(send=True, recv=True)
        n, m = ns[owner]
        pieces = [(0, n, cache.left)] if parts == 1 else [(0, m, -1), (m, n, cache.left)]
        for i, (a, b, left) in enumerate(pieces):
            at = parts * owner + i
            be.decode(qg, cur["k"][:, :, a:], cur["v"][:, :, a:], cur["kpos"][a:], b - a, cache.seqlen, left,
                      cache.scale, parts_out[at].reshape(B, T, Zkv, g, dv).transpose(0, 2, 1, 3, 4),
                      parts_lse[at].reshape(B, T, Zkv, g).transpose(0, 2, 1, 3))
        if more:
            chan.wait()
            cur = chan.current
    rt.finish()
    out, lse = xp.empty((R, dv), cache.dtype), xp.empty(R, acc)
    be.combine(parts_out, parts_lse, out, lse)
    return out.reshape(B, T, Z, dv), chan.bytes_sent


def _float64_decode(comm, cache, q, window, sinks=0):
    """The exact result of the last call over everything cached: each rank's shard in
    float64 (dense, written from the definition) a chunk of CHECK_BYTES at a time, merged
    online and then over the ranks in float64: (out, lse) on every rank. Holds one chunk
    in float64, never the shard."""
    k, v, pos = cache.shard()
    host = lambda a: np.asarray(a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else a, np.float64)
    qh = host(q)
    B, T, Z, d = qh.shape
    Zkv, dv = k.shape[2], v.shape[3]
    g = Z // Zkv
    qg = qh.reshape(B, T, Zkv, g, d)
    qpos = cache.seqlen - T + np.arange(T)  # the call's query positions
    m = np.full((B, T, Zkv, g), -np.inf)
    l, o = np.zeros(m.shape), np.zeros(m.shape + (dv,))
    chunk = max(64, CHECK_BYTES // (8 * max(B * Zkv * (d + dv), B * T * Z)))
    for c0 in range(0, len(pos), chunk):
        kc, vc, pc = host(k[:, c0:c0 + chunk]), host(v[:, c0:c0 + chunk]), pos[c0:c0 + chunk]
        seen = pc[None, :] <= qpos[:, None]
        if window is not None and window[0] >= 0:
            seen &= (pc[None, :] >= qpos[:, None] - window[0]) | (pc[None, :] < sinks)
        s = np.einsum("btkgd,bnkd->btkgn", qg, kc)  # scores, then probabilities, in place:
        s *= cache.scale                             # one chunk-sized array besides kc, vc
        s[~np.broadcast_to(seen[None, :, None, None, :], s.shape)] = -np.inf
        m_new = np.maximum(m, s.max(axis=-1, initial=-np.inf))
        m_safe = np.where(np.isfinite(m_new), m_new, 0)
        s -= m_safe[..., None]
        p = np.exp(s, out=s)
        alpha = np.exp(m - m_safe)  # 0 where nothing was seen before
        l = l * alpha + p.sum(axis=-1)
        o = o * alpha[..., None] + np.einsum("btkgn,bnkd->btkgd", p, vc)
        m = m_new
    parts = comm.allgather((o, l, np.where(np.isfinite(m), m, 0)))
    mx = np.max([np.where(pl > 0, pm, -np.inf) for _, pl, pm in parts], axis=0)
    mx = np.where(np.isfinite(mx), mx, 0)
    num = sum(po * np.exp(pm - mx)[..., None] for po, _, pm in parts)
    den = sum(pl * np.exp(pm - mx) for _, pl, pm in parts)
    out = (num / np.where(den > 0, den, 1)[..., None]).reshape(B, T, Z, -1)
    with np.errstate(divide="ignore"):
        lse = np.where(den > 0, mx + np.log(np.where(den > 0, den, 1)), -np.inf).reshape(B, T, Z)
    return out, lse.transpose(0, 2, 1)


def _count_wrong(comm, cfg, cache, q, out, lse, window, dev):
    ref_out, ref_lse = _float64_decode(comm, cache, q, window, cfg.get("sinks") or 0)
    atol, rtol = TOLERANCE[cfg["dtype"]]
    bad = 0
    for ours, ref in ((dev.host(out), ref_out), (dev.host(lse), ref_lse)):
        ours = np.asarray(ours, np.float64)
        finite = np.isfinite(ref)
        bad += int((~(np.abs(ours[finite] - ref[finite]) <= atol + rtol * np.abs(ref[finite]))).sum())
        bad += int((ours[~finite] != ref[~finite]).sum())
    return bad  # the same on every rank: the result is


def _collective_s(comm, cache, size, iters, dev):
    """Seconds of an allgather of ``size`` bytes per rank alone on the cache's transport
    (each after a barrier on ``comm``, the bench's: its deadline is ``--timeout``)."""
    rt = cache.runtime
    send, recv = rt.backend.alloc(size), rt.backend.alloc(size * rt.nranks)
    best = float("inf")
    for _ in range(max(1, iters) + 1):
        t, _ = timed(comm, lambda: rt.transport.allgather(send, recv), dev)
        best = min(best, t)
    return best


def _one_rank_s(comm, cfg, *, iters, warmup, seed, dev, window, runs, timeout=None):
    """Rank 0 alone with the whole cache (when ``runs``: the row's memory plan says it
    fits): seconds per decode call, or None. The other ranks wait without spinning."""
    result = None
    if comm.Get_rank() == 0 and runs:
        one = _filled_cache(MPI.COMM_SELF, cfg, seed, dev, window, (warmup + iters) * cfg["tokens"], timeout=timeout)
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


def run_config(comm, cfg, *, iters, warmup, check, reduce, seed, dev, budget, window=None, timeout=None):
    """Benchmark one decode configuration; return its row (identical on every rank).
    ``budget`` (``memory.Budget``) checks its memory first: raises ``memory.Refused``
    when the row does not fit, skips the baselines that do not. ``timeout``: the caches'
    (``--timeout``)."""
    P = comm.Get_size()
    _, red = REDUCE[reduce]
    calls = warmup + iters + 1
    label = f"cached {cfg['seqlen']} {cfg['dtype']}"
    plan = budget.plan(decode_stages(comm, cfg, window=window, calls=calls, one_rank_calls=warmup + iters,
                                     gpu=dev.backend == "cuda", shm=reads_in_place(comm, dev, budget)), label)
    say(comm, *plan.lines)
    cache = _filled_cache(comm, cfg, seed, dev, window, calls * cfg["tokens"], timeout=timeout)
    times, compute, moves = [], [], []
    for i in range(warmup + iters):
        args = [dev.put(x) for x in _new_tokens(cfg, seed, i)]
        t, moved = timed(comm, lambda: _counted(lambda: cache.decode(*args)), dev)
        if i >= warmup:
            times.append(t)
            compute.append(cache.last_stats.compute_s)
            moves.append(moved)
    st = cache.last_stats
    q, k, v = (dev.put(x) for x in _new_tokens(cfg, seed, 999_999))
    out, lse = cache.decode(q, k, v, return_lse=True)
    wrong = _count_wrong(comm, cfg, cache, q, out, lse, window, dev) if check else -1
    peaks = {"the decode": peak_bytes()}  # each part's own peak, to hold against its estimate
    reset_peak()
    # The ring way, on the same cache and queries (after the checked call's tokens).
    ring_t, ring_sent = [], 0
    for i in range(warmup + iters if plan["the ring way"] else 0):
        state = ring_prepare(cache)
        t, (_, ring_sent) = timed(comm, lambda: ring_decode(cache, q, state), dev)
        if i >= warmup:
            ring_t.append(t)
    coll = _collective_s(comm, cache, st.message_bytes, iters, dev)
    cache_mb = comm.allreduce(cache.nbytes, op=MPI.MAX) / 1e6
    if plan["the ring way"]:
        peaks["the ring way"] = peak_bytes()
    cache.release()
    reset_peak()
    one = _one_rank_s(comm, cfg, iters=iters, warmup=warmup, seed=seed, dev=dev, window=window,
                      runs=plan[ONE_RANK], timeout=timeout)
    if plan[ONE_RANK]:
        peaks[ONE_RANK] = peak_bytes()
    all_t = comm.allgather(float(np.mean(times)))
    t_s = float(red(all_t))
    ring_s = float(red(comm.allgather(float(np.mean(ring_t))))) if ring_t else None
    row = dict(cfg, mode="decode", ranks=P, backend=dev.backend, window=window,
               transport=cache.runtime.transport.name,
               decode_ms=1e3 * t_s, decode_ms_min=1e3 * min(all_t), decode_ms_max=1e3 * max(all_t),
               tokens_per_s=cfg["batch"] * cfg["tokens"] / t_s,
               message_bytes=st.message_bytes, kb_per_call=comm.allreduce(st.bytes_moved, op=MPI.MAX) / 1e3,
               compute_ms=1e3 * comm.allreduce(float(np.mean(compute)), op=MPI.MAX),
               collective_ms=1e3 * coll, ring_ms=None if ring_s is None else 1e3 * ring_s,
               ring_mb_per_call=None if ring_s is None else comm.allreduce(ring_sent, op=MPI.MAX) / 1e6,
               vs_ring=None if ring_s is None else ring_s / t_s,
               one_rank_ms=None if one is None else 1e3 * one,
               vs_one_rank=None if one is None else one / t_s,
               cache_mb=cache_mb,
               est_mb=comm.allreduce(plan.estimate if dev.cupy is None else plan.device_estimate, op=MPI.MAX) / 1e6,
               peak_mb=comm.allreduce(max(peaks.values()) / 1e6 if dev.cupy is None else dev.peak_mb(), op=MPI.MAX),
               wrong=wrong,
               **{f: comm.allreduce(max(getattr(m, f) for m in moves), op=MPI.MAX) for f in TRANSFERS})
    if dev.cupy is None:  # each part's estimate and measured peak (host; max over ranks), in the JSON rows
        row["stage_mb"] = {what: dict(est=comm.allreduce(plan.stages[what], op=MPI.MAX) / 1e6,
                                      peak=comm.allreduce(peaks.get(what, 0), op=MPI.MAX) / 1e6)
                           for what in plan.stages}
    return row


def _counted(call):
    """``call()``'s copies between host and device and its waits for the device
    (``burstmpi._transfers``), its result dropped."""
    with counting() as moved:
        call()
    return moved


def _transfers_line(rows):
    """The footer's line: what one decode call copied between host and device, per row kind."""
    seen = sorted({tuple(r[f] for f in TRANSFERS) for r in rows})
    if seen == [(0,) * len(TRANSFERS)]:
        return "# Host transfers per decode call : host arrays: no transfers"
    return "# Host transfers per decode call (most on a rank) : " + "; ".join(str(Transfers(*m)) for m in seen)


def main(comm, ctx, o):
    """The decode mode of ``burstmpi-bench``: ``o`` holds the command line's options."""
    import click

    source = lambda name: ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
    inapplicable = [f for f in ("mask", "layout", "docs", "bwd_comm", "balance", "use_torch", "trace_memory", "preset",
                                "transport") if source(f)]
    if inapplicable:
        raise click.UsageError(f"--decode does not take {', '.join(inapplicable)} (decode is causal over a "
                               "contiguous cache; see burstmpi-bench --help)")
    window = o["window"]
    if window is not None and window[1] not in (0, -1):
        raise click.BadParameter(f"--decode is causal: the window's right bound must be 0 or -1, got {window}")
    if o["sinks"] and (window is None or window[0] < 0):
        raise click.BadParameter(f"--sinks keeps the first tokens beside a window: expected --window LEFT,0 with "
                                 f"LEFT >= 0, got {window}")
    heads = o["heads"]
    kv_heads = heads if o["kv_heads"] is None else o["kv_heads"]
    if heads % kv_heads:
        raise click.BadParameter(f"--kv-heads must divide --heads ({heads}), got {kv_heads}")
    dev = resolve_device(comm, o["backend"])
    configs = [dict(seqlen=n, tokens=o["tokens"], batch=o["batch"], heads=heads, kv_heads=kv_heads,
                    head_dim=o["head_dim"], dtype=dt,
                    sinks=o["sinks"] or None)  # None: rows match baselines from before --sinks
               for n in seqlens(o["minseq"], o["maxseq"], o["stepfactor"])
               for dt in choices(o["dtype"], DTYPES)
               if not (dev.backend == "cuda" and dt == "float64")]
    params = dict(mode="decode", minseq=o["minseq"], maxseq=o["maxseq"], stepfactor=o["stepfactor"],
                  tokens=o["tokens"], iters=o["iters"], warmup=o["warmup"], check=o["check"], dtype=o["dtype"],
                  average=REDUCE[o["reduce"]][0], batch=o["batch"], heads=heads, kv_heads=kv_heads,
                  head_dim=o["head_dim"], window=window, sinks=o["sinks"], seed=o["seed"], backend=dev.backend,
                  baseline=o["baseline"], tolerance=o["tolerance"] if o["baseline"] else None,
                  mem_limit=o["mem_limit"], timeout=o["timeout"])
    budget = budget_for(comm, dev, o["mem_limit"])

    def run_one(cfg):
        return run_config(comm, cfg, iters=o["iters"], warmup=o["warmup"], check=o["check"], reduce=o["reduce"],
                          seed=o["seed"], dev=dev, budget=budget, window=window, timeout=o["timeout"])

    def footer(rows):
        vs_ring = [r["vs_ring"] for r in rows if r["vs_ring"] is not None]
        return [f"# Avg decode ms per call : {float(np.mean([r['decode_ms'] for r in rows])):.4f}",
                f"# Avg speedup over the ring way : {float(np.mean(vs_ring)):.2f}" if vs_ring else
                "# Avg speedup over the ring way : - (skipped: not enough memory)",
                f"# Bytes per call per rank (KB) : {sorted({round(r['kb_per_call'], 3) for r in rows})}",
                _transfers_line(rows)]

    show = (len(configs) > 1) if o["progress"] is None else o["progress"]
    sweep(comm, mode="decode", params=params, dev=dev, columns=COLUMNS, configs=configs, run_one=run_one,
          work=[float(c["seqlen"]) for c in configs], footer=footer, config_keys=CONFIG_KEYS,
          metric="decode_ms", check=o["check"], show_progress=show, json_path=o["json_path"],
          junit_path=o["junit_path"], baseline=o["baseline"], tolerance=o["tolerance"], bind=o["bind"])
