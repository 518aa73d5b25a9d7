"""The kernel rate ``topology="auto"`` plans with: ``kernel_tflops`` (``BURSTMPI_KERNEL_TFLOPS``),
else the rate ``burstmpi-gpucheck`` measured on a GPU of the same name (the rate file,
``$XDG_CACHE_HOME/burstmpi/rates.json``), else nominal; the ranks agree on the slowest;
``last_stats`` says which was used. Runs alone and under mpiexec; what needs several nodes
of several ranks (the model asked for real) runs at 4 ranks and up."""

import json
import os
import types

import pytest

import burstmpi
from burstmpi import reference as ref
from burstmpi._config import NOMINAL_TFLOPS, Settings, rates_path, store_rate, stored_rate
from conftest import COMM, NRANKS, RANK

SPREAD = [g for g in range(2, NRANKS) if NRANKS % g == 0]  # several nodes of several ranks
GPU = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """The rate file in a fresh folder of this rank's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("BURSTMPI_KERNEL_TFLOPS", raising=False)
    return tmp_path


def test_the_rate_file_lives_in_the_xdg_cache(cache_home, monkeypatch):
    assert rates_path() == os.path.join(str(cache_home), "burstmpi", "rates.json")
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # not absolute: the XDG rule ignores it
    monkeypatch.setenv("HOME", str(cache_home))
    assert rates_path() == os.path.join(str(cache_home), ".cache", "burstmpi", "rates.json")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert rates_path() == os.path.join(str(cache_home), ".cache", "burstmpi", "rates.json")


def test_a_stored_rate_is_kept_per_device_name(cache_home):
    path = store_rate(GPU, 410.0, 300.0, shape="16384 tokens")
    store_rate("NVIDIA A100-SXM4-80GB", 180.0, 120.0)
    store_rate(GPU, 420.0, 310.0)  # a new measurement replaces that device's entry only
    assert path == rates_path() and os.path.isfile(path)
    entries = json.loads(open(path).read())
    assert set(entries) == {GPU, "NVIDIA A100-SXM4-80GB"}
    got = stored_rate(GPU)
    assert (got["fwd_tflops"], got["bwd_tflops"], got["by"]) == (420.0, 310.0, "burstmpi-gpucheck")
    assert len(got["date"]) == 10 and "shape" not in got
    assert stored_rate("Tesla T4") is None
    assert not [n for n in os.listdir(os.path.dirname(path)) if n != "rates.json"], "a temporary file was left"
    with pytest.raises(ValueError, match=r"^store_rate: expected two positive rates in TFLOP/s, got 0, 1$"):
        store_rate(GPU, 0, 1)


def test_where_the_rate_comes_from(cache_home, monkeypatch):
    """The setting, else a GPU's stored measurement, else nominal; host arrays never read
    the file (nothing measures the CPU backend into it)."""
    store_rate(GPU, 410.0, 300.0)
    measured = f"measured by burstmpi-gpucheck on {stored_rate(GPU)['date']}"
    nominal = Settings()
    assert nominal.kernel_rate("cuda", GPU) == (410.0, 300.0, measured)
    assert nominal.kernel_rate("cuda", "Tesla T4") == (NOMINAL_TFLOPS["cuda"],) * 2 + ("nominal",)
    assert nominal.kernel_rate("cuda") == (200.0, 200.0, "nominal")
    assert nominal.kernel_rate("host", GPU) == (0.05, 0.05, "nominal")
    given = Settings.resolve("f", kernel_tflops=90)
    assert given.kernel_rate("cuda", GPU) == (90.0, 90.0, "setting")
    assert given.kernel_rate("host") == (90.0, 90.0, "setting")
    monkeypatch.setenv("BURSTMPI_KERNEL_TFLOPS", "1.5")
    assert Settings.from_env().kernel_rate("cuda", GPU) == (1.5, 1.5, "setting")


def test_a_broken_rate_file_is_ignored_with_a_warning(cache_home):
    path = rates_path()
    os.makedirs(os.path.dirname(path))
    with open(path, "w") as f:
        f.write("{not json")
    with pytest.warns(RuntimeWarning, match=r"rates\.json: ignored, not a readable rate file of burstmpi-gpucheck"):
        assert Settings().kernel_rate("cuda", GPU) == (200.0, 200.0, "nominal")
    with open(path, "w") as f:
        json.dump({GPU: {"fwd_tflops": -1, "bwd_tflops": 300.0, "date": "2026-01-05"}}, f)
    with pytest.warns(RuntimeWarning, match=r"the entry of 'NVIDIA H100 80GB HBM3' is ignored: expected positive"):
        assert Settings().kernel_rate("cuda", GPU)[2] == "nominal"
    store_rate(GPU, 400.0, 300.0)  # a good measurement replaces the broken entry
    assert Settings().kernel_rate("cuda", GPU)[:2] == (400.0, 300.0)


@pytest.mark.parametrize("value,message", [
    (0, r"^BurstAttention: kernel_tflops: expected a finite number of TFLOP/s > 0, got 0$"),
    (float("inf"), r"^BurstAttention: kernel_tflops: expected a finite number of TFLOP/s > 0, got inf$"),
    (True, r"^BurstAttention: kernel_tflops: expected a finite number of TFLOP/s > 0, got True$"),
    ("fast", r"^BurstAttention: kernel_tflops: expected a finite number of TFLOP/s > 0, got 'fast'$"),
])
def test_a_bad_rate_names_the_keyword(value, message):
    with pytest.raises(ValueError, match=message):
        burstmpi.BurstAttention(kernel_tflops=value)


def test_a_bad_rate_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("BURSTMPI_KERNEL_TFLOPS", "-3")
    with pytest.raises(ValueError, match=r"^environment variable BURSTMPI_KERNEL_TFLOPS: expected a finite number "
                                         r"of TFLOP/s > 0, got '-3'$"):
        Settings.from_env()
    monkeypatch.setenv("BURSTMPI_KERNEL_TFLOPS", "fast")
    with pytest.raises(ValueError, match=r"^environment variable BURSTMPI_KERNEL_TFLOPS: expected a finite number, "
                                         r"got 'fast'$"):
        Settings.from_env()
    monkeypatch.setenv("BURSTMPI_KERNEL_TFLOPS", "350")
    assert burstmpi.BurstAttention().settings.kernel_tflops == 350.0


def _on_a_gpu(plan, name):
    """``plan`` as if its last call ran on a CuPy device named ``name`` (what
    ``_kernel_rate`` reads of the backend)."""
    props = lambda i: {"name": name.encode()}
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceProperties=props)))
    plan.runtime.backend = types.SimpleNamespace(name="cuda", xp=cupy, device_id=0)
    return plan


def test_the_ranks_plan_with_the_slowest_ranks_rate(cache_home):
    """Each rank's own setting or rate file; every rank gets the slowest rank's (rank 0's
    here), with its source."""
    plan = burstmpi.BurstAttention(kernel_tflops=1.0 + RANK)
    assert plan._kernel_rate("host") == (1.0, 1.0, "setting")
    store_rate(GPU, 400.0 + RANK, 300.0)  # every rank its own file (its own cache_home)
    plan = _on_a_gpu(burstmpi.BurstAttention(), GPU)
    fwd, bwd, source = plan._kernel_rate("cuda")
    assert (fwd, bwd) == (400.0, 300.0) and source.startswith("measured by burstmpi-gpucheck on ")
    plan = _on_a_gpu(burstmpi.BurstAttention(), "Tesla T4" if RANK == NRANKS - 1 else GPU)
    assert plan._kernel_rate("cuda") == (200.0, 200.0, "nominal")  # the last rank knows no rate for its GPU


def test_the_rate_is_reported_only_where_the_model_is_asked(cache_home):
    """At one node (or topology="flat") nothing asks the model: no rate in ``last_stats``."""
    q, k, v = (burstmpi.shard(x) for x in ref.random_problem(1, 16 * NRANKS, 2, 1, 16, seed=1)[:3])
    for topology in ("flat", "auto"):
        plan = burstmpi.BurstAttention(topology=topology, causal=True, layout="contiguous", kernel_tflops=5)
        plan.forward(q, k, v)
        st = plan.last_stats
        if not plan.runtime.nodes.spread:
            assert (st.rate_tflops, st.rate_source) == (None, None), topology
        assert st.as_dict()["rate_source"] == st.rate_source


@pytest.mark.skipif(not SPREAD, reason="needs a rank count with a divisor g, 1 < g < P (run under mpiexec -n 4)")
def test_auto_reports_the_rate_it_planned_with(cache_home, monkeypatch):
    """Across fake nodes the model is asked: ``last_stats`` has the setting's rate, else the
    nominal host rate (the rate file holds GPUs only), for the forward and the backward;
    topology="flat" reports none."""
    monkeypatch.setenv("BURSTMPI_RANKS_PER_NODE", str(SPREAD[0]))
    monkeypatch.setenv("BURSTMPI_LINK_GBPS", "8,0.05")
    store_rate(GPU, 400.0, 300.0)
    q, k, v, do = (burstmpi.shard(x) for x in ref.random_problem(1, 32 * NRANKS, 2, 1, 16, seed=3))
    for kw, want in (({"kernel_tflops": 7}, ((7.0, 7.0), "setting")), ({}, ((0.05, 0.05), "nominal"))):
        plan = burstmpi.BurstAttention(topology="auto", causal=True, layout="contiguous", **kw)
        out, lse = plan.forward(q, k, v)
        assert plan.runtime.nodes.spread
        assert (plan.last_stats.rate_tflops, plan.last_stats.rate_source) == want, kw
        plan.backward(do, q, k, v, out, lse)
        assert (plan.last_stats.rate_tflops, plan.last_stats.rate_source) == want, kw
    assert COMM.allgather(plan.last_stats.topology) == [plan.last_stats.topology] * NRANKS
    flat = burstmpi.BurstAttention(topology="flat", causal=True, layout="contiguous", kernel_tflops=7)
    flat.forward(q, k, v)
    assert (flat.last_stats.rate_tflops, flat.last_stats.rate_source) == (None, None)


@pytest.mark.skipif(NRANKS % 2, reason="head_parallel=2 needs an even rank count")
def test_head_parallelism_reports_its_ring_of_groups_rate(monkeypatch):
    """With head_parallel=2 the ring of groups asks the model: across 2 nodes of 2+ groups
    (8 ranks and up) ``last_stats`` has its rate, on one node none."""
    spread = NRANKS >= 8 and NRANKS % 4 == 0
    monkeypatch.setenv("BURSTMPI_RANKS_PER_NODE", str(NRANKS // 2 if spread else NRANKS))
    monkeypatch.setenv("BURSTMPI_LINK_GBPS", "8,0.05")
    q, k, v, do = (burstmpi.shard(x, layout="zigzag") for x in ref.random_problem(1, 32 * NRANKS, 4, 2, 16, seed=5))
    plan = burstmpi.BurstAttention(topology="auto", causal=True, layout="zigzag", head_parallel=2, kernel_tflops=7)
    out, lse = plan.forward(q, k, v)
    want = ((7.0, 7.0), "setting") if spread else (None, None)
    assert (plan.last_stats.rate_tflops, plan.last_stats.rate_source) == want
    plan.backward(do, q, k, v, out, lse)
    assert (plan.last_stats.rate_tflops, plan.last_stats.rate_source) == want
    assert plan.last_stats.topology == ("two-level" if spread else "flat")
