"""A counted bound on the GPU path's trips through the host.

A GPU call should cost kernels and transfers between GPUs: every copy between host and
device memory, and every wait of the host for the device, stalls both. These tests run
burstmpi's "cuda" path on a fake CuPy (tests/gpu/fake_cupy.py: device arrays that count
every copy to or from the host and every synchronisation, the CUDA kernels on the CPU
emulator, the real ``NCCLTransport`` over a fake NCCL that moves device memory directly)
and check, for one forward, one backward and one decode call at two sequence lengths:

- the fake's counts EQUAL ``burstmpi._transfers``' (so no copy or wait escapes the counters
  that ``burstmpi-gpucheck`` and the benches print);
- they are the same at both lengths (cache sizes for the decode) and small: headers and
  scalars, never a copy of the arrays.

Counted after one call of the same shapes: a plan's first call copies each rank's token
positions and mask intervals (int32, a few per token) and a block-sparse mask's bitmap to
the device once, and keeps them for the calls that follow (``KernelBackend._device_ints``).

MPI with device buffers (``transport="mpi"``: staged through host memory, or CUDA-aware)
waits for the device, and when staged copies every packet through the host, per ring step
by design; ``test_host_transfers_mpi_*`` documents that their count grows with the ring's
steps, not with the length. Runs alone and under mpiexec; needs g++.
"""

import numpy as np
import pytest

import burstmpi
import fake_cupy as fake
import kernel_harness as kh
from burstmpi import _transfers
from burstmpi import reference as ref
from burstmpi._transfers import Transfers
from burstmpi._transport import lifetime
from burstmpi.masks import BlockSparse, Causal
from conftest import COMM, NRANKS, RANK, REPORTS, check_close

pytestmark = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")

D = 32
CONFIGS = [("float32", D, D)]
PER_RANK = (32, 128)  # tokens per rank at the two lengths (global: times the ranks)
LENGTHS = tuple(c * NRANKS for c in PER_RANK)
HEADER = 32  # bytes of the decode's header per rank (4 int64: status, checksum, T, heads)
TABLE = {}  # (case, call, length) -> Transfers, reported at the end of the session


# How the fake device runs the comm streams' work (tests/gpu/fake_device.py): as late as
# allowed, as early as allowed, and two seeded random interleavings.
POLICIES = [("late", 0), ("early", 0), ("random", 1), ("random", 2)]


@pytest.fixture(params=POLICIES, ids=lambda p: f"{p[0]}{p[1] or ''}")
def gpu(monkeypatch, request):
    """burstmpi's "cuda" path on the fake CuPy (an asynchronous device, each policy of
    ``POLICIES``), NCCL and the emulated kernels; the stream sanitizer finds no race."""
    xp = fake.emulated(monkeypatch, COMM, CONFIGS, *request.param)
    yield xp
    fake.DEVICE.sanitizer.check()


def _counted(run):
    """``(result, burstmpi's counts, the fake's counts)`` of ``run()``."""
    fake.reset()
    with _transfers.counting() as ours:
        result = run()
    return result, ours, Transfers(**fake.COUNTS.as_dict())


def _record(case, call, length, counts):
    TABLE[(case, call, length)] = counts
    if RANK == 0 and not any(t == "host transfers per call (fake CuPy)" for t, _ in REPORTS):
        REPORTS.append(("host transfers per call (fake CuPy)", _Lines()))


class _Lines(list):
    """The table, read when the session ends (tests fill ``TABLE`` until then)."""

    def __iter__(self):
        yield f"    at {NRANKS} rank(s); d2h/h2d: count (bytes)"
        for (case, call, n), t in sorted(TABLE.items()):
            yield (f"    {case:28s} {call:14s} N={n:5d}: d2h {t.d2h} ({t.d2h_bytes} B), h2d {t.h2d} "
                   f"({t.h2d_bytes} B), syncs {t.syncs}")


