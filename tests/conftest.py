"""Shared helpers. Every test here runs alone (1 rank) and under ``mpiexec -n P``.

Tests that involve the ring use ``MPI.COMM_WORLD``; ``tests/test_mpi.py`` reruns them
under mpiexec with 2, 3 and 4 ranks. A test needing several ranks says so with
``needs_ranks``.
"""

import json
import os

import numpy as np
import pytest
from mpi4py import MPI

import burstmpi
from burstmpi import reference as ref
from burstmpi._interop import bfloat16

COMM = MPI.COMM_WORLD
RANK, NRANKS = COMM.Get_rank(), COMM.Get_size()

DTYPES = ["float16", "float32", "float64"] + (["bfloat16"] if bfloat16 is not None else [])

# The largest error seen against float64 per dtype and quantity, and the summaries of
# the runs under mpiexec: both reported at the end of the session.
WORST = {}
MULTIRANK = []
# (title, lines) blocks that tests add for the end of the session (compile check, seeded mistakes).
REPORTS = []


def needs_ranks(n):
    return pytest.mark.skipif(NRANKS < n, reason=f"needs {n}+ MPI ranks (run under mpiexec)")


def dtype_of(name):
    return bfloat16 if name == "bfloat16" else np.dtype(name)


def f64(x):
    return np.asarray(x, dtype=np.float64)


def random_docs(N, seed=0, mean=6):
    """Document offsets (cu_seqlens) filling N tokens, the same on every rank: lengths
    around ``mean`` with 1-token and empty documents among them."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < N:
        lengths.append(int(rng.choice([0, 1, 1, 2, rng.integers(1, 3 * mean)])))
    cu = np.concatenate([[0], np.cumsum(lengths)])
    cu[-1] = N
    return np.minimum(cu, N)


def check_close(name, ours, exact, plain, dtype, record=True):
    """Assert flash-attn's rule (``reference.flash_attn_rule``); record the error for the
    summary (unless ``record`` is false: runs that are meant to fail must not enter the
    table)."""
    problem, err = ref.flash_attn_rule(f64(ours), f64(exact), f64(plain), dtype)
    if record and np.isfinite(err):
        WORST[(dtype, name)] = max(WORST.get((dtype, name), 0.0), err)
    assert problem is None, f"{name}: {problem}"
    return err


def check_against_float64(*, B=1, C=24, Z=4, Zkv=2, d=32, dv=None, dtype="float32", causal=False,
             window=None, layout="contiguous", bwd_comm="burst", softmax_scale=None, seed=0,
             check_backward=True, backend=None, transport=None, tag="", N=None, cu_seqlens=None, mask=None,
             record=True, head_parallel=1, topology="flat", balance="auto"):
    """Run forward and backward on COMM_WORLD and check them against float64.

    The global length is ``N`` (default ``C`` tokens per rank); ``cu_seqlens`` packs
    documents. ``backend``: a backend object to run the plan on instead of the default
    one; ``transport``: a transport class to build the plan's transport from; ``tag``
    prefixes the quantity names in the error table; ``mask``: a ``burstmpi.masks`` mask;
    ``record=False`` keeps the errors out of the table (runs meant to fail); ``head_parallel``:
    the plan's (``burstmpi._heads``); ``topology``: the plan's ("flat", "two-level", "auto");
    ``balance``: the plan's (``burstmpi._ring.balance``)."""
    N = C * NRANKS if N is None else N
    q, k, v, do = ref.random_problem(B, N, Z, Zkv, d, dv, dtype=dtype_of(dtype), seed=seed)
    opts = dict(causal=causal, window=window, softmax_scale=softmax_scale, mask=mask)
    docs = dict(cu_seqlens=cu_seqlens)
    sh = lambda x: burstmpi.shard(x, layout=layout, **docs)
    un = lambda x, axis=1: burstmpi.unshard(x, layout=layout, axis=axis, **docs)
    plan = burstmpi.BurstAttention(layout=layout, bwd_comm=bwd_comm, head_parallel=head_parallel, topology=topology,
                                   balance=balance,
                                   backend="auto" if backend is None else backend,
                                   transport="auto" if transport is None else transport, **opts)
    ql, kl, vl, dol = sh(q), sh(k), sh(v), sh(do)
    C = ql.shape[1]
    out, lse = plan.forward(ql, kl, vl, **docs)
    assert out.dtype == ql.dtype and out.shape == ql.shape[:3] + (vl.shape[3],)
    assert lse.shape == (B, Z, C)
    o64, l64 = ref.forward(q, k, v, **opts, **docs)
    op, lp = ref.forward(q, k, v, precision="plain", **opts, **docs)
    errs = {"out": check_close(tag + "out", un(out), o64, op, dtype, record),
            "lse": check_close(tag + "lse", un(lse, axis=2), l64, lp, dtype, record)}
    if check_backward:
        dq, dk, dv_ = plan.backward(dol, ql, kl, vl, out, lse, **docs)
        exact = ref.backward(do, q, k, v, **opts, **docs)
        plain = ref.backward(do, q, k, v, precision="plain", **opts, **docs)
        for name, ours, e, p in zip(("dq", "dk", "dv"), (dq, dk, dv_), exact, plain):
            assert ours.dtype == ql.dtype
            errs[name] = check_close(tag + name, un(ours), e, p, dtype, record)
    return plan, errs


