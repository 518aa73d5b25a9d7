"""The "cuda" backend: burstmpi's kernels (cuda/) launched through CuPy on one GPU.

Everything between the ring and a launch is ``KernelBackend``'s (and is tested on the CPU
emulator in CI); this file only adds what touches a real device: CuPy arrays, the
compiled modules (``burstmpi._gpu.kernels.module``, memoized per device), the opt-in for more
than 48 KiB of dynamic shared memory, and launching on the caller's current stream.
"""

import numpy as np

from .. import _transfers
from .._gpu import kernels
from .kernel_backend import KernelBackend

__all__ = ["CupyBackend"]

_DEFAULT_SMEM = 48 * 1024
_CONVERT = {"p": np.uint64, "q": np.int64, "i": np.int32, "f": np.float32}


class CupyBackend(KernelBackend):
    """Local attention on device ``device_id`` with CuPy arrays."""

    def __init__(self, cupy, device_id):
        self.xp, self.device_id = cupy, device_id
        self.device = cupy.cuda.Device(device_id)
        super().__init__(smem_limit=int(self.device.attributes["MaxSharedMemoryPerBlockOptin"]))
        self._functions = {}

    @staticmethod
    def ptr(a):
        return int(a.data.ptr)

    def to_device(self, a):
        with self.device:
            return _transfers.to_device(self.xp, a)  # counted

    def _function(self, spec):
        fn = self._functions.get(spec.kernel)
        if fn is None:
            fn = kernels.module(self.device_id, *spec.module).get_function(spec.kernel)
            self._functions[spec.kernel] = fn
        if spec.smem > _DEFAULT_SMEM and fn.max_dynamic_shared_size_bytes < spec.smem:
            fn.max_dynamic_shared_size_bytes = spec.smem
        return fn

    def launch(self, spec):
        # Kernel pointers travel as 64-bit integers: the same bytes as a device pointer.
        args = tuple(_CONVERT[kind](value) for kind, value in spec.args)
        with self.device:
            self._function(spec)(spec.grid, spec.block, args, shared_mem=spec.smem)
