"""burstmpi-bench's attention mode: time and check the ring's forward and backward, the way
nccl-tests does for NCCL.

Run it under the MPI launcher; the number of ranks is mpiexec's business:

    mpiexec -n 4 burstmpi-bench                      # default sweep, 1K..4K tokens
    mpiexec -n 4 burstmpi-bench -b 4K -e 32K -f 2 -d all -J out.json

Only rank 0 prints. Every line that is not a data row starts with ``#``. Each row is
one configuration; times are the mean over ``-n`` iterations on each rank, reduced
over ranks by ``-a`` (default: the slowest rank, which is what the job waits for).

``columns.LEGEND`` defines every column (``burstmpi-bench --legend`` prints it). In short: forward,
backward and forward+backward times and TFLOP/s (FLOPs by flash-attn's convention), bytes
each rank sent, the time inside the local kernels against the time waiting on transfers,
``vs local`` (the ring's per-rank rate over the local kernel's alone on one unmasked block
of the same per-rank shape, timed side by side between the ring's iterations), skipped
steps, the load imbalance, memory, and ``#wrong`` (sampled rows of out, lse, dq, dk, dv
against float64; the job exits 1 if any is wrong). ``--torch`` times PyTorch's
scaled_dot_product_attention on the whole problem on rank 0, an iteration after each of
ours; ``--docs SPEC`` packs every length with documents (``burstmpi.masks._packing``) and also
runs them the way ring-attention peers force users to, each padded to a multiple of 2P
and run as its own zigzag sequence; ``--trace-memory`` traces a first forward and
backward's NumPy allocations. With --backend cuda (the default "auto" picks it when every
rank has a GPU) the arrays live on each rank's GPU and every phase is timed to the end of
its GPU work.

Memory (``burstmpi.bench.memory``): before each row the bench estimates what one rank
holds while the ring runs (its inputs, results, the plan's working arrays and ring
buffers), while the float64 check runs (the global q, k, v and dout it gathers), while
torch runs (rank 0: the global problem, torch's copies and gradients) and while the padded
way runs, sums them over each node's ranks and compares with what the node has free: a
baseline (torch, padded) that does not fit is skipped with a ``#`` line, a row whose ring
or check does not fit is refused (exit 4; ``-c 0`` drops the check).

Every run's preamble names the CPU and its vector extensions (AVX2, AVX-512): NumPy's
elementwise speed, and so every CPU figure, depends on them.

Presets (``--preset``) reproduce published setups; regression mode (``--baseline``)
compares with a stored JSON run and exits 3 when a configuration got slower than the
tolerance allows, optionally writing JUnit XML for CI systems; progress goes to stderr.
"""

import time
import tracemalloc

import click
import numpy as np
from mpi4py import MPI

from .. import reference
from .._api import shard_indices, unshard
from ..masks import _packing as packing
from ..masks._intervals import Bounds, Mask
from ..masks._layout import LAYOUTS
from .._plan import BurstAttention
from .._transport.nodes import nodes
from .columns import (ALL_COLUMNS, BALANCE_COLUMNS, COLUMNS, CONFIG_KEYS, HEAD_COLUMNS, LEGEND, MASK_COLUMNS,
                      MEMORY_COLUMNS, NODE_COLUMNS, PADDED_COLUMNS, PRESETS, TORCH_COLUMNS)
from .common import (DTYPES, REDUCE, TOLERANCE, Device, barrier, budget_for, choices, deadline, np_dtype,
                     reads_in_place, resolve_device, say, seqlens, sweep, timed)
from .estimates import attention_stages
from .memory import Budget
from .patterns import DENSE, build as build_pattern
from .torchref import torch_timer

__all__ = ["COLUMNS", "ALL_COLUMNS", "LEGEND", "CONFIG_KEYS", "PRESETS", "check_docs", "flops", "run_config",
           "main"]

CHECK_ROWS = 64