def check_fully_masked_rows(be, dtype, d):
    """A backend's local work on queries that see no key: out 0, lse -inf, no NaN anywhere,
    and zero gradients (lse -inf goes in as is: the backend must read it as +inf)."""
    from burstmpi.masks._intervals import Bounds, Mask

    mask, rng = Mask(Bounds(causal=True), 8), np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 6, 2, d)).astype(dtype)
    k, v = (rng.standard_normal((1, 1, 5, d)).astype(dtype) for _ in range(2))
    # causal: queries 0..2 see none of keys 3..7
    qb, kb = mask.query_block(np.arange(6)), mask.key_block(np.arange(3, 8))
    acc = be.acc_dtype(q.dtype)
    state = be.fwd_state(1, 1, 6, 2, d, acc)
    be.fwd_block(q, k, v, state, qb, kb, 0.3)
    out, lse = be.fwd_finalize(state, q.dtype)
    assert not np.isnan(f64(out)).any() and not np.isnan(lse).any()
    assert (f64(out)[:, :, :3] == 0).all() and (lse[:, :, :3] == -np.inf).all()
    assert np.isfinite(lse[:, :, 3:]).all()
    dq = np.zeros(q.shape, acc)
    dk, dv = np.zeros(k.shape, acc), np.zeros(v.shape, acc)
    out_user = out.astype(q.dtype).transpose(0, 2, 1, 3, 4).reshape(1, 6, 2, d)
    D = be.bwd_preprocess(out_user, out_user, 1, acc)
    be.bwd_block(q, out.astype(q.dtype), D, np.where(lse == -np.inf, np.inf, lse), k, v, dq, dk, dv,
                 qb, kb, 0.3)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert (dq[:, :, :3] == 0).all()


def pytest_terminal_summary(terminalreporter):
    # Under tests/test_mpi.py each rank reports to a file of its own: interleaved
    # stdout from several ranks cannot be parsed reliably.
    report_dir = os.environ.get("BURSTMPI_REPORT_DIR")
    if report_dir:
        counts = {k: len(terminalreporter.stats.get(k, [])) for k in ("passed", "failed", "error", "skipped")}
        worst = {f"{dt} {name}": err for (dt, name), err in sorted(WORST.items())}
        with open(os.path.join(report_dir, f"rank{RANK}.json"), "w") as fh:
            json.dump({"counts": counts, "worst": worst}, fh)
    if WORST and RANK == 0:
        terminalreporter.write_line(f"largest error against float64 ({NRANKS} rank(s)):")
        for (dt, name), err in sorted(WORST.items()):
            terminalreporter.write_line(f"  {dt:9s} {name:4s} {err:.3e}")
    for summary in MULTIRANK:
        terminalreporter.write_line(summary)
    for title, lines in REPORTS:
        terminalreporter.write_line(f"{title}:")
        for line in lines:
            terminalreporter.write_line(line)
