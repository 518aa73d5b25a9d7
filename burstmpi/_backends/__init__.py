"""Backends: the local work of one ring step, for one kind of memory.

A backend provides ``xp`` (the array module), ``alloc(nbytes)``, ``output(shape, dtype)``
and ``acc_dtype``, the local work of a ring step: ``fwd_state``, ``fwd_block``,
``fwd_finalize``, ``bwd_preprocess``, ``bwd_state``, ``bwd_block`` and ``store(dst, src,
scale=None)`` (an accumulator the ring is done with, times ``scale``, into a result in the
caller's layout), and that of a decode (``burstmpi._decode.cache``): ``decode`` (new queries over a
cache shard, a normalised partial) and ``combine`` (partials merged in a fixed order). The
ring algorithm in ``burstmpi._ring.flat`` and the cache are written once against this interface.
``CpuBackend`` (``cpu/``) computes on the CPU: its tile loops compiled with numba, or in
NumPy where numba is missing, on the rank's threads; ``KernelBackend`` launches burstmpi's
CUDA kernels (``gpu/``). ``jit_cache`` keeps numba's disk cache in step with the sources.
"""

from .cpu import CpuBackend
from .cupy_backend import CupyBackend
from .kernel_backend import KernelBackend

__all__ = ["CpuBackend", "KernelBackend", "CupyBackend"]
