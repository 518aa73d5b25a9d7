"""Settings read from the environment: the one place that reads ``BURSTMPI_*``.

Every knob has a keyword argument as well; the environment only supplies defaults,
so a cluster admin can tune a job without touching the code that calls burstmpi.

======================  ==========  ===================================================
variable                default     meaning
======================  ==========  ===================================================
BURSTMPI_BACKEND        auto        ``numpy`` (CPU) or ``cuda``; ``auto`` follows the
                                    arrays' device
BURSTMPI_TILE_Q         512         GEMM rows (query tokens x heads per KV head) per
                                    local tile (NumPy backend)
BURSTMPI_TILE_K         512         rows of K/V per local tile (NumPy backend)
BURSTMPI_CPU_KERNELS    auto        the CPU backend's elementwise work: ``numba``
                                    (compiled, fused), ``numpy`` (the pure-NumPy
                                    fallback), ``auto`` = numba when it imports
BURSTMPI_CPU_GEMM       auto        the float32 forward's GEMMs: ``auto`` = our
                                    micro-kernel on operands packed once
                                    (``backends.cpu_packed``) where the CPU has AVX2
                                    with FMA or AVX-512 and a block's keys meet 512
                                    query rows or more, else BLAS; ``blas`` = BLAS's
                                    sgemm on every tile; ``packed`` = the micro-kernel
                                    on every block (an error without those CPU flags)
BURSTMPI_BLAS           auto        the BLAS whose sgemm the compiled tile loops call:
                                    ``mkl`` (Intel oneMKL: pip's ``mkl`` wheel, conda,
                                    or the loader path), ``numpy`` (NumPy's own),
                                    ``auto`` = oneMKL when present; read once per process
BURSTMPI_THREADS        0           threads per rank for the CPU backend's tiles;
                                    ``0`` = the cores this process may use divided by
                                    the ranks on its node (at least 1)
BURSTMPI_CHECK          1           ``0`` leaves the argument fingerprint out of the
                                    per-call collective (which still runs: it carries
                                    every rank's local length); mismatched arguments
                                    then go undetected
BURSTMPI_CUDA_AWARE_MPI 0           ``1``: the MPI transport hands GPU buffers to MPI
                                    directly (CUDA-aware MPI) instead of staging them
                                    through host memory
BURSTMPI_TIMEOUT        300         seconds any wait on other ranks may last (a ring
                                    step's transfers, the per-call agreement, set-up
                                    collectives, NCCL's phase end, the decode's
                                    collective) before the watchdog prints who it
                                    waited for and aborts the job with exit code 75
                                    (``burstmpi.transport.watchdog``); the ``timeout``
                                    keyword of plans, caches and adapters overrides it.
                                    Replaces ``BURSTMPI_NCCL_TIMEOUT`` (still read, with
                                    a warning, when this one is unset)
BURSTMPI_RANKS_PER_NODE 0           ``g``: consecutive blocks of g ranks form a node
                                    (one machine plays a cluster); ``0`` = the ranks
                                    MPI's shared-memory split puts together
BURSTMPI_INTERNODE_GBPS 0           a simulation aid: host transfers between nodes
                                    take at least bytes / (X GB/s) (MPI transport;
                                    ``burstmpi.transport.slowlinks``; refused with
                                    GPU arrays across nodes); ``0`` = off
BURSTMPI_LINK_GBPS      (measured)  ``INTRA,INTER``: the links' GB/s (one way, per
                                    rank) inside a node and between nodes, for
                                    ``topology="auto"``'s choice; unset = measured
                                    once per plan (``burstmpi.transport.links``)
======================  ==========  ===================================================
"""

import os
import warnings

__all__ = ["Settings", "settings"]


def _number(name, default, kind, minimum):
    """``BURSTMPI_*`` variable ``name`` as ``kind`` (int or float), at least ``minimum`` and
    finite; ``default`` when unset or empty."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    what = "an integer" if kind is int else "a finite number"
    try:
        value = kind(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}: expected {what}, got {raw!r}") from None
    if not (minimum <= value < float("inf")):
        raise ValueError(f"environment variable {name}: expected {what} >= {minimum}, got {raw}")
    return value


def _int(name, default, minimum=1):
    return _number(name, default, int, minimum)


def _pair(name):
    """``BURSTMPI_*`` variable ``name`` as two positive finite numbers ``A,B``, or None when
    unset or empty."""
    raw = os.environ.get(name, "")
    if not raw:
        return None
    try:
        pair = tuple(float(x) for x in raw.split(","))
    except ValueError:
        pair = ()
    if len(pair) != 2 or not all(0 < x < float("inf") for x in pair):
        raise ValueError(f"environment variable {name}: expected two positive numbers A,B, got {raw!r}")
    return pair


def _timeout():
    """``BURSTMPI_TIMEOUT`` in seconds (> 0), or the retired ``BURSTMPI_NCCL_TIMEOUT`` with a
    warning where only that one is set, else 300."""
    if not os.environ.get("BURSTMPI_TIMEOUT") and os.environ.get("BURSTMPI_NCCL_TIMEOUT"):
        warnings.warn("BURSTMPI_NCCL_TIMEOUT is replaced by BURSTMPI_TIMEOUT, which bounds every wait on other "
                      "ranks (not only NCCL's); set that instead", FutureWarning, stacklevel=3)
        return float(_number("BURSTMPI_NCCL_TIMEOUT", 300.0, float, 1e-3))
    return float(_number("BURSTMPI_TIMEOUT", 300.0, float, 1e-3))


def _choice(name, default, choices):
    raw = os.environ.get(name, "") or default
    if raw not in choices:
        raise ValueError(f"environment variable {name}: expected one of {sorted(choices)}, got {raw!r}")
    return raw


class Settings:
    """A snapshot of the ``BURSTMPI_*`` environment, taken when it is created."""

    def __init__(self):
        self.backend = _choice("BURSTMPI_BACKEND", "auto", {"auto", "numpy", "cuda"})
        self.tile_q = _int("BURSTMPI_TILE_Q", 512)
        self.tile_k = _int("BURSTMPI_TILE_K", 512)
        self.cpu_kernels = _choice("BURSTMPI_CPU_KERNELS", "auto", {"auto", "numba", "numpy"})
        self.cpu_gemm = _choice("BURSTMPI_CPU_GEMM", "auto", {"auto", "blas", "packed"})
        self.blas = _choice("BURSTMPI_BLAS", "auto", {"auto", "mkl", "numpy"})
        self.threads = _int("BURSTMPI_THREADS", 0, minimum=0)
        self.check = _int("BURSTMPI_CHECK", 1, minimum=0) != 0
        self.cuda_aware_mpi = _int("BURSTMPI_CUDA_AWARE_MPI", 0, minimum=0) != 0
        self.timeout = _timeout()
        self.ranks_per_node = _int("BURSTMPI_RANKS_PER_NODE", 0, minimum=0)
        self.internode_gbps = _number("BURSTMPI_INTERNODE_GBPS", 0.0, float, 0)
        self.link_gbps = _pair("BURSTMPI_LINK_GBPS")


def settings():
    """Return the current settings (read afresh, so tests may change the environment)."""
    return Settings()