def flops(batch, seqlen, heads, head_dim, causal, phase="fwd", window=None, cu_seqlens=None):
    """Attention FLOPs by flash-attn's convention (backward = 2.5 x forward).

    Without a window or documents: 4 B Z N^2 d, halved when causal. Otherwise 4 B Z d
    times the number of visible (query, key) pairs.
    """
    if window is None and cu_seqlens is None:
        f = 4.0 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    else:
        qb = Mask(Bounds(causal, window), seqlen, cu_seqlens).query_block(np.arange(seqlen))
        f = 4.0 * batch * heads * head_dim * float((qb.last - qb.first + 1).sum())
    return {"fwd": f, "bwd": 2.5 * f, "fwdbwd": 3.5 * f}[phase]


def check_docs(spec):
    """A --docs SPEC, checked (or None)."""
    if spec is None:
        return None
    try:
        packing.parse_docs(spec)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--docs")
    return spec


def _count_wrong(comm, cfg, local, out, lse, grads, window, positions, cu_seqlens=None, mask=None):
    """Values that miss float64 on sampled rows (summed over ranks).

    Query rows: out, lse and dq against an exact float64 forward and backward. Key rows:
    dk and dv against float64 given the forward's lse and out (checked just before), so
    a fault in the backward's ring shows up on its own.
    """
    lay = dict(layout=cfg["layout"], cu_seqlens=cu_seqlens, timeout=deadline(comm))  # each wait within it
    q, k, v, do = local
    dq, dk, dv = grads
    kg, vg = unshard(k, **lay), unshard(v, **lay)
    qg, dog = unshard(q, **lay), unshard(do, **lay)
    lse_g = unshard(lse, axis=2, **lay)
    # delta = rowsum(do * out) in float64, a block of rows at a time (no float64 copy of the shard)
    delta = np.empty(out.shape[:1] + out.shape[2:3] + out.shape[1:2])
    for a in range(0, out.shape[1], reference.CHUNK):
        b = a + reference.CHUNK
        delta[:, :, a:b] = np.einsum("bnhd,bnhd->bhn", np.asarray(do[:, a:b], np.float64),
                                     np.asarray(out[:, a:b], np.float64))
    delta_g = unshard(delta, axis=2, **lay)
    N = cfg["seqlen"]
    sample = np.unique(np.linspace(0, N - 1, min(CHECK_ROWS, N)).astype(np.int64))
    mine = np.nonzero(np.isin(positions, sample))[0]
    atol, rtol = TOLERANCE[cfg["dtype"]]
    opts = dict(causal=bool(cfg["causal"]), window=window, cu_seqlens=cu_seqlens, mask=mask)

    def wrong(ours, ref):
        ours = np.asarray(ours, dtype=np.float64)
        return int((~(np.abs(ours - ref) <= atol + rtol * np.abs(ref))).sum())  # NaN is wrong

    bad = 0
    if mine.size:
        o_ref, l_ref, dq_ref = reference.rows(q[:, mine], kg, vg, do[:, mine], positions[mine], **opts)
        dk_ref, dv_ref = reference.key_rows(qg, k[:, mine], v[:, mine], dog, lse_g, delta_g,
                                            positions[mine], **opts)
        bad = (wrong(out[:, mine], o_ref) + wrong(lse[:, :, mine], l_ref) + wrong(dq[:, mine], dq_ref)
               + wrong(dk[:, mine], dk_ref) + wrong(dv[:, mine], dv_ref))
    return comm.allreduce(bad, op=MPI.SUM)


