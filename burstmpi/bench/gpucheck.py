"""``burstmpi-gpucheck``: everything GPU-related, on a machine with one GPU.

    burstmpi-gpucheck            # all checks and the benchmark, a few minutes
    burstmpi-gpucheck --quick    # fewer configurations, no benchmark

1. probe   cuda/probe.cu's fragment GEMMs (ldmatrix, mma.sync, the C-to-A reuse) against
           NumPy, for float16, bfloat16 and float32: the PTX layouts the emulator assumes.
2. kernels one rank, ``BurstAttention(backend="cuda")`` on CuPy arrays against float64
           (flash-attn's rule) and against the CPU backend: forward and backward, three
           dtypes, head dims 64 and 128, no mask / causal / sliding window, GQA.
3. decode  ``KVCache(backend="cuda")``: prefill, then decode steps (the split-KV kernel and
           the combine of cuda/attn_decode.cu) against float64 and the CPU backend, three
           dtypes, T = 1 and 4, GQA and MQA, a window; under ``ranks`` also at 2-4 ranks.
4. transfers  the copies between host and device, and the waits for the device, of one
           forward, one backward and one decode call (``burstmpi._transfers``), at two
           sequence lengths: printed per call, and none may grow with the length (a call
           moves headers and scalars through the host, never its tokens).
5. interop torch CUDA tensors in, torch CUDA tensors out, zero-copy (if torch has CUDA).
6. ranks   ``mpiexec -n 2, 3, 4`` on this one GPU through the MPI transport (NCCL refuses
           two ranks on one GPU), every rank checked against float64: the ring, and decode
           over a cache sharded across the ranks (bitwise the same result on every rank);
           at 4 ranks, as 2 fake nodes of 2, also the two-level ring (every backward
           mode) and head parallelism (u = 2). Over NCCL (``--transport nccl``, a GPU
           per rank), also the stream-ordering check (``bench/ordering.py``): the ring
           and the decode again with the comm stream held back, then the compute
           stream, must give the same bits.
7. bench   forward and backward TFLOP/s at 16384 tokens, head dim 128, bfloat16, next to
           PyTorch's ``scaled_dot_product_attention`` on the same GPU; one decode call over a
           cache of 256K tokens (bfloat16, 32/8 heads, head dim 128) and the rate it reads K/V.
           The forward and backward rates without a mask are stored in the rate file
           (``burstmpi._config.store_rate``), where ``topology="auto"`` finds them.

Prints one line per check, ``# ... OK`` or ``# ... FAILED`` at the end, exit status 1 on
any failure. On a machine with two or more GPUs, ``mpiexec -n 2 burstmpi-gpucheck
--ranks-only --transport nccl`` checks the NCCL ring itself.
"""

import os
import shutil
import subprocess
import sys
import time
import zlib

import click
import numpy as np
from mpi4py import MPI

from .. import __version__
from .. import reference as ref
from .._config import store_rate
from .._decode.cache import KVCache
from .._gpu import kernels
from .._gpu.device import device_name, import_cupy
from .._interop import bfloat16
from .._plan import BurstAttention
from .._transfers import Transfers, counting

__all__ = ["main"]

DTYPES = ("float16", "bfloat16", "float32")


def _np_dtype(name):
    return bfloat16 if name == "bfloat16" else np.dtype(name)


def _f64(x):
    get = getattr(x, "get", None)  # CuPy
    return np.asarray(get() if get else x, dtype=np.float64)


def _within(ours, exact, plain, dtype):
    """flash-attn's rule, as the test suite applies it: (holds, error)."""
    problem, err = ref.flash_attn_rule(_f64(ours), _f64(exact), _f64(plain), dtype)
    return problem is None, err


class Report:
    def __init__(self):
        self.failed = 0

    def line(self, ok, text):
        self.failed += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {text}", flush=True)


# -- 1. probe ---------------------------------------------------------------------------------