def _check_bound(case, counts):
    """``counts``: {(call, length): (ours, fake's)}. Equal, the same at every length, and
    no array's worth of bytes."""
    for (call, n), (ours, theirs) in counts.items():
        _record(case, call, n, theirs)
        assert ours.as_dict() == theirs.as_dict(), \
            f"{case} {call} N={n}: burstmpi counted {ours}, the fake CuPy saw {theirs} (an uncounted copy or wait)"
    for call in {c for c, _ in counts}:
        seen = {n: counts[(call, n)][1].as_dict() for c, n in counts if c == call}
        assert len({tuple(v.values()) for v in seen.values()}) == 1, \
            f"{case} {call}: the host transfers grow with the length: {seen}"


def _ring(xp, case, N, *, Z=4, Zkv=2, cu_seqlens=None, **opts):
    """One plan's forward and backward on the fake GPU at global length ``N``, counted on
    the second call; values checked against float64."""
    q, k, v, do = ref.random_problem(1, N, Z, Zkv, D, dtype=np.float32, seed=N)
    docs = dict(cu_seqlens=cu_seqlens)
    sh = lambda x: xp.asarray(burstmpi.shard(x, layout="zigzag", **docs))
    un = lambda x, axis=1: burstmpi.unshard(x.get(), layout="zigzag", axis=axis, **docs)
    plan = burstmpi.BurstAttention(layout="zigzag", **opts)
    ql, kl, vl, dol = sh(q), sh(k), sh(v), sh(do)
    # The first calls copy positions and masks to the device: counted, not bounded.
    (out, lse), ours, theirs = _counted(lambda: plan.forward(ql, kl, vl, **docs))
    _, b_ours, b_theirs = _counted(lambda: plan.backward(dol, ql, kl, vl, out, lse, **docs))
    for call, a, b in (("first forward", ours, theirs), ("first backward", b_ours, b_theirs)):
        TABLE[(case, call, N)] = b
        assert a.as_dict() == b.as_dict(), f"{case} {call} N={N}: burstmpi counted {a}, the fake CuPy saw {b}"
    (out, lse), f_ours, f_fake = _counted(lambda: plan.forward(ql, kl, vl, **docs))
    grads, b_ours, b_fake = _counted(lambda: plan.backward(dol, ql, kl, vl, out, lse, **docs))
    assert plan.backend.name == "cuda" and plan.transport.name in ("nccl", "mpi-staged", "mpi")
    assert type(out) is fake.DeviceArray and all(type(g) is fake.DeviceArray for g in grads)
    mask = {k: opts[k] for k in ("causal", "window", "mask") if k in opts}
    o64, l64 = ref.forward(q, k, v, **mask, **docs)
    op, lp = ref.forward(q, k, v, precision="plain", **mask, **docs)
    check_close(f"transfers {case} out", un(out), o64, op, "float32")
    exact = ref.backward(do, q, k, v, **mask, **docs)
    plain = ref.backward(do, q, k, v, precision="plain", **mask, **docs)
    for name, ours, e, p in zip(("dq", "dk", "dv"), grads, exact, plain):
        check_close(f"transfers {case} {name}", un(ours), e, p, "float32")
    return {("forward", N): (f_ours, f_fake), ("backward", N): (b_ours, b_fake)}, plan


def _both(xp, case, **opts):
    counts = {}
    for N in LENGTHS:
        got, plan = _ring(xp, case, N, **opts)
        counts.update(got)
    _check_bound(case, counts)
    return counts, plan


def _no_array_bytes(counts, N=min(LENGTHS)):
    """Nothing of an array's size: at most a few words per call."""
    for (call, n), (_, t) in counts.items():
        assert t.d2h_bytes + t.h2d_bytes < 64 * N, f"{call} N={n}: {t}"


# -- the fake itself -----------------------------------------------------------------------------

