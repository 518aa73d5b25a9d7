"""Backends: the local work of one ring step, for one kind of memory.

A backend provides ``xp`` (the array module), ``alloc(nbytes)`` and the local kernels
``fwd_block``, ``fwd_finalize`` and ``bwd_block``. The ring algorithm in
``burstmpi.ring`` is written once against this interface.
"""

from .numpy_backend import NumpyBackend

__all__ = ["NumpyBackend", "get_backend"]


def get_backend(name):
    """Return the backend called ``name`` ("numpy"; "cuda" arrives with the GPU runtime)."""
    if name == "numpy":
        return NumpyBackend()
    if name == "cuda":
        raise NotImplementedError(
            "backend='cuda': the CuPy/NCCL runtime is not part of this release yet; "
            "use backend='numpy' with host arrays")
    raise ValueError(f"backend: expected 'auto', 'numpy' or 'cuda', got {name!r}")