def _footprint(comm, cfg, window, q, k, v, do, cu_seqlens=None, mask=None, timeout=None):
    """Peak bytes of one forward and one backward on a fresh plan, inputs included.

    tracemalloc sees every NumPy allocation made while it runs; the inputs were made
    before, so their bytes are added. Returns MB (max over ranks) of the peaks and of
    what each phase cannot do without: its arrays in and out and its ring buffers.
    """
    plan = BurstAttention(causal=bool(cfg["causal"]), window=window, layout=cfg["layout"],
                          bwd_comm=cfg["bwd_comm"], mask=mask, timeout=timeout)
    tracemalloc.start()
    out, lse = plan.forward(q, k, v, cu_seqlens=cu_seqlens)
    fwd_peak = tracemalloc.get_traced_memory()[1] + q.nbytes + k.nbytes + v.nbytes
    fwd_need = q.nbytes + k.nbytes + v.nbytes + out.nbytes + lse.nbytes + plan.buffer_bytes
    tracemalloc.reset_peak()
    grads = plan.backward(do, q, k, v, out, lse, cu_seqlens=cu_seqlens)
    bwd_peak = tracemalloc.get_traced_memory()[1] + do.nbytes + q.nbytes + k.nbytes + v.nbytes
    bwd_need = (do.nbytes + q.nbytes + k.nbytes + v.nbytes + out.nbytes + lse.nbytes
                + sum(g.nbytes for g in grads) + plan.buffer_bytes)
    tracemalloc.stop()
    mb = [comm.allreduce(x, op=MPI.MAX) / 1e6 for x in (fwd_need, fwd_peak, bwd_need, bwd_peak)]
    return dict(zip(("fwd_operands_mb", "fwd_traced_peak_mb", "bwd_operands_mb", "bwd_traced_peak_mb"), mb))


def _local_kernel_s(plan, q, k, v, do, dev, start):
    """Seconds of the backend's local forward and backward on one unmasked block of this
    rank's own q against its own k, v: the single-device work one ring step does.
    ``start()`` (a barrier) precedes each, so the ranks run it side by side as they run
    the ring."""
    from .._ring.flat import grouped_rows

    be = plan.backend
    B, C, Z, d = q.shape
    Zkv, dv = k.shape[2], v.shape[3]
    g = Z // Zkv
    acc = be.acc_dtype(q.dtype)
    dense = Mask(Bounds(), C)
    qb, kb = dense.query_block(np.arange(C)), dense.key_block(np.arange(C))
    qr, dor = grouped_rows(q, Zkv), grouped_rows(do, Zkv)
    kr, vr = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    state = be.fwd_state(B, Zkv, C, g, dv, acc)
    dev.sync()
    start()
    t0 = time.perf_counter()
    be.fwd_block(qr, kr, vr, state, qb, kb, plan.last_call.scale)
    dev.sync()
    tf = time.perf_counter() - t0
    out, lse = be.fwd_finalize(state, q.dtype)
    D = (out.astype(acc) * out.astype(acc)).sum(axis=-1)
    del out  # the CPU backend's is its accumulator, which bwd_state zeroes for dq
    grads = be.bwd_state(B, Zkv, C, g, d, dv, acc).values()
    dev.sync()
    start()
    t0 = time.perf_counter()
    be.bwd_block(qr, dor, D, lse, kr, vr, *grads, qb, kb, plan.last_call.scale)
    dev.sync()
    return tf, time.perf_counter() - t0


