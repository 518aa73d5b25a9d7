"""The ring on burstmpi's CUDA kernels, run by the CPU emulator: everything a GPU run
does except the GPU itself (CuPy memory and streams). Runs alone and under mpiexec."""

import numpy as np
import pytest

import kernel_harness as kh
from conftest import COMM, NRANKS, RANK, check_against_float64, check_fully_masked_rows, dtype_of, random_docs

pytestmark = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")

CONFIGS = [(dt, 32, 32) for dt in ("float16", "bfloat16", "float32")] + [("bfloat16", 64, 64)]
MASKS = {"none": (False, None), "causal": (True, None), "window": (False, (9, 4))}
LAYOUTS = ["contiguous", "zigzag", "striped"]


@pytest.fixture(scope="module")
def lib():
    return kh.library_on_every_rank(COMM, CONFIGS)


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


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_fully_masked_rows_give_zero_and_minus_inf(lib, dtype):
    """Queries that see no key of any block end with out 0 and lse -inf, and no NaN."""
    check_fully_masked_rows(kh.EmulatedBackend(lib), dtype, 32)


def test_float64_is_refused_by_name(lib):
    with pytest.raises(ValueError, match=r"backend 'cuda': dtype: expected float16, bfloat16 or float32, got float64"):
        check_against_float64(dtype="float64", backend=kh.EmulatedBackend(lib))
    assert dtype_of("float16") == np.float16


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("mode", ["burst", "ring", "two-way"])
def test_documents_and_uneven_lengths_on_emulated_kernels(lib, dtype, mode):
    """Packed documents (1-token and empty ones too) over a length no rank count divides."""
    be = kh.EmulatedBackend(lib, schedule=list(kh.SCHEDULES)[(RANK + 1) % 4])
    N = 23 * NRANKS + 5
    check_against_float64(N=N, cu_seqlens=random_docs(N, seed=11), causal=True, layout="zigzag",
                          dtype=dtype, bwd_comm=mode, backend=be, tag="kernels docs ")
    check_against_float64(N=N, cu_seqlens=random_docs(N, seed=12, mean=20), window=(6, 6),
                          layout="contiguous", dtype=dtype, bwd_comm=mode, backend=be, tag="kernels docs ")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fewer_tokens_than_ranks_on_emulated_kernels(lib, layout):
    """Ranks that hold no token launch nothing and still pass packets on."""
    be = kh.EmulatedBackend(lib)
    check_against_float64(N=max(1, NRANKS - 1), causal=True, layout=layout, dtype="float16", bwd_comm="auto",
                          backend=be, tag="kernels uneven ")
    check_against_float64(N=2 * NRANKS + 1, window=(1, 2), layout=layout, dtype="bfloat16", bwd_comm="ring",
                          backend=be, tag="kernels uneven ")
    check_against_float64(N=3 * NRANKS + 2, causal=True, layout=layout, dtype="float32", bwd_comm="burst",
                          backend=be, tag="kernels uneven ")
