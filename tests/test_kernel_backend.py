"""The ring on burstmpi's CUDA kernels, run by the CPU emulator: everything a GPU run
does except the GPU itself (CuPy memory and streams). Runs alone and under mpiexec."""

import numpy as np
import pytest

import kernel_harness as kh
from burstmpi.masks import Window
from conftest import COMM, RANK, check_against_float64, dtype_of

pytestmark = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")

CONFIGS = [(dt, 32, 32) for dt in ("float16", "bfloat16", "float32")] + [("bfloat16", 64, 64)]
MASKS = {"none": (False, None), "causal": (True, None), "window": (False, (9, 4))}
LAYOUTS = ["contiguous", "zigzag", "striped"]


@pytest.fixture(scope="module")
def lib():
    # Rank 0 compiles; the others then load the cached library instead of racing g++.
    if RANK == 0:
        kh.backend_library(CONFIGS)
    COMM.Barrier()
    return kh.backend_library(CONFIGS)


CASES = [(dt, mask, mode, LAYOUTS[i % 3])
         for i, (dt, mask, mode) in enumerate((dt, mask, mode) for dt in ("float16", "bfloat16", "float32")
                                              for mask in MASKS for mode in ("burst", "ring"))]


@pytest.mark.parametrize("dtype,mask,mode,layout", CASES)
def test_ring_on_emulated_kernels(lib, dtype, mask, mode, layout):
    causal, window = MASKS[mask]
    be = kh.EmulatedBackend(lib, schedule=list(kh.SCHEDULES)[RANK % 4])
    plan, _ = check_against_float64(C=24, Z=4, Zkv=2, d=32, dtype=dtype, causal=causal, window=window,
                                    layout=layout, bwd_comm=mode, backend=be, tag="kernels ")
    assert plan.backend is be and be.launches > 0
    assert plan.last_stats.bwd_mode == mode


@pytest.mark.parametrize("mode", ["burst", "ring"])
def test_gqa_odd_length_and_batch(lib, mode):
    be = kh.EmulatedBackend(lib)
    check_against_float64(B=2, C=7, Z=4, Zkv=1, d=64, dtype="bfloat16", causal=True,
                          bwd_comm=mode, backend=be, tag="kernels ", softmax_scale=0.2)


def test_fully_masked_rows_give_zero_and_minus_inf(lib):
    """Queries that see no key of any block end with out 0 and lse -inf, and no NaN."""
    be = kh.EmulatedBackend(lib)
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 6, 2, 32)).astype(np.float16)
    k = rng.standard_normal((1, 1, 5, 32)).astype(np.float16)
    v = rng.standard_normal((1, 1, 5, 32)).astype(np.float16)
    qpos, kpos = np.arange(6), np.arange(3, 8)  # causal: queries 0..2 see none of keys 3..7
    state = be.fwd_state(1, 1, 6, 2, 32, np.float32)
    be.fwd_block(q, k, v, state, qpos, kpos, Window(causal=True), 0.3)
    out, lse = be.fwd_finalize(state, np.float16)
    assert not np.isnan(out.astype(np.float32)).any() and not np.isnan(lse).any()
    assert (out[:, :, :3] == 0).all() and (lse[:, :, :3] == -np.inf).all()
    assert np.isfinite(lse[:, :, 3:]).all()
    dq = np.zeros(q.shape, np.float32)
    dk, dv = np.zeros(k.shape, np.float32), np.zeros(v.shape, np.float32)
    D = be.bwd_preprocess(out.transpose(0, 2, 1, 3, 4).reshape(1, 6, 2, 32),
                          out.transpose(0, 2, 1, 3, 4).reshape(1, 6, 2, 32), 1, np.float32)
    be.bwd_block(q, out, D, lse, k, v, dq, dk, dv, qpos, kpos, Window(causal=True), 0.3)
    assert np.isfinite(dq).all() and np.isfinite(dk).all() and np.isfinite(dv).all()
    assert (dq[:, :, :3] == 0).all()


def test_float64_is_refused_by_name(lib):
    with pytest.raises(ValueError, match=r"backend 'cuda': dtype: expected float16, bfloat16 or float32, got float64"):
        check_against_float64(dtype="float64", backend=kh.EmulatedBackend(lib))
    assert dtype_of("float16") == np.float16
