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
        self._stream = None  # the stream the previous call ran on

    def follow(self):
        """A call begins, on the caller's current stream. What burstmpi keeps between calls
        (the arena's packets and workspaces, a KV cache, positions and masks copied to the
        device) was last used on the previous call's stream: where the stream changed (CuPy's,
        then JAX's or torch's), the new one waits for the old one's work first, through an
        event, so the two never use those buffers at once. If the old stream is gone (its
        framework destroyed it), the host waits for the device instead (counted)."""
        cur = self.xp.cuda.get_current_stream()
        prev, self._stream = self._stream, cur
        if prev is None or prev.ptr == cur.ptr:
            return
        try:
            cur.wait_event(prev.record())
        except Exception:  # noqa: BLE001 - a destroyed stream: CUDA reports an invalid handle
            _transfers.synchronize(self.device)

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