def check_probe(cupy, dev, rep):
    mod = kernels.probe_module(dev)
    rng = np.random.default_rng(1)
    for dtype in DTYPES:
        dt = _np_dtype(dtype)
        a, b, z = (rng.standard_normal(s).astype(dt) for s in ((16, 32), (16, 32), (16, 16)))
        c1, c2 = cupy.zeros((16, 16), np.float32), cupy.zeros((16, 16), np.float32)
        da, db, dz = (cupy.asarray(x) for x in (a, b, z))
        fn = mod.get_function(f"gemm_probe<{kernels.DTYPES[dtype]}>")
        fn((1,), (32,), (da, db, dz, c1, c2), shared_mem=16384)
        s = _f64(a) @ _f64(b).T
        p = s if dtype == "float32" else s.astype(np.float32).astype(dt).astype(np.float64)
        ok = np.allclose(c1.get(), s, rtol=1e-5, atol=1e-5) and np.allclose(c2.get(), p @ _f64(z), rtol=1e-4, atol=1e-4)
        rep.line(ok, f"probe {dtype:8s} fragment GEMMs against NumPy")


# -- 2./4. attention against float64 ------------------------------------------------------------

def _problem(B, N, Z, Zkv, d, dtype, seed):
    return ref.random_problem(B, N, Z, Zkv, d, dtype=_np_dtype(dtype), seed=seed)


def check_one_rank(cupy, rep, quick):
    # Packed documents: 1-token and empty ones, and documents crossing every 64-row tile.
    docs = np.array([0, 1, 1, 90, 333, 334, 600, 777])
    masks = {"none": (False, None, None), "causal": (True, None, None), "window": (False, (200, 50), None),
             "docs": (True, None, docs)}
    dims = [(64, 64), (128, 128)] if not quick else [(128, 128)]
    comm = MPI.COMM_SELF
    for dtype in DTYPES:
        for d, dv in dims:
            for mask, (causal, window, cu) in masks.items():
                q, k, v, do = _problem(1, 777, 8, 2, d, dtype, seed=d)
                opts = dict(causal=causal, window=window)
                gpu = BurstAttention(comm, backend="cuda", **opts)
                host = BurstAttention(comm, backend="cpu", **opts)
                gq, gk, gv, gdo = (cupy.asarray(x) for x in (q, k, v, do))
                t0 = time.perf_counter()
                out, lse = gpu.forward(gq, gk, gv, cu_seqlens=cu)
                grads = gpu.backward(gdo, gq, gk, gv, out, lse, cu_seqlens=cu)
                cupy.cuda.get_current_stream().synchronize()
                secs = time.perf_counter() - t0
                ho, hl = host.forward(q, k, v, cu_seqlens=cu)
                hgrads = host.backward(do, q, k, v, ho, hl, cu_seqlens=cu)
                exact = (ref.forward(q, k, v, cu_seqlens=cu, **opts)
                         + ref.backward(do, q, k, v, cu_seqlens=cu, **opts))
                plain = (ref.forward(q, k, v, precision="plain", cu_seqlens=cu, **opts)
                         + ref.backward(do, q, k, v, precision="plain", cu_seqlens=cu, **opts))
                errs, ok_all = [], True
                for ours, nb, e, p in zip((out, lse) + grads, (ho, hl) + hgrads, exact, plain):
                    ok, err = _within(ours, e, p, dtype)
                    diff = float(np.nanmax(np.abs(_f64(ours) - _f64(nb))[np.isfinite(_f64(e))]))
                    ok_all &= ok
                    errs.append(f"{err:.1e}/{diff:.1e}")
                rep.line(ok_all, f"kernels {dtype:8s} d{d} {mask:6s} GQA 8/2 N=777: err vs float64 / "
                                 f"vs NumPy (out lse dq dk dv) {' '.join(errs)}  [{secs:.2f} s incl. compile]")


def _decode_run(cache, q, k, v, N0, T, put):
    """Prefill N0 tokens into ``cache``, then decode the rest T at a time: every output."""
    outs = [cache.prefill(put(q[:, :N0]), put(k[:, :N0]), put(v[:, :N0]))] if N0 else []
    for s in range(N0, q.shape[1], T):
        outs.append(cache.decode(*(put(x[:, s:s + T]) for x in (q, k, v))))
    return np.concatenate([_f64(o) for o in outs], axis=1)


