"""The CPU emulator of tests/emulator checks itself: conversions, fragment layouts, and
the failures it must report. Skipped where no C++ compiler exists."""

import ctypes

import numpy as np
import pytest

import kernel_harness as kh
from burstmpi._interop import bfloat16

pytestmark = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")

BROKEN = ["exit_before_barrier", "divergent_collective", "lane_exits_in_collective", "smem_overflow"]
NAMES = ["gemm_probe<half_t>", "gemm_probe<bf16_t>", "gemm_probe<float>", "stream_delay", "broadcast"] + BROKEN


@pytest.fixture(scope="module")
def lib():
    return kh.build(NAMES, source='#include "selftest.cu"\n')


def _launch(lib, name, args, block=128, smem=256, schedule="forward/late"):
    kh.launch(lib, kh.kernels.Launch(name, (1, 1, 1), (block, 1, 1), smem, tuple(args)), schedule)


@pytest.mark.parametrize("kind,np_dtype", [(0, np.float16), (1, bfloat16)], ids=["float16", "bfloat16"])
def test_conversions_round_like_numpy(lib, kind, np_dtype):
    rng = np.random.default_rng(0)
    edge = np.array([0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e5, -1e5, 6.1e-5, 5.96e-8, 2.98e-8,
                     2.99e-8, 1e-9, 3.0e38, 3.4e38, np.inf, -np.inf, 1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11,
                     1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8], dtype=np.float32)
    x = np.concatenate([edge, rng.standard_normal(20000).astype(np.float32) * 10.0 ** rng.integers(-9, 6, 20000)])
    x = x.astype(np.float32)
    bits = np.empty(x.size, np.uint16)
    lib.emu_from_float(kind, x.ctypes.data_as(ctypes.c_void_p), bits.ctypes.data_as(ctypes.c_void_p), x.size)
    with np.errstate(over="ignore"):
        assert np.array_equal(bits, x.astype(np_dtype).view(np.uint16))
    back = np.empty(x.size, np.float32)
    lib.emu_to_float(kind, bits.ctypes.data_as(ctypes.c_void_p), back.ctypes.data_as(ctypes.c_void_p), x.size)
    assert np.array_equal(back, bits.view(np_dtype).astype(np.float32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("schedule", list(kh.SCHEDULES))
def test_fragment_gemms_match_numpy(lib, dtype, schedule):
    """ldmatrix + mma.sync (or the SIMT path) through cuda/tile.cuh give NumPy's products."""
    rng = np.random.default_rng(1)
    dt = kh.NP_DTYPES[dtype]
    a, b, z = (kh.Guarded(rng.standard_normal(s), dt) for s in ((16, 32), (16, 32), (16, 16)))
    c1, c2 = kh.Guarded(np.zeros((16, 16)), np.float32), kh.Guarded(np.zeros((16, 16)), np.float32)
    name = f"gemm_probe<{kh.kernels.DTYPES[dtype]}>"
    _launch(lib, name, [("p", x.ptr) for x in (a, b, z, c1, c2)], block=32, smem=16384, schedule=schedule)
    f = lambda x: x.array.astype(np.float64)
    s = f(a) @ f(b).T
    assert np.allclose(c1.array, s, rtol=1e-5, atol=1e-5)
    p = s.astype(np.float32).astype(dt).astype(np.float64) if dtype != "float32" else s
    assert np.allclose(c2.array, p @ f(z), rtol=1e-4, atol=1e-4)
    assert c1.intact() and c2.intact()


def test_the_stream_delay_probe_waits_as_long_as_asked(lib):
    """cuda/probe.cu's stream_delay (burstmpi-gpucheck's held-back stream) through
    arch.cuh's global_ns: one warp, at least the nanoseconds asked."""
    import time

    t0 = time.perf_counter()
    _launch(lib, "stream_delay", [("q", 30_000_000)], block=32, smem=0)
    assert 0.03 <= time.perf_counter() - t0 < 5


def test_missing_barrier_shows(lib):
    out = kh.Guarded(np.zeros(128), np.float32)
    _launch(lib, "broadcast", [("p", out.ptr), ("i", 1)], schedule="reverse/early")
    assert np.array_equal(out.array, np.tile(np.arange(32), 4))
    _launch(lib, "broadcast", [("p", out.ptr), ("i", 0)], schedule="reverse/early")
    assert np.isnan(out.array[32:]).all()  # later warps ran first and read the 0xFF fill


@pytest.mark.parametrize("name,message", [
    ("exit_before_barrier", "have exited"),
    ("divergent_collective", "divergent warp collectives"),
    ("lane_exits_in_collective", "never completed"),
    ("smem_overflow", "past the launch's dynamic size"),
])
def test_broken_kernels_are_reported(lib, name, message):
    out = kh.Guarded(np.zeros(128), np.float32)
    with pytest.raises(kh.EmulatorError, match=message):
        _launch(lib, name, [("p", out.ptr), ("i", 256)])
