"""KVCache on burstmpi's CUDA kernels, run by the CPU emulator: the prefill (the ring on the
emulated kernels), every decode step (cuda/attn_decode.cu's split-KV kernel and its combine)
and the merge across ranks (the same combine kernel), against float64. Everything a GPU run
does but the GPU itself. Runs alone and under mpiexec."""

import numpy as np
import pytest

import kernel_harness as kh
from conftest import COMM, NRANKS, RANK
from decode_harness import run_cache

import burstmpi

pytestmark = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")

DTYPES = ("float16", "bfloat16", "float32")
CONFIGS = [(dt, 32, 32) for dt in DTYPES]


@pytest.fixture(scope="module")
def lib():
    return kh.library_on_every_rank(COMM, CONFIGS)


def _backend(lib):
    return kh.EmulatedBackend(lib, schedule=list(kh.SCHEDULES)[RANK % len(kh.SCHEDULES)])


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_and_decode_on_emulated_kernels(lib, dtype):
    be = _backend(lib)
    run_cache(dtype=dtype, d=32, backend=be, N0=5 * NRANKS + 2, Ts=(1,) * 6 + (3, 1), tag="kernels decode ")
    assert be.launches > 0


@pytest.mark.parametrize("Z,Zkv,window,layout", [(4, 1, None, "zigzag"), (4, 4, (6, 0), "contiguous"),
                                                   (6, 2, (9, -1), "striped")])
def test_gqa_windows_layouts_on_emulated_kernels(lib, Z, Zkv, window, layout):
    capacity = None if window is None else window[0] + 3
    be = _backend(lib)
    cache = run_cache(dtype="bfloat16", d=32, Z=Z, Zkv=Zkv, window=window, layout=layout, backend=be,
                      N0=4 * NRANKS + 1, Ts=(1,) * 10 + (3,), capacity=capacity, tag="kernels decode ")
    assert cache.runtime.backend is be and be.launches > 0


@pytest.mark.parametrize("N0", [0, 23])
def test_sinks_on_emulated_kernels(lib, N0):
    """StreamingLLM on the kernels: the window's pass and the sinks' pass, merged by the
    combine kernel before the collective."""
    be = _backend(lib)
    cache = run_cache(dtype="float16", d=32, backend=be, N0=N0, Ts=(1,) * 12 + (2,), window=(5, 0), sinks=3,
                      capacity=3 + 5 + 2, tag="kernels decode sinks ")
    assert cache.runtime.backend is be and be.launches > 0


def test_empty_cache_and_many_rows_on_emulated_kernels(lib):
    # From an empty cache; then a chunk of 21 tokens x 2 heads per KV head: several row
    # groups of the decode kernel.
    be = _backend(lib)
    cache = run_cache(dtype="float16", d=32, backend=be, N0=0, Ts=(1, 2, 21, 1), tag="kernels decode ")
    assert cache.seqlen == 25 and be.launches > 0


def test_float64_needs_the_cpu_backend(lib):
    """A backend given as an object is where the cache lives from the start: the cache
    refuses float64 when it is made (a backend chosen by name or "auto" refuses it on
    the first call that places the cache)."""
    with pytest.raises(ValueError, match=r"KVCache: dtype: a cache of float64 cannot live on backend .*float64 caches run on backend=.cpu."):
        burstmpi.KVCache(capacity=8, batch=1, kv_heads=2, head_dim=32, dtype=np.float64, backend=_backend(lib))