def test_host_transfers_fake_cupy_counts_what_cupy_copies(gpu):
    """The ground truth first: the fake counts the copies CuPy makes and refuses what CuPy
    refuses, and burstmpi's counters agree where they are used."""
    xp = gpu
    fake.reset()
    a = xp.asarray(np.arange(6, dtype=np.float32))  # host -> device: counted
    b = a * 2 + 1  # on the device: nothing
    assert type(b) is fake.DeviceArray and fake.COUNTS.as_dict() == Transfers(h2d=1, h2d_bytes=24).as_dict()
    assert float(b.sum()) == 36.0  # a value read on the host: one element copied
    assert b.get().tolist() == [1, 3, 5, 7, 9, 11]
    assert (fake.COUNTS.d2h, fake.COUNTS.d2h_bytes) == (2, 4 + 24)
    with pytest.raises(TypeError, match="implicit conversion"):
        np.concatenate([a, a])
    with pytest.raises(TypeError, match="implicit conversion"):
        a + np.ones(6, np.float32)
    with _transfers.counting() as t:
        _transfers.to_host(b)
        _transfers.to_device(xp, np.zeros(3, np.int64))
        _transfers.synchronize(xp.cuda.get_current_stream())
    assert t.as_dict() == Transfers(d2h=1, d2h_bytes=24, h2d=1, h2d_bytes=24, syncs=1).as_dict()
    from burstmpi import _interop

    assert not _interop.is_host(a) and _interop.is_host(a.get())


def test_host_transfers_small_arguments_of_other_frameworks_are_counted():
    """Document offsets on a GPU of another framework (torch, JAX: copied by the framework
    itself) are copied to the host once per call, and counted like CuPy's copies."""
    from burstmpi import _interop

    class OnGpu:  # what a JAX or torch array on CUDA device 0 shows burstmpi
        def __init__(self, a):
            self.a = a

        def __dlpack_device__(self):
            return (2, 0)  # kDLCUDA

        def __array__(self, dtype=None, copy=None):
            return self.a

    cu = np.array([0, 40, 96], dtype=np.int32)
    with _transfers.counting() as t:
        got = _interop.to_numpy(OnGpu(cu), "cu_seqlens", "f")
    assert got.tolist() == [0, 40, 96]
    assert t.as_dict() == Transfers(d2h=1, d2h_bytes=12).as_dict()


# -- the ring ----------------------------------------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["burst", "ring", "two-way"])
def test_host_transfers_forward_and_backward(gpu, mode):
    """Causal, zigzag, every backward mode, on NCCL: no copy through the host at all; one
    wait per phase (``NCCLTransport.finish``, with the deadline) where transfers ran."""
    counts, plan = _both(gpu, f"flat causal {mode}", causal=True, bwd_comm=mode)
    assert plan.transport.name == "nccl"
    want_mode = "burst" if mode == "two-way" and NRANKS < 3 else mode
    assert plan.last_stats.bwd_mode == want_mode
    for (call, n), (_, t) in counts.items():
        assert (t.d2h, t.h2d) == (0, 0), f"{call} N={n}: {t}"
        assert t.syncs == (1 if NRANKS > 1 else 0), f"{call} N={n}: {t}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["burst", "ring", "two-way"])
def test_host_transfers_two_level(gpu, mode):
    """The two-level ring (nodes of ``ranks_per_node`` ranks): its inner and outer rings each
    wait once per phase at most."""
    g = next((g for g in (2, 3) if NRANKS % g == 0 and NRANKS > g), 1)
    counts, plan = _both(gpu, f"two-level ({g}/node) {mode}", causal=True, bwd_comm=mode, topology="two-level",
                         ranks_per_node=g)
    assert plan.last_stats.topology == "two-level"
    _no_array_bytes(counts)
    for (call, n), (_, t) in counts.items():
        assert (t.d2h, t.h2d) == (0, 0) and t.syncs <= 3, f"{call} N={n}: {t}"


