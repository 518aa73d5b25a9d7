"""Every kernel instantiation compiles with NVRTC for sm_80 and sm_90, without spills.

NVRTC is called directly with an explicit architecture (no GPU is queried), through
``cuda-bindings`` and the NVRTC library of the ``nvidia-cuda-nvrtc`` wheel; the test is
skipped where those are missing. The table of registers, shared memory and spills is
printed at the end of the session.
"""

import concurrent.futures

import pytest

from burstmpi._gpu import kernelcheck, kernels

nvrtc = pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) is not installed")


def _nvrtc_usable():
    try:
        return nvrtc.nvrtcVersion()[0] == nvrtc.nvrtcResult.NVRTC_SUCCESS
    except Exception:  # the bindings import, but no NVRTC library can be loaded
        return False


@pytest.fixture(scope="module")
def reports():
    """Every architecture's compile report, compiled side by side: NVRTC releases the GIL,
    so two threads halve the wall time of the suite's slowest test on a 2-core CI machine."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(kernels.ARCHS)) as pool:
        return dict(zip(kernels.ARCHS, pool.map(kernelcheck.compile_report, kernels.ARCHS)))


@pytest.mark.skipif(not _nvrtc_usable(), reason="no NVRTC library (pip install nvidia-cuda-nvrtc)")
@pytest.mark.parametrize("arch", kernels.ARCHS)
def test_kernels_compile_without_spills(arch, reports):
    from conftest import REPORTS

    rows = reports[arch]
    version = ".".join(map(str, nvrtc.nvrtcVersion()[1:]))
    REPORTS.append((f"NVRTC {version} compile check, {arch}", kernelcheck.format_report(rows).splitlines()))
    expected = sum(len(kernels.kernel_names(dt, d, dv, kernels.SMEM_LIMIT[arch]))
                   for dt in kernels.DTYPES for d, dv in kernels.HEAD_DIMS)
    # finalize/preprocess depend on dv only, so some names repeat across head dims.
    assert 0 < len(rows) <= expected
    spills = [r["name"] for r in rows if r["spill_stores"] or r["spill_loads"]]
    assert not spills, f"{arch}: kernels spill registers: {spills}"
    for r in rows:
        assert r["smem_dynamic"] <= kernels.SMEM_LIMIT[arch], r
        assert r["registers"] <= 255, r
    # The decode kernels are there for every (dtype, head dims), with their shared memory.
    decode = {r["name"]: r["smem_dynamic"] for r in rows if r["name"].startswith("burst_decode<")}
    assert decode == {kernels._decode_name(dt, d, dv): kernels.decode_smem_bytes(dt, d, dv)
                      for dt in kernels.DTYPES for d, dv in kernels.HEAD_DIMS}
