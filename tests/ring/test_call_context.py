"""The ring reads a call's context, never the plan; what a plan keeps is its runtime's.

``Call`` (``burstmpi._ring.context``) is all that the flat, two-way, two-level and
head-parallel code get. A plan whose every attribute read is watched shows that nothing
under ``ring/``, ``transport/``, ``backends/`` or ``masks/`` reaches back into it, on each
of those paths; ``tests/test_architecture.py`` checks the same statically. The two-level
rings and head parallelism's ring of groups are the runtime's: ``release()`` frees their
buffers and ``buffer_bytes`` counts them, and they are keyed by the arrays' kind, so a
plan used with host arrays and then GPU arrays does not reuse the host's.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

import burstmpi
import kernel_harness as kh
from burstmpi import reference as ref
from conftest import COMM, NRANKS

PACKAGE = Path(burstmpi.__file__).resolve().parent
BELOW = tuple(str(PACKAGE / d) for d in ("_ring", "_transport", "_backends", "masks"))
GROUP = next((u for u in (2, 3) if NRANKS % u == 0), None)


class Watched(burstmpi.BurstAttention):
    """A plan that records every attribute read made by code under ``BELOW``."""

    touched = []

    def __getattribute__(self, name):
        caller = sys._getframe(1).f_code.co_filename
        if caller.startswith(BELOW):
            Watched.touched.append(f"{caller}:{sys._getframe(1).f_lineno} read plan.{name}")
        return object.__getattribute__(self, name)


def _paths():
    """(name, plan options, ranks per node) of every ring the plan can run at this rank
    count."""
    yield "flat", dict(causal=True, layout="zigzag", bwd_comm="burst"), 0
    yield "flat ring mode", dict(causal=True, layout="zigzag", bwd_comm="ring"), 0
    if NRANKS >= 3:
        yield "two-way", dict(window=(2, 2), layout="contiguous", bwd_comm="two-way"), 0
    g = next((g for g in (2, 3) if NRANKS % g == 0 and NRANKS > g), 1)
    yield "two-level", dict(causal=True, layout="zigzag", topology="two-level", bwd_comm="burst"), g
    yield "two-level two-way", dict(causal=True, layout="zigzag", topology="two-level", bwd_comm="two-way"), g
    if GROUP:
        yield "head-parallel", dict(causal=True, layout="zigzag", head_parallel=GROUP), GROUP


@pytest.mark.parametrize("name,opts,per_node", list(_paths()), ids=[p[0] for p in _paths()])
def test_nothing_below_the_plan_reads_it(name, opts, per_node):
    Watched.touched.clear()
    q, k, v, do = ref.random_problem(1, 5 * NRANKS + 1, 6 if GROUP == 3 else 4, GROUP or 2, 8, seed=1)
    sh = lambda x: burstmpi.shard(x, layout=opts["layout"])
    plan = Watched(ranks_per_node=per_node, **opts)
    out, lse = plan.forward(sh(q), sh(k), sh(v))
    plan.backward(sh(do), sh(q), sh(k), sh(v), out, lse)
    assert Watched.touched == [], f"{name}: code below the plan read it:\n" + "\n".join(Watched.touched[:10])


def test_release_frees_the_two_level_rings_buffers():
    g = next((g for g in (2, 3) if NRANKS % g == 0 and NRANKS > g), 1)
    q, k, v, do = ref.random_problem(1, 6 * NRANKS, 2, 2, 8, seed=4)
    sh = lambda x: burstmpi.shard(x, layout="zigzag")
    plan = burstmpi.BurstAttention(topology="two-level", causal=True, layout="zigzag", ranks_per_node=g,
                                   transport="mpi")
    out, lse = plan.forward(sh(q), sh(k), sh(v))
    plan.backward(sh(do), sh(q), sh(k), sh(v), out, lse)
    rings = plan.last_call.rings
    assert plan.last_stats.topology == "two-level" and rings is not None
    assert plan.buffer_bytes >= rings.nbytes > (0 if NRANKS > 1 else -1)  # one rank sends nothing
    assert plan.last_stats.buffer_bytes == plan.buffer_bytes
    plan.release()
    assert rings.nbytes == 0 and plan.buffer_bytes == 0
    again = plan.forward(sh(q), sh(k), sh(v))  # made again, the same bits
    assert plan.last_call.rings is rings and rings.nbytes > (0 if NRANKS > 1 else -1)
    assert all(np.array_equal(a, b) for a, b in zip((out, lse), again))


@pytest.mark.skipif(GROUP is None, reason="head parallelism needs 2+ MPI ranks (run under mpiexec)")
def test_release_frees_the_ring_of_groups_buffers():
    q, k, v, _ = ref.random_problem(1, 4 * NRANKS, 2 * GROUP, GROUP, 8, seed=2)
    sh = lambda x: burstmpi.shard(x, layout="zigzag")
    plan = burstmpi.BurstAttention(head_parallel=GROUP, causal=True, layout="zigzag", ranks_per_node=GROUP,
                                   transport="mpi")
    plan.forward(sh(q), sh(k), sh(v))
    before = plan.buffer_bytes
    assert plan.last_stats.buffer_bytes == before > (0 if NRANKS > GROUP else -1)  # one group: no ring
    plan.release()
    assert plan.buffer_bytes == 0


pytest_kernels = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")


@pytest_kernels
def test_host_then_emulated_gpu_arrays_do_not_share_the_rings(monkeypatch):
    """One plan called with host arrays, then with arrays on the (emulated) GPU: the second
    call gets rings and buffers of its own, keyed by the arrays' kind, and the first's stay
    the host's; both give the float64 reference's answer."""
    from burstmpi import _runtime as rt_mod

    lib = kh.library_on_every_rank(COMM, [("float32", 32, 32)])
    emulated = kh.EmulatedBackend(lib)
    g = next((g for g in (2, 3) if NRANKS % g == 0 and NRANKS > g), 1)
    plan = burstmpi.BurstAttention(topology="two-level", causal=True, layout="zigzag", ranks_per_node=g,
                                   transport="mpi")

    def use_emulated(self, fn):  # the GPU set-up, with the emulated kernels for the GPU
        self.release()
        self.backend = emulated

    monkeypatch.setattr(rt_mod.Runtime, "_use_cuda", use_emulated)
    plan.runtime.kind = lambda arrays: "cuda" if any(getattr(a, "on_gpu", False) for a in arrays.values()) \
        else "cpu"
    q, k, v, _ = ref.random_problem(1, 6 * NRANKS, 2, 2, 32, seed=5)
    sh = lambda x: burstmpi.shard(x, layout="zigzag")
    host_out, _ = plan.forward(sh(q), sh(k), sh(v))
    host_rings = plan.last_call.rings

    class OnGPU(np.ndarray):
        on_gpu = True

    gpu = lambda x: sh(x).view(OnGPU)
    gpu_out, _ = plan.forward(gpu(q), gpu(k), gpu(v))
    gpu_rings = plan.last_call.rings
    assert plan.backend is emulated and gpu_rings is not host_rings
    assert host_rings.nbytes == 0, "the switch to the GPU released the host's buffers"
    assert gpu_rings.nbytes > (0 if NRANKS > 1 else -1)
    exact, _ = ref.forward(q, k, v, causal=True)
    for ours in (host_out, gpu_out):
        np.testing.assert_allclose(burstmpi.unshard(np.asarray(ours), layout="zigzag"), exact, rtol=2e-3, atol=2e-4)
    plan.release()
    assert plan.buffer_bytes == 0