@pytest.mark.timeout(600)
@pytest.mark.skipif(NRANKS < 2, reason="head parallelism needs 2+ MPI ranks (run under mpiexec)")
def test_host_transfers_head_parallel(gpu):
    """Head parallelism: the all-to-all inside the group on NCCL, device to device (a ring
    of groups from 4 ranks on)."""
    u = next((u for u in (2, 3) if NRANKS % u == 0 and NRANKS > u), NRANKS)
    counts, plan = _both(gpu, f"head_parallel={u}", Z=2 * u, Zkv=u, causal=True, head_parallel=u)
    _no_array_bytes(counts)
    for (call, n), (_, t) in counts.items():
        assert (t.d2h, t.h2d) == (0, 0), f"{call} N={n}: {t}"


def _blocks(N):
    nb = 8  # the same plane at every length: the bitmap is copied once per mask anyway
    return BlockSparse(np.random.default_rng(1).random((nb, nb)) < 0.4, N // nb) & Causal()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["window", "blocks", "docs"])
def test_host_transfers_masks(gpu, case):
    """A sliding window, a block-sparse mask (its bitmap stays on the device) and packed
    documents (``cu_seqlens``, the same each call): no copy through the host."""
    counts = {}
    for N in LENGTHS:
        opts = {"window": dict(causal=True, window=(N // 4, 0)),
                "blocks": dict(mask=_blocks(N)),
                "docs": dict(causal=True, cu_seqlens=np.array([0, N // 3, N // 3 + 1, N // 2, N]))}[case]
        got, _ = _ring(gpu, f"mask {case}", N, **opts)
        counts.update(got)
    _check_bound(f"mask {case}", counts)
    for (call, n), (_, t) in counts.items():
        assert (t.d2h, t.h2d) == (0, 0), f"{call} N={n}: {t}"


# -- the decode ---------------------------------------------------------------------------------------

def _decode(xp, S, Z=4, Zkv=2, T=1):
    """A cache of ``S`` prefilled tokens on the fake GPU, one decode call counted (after one
    uncounted); values checked against float64."""
    total = S + 2 * T
    q, k, v, _ = ref.random_problem(1, total, Z, Zkv, D, dtype=np.float32, seed=S)
    cache = burstmpi.KVCache(capacity=total, batch=1, kv_heads=Zkv, head_dim=D, dtype=np.float32)
    sh = lambda x: xp.asarray(burstmpi.shard(x[:, :S], layout="zigzag"))
    cache.prefill(sh(q), sh(k), sh(v), layout="zigzag")
    new = lambda t: [xp.asarray(x[:, S + t * T:S + (t + 1) * T]) for x in (q, k, v)]
    cache.decode(*new(0))
    args = new(1)
    (out, lse), ours, theirs = _counted(lambda: cache.decode(*args, return_lse=True))
    assert cache.runtime.backend.name == "cuda" and type(out) is fake.DeviceArray
    o64, l64 = ref.forward(q, k, v, causal=True)
    op, lp = ref.forward(q, k, v, causal=True, precision="plain")
    rows = slice(S + T, S + 2 * T)
    check_close("transfers decode out", out.get(), o64[:, rows], op[:, rows], "float32")
    check_close("transfers decode lse", lse.get(), l64[..., rows], lp[..., rows], "float32")
    return ours, theirs


@pytest.mark.timeout(600)
def test_host_transfers_decode(gpu):
    """A decode call copies to the host only the gathered headers (``nranks`` x 32 bytes,
    in one copy) and to the device a few words (the header, the new tokens' positions):
    never q, k, v, the partials or the cache, whatever the cache's size."""
    counts = {("decode", S): _decode(gpu, S) for S in LENGTHS}
    _check_bound("decode (T=1)", counts)
    for (call, S), (_, t) in counts.items():
        assert t.d2h == 1 and t.d2h_bytes == NRANKS * HEADER, f"decode S={S}: {t}"
        assert t.h2d <= 4 and t.h2d_bytes <= 256, f"decode S={S}: {t}"
        assert t.syncs <= 1, f"decode S={S}: {t}"


# -- MPI for device buffers, for the record ----------------------------------------------------------

@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["staged", "cuda-aware"])
def test_host_transfers_mpi_grow_with_steps_not_length(gpu, how):
    """Without NCCL (``transport="mpi"``) device buffers cost host round trips per ring step,
    by design. Staged through host memory (an MPI that is not CUDA-aware): a copy each way
    per transfer and a wait each; handed to a CUDA-aware MPI: a wait before each send. Their
    number follows the ring's steps (it grows with the ranks), the same at both lengths;
    the staged copies' bytes grow with the packets."""
    name, extra = {"staged": ("mpi-staged", {}), "cuda-aware": ("mpi", {"cuda_aware_mpi": True})}[how]
    case = f"{how} mpi (burst)"
    counts = {}
    for N in LENGTHS:
        got, plan = _ring(gpu, case, N, causal=True, bwd_comm="burst", transport="mpi", **extra)
        counts.update(got)
        assert plan.transport.name == name
    for (call, n), (ours, theirs) in counts.items():
        _record(case, call, n, theirs)
        assert ours.as_dict() == theirs.as_dict(), f"{call} N={n}: burstmpi {ours}, fake {theirs}"
    for call in ("forward", "backward"):
        small, large = (counts[(call, n)][1] for n in LENGTHS)
        assert (small.d2h, small.h2d, small.syncs) == (large.d2h, large.h2d, large.syncs)
        assert (small.syncs > 0) == (NRANKS > 1)
        assert (small.d2h > 0) == (NRANKS > 1 and how == "staged")


def test_a_cuda_aware_setting_on_an_mpi_without_cuda_is_refused_on_every_rank(gpu, monkeypatch):
    """``cuda_aware_mpi=True`` where the MPI says it takes no GPU memory (the pip wheels): an
    error on every rank naming the setting and the MPI, not a segmentation fault in its
    first send."""
    from burstmpi._transport import mpi_library

    monkeypatch.setattr(mpi_library, "cuda_support", lambda: False)
    q = gpu.asarray(burstmpi.shard(ref.random_problem(1, 8 * NRANKS, 2, 2, D, seed=1)[0], layout="zigzag"))
    plan = burstmpi.BurstAttention(causal=True, layout="zigzag", transport="mpi", cuda_aware_mpi=True)
    every = ", ".join(map(str, range(NRANKS)))
    with pytest.raises(ValueError, match=r"cuda_aware_mpi \(BURSTMPI_CUDA_AWARE_MPI\): expected an MPI that takes "
                                         r"GPU memory, but .* says it does not \(MPIX_Query_cuda_support\(\) is 0 "
                                         rf"on rank\(s\) {every}\)"):
        plan.forward(q, q, q)


def test_host_transfers_nccl_communicators_go_with_the_callers(gpu):
    """NCCL communicators belong to the state of the caller's communicator
    (``_transport.lifetime``): freeing it destroys them, before burstmpi's own duplicate
    they were made over, and nothing is left."""
    before, destroyed = lifetime.live(), fake.FakeNcclComm.destroyed
    c = COMM.Dup()
    q = gpu.asarray(burstmpi.shard(ref.random_problem(1, 8 * NRANKS, 2, 2, D, seed=1)[0], comm=c, layout="zigzag"))
    plan = burstmpi.BurstAttention(c, causal=True, layout="zigzag")
    plan.forward(q, q, q)
    assert plan.transport.name == "nccl"
    made = lifetime.live()["nccl"] - before["nccl"]
    assert made >= 1
    c.Free()
    assert lifetime.live() == before
    assert fake.FakeNcclComm.destroyed - destroyed == made