def check_decode(cupy, rep, quick):
    """KVCache on the GPU against float64 (flash-attn's rule) and the CPU backend."""
    cases = [(1, None, 2), (4, None, 8), (1, (300, 0), 1)][:2 if quick else 3]
    for dtype in DTYPES:
        for T, window, Zkv in cases:
            N0, steps = 1000, 12
            q, k, v, _ = _problem(1, N0 + steps * T, 8, Zkv, 128, dtype, seed=T)
            opts = dict(capacity=N0 + steps * T, batch=1, kv_heads=Zkv, head_dim=128,
                        dtype=_np_dtype(dtype), window=window)
            t0 = time.perf_counter()
            ours = _decode_run(KVCache(MPI.COMM_SELF, backend="cuda", **opts), q, k, v, N0, T, cupy.asarray)
            secs = time.perf_counter() - t0
            host = _decode_run(KVCache(MPI.COMM_SELF, backend="cpu", **opts), q, k, v, N0, T, lambda x: x)
            exact, _ = ref.forward(q, k, v, causal=True, window=window)
            plain, _ = ref.forward(q, k, v, causal=True, window=window, precision="plain")
            ok, err = _within(ours[:, N0:], exact[:, N0:], plain[:, N0:], dtype)
            ok_p, err_p = _within(ours[:, :N0], exact[:, :N0], plain[:, :N0], dtype)
            diff = float(np.abs(ours[:, N0:] - host[:, N0:]).max())
            rep.line(ok and ok_p, f"decode  {dtype:8s} T={T} kvh {Zkv} window={window}: {steps} steps err vs "
                                  f"float64 {err:.1e} (prefill {err_p:.1e}), vs NumPy {diff:.1e}  [{secs:.2f} s]")


# -- 4. transfers ---------------------------------------------------------------------------------

def _counted(cupy, call):
    """What one call of ``call`` in the steady state copies and waits for: a first call
    compiles and allocates, the second is counted."""
    call()
    cupy.cuda.get_current_stream().synchronize()  # the warm-up's work is not the counted call's
    with counting() as t:
        call()
    cupy.cuda.get_current_stream().synchronize()
    return t


def transfer_growth(what, by_length):
    """The bound on a call's host transfers, checked: ``by_length`` maps two or more
    sequence lengths to the call's ``Transfers``; a count or a byte total that is larger at
    a longer length moves tokens through the host (or waits per tile), which no call may.
    Returns one line per breach, naming ``what``, the counter and its values."""
    lengths = sorted(by_length)
    bad = []
    for name in Transfers().as_dict():
        values = [getattr(by_length[n], name) for n in lengths]
        if any(b > a for a, b in zip(values, values[1:])):
            bad.append(f"{what}: {name} grows with the sequence: "
                       + ", ".join(f"{v} at N={n}" for n, v in zip(lengths, values)))
    return bad


def transfer_line(what, by_length):
    """``forward N=1024: 0 to host (0 B), ...; N=4096: ...``: one call's transfers at each
    length."""
    return f"{what} " + "; ".join(f"N={n}: {by_length[n]}" for n in sorted(by_length))


def check_transfers(cupy, rep, lengths=(1024, 4096), Z=8, Zkv=2, d=128):
    """A forward, a backward and a decode call on CuPy arrays, one rank, at two lengths:
    their host transfers, printed, and checked against ``transfer_growth``."""
    counts = {"forward": {}, "backward": {}, "decode": {}}
    rng = np.random.default_rng(7)
    for N in lengths:
        q, k, v, do = (cupy.asarray(x) for x in _problem(1, N, Z, Zkv, d, "bfloat16", seed=7))
        plan = BurstAttention(MPI.COMM_SELF, causal=True, backend="cuda")
        state = {}

        def fwd():
            state["out"] = plan.forward(q, k, v)

        counts["forward"][N] = _counted(cupy, fwd)
        out, lse = state["out"]
        counts["backward"][N] = _counted(cupy, lambda: plan.backward(do, q, k, v, out, lse))
        cache = KVCache(MPI.COMM_SELF, capacity=N + 2, batch=1, kv_heads=Zkv, head_dim=d, dtype=bfloat16,
                        backend="cuda")
        cache.load(k, v)
        new = iter([[cupy.asarray(rng.standard_normal((1, 1, h, d), dtype=np.float32).astype(bfloat16))
                     for h in (Z, Zkv, Zkv)] for _ in range(2)])
        counts["decode"][N] = _counted(cupy, lambda: cache.decode(*next(new)))
    for what, by_length in counts.items():
        bad = transfer_growth(what, by_length)
        rep.line(not bad, "transfers per call: " + transfer_line(what, by_length))
        for b in bad:
            print(f"  {b}")


