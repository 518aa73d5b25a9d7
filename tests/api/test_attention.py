"""Forward and backward against a float64 dense reference on the global sequence.

Runs on however many ranks COMM_WORLD has (tests/test_mpi.py runs 2, 3 and 4).
"""

import numpy as np
import pytest

import burstmpi
from burstmpi import reference as ref

from conftest import DTYPES, NRANKS, RANK, check_against_float64

LAYOUTS = ["contiguous", "zigzag", "striped"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("bwd_comm", ["burst", "ring"])
def test_layouts_and_masks(layout, causal, bwd_comm):
    check_against_float64(layout=layout, causal=causal, bwd_comm=bwd_comm, C=26)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal,window", [(False, (3, 5)), (False, (0, 0)), (True, (17, -1)),
                                           (False, (-1, 4)), (True, (1, 0)), (False, (40, 2))])
def test_sliding_windows(layout, causal, window):
    check_against_float64(layout=layout, causal=causal, window=window, C=22, bwd_comm="auto")


@pytest.mark.parametrize("Z,Zkv", [(8, 8), (8, 2), (8, 1), (6, 3)])
def test_gqa_and_mqa(Z, Zkv):
    check_against_float64(Z=Z, Zkv=Zkv, causal=True, layout="zigzag", bwd_comm="auto", C=18)


@pytest.mark.parametrize("d", [32, 64, 80, 96, 128, 256])
def test_head_dims(d):
    check_against_float64(d=d, Z=2, Zkv=1, C=12, causal=True)


def test_v_head_dim_differs():
    check_against_float64(d=64, dv=32, causal=True, bwd_comm="ring")
    check_against_float64(d=48, dv=80, window=(5, 5), bwd_comm="burst")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_dtypes(dtype, causal):
    check_against_float64(dtype=dtype, causal=causal, d=64, C=20, layout="zigzag", bwd_comm="auto")


@pytest.mark.parametrize("C", [1, 7, 37])
def test_lengths_not_multiple_of_tile(C, monkeypatch):
    monkeypatch.setenv("BURSTMPI_TILE_Q", "16")
    monkeypatch.setenv("BURSTMPI_TILE_K", "5")
    check_against_float64(C=C, Z=4, Zkv=1, causal=True, bwd_comm="burst")
    check_against_float64(C=C, Z=4, Zkv=1, window=(6, 2), layout="striped", bwd_comm="ring")


def test_batch_and_scale():
    check_against_float64(B=3, softmax_scale=0.37, causal=True, layout="striped")


def test_burst_and_ring_backward_agree():
    q, k, v, do = ref.random_problem(2, 30 * NRANKS, 4, 2, 32, dtype=np.float32, seed=3)
    sh = burstmpi.shard
    plans = {m: burstmpi.BurstAttention(causal=True, layout="contiguous", bwd_comm=m) for m in ("burst", "ring")}
    out, lse = plans["burst"].forward(sh(q), sh(k), sh(v))
    g = {m: p.backward(sh(do), sh(q), sh(k), sh(v), out, lse) for m, p in plans.items()}
    for a, b in zip(g["burst"], g["ring"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert plans["burst"].last_stats.bwd_mode == "burst"
    assert plans["ring"].last_stats.bwd_mode == "ring"


def test_functional_api_matches_plan():
    q, k, v, do = [burstmpi.shard(x) for x in ref.random_problem(1, 16 * NRANKS, 2, 2, 16, seed=4)]
    out, lse = burstmpi.attention(q, k, v, causal=True, layout="contiguous", return_lse=True)
    out_only = burstmpi.attention(q, k, v, causal=True, layout="contiguous")
    np.testing.assert_array_equal(out, out_only)
    plan_out, plan_lse = burstmpi.BurstAttention(causal=True, layout="contiguous").forward(q, k, v)
    np.testing.assert_array_equal(out, plan_out)
    np.testing.assert_array_equal(lse, plan_lse)
    grads = burstmpi.attention_backward(do, q, k, v, out, lse, causal=True, layout="contiguous")
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_deterministic_and_inputs_untouched():
    q, k, v, do = [burstmpi.shard(x) for x in ref.random_problem(1, 20 * NRANKS, 4, 2, 16, seed=5)]
    before = [x.copy() for x in (q, k, v, do)]
    plan = burstmpi.BurstAttention(window=(7, 3), layout="contiguous")
    runs = []
    for _ in range(2):
        out, lse = plan.forward(q, k, v)
        runs.append((out, lse) + tuple(plan.backward(do, q, k, v, out, lse)))
    for a, b in zip(*runs):
        assert np.array_equal(a, b), "results differ between two identical calls"
    for a, b in zip(before, (q, k, v, do)):
        assert np.array_equal(a, b), "an input was modified"


def test_shard_unshard_round_trip():
    x = np.arange(2 * 12 * NRANKS * 3).reshape(2, 12 * NRANKS, 3).astype(np.float32)
    for layout in LAYOUTS:
        part = burstmpi.shard(x, layout=layout)
        assert part.shape == (2, 12, 3)
        np.testing.assert_array_equal(burstmpi.unshard(part, layout=layout), x)
    np.testing.assert_array_equal(burstmpi.unshard(burstmpi.shard(x, axis=-2), axis=-2), x)
    if NRANKS == 2:
        z = burstmpi.shard(np.arange(8), layout="zigzag", axis=0)
        assert list(z) == ([0, 1, 6, 7] if RANK == 0 else [2, 3, 4, 5])