def _inputs(cfg, C, seed, rank, dev):
    """Random local q, k, v, dout of C rows (host copies, and where the run keeps them)."""
    B, N, Z, Zkv, d = cfg["batch"], cfg["seqlen"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    rng = np.random.default_rng([seed, rank, N])
    dt = np_dtype(cfg["dtype"])
    shapes = [(B, C, Z, d), (B, C, Zkv, d), (B, C, Zkv, d), (B, C, Z, d)]
    local = [rng.standard_normal(s, dtype=np.float32).astype(dt, copy=False) for s in shapes]
    return local, [dev.put(x) for x in local]


def _iterations(comm, plan, arrays, iters, warmup, dev, cu_seqlens=None, between=None):
    """Forward and backward ``warmup + iters`` times; the timed ones' seconds and the last
    results. ``between(j)`` runs after the j-th timed iteration."""
    q, k, v, do = arrays
    tf, tb = [], []
    for i in range(warmup + iters):
        a, (out, lse) = timed(comm, lambda: plan.forward(q, k, v, cu_seqlens=cu_seqlens), dev)
        b, grads = timed(comm, lambda: plan.backward(do, q, k, v, out, lse, cu_seqlens=cu_seqlens), dev)
        if i >= warmup:
            tf.append(a)
            tb.append(b)
            if between is not None:
                between(i - warmup)
    return tf, tb, out, lse, grads


def _padded_way(comm, cfg, cu_seqlens, *, iters, warmup, window, seed, dev, transport, red, timeout=None):
    """The documents as peers run them: each padded to a multiple of 2P tokens and run as
    its own zigzag sequence, one after another. Returns the row's padded-way columns."""
    P = comm.Get_size()
    lengths, padded = packing.padded_documents(cu_seqlens, P)
    plan = BurstAttention(causal=bool(cfg["causal"]), window=window, layout="zigzag",
                          bwd_comm=cfg["bwd_comm"], backend=dev.backend,
                          transport=transport, timeout=timeout)
    fb, sent = 0.0, 0
    for n in padded:
        _, arrays = _inputs(dict(cfg, seqlen=int(n)), int(n) // P, seed, comm.Get_rank(), dev)
        tf, tb, *_ = _iterations(comm, plan, arrays, max(1, iters), warmup, dev)
        fb += float(np.mean(tf)) + float(np.mean(tb))
        sent += plan.last_stats.forward.bytes_sent + plan.last_stats.backward.bytes_sent
    return dict(pad_fwdbwd_ms=1e3 * float(red(comm.allgather(fb))),
                pad_mb_sent=comm.allreduce(sent, op=MPI.MAX) / 1e6,
                pad_ratio=float(padded.sum()) / float(lengths.sum()))


def run_config(comm, cfg, *, iters, warmup, check, reduce, window, use_torch, seed,
               trace_memory=False, dev=None, transport="auto", docs=None, budget=None, timeout=None):
    """Benchmark one configuration; return its row (identical on every rank). ``docs``
    (a ``--docs`` SPEC) packs each sequence with documents; ``cfg["mask_spec"]`` (a
    ``--mask`` pattern, or None) masks it, and then the same shapes run unmasked side by
    side for the ``vs dense`` and efficiency columns. ``budget`` (``memory.Budget``, made
    here when None) checks the row's memory first: raises ``memory.Refused`` when the row
    does not fit, skips the baselines that do not. ``timeout``: every plan's (``--timeout``;
    None: ``BURSTMPI_TIMEOUT``)."""
    dev = Device("cpu") if dev is None else dev
    budget = Budget(comm) if budget is None else budget
    P, rank = comm.Get_size(), comm.Get_rank()
    B, N, Z, d = cfg["batch"], cfg["seqlen"], cfg["heads"], cfg["head_dim"]
    cu = None if docs is None else packing.pack(docs, N, seed)
    positions = shard_indices(N, comm=comm, layout=cfg["layout"], cu_seqlens=cu)
    C = len(positions)
    padded_C = 0 if cu is None else int(packing.padded_documents(cu, P)[1].max(initial=0)) // P
    plan_mem = budget.plan(attention_stages(comm, cfg, max(comm.allgather(C)), gpu=dev.backend == "cuda",
                                            check=check, use_torch=use_torch, padded_C=padded_C,
                                            shm=reads_in_place(comm, dev, budget, transport)),
                           f"seqlen {N} {cfg['dtype']} causal {cfg['causal']} {cfg['layout']} {cfg['bwd_comm']}")
    say(comm, *plan_mem.lines)
    use_torch = use_torch and plan_mem.runs.get("torch on rank 0", False)
    local, arrays = _inputs(cfg, C, seed, rank, dev)
    q, k, v, do = arrays
    spec = cfg.get("mask_spec")
    mask = None if spec is None else build_pattern(spec, N, Z, seed)
    hp, topology = cfg.get("head_parallel") or 1, cfg.get("topology") or "flat"
    plan = BurstAttention(causal=bool(cfg["causal"]), window=window, layout=cfg["layout"],
                          bwd_comm=cfg["bwd_comm"], backend=dev.backend,
                          transport=transport, mask=mask, head_parallel=hp, topology=topology, timeout=timeout,
                          balance=cfg.get("balance") or "auto")
    memory = _footprint(comm, cfg, window, q, k, v, do, cu, mask, timeout) if trace_memory else {}
    dense, dense_times = None, []  # the same shapes unmasked, for --mask PATTERN
    if mask is not None:
        dense = BurstAttention(layout=cfg["layout"], bwd_comm=cfg["bwd_comm"], backend=dev.backend,
                               transport=transport, head_parallel=hp, topology=topology, timeout=timeout)
        _iterations(comm, dense, arrays, 0, 1, dev)  # warmed up, untimed
    ref = []  # (fwd, bwd) seconds of the local kernel
    torch_tick, torch_times = torch_timer(comm, cfg, local, dev.backend == "cuda") if use_torch else (None, [])

    def between(j):
        if torch_tick is not None:  # torch after each of our iterations: means over the same span
            torch_tick()
        if dense is not None:  # one unmasked iteration after each masked one: side by side
            f, b, *_ = _iterations(comm, dense, arrays, 1, 0, dev)
            dense_times.append((f[0], b[0]))
        # The single-device reference, timed after every iteration: side by side with the
        # ring's, on machines whose speed drifts, and a mean of as many samples (one sample
        # after every second iteration, as before, left `vs local` of one 4-rank 16K causal
        # row at 0.93-0.98 over three runs whose ring times were within 0.5 %).
        start = lambda: barrier(comm, dev.idle)
        if C:
            ref.append(_local_kernel_s(plan, q, k, v, do, dev, start))
        else:  # no rows here: only the barriers
            start()
            start()

    tf, tb, out, lse, grads = _iterations(comm, plan, arrays, iters, warmup, dev, cu, between)
    st = plan.last_stats
    name, red = REDUCE[reduce]
    all_f = comm.allgather(float(np.mean(tf)))
    all_b = comm.allgather(float(np.mean(tb)))
    all_fb = [a + b for a, b in zip(all_f, all_b)]
    tf_s, tb_s = float(red(all_f)), float(red(all_b))
    fb_s = float(red(all_fb))
    # The single-device reference: the largest ranks' blocks (what the slowest step costs),
    # each rank's mean over its runs, reduced over those ranks as the ring's times are.
    everyone = comm.allgather((C, *(float(np.mean(x)) for x in zip(*ref))) if ref else (C, 0.0, 0.0))
    Cl = max(c for c, _, _ in everyone)
    largest = [(f, b) for c, f, b in everyone if c == Cl]
    lf, lb = (float(red([x[i] for x in largest])) for i in (0, 1))
    lfb = float(red([f + b for f, b in largest]))
    compute = comm.allreduce(st.forward.compute_s + st.backward.compute_s, op=MPI.MAX)
    exposed = comm.allreduce(st.forward.wait_s + st.backward.wait_s, op=MPI.MAX)
    sent = comm.allreduce(st.forward.bytes_sent + st.backward.bytes_sent, op=MPI.MAX)
    inter = st.forward.bytes_internode + st.backward.bytes_internode
    intra = st.forward.bytes_sent + st.backward.bytes_sent - inter
    row = dict(cfg)
    row.pop("bwd_comm")
    fl = {phase: flops(B, N, Z, d, cfg["causal"], phase, window, cu) for phase in ("fwd", "bwd", "fwdbwd")}
    pairs = comm.allgather(st.forward.pairs)  # as computed: on the layout the ring ran on
    bwd_pairs = comm.allgather(st.backward.pairs)
    if mask is not None:  # FLOPs of the visible pairs (per head on average), as with a window
        f = 4.0 * B * Z * d * float(sum(pairs))
        fl = {"fwd": f, "bwd": 2.5 * f, "fwdbwd": 3.5 * f}
    local_rate = 3.5 * 4.0 * B * Z * Cl * Cl * d / lfb  # dense Cl x Cl block, fwd + bwd
    row.update(
        bwd_mode=st.bwd_mode, ranks=P, backend=st.backend, transport=st.transport,
        fwd_ms=1e3 * tf_s, bwd_ms=1e3 * tb_s, fwdbwd_ms=1e3 * fb_s,
        fwd_ms_min=1e3 * min(all_f), fwd_ms_avg=1e3 * float(np.mean(all_f)), fwd_ms_max=1e3 * max(all_f),
        bwd_ms_min=1e3 * min(all_b), bwd_ms_avg=1e3 * float(np.mean(all_b)), bwd_ms_max=1e3 * max(all_b),
        fwdbwd_ms_min=1e3 * min(all_fb), fwdbwd_ms_avg=1e3 * float(np.mean(all_fb)),
        fwdbwd_ms_max=1e3 * max(all_fb),
        algbw=sent / fb_s / 1e9, busbw=sent / fb_s / 1e9,
        compute_ms=1e3 * compute, exposed_ms=1e3 * exposed,  # the last iteration's forward + backward
        overlap=compute / (compute + exposed) if compute + exposed > 0 else 1.0,
        local_fwd_ms=1e3 * lf, local_bwd_ms=1e3 * lb, local_fwdbwd_tflops=local_rate / 1e12,
        fwd_tflops=fl["fwd"] / P / tf_s / 1e12,
        bwd_tflops=fl["bwd"] / P / tb_s / 1e12,
        fwdbwd_tflops=fl["fwdbwd"] / P / fb_s / 1e12,
        fwd_mb_sent=comm.allreduce(st.forward.bytes_sent, op=MPI.MAX) / 1e6,
        bwd_mb_sent=comm.allreduce(st.backward.bytes_sent, op=MPI.MAX) / 1e6,
        ring=st.topology, hp=hp, intra_mb=comm.allreduce(intra, op=MPI.MAX) / 1e6, inter_mb=comm.allreduce(inter, op=MPI.MAX) / 1e6,
        steps_skipped=comm.allreduce(st.forward.steps_skipped, op=MPI.SUM),
        fwd_wait_ms=1e3 * comm.allreduce(st.forward.wait_s, op=MPI.MAX),
        bwd_wait_ms=1e3 * comm.allreduce(st.backward.wait_s, op=MPI.MAX),
        est_mb=comm.allreduce(plan_mem.estimate if dev.cupy is None else plan_mem.device_estimate, op=MPI.MAX) / 1e6,
        # None without documents, as rows from before --docs have it: old baselines still match.
        docs_spec=docs, docs=0 if cu is None else int(np.count_nonzero(np.diff(cu))),
        imbalance=max(pairs) / float(np.mean(pairs)) if np.mean(pairs) > 0 else 1.0,
        bwd_imbalance=max(bwd_pairs) / float(np.mean(bwd_pairs)) if np.mean(bwd_pairs) > 0 else 1.0,
        ring_layout=st.ring_layout, balance_shown=cfg.get("balance") or "auto",
        wrong=-1,
    )
    row["fwdbwd_tflops_all"] = row["fwdbwd_tflops"] * P
    row["vs_local"] = row["fwdbwd_tflops"] / row["local_fwdbwd_tflops"]
    row.update(memory)
    if mask is not None:
        dense_f = float(red(comm.allgather(float(np.mean([x for x, _ in dense_times])))))
        dense_fb = float(red(comm.allgather(float(np.mean([x + y for x, y in dense_times])))))
        visible = float(sum(pairs)) / (float(N) * N)
        row.update(visible=visible, dense_fwd_ms=1e3 * dense_f, dense_fwdbwd_ms=1e3 * dense_fb,
                   vs_dense=dense_fb / fb_s, eff_fwd=dense_f * visible / tf_s, eff_fwdbwd=dense_fb * visible / fb_s)
    if check:
        row["wrong"] = _count_wrong(comm, row, local, dev.host(out), dev.host(lse),
                                    [dev.host(g) for g in grads], window, positions, cu, mask)
    if cu is not None and plan_mem.runs["the padded way"]:
        row.update(_padded_way(comm, cfg, cu, iters=iters, warmup=warmup, window=window, seed=seed,
                               dev=dev, transport=transport, red=red, timeout=timeout))
        row["vs_padded"] = row["pad_fwdbwd_ms"] / row["fwdbwd_ms"]
    if use_torch:  # (and it fits)
        # The mean over the timed iterations, as ours is: a minimum against a mean would
        # favour torch by this machine's run-to-run noise.
        t_f, t_fb = comm.bcast(tuple(float(np.mean(x)) for x in zip(*torch_times)) if torch_times else None, root=0)
        row["torch_fwd_tflops"] = fl["fwd"] / t_f / 1e12
        row["torch_fwdbwd_tflops"] = fl["fwdbwd"] / t_fb / 1e12
        row["vs_torch_fwd"] = row["fwd_tflops"] * P / row["torch_fwd_tflops"]
        row["vs_torch_fwdbwd"] = row["fwdbwd_tflops_all"] / row["torch_fwdbwd_tflops"]
    row["peak_mb"] = comm.allreduce(dev.peak_mb(), op=MPI.MAX)  # after the check and the baselines
    return row


def main(comm, ctx, o):
    """The attention mode of ``burstmpi-bench``: ``o`` holds the command line's options."""
    P = comm.Get_size()
    minseq, maxseq, stepfactor = o["minseq"], o["maxseq"], o["stepfactor"]
    heads, kv_heads, head_dim, dtype = o["heads"], o["kv_heads"], o["head_dim"], o["dtype"]
    mask, layout, docs, window = o["mask"], o["layout"], o["docs"], o["window"]
    if o["preset"] is not None:
        given = lambda name: ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
        ps = dict(PRESETS[o["preset"]])
        per_rank = ps.pop("per_rank", None)
        if per_rank is not None:
            ps.update(minseq=per_rank * P, maxseq=per_rank * P)
        values = dict(minseq=minseq, maxseq=maxseq, stepfactor=stepfactor, heads=heads, kv_heads=kv_heads,
                      head_dim=head_dim, dtype=dtype, mask=mask, layout=layout, docs=docs)
        values.update({k: v for k, v in ps.items() if not given(k)})
        minseq, maxseq, stepfactor = values["minseq"], values["maxseq"], values["stepfactor"]
        heads, kv_heads, head_dim = values["heads"], values["kv_heads"], values["head_dim"]
        dtype, mask, layout, docs = values["dtype"], values["mask"], values["layout"], check_docs(values["docs"])
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise click.BadParameter(f"--kv-heads must divide --heads ({heads}), got {kv_heads}")
    if o["use_torch"]:
        if window is not None or docs is not None:
            raise click.UsageError("--torch compares dense or causal attention only; drop --window and --docs")
        try:
            import torch  # noqa: F401
        except ImportError:
            raise click.UsageError("--torch needs PyTorch (pip install torch)")
    pattern = None if mask in DENSE else mask  # a sparse pattern runs causal
    causals = [True] if pattern else {"none": [False], "causal": [True], "both": [False, True]}[mask]
    if pattern and (o["use_torch"] or docs is not None or window is not None):
        raise click.UsageError("--mask PATTERN runs alone: drop --torch, --docs and --window")
    # head_parallel None for 1: rows from before --head-parallel still match a baseline's.
    configs = [dict(seqlen=n, batch=o["batch"], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                    dtype=dt, causal=int(c), layout=lay, bwd_comm=bw, mask_spec=pattern,
                    head_parallel=u if u > 1 else None, topology=None if topo == "flat" else topo,
                    balance=None if bal == "auto" else bal)  # None: rows from before --balance still match
               for n in seqlens(minseq, maxseq, stepfactor)
               for dt in choices(dtype, DTYPES)
               for c in causals
               for lay in choices(layout, LAYOUTS)
               for bw in choices(o["bwd_comm"], ["burst", "ring", "two-way"])  # "all": side by side
               for u in o["head_parallel"]
               for topo in o["topology"]
               for bal in o["balance"]]
    params = dict(minseq=minseq, maxseq=maxseq, stepfactor=stepfactor, iters=o["iters"], warmup=o["warmup"],
                  check=o["check"], dtype=dtype, average=REDUCE[o["reduce"]][0], batch=o["batch"], heads=heads,
                  kv_heads=kv_heads, head_dim=head_dim, mask=mask, layout=layout,
                  head_parallel=",".join(map(str, o["head_parallel"])), topology=",".join(o["topology"]),
                  balance=",".join(o["balance"]),
                  window=window, docs=docs, bwd=o["bwd_comm"], torch=o["use_torch"],
                  trace_memory=o["trace_memory"], seed=o["seed"], preset=o["preset"], baseline=o["baseline"],
                  tolerance=o["tolerance"] if o["baseline"] else None, mem_limit=o["mem_limit"],
                  timeout=o["timeout"])
    dev = resolve_device(comm, o["backend"])
    if o["trace_memory"] and dev.backend == "cuda":
        raise click.UsageError("--trace-memory traces NumPy allocations; use --backend cpu")
    transport = o["transport"]
    if dev.backend == "cuda" and transport == "shm":
        raise click.UsageError("--transport shm shares host buffers; GPU arrays take auto, nccl or mpi")
    if dev.backend != "cuda" and transport == "nccl":
        transport = "auto"  # a GPU transport: host arrays take shm or mpi, as auto picks
    params.update(backend=dev.backend, transport=transport)
    columns = (COLUMNS + (MEMORY_COLUMNS if o["trace_memory"] else []) + (PADDED_COLUMNS if docs else [])
               + (MASK_COLUMNS if pattern else []) + (NODE_COLUMNS if nodes(comm, o["timeout"]).count > 1 else [])
               + (HEAD_COLUMNS if o["head_parallel"] != [1] or o["topology"] != ["flat"] else [])
               + (BALANCE_COLUMNS if o["balance"] != ["auto"] else [])
               + (TORCH_COLUMNS if o["use_torch"] else []))
    work = [flops(c["batch"], c["seqlen"], c["heads"], c["head_dim"], c["causal"], "fwdbwd", window,
                  None if docs is None else packing.pack(docs, c["seqlen"], o["seed"]))
            for c in configs]

    budget = budget_for(comm, dev, o["mem_limit"])

    def run_one(cfg):
        return run_config(comm, cfg, iters=o["iters"], warmup=o["warmup"], check=o["check"],
                          reduce=o["reduce"], window=window, use_torch=o["use_torch"], seed=o["seed"],
                          trace_memory=o["trace_memory"], dev=dev, transport=transport, docs=docs, budget=budget,
                          timeout=o["timeout"])

    def footer(rows):
        return [f"# Avg TFLOP/s per rank (fwd+bwd) : {float(np.mean([r['fwdbwd_tflops'] for r in rows])):.4f}",
                f"# Avg bus bandwidth (GB/s) : {float(np.mean([r['busbw'] for r in rows])):.4f}"]

    show = (len(configs) > 1) if o["progress"] is None else o["progress"]
    sweep(comm, mode="attention", params=params, dev=dev, columns=columns, configs=configs, run_one=run_one,
          work=work, footer=footer, config_keys=CONFIG_KEYS, metric="fwdbwd_ms", check=o["check"],
          show_progress=show, json_path=o["json_path"], junit_path=o["junit_path"], baseline=o["baseline"],
          tolerance=o["tolerance"], bind=o["bind"], torch=o["use_torch"], transport=transport)