def check_interop(rep):
    try:
        import torch
    except ImportError:
        print("skip interop: torch is not installed")
        return
    if not torch.cuda.is_available():
        print("skip interop: torch has no CUDA")
        return
    q, k, v, do = (torch.randn(1, 512, 4, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    plan = BurstAttention(MPI.COMM_SELF, causal=True)
    out, lse = plan.forward(q, k, v)
    dq, dk, dv = plan.backward(do, q, k, v, out, lse)
    same_kind = all(isinstance(x, torch.Tensor) and x.is_cuda for x in (out, lse, dq, dk, dv))
    qr, kr, vr = (x.detach().float().transpose(1, 2).requires_grad_() for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qr, kr, vr, is_causal=True)
    o.backward(do.float().transpose(1, 2))
    close = lambda a, b: float((a.float() - b).abs().max()) < 0.05
    ok = (same_kind and close(out, o.transpose(1, 2)) and close(dq, qr.grad.transpose(1, 2))
          and close(dk, kr.grad.transpose(1, 2)) and close(dv, vr.grad.transpose(1, 2)))
    rep.line(ok, "interop torch CUDA bfloat16 in -> torch CUDA out, against torch's autograd")


def ranks_worker(transport, seqlen_local):
    """Run by each rank under mpiexec: the ring on the GPU against float64."""
    from .._config import settings
    from .._transport import watchdog

    # Its collectives under the watchdog's deadline (BURSTMPI_TIMEOUT), as burstmpi-bench's.
    comm = watchdog.guarded(MPI.COMM_WORLD, settings().timeout, who="burstmpi.bench.gpucheck")
    P, rank = comm.Get_size(), comm.Get_rank()
    bad = []
    import cupy

    from .._api import shard, unshard

    n = P * seqlen_local
    docs = np.array([0, 1, n // 3, n // 3, n // 2 + 7, n - 5])  # any length, packed documents
    cases = [("zigzag", True, None, None, n, ("burst", "ring"), {}),
             ("contiguous", False, None, None, n, ("burst", "ring"), {}),
             ("zigzag", True, None, docs, n - 5, ("burst", "ring"), {}),
             ("contiguous", False, (40, 40), None, n - 3, ("two-way",), {})]
    if P >= 4 and P % 2 == 0:  # check_ranks makes nodes of 2 ranks here (BURSTMPI_RANKS_PER_NODE)
        cases += [("zigzag", True, None, docs, n - 5, ("burst", "ring", "two-way"), {"topology": "two-level"}),
                  ("zigzag", True, None, None, n, ("burst",), {"head_parallel": 2})]
    for dtype in ("bfloat16", "float32"):
        for layout, causal, window, cu, N, modes, extra in cases:
            for mode in modes:
                q, k, v, do = _problem(1, N, 4, 2, 64, dtype, seed=P)
                plan = BurstAttention(causal=causal, window=window, layout=layout, bwd_comm=mode,
                                      backend="cuda", transport=transport, **extra)
                loc = [cupy.asarray(shard(x, layout=layout, cu_seqlens=cu)) for x in (q, k, v, do)]
                out, lse = plan.forward(*loc[:3], cu_seqlens=cu)
                grads = plan.backward(loc[3], *loc[:3], out, lse, cu_seqlens=cu)
                un = lambda x, axis=1: unshard(cupy.asnumpy(x), layout=layout, axis=axis, cu_seqlens=cu)
                ours = (un(out), un(lse, 2)) + tuple(un(g) for g in grads)
                opts = dict(causal=causal, window=window, cu_seqlens=cu)
                exact = ref.forward(q, k, v, **opts) + ref.backward(do, q, k, v, **opts)
                plain = (ref.forward(q, k, v, precision="plain", **opts)
                         + ref.backward(do, q, k, v, precision="plain", **opts))
                what = (f"{dtype} {layout} N={N} causal={causal} window={window} docs={cu is not None} {mode}"
                        + "".join(f" {k}={v}" for k, v in extra.items()))
                for name, o, e, p in zip(("out", "lse", "dq", "dk", "dv"), ours, exact, plain):
                    ok, err = _within(o, e, p, dtype)
                    if not ok:
                        bad.append(f"r{rank} {what} {name}: {err:.2e}")
                st = plan.last_stats
                if st.topology != extra.get("topology", "flat"):
                    bad.append(f"r{rank} {what}: ran topology {st.topology}")
                if rank == 0 and dtype == "bfloat16" and mode == "burst":
                    print(f"  P={P} {layout:10s} causal={causal!s:5s} {extra or ''} transport={st.transport} "
                          f"fwd {st.forward.wall_s * 1e3:.1f} ms, bwd {st.backward.wall_s * 1e3:.1f} ms",
                          flush=True)
    for dtype in ("bfloat16", "float32"):  # decode over a cache sharded across the ranks
        N0, T, steps = P * seqlen_local - 3, 3, 5
        q, k, v, _ = _problem(1, N0 + T * steps, 8, 2, 128, dtype, seed=P)
        cache = KVCache(capacity=N0 + T * steps, batch=1, kv_heads=2, head_dim=128, dtype=_np_dtype(dtype),
                        backend="cuda")
        outs = [unshard(cupy.asnumpy(cache.prefill(*(cupy.asarray(shard(x[:, :N0])) for x in (q, k, v)),
                                                   layout="contiguous")))]
        for s in range(N0, q.shape[1], T):
            outs.append(cupy.asnumpy(cache.decode(*(cupy.asarray(x[:, s:s + T]) for x in (q, k, v)))))
        ours = np.concatenate([_f64(o) for o in outs], axis=1)
        exact, _ = ref.forward(q, k, v, causal=True)
        plain, _ = ref.forward(q, k, v, causal=True, precision="plain")
        ok, err = _within(ours, exact, plain, dtype)
        same = comm.allgather(zlib.crc32(ours.tobytes()))
        if not ok or len(set(same)) != 1:
            bad.append(f"r{rank} decode {dtype} N0={N0} T={T}: err {err:.2e}, same on every rank: {len(set(same)) == 1}")
        if rank == 0:
            print(f"  P={P} decode {dtype} prefill {N0} + {steps} x {T} tokens: err {err:.1e}, "
                  f"{cache.last_stats.message_bytes} B per rank per call", flush=True)
    if transport == "nccl":  # the comm stream, then the compute stream, held back: the same bits
        from .ordering import delayed_runs_differ

        t0 = time.perf_counter()
        differ = delayed_runs_differ(cupy, comm, P * seqlen_local - 5)
        bad += differ
        if rank == 0:
            print(f"  P={P} stream ordering: the ring (3 modes) and decode with the comm, then the compute stream "
                  f"held back: {'the same bits' if not differ else 'DIFFERENT bits'} "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
    everyone = comm.gather(bad, root=0)
    if rank == 0:
        flat = [b for r in everyone for b in r]
        for b in flat:
            print("  " + b)
        print(f"RANKS {'OK' if not flat else 'FAILED'}", flush=True)
    return 0 if not bad else 1


def check_ranks(rep, transport, quick):
    mpiexec = shutil.which("mpiexec") or shutil.which("mpirun")
    if mpiexec is None:
        print("skip ranks: no mpiexec on PATH")
        return
    for n in ((2,) if quick else (2, 3, 4)):
        cmd = [mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", "-m", "burstmpi.bench.gpucheck",
               "--ranks-only", "--transport", transport]
        t0 = time.perf_counter()
        try:
            nodes = {"BURSTMPI_RANKS_PER_NODE": "2"} if n % 2 == 0 else {}  # 4 ranks: two-level, head_parallel
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=240,
                                 env=dict(os.environ, OPENBLAS_NUM_THREADS="1", **nodes))
            out, rc = res.stdout + res.stderr, res.returncode
        except subprocess.TimeoutExpired as e:
            out, rc = (e.stdout or "") if isinstance(e.stdout, str) else "", "timeout"
        print(out.rstrip())
        rep.line(rc == 0 and "RANKS OK" in out,
                 f"ranks mpiexec -n {n} sharing this GPU, transport={transport}: exit {rc} "
                 f"in {time.perf_counter() - t0:.0f} s")


# -- 7. bench -------------------------------------------------------------------------------------

def _time(cupy, fn, iters=5, warmup=2):
    for _ in range(warmup):
        fn()
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / iters


def bench(cupy, rep, N=16384, H=16, d=128):
    """Prints the kernels' rates next to torch's, and the decode's; returns {causal: (forward
    TFLOP/s, backward TFLOP/s)}."""
    rates = {}
    try:
        import torch
    except ImportError:
        torch = None
    print(f"bench: batch 1, {N} tokens, {H} heads, head dim {d}, bfloat16, one rank")
    for causal in (False, True):
        flops = 4 * N * N * H * d * (0.5 if causal else 1.0)
        q, k, v, do = (cupy.asarray(np.random.default_rng(i).standard_normal((1, N, H, d)).astype(bfloat16))
                       for i in range(4))
        plan = BurstAttention(MPI.COMM_SELF, causal=causal, backend="cuda")
        state = {}

        def fwd():
            state["o"] = plan.forward(q, k, v)

        t_fwd = _time(cupy, fwd)
        out, lse = state["o"]
        t_bwd = _time(cupy, lambda: plan.backward(do, q, k, v, out, lse))
        rates[causal] = (flops / t_fwd / 1e12, 2.5 * flops / t_bwd / 1e12)
        line = (f"  causal={causal!s:5s} burstmpi fwd {t_fwd * 1e3:7.2f} ms {flops / t_fwd / 1e12:6.1f} TF/s, "
                f"bwd {t_bwd * 1e3:7.2f} ms {2.5 * flops / t_bwd / 1e12:6.1f} TF/s")
        if torch is not None and torch.cuda.is_available():
            tq, tk, tv, tdo = (torch.from_dlpack(x).transpose(1, 2) for x in (q, k, v, do))
            sdpa = torch.nn.functional.scaled_dot_product_attention
            ev = lambda: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

            def ttime(fn, iters=5):
                for _ in range(2):
                    fn()
                a, b = ev()
                a.record()
                for _ in range(iters):
                    fn()
                b.record()
                torch.cuda.synchronize()
                return a.elapsed_time(b) / 1e3 / iters

            s_fwd = ttime(lambda: sdpa(tq, tk, tv, is_causal=causal))
            tqg, tkg, tvg = (x.detach().requires_grad_() for x in (tq, tk, tv))

            def fb():
                o = sdpa(tqg, tkg, tvg, is_causal=causal)
                o.backward(tdo)

            s_fb = ttime(fb)
            s_bwd = max(s_fb - s_fwd, 1e-9)
            line += (f" | torch SDPA fwd {flops / s_fwd / 1e12:6.1f} TF/s, bwd {2.5 * flops / s_bwd / 1e12:6.1f} TF/s"
                     f" | ratio fwd {s_fwd / t_fwd:.2f}, bwd {s_bwd / t_bwd:.2f}")
        print(line, flush=True)
    N, Zkv = 256 * 1024, 8
    cache = KVCache(MPI.COMM_SELF, capacity=N + 64, batch=1, kv_heads=Zkv, head_dim=d, dtype=bfloat16,
                    backend="cuda")
    rng = np.random.default_rng(0)
    cache.load(*(cupy.asarray(rng.standard_normal((1, N, Zkv, d), dtype=np.float32).astype(bfloat16))
                 for _ in range(2)))
    new = [[cupy.asarray(rng.standard_normal((1, 1, h, d), dtype=np.float32).astype(bfloat16))
            for h in (32, Zkv, Zkv)] for _ in range(40)]
    calls = iter(new)
    t = _time(cupy, lambda: cache.decode(*next(calls)), iters=30, warmup=5)
    kv_bytes = 2 * N * Zkv * d * 2
    print(f"  decode: cache {N} tokens, 32/{Zkv} heads, d {d}, bf16, T=1: {t * 1e3:.3f} ms per call, "
          f"K/V read at {kv_bytes / t / 1e9:.0f} GB/s", flush=True)
    rep.line(True, "bench done")
    return rates


def store_measured_rate(cupy, dev, rates, N=16384, H=16, d=128):
    """The bench's rates without a mask, stored in the rate file under this GPU's name, for
    ``topology="auto"`` (``config.Settings.kernel_rate``). A file that cannot be written
    is said, not failed: the GPU is fine."""
    fwd, bwd = rates[False]
    name = device_name(cupy, dev)
    shape = f"{N} tokens, {H} heads, head dim {d}, bfloat16, no mask, one rank"
    try:
        path = store_rate(name, fwd, bwd, burstmpi=__version__, shape=shape)
    except OSError as e:
        print(f"# kernel rate not stored ({type(e).__name__}: {e}): topology='auto' plans with the nominal rate "
              "here unless kernel_tflops= (BURSTMPI_KERNEL_TFLOPS) is given", flush=True)
        return
    print(f"# kernel rate stored for topology='auto': {name}: forward {fwd:.1f}, backward {bwd:.1f} TFLOP/s "
          f"in {path}", flush=True)


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--quick", is_flag=True, help="Fewer configurations and no benchmark.")
@click.option("--ranks-only", is_flag=True, help="Only the multi-rank check (run under mpiexec).")
@click.option("--transport", type=click.Choice(["mpi", "nccl", "auto"]), default="mpi", show_default=True,
              help="Transport of the multi-rank check.")
@click.option("--seqlen-local", default=384, show_default=True, help="Tokens per rank in the multi-rank check.")
def main(quick, ranks_only, transport, seqlen_local):
    """Check burstmpi's GPU path on this machine: probe, kernels, decode, transfers, interop, ranks, bench
    (which stores the kernels' rate for topology="auto")."""
    if ranks_only:
        sys.exit(ranks_worker(transport, seqlen_local))
    try:
        cupy = import_cupy("burstmpi-gpucheck")
    except (NotImplementedError, RuntimeError) as e:
        print(f"# {e}\n# nothing checked: FAILED")
        sys.exit(2)
    dev = cupy.cuda.Device()
    print(f"# burstmpi-gpucheck: {device_name(cupy, dev.id)} (sm_{dev.compute_capability}), CuPy "
          f"{cupy.__version__}, CUDA runtime {cupy.cuda.runtime.runtimeGetVersion()}, driver "
          f"{cupy.cuda.runtime.driverGetVersion()}", flush=True)
    rep, t0 = Report(), time.perf_counter()
    steps = [("probe", lambda: check_probe(cupy, dev.id, rep)),
             ("kernels", lambda: check_one_rank(cupy, rep, quick)),
             ("decode", lambda: check_decode(cupy, rep, quick)),
             ("transfers", lambda: check_transfers(cupy, rep)),
             ("interop", lambda: check_interop(rep)),
             ("ranks", lambda: check_ranks(rep, transport, quick))]
    if not quick:
        steps.append(("bench", lambda: store_measured_rate(cupy, dev.id, bench(cupy, rep))))
    for name, step in steps:
        # GPU time is scarce: one check's crash is reported and the others still run.
        try:
            step()
        except Exception as e:  # noqa: BLE001 - reported as a failed check, with its traceback
            import traceback

            traceback.print_exc()
            rep.line(False, f"{name}: {type(e).__name__}: {e}")
    print(f"# {rep.failed} check(s) failed in {time.perf_counter() - t0:.0f} s: {'FAILED' if rep.failed else 'OK'}")
    sys.exit(1 if rep.failed else 0)


if __name__ == "__main__":
    main()
