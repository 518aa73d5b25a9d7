"""Backends: the local work of one ring step, for one kind of memory.

A backend provides ``xp`` (the array module), ``alloc(nbytes)``, ``acc_dtype`` and the
local work of a ring step: ``fwd_state``, ``fwd_block``, ``fwd_finalize``,
``bwd_preprocess`` and ``bwd_block``. The ring algorithm in ``burstmpi.ring`` is written
once against this interface. ``NumpyBackend`` computes with NumPy on the CPU;
``KernelBackend`` launches burstmpi's CUDA kernels (``cuda/``).
"""

from .kernel_backend import KernelBackend
from .numpy_backend import NumpyBackend

__all__ = ["NumpyBackend", "KernelBackend", "get_backend"]


def get_backend(name):
    """Return the backend called ``name`` ("numpy"; "cuda" arrives with the GPU runtime)."""
    if name == "numpy":
        return NumpyBackend()
    if name == "cuda":
        raise NotImplementedError(
            "backend='cuda': the CuPy/NCCL runtime is not part of this release yet; "
            "use backend='numpy' with host arrays")
    raise ValueError(f"backend: expected 'auto', 'numpy' or 'cuda', got {name!r}")
