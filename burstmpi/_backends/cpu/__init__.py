"""The CPU backend: local attention on host memory, one backend class (``CpuBackend``).

``backend`` holds the class: it plans tiles (``tile_plan``), converts and packs the key
blocks and hands work items to the rank's threads (``threads``), in memory kept from call to
call (``workspace``). A query tile's loop over its key tiles runs compiled with numba
(``tiles``: BLAS's sgemm bound in ``blas`` and called from machine code, the fused
elementwise sweeps of ``kernels`` between the GEMMs) where numba and a cblas sgemm are
there, else in NumPy (``numpy_tiles``, also the float64 path and the tests' reference;
``BURSTMPI_CPU_KERNELS``). The float32 forward's GEMMs run on burstmpi's own micro-kernel
(``packed`` over ``micro``, LLVM IR through numba) where the CPU has AVX2 with FMA or
AVX-512 (``BURSTMPI_CPU_GEMM``). ``decode`` is the decode path over a cache shard.

Only ``backend`` and the NumPy modules are imported here: the numba ones load on first use,
so the backend works without numba.
"""

from .backend import CpuBackend

__all__ = ["CpuBackend"]
