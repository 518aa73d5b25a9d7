"""What the MPI library says of itself: its name, and whether it takes GPU memory.

``cuda_aware_mpi`` (``BURSTMPI_CUDA_AWARE_MPI=1``) hands device pointers to MPI. An MPI
built without CUDA reads them as host addresses and the rank dies of a segmentation
fault, far from the setting that caused it. MPICH, Open MPI and Intel MPI all export
``MPIX_Query_cuda_support()`` (an extension, not in mpi4py 4.1's API): it is asked here
through the library mpi4py loaded, so a wrong setting is an error naming the MPI and the
setting instead. Measured on the pip wheels (MPICH 5.0.2, Open MPI 5.0.11, Intel MPI
2021.18): all three say 0.
"""

import ctypes
import functools

from mpi4py import MPI

__all__ = ["library_version", "library_name", "cuda_support", "refuse_cuda_unaware"]


def library_version():
    """The first line of the MPI's own version string, as printable text: Open MPI's ends
    in the C string's NUL byte (measured with 5.0.11), which a log would carry on."""
    text = MPI.Get_library_version().replace("\0", "").strip()
    return " ".join(text.splitlines()[0].split()) if text else "an unnamed MPI"


def library_name():
    """``Open MPI v5.0.11``, ``MPICH Version: 5.0.2``, ...: ``library_version`` shortened
    to the MPI's name and version."""
    return library_version().split(",")[0].strip()


@functools.lru_cache(maxsize=1)
def cuda_support(maps="/proc/self/maps"):
    """True or False as the MPI library answers ``MPIX_Query_cuda_support()``, or None where
    it cannot be asked (no such function, not Linux)."""
    try:
        with open(maps) as f:
            paths = {line.split()[-1] for line in f if "/libmpi" in line.split()[-1]}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support")
        except (OSError, AttributeError):
            continue
        query.restype, query.argtypes = ctypes.c_int, []
        return bool(query())
    return None


def refuse_cuda_unaware(fn, ranks):
    """Raise (on every rank: ``ranks`` is the same everywhere) where ``cuda_aware_mpi`` is on
    but the MPI of ``ranks`` says it takes no GPU memory."""
    if ranks:
        raise ValueError(
            f"{fn}: cuda_aware_mpi (BURSTMPI_CUDA_AWARE_MPI): expected an MPI that takes GPU memory, but "
            f"{library_name()} says it does not (MPIX_Query_cuda_support() is 0 on rank(s) "
            f"{', '.join(map(str, ranks))}): its library was built without CUDA (the pip wheels of MPICH, Open "
            "MPI and Intel MPI are), or needs it turned on before it starts (MPICH: MPIR_CVAR_ENABLE_GPU=1, Cray "
            "MPICH: MPICH_GPU_SUPPORT_ENABLED=1). Leave cuda_aware_mpi off: GPU buffers then travel through "
            "NCCL, or with transport='mpi' staged through host memory")
