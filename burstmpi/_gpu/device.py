"""The GPU of each rank, and CuPy, for the "cuda" backend.

Which GPU: the rank's index among the ranks of its node (MPI split by shared memory)
modulo the GPUs the process sees, unless the caller names one. With one rank per GPU
that is the usual binding; with more ranks than GPUs they share, which the MPI transport
allows and NCCL refuses (see ``burstmpi._transport.nccl``).
"""

import contextlib
import sys
import time

from mpi4py import MPI

__all__ = ["import_cupy", "node_rank", "pick_device", "check_capability", "device_name", "rank_prefix",
           "abort_on_device_error"]

# burstmpi's kernels use cp.async, ldmatrix and bfloat16 mma.sync (cuda/*.cu): Ampere's
# instructions. Below it NVRTC fails deep inside the first kernel's compilation, so a
# plan refuses such a GPU before it compiles anything.
MIN_CAPABILITY = (8, 0)


def rank_prefix(comm):
    """``r3 | `` for messages from rank 3 of ``comm``, as mpi4jax writes them."""
    return f"r{comm.Get_rank()} | "


def import_cupy(fn):
    """Return the ``cupy`` module, or raise an error that says how to get a working one."""
    try:
        import cupy
    except ImportError as e:
        raise NotImplementedError(
            f"{fn}: backend 'cuda' needs CuPy: pip install 'burstmpi[cuda12]' (CUDA 12) or "
            f"'burstmpi[cuda13]' (CUDA 13); import failed: {e}") from None
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError without a driver, or no device at all
        raise RuntimeError(f"{fn}: backend 'cuda': no usable CUDA device ({type(e).__name__}: {e})") from None
    if count < 1:
        raise RuntimeError(f"{fn}: backend 'cuda': no CUDA device is visible "
                           f"(CUDA_VISIBLE_DEVICES={_visible()!r})")
    return cupy


def _visible():
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES")


def node_rank(comm):
    """This rank's index among the ranks of ``comm`` on the same node (collective)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def pick_device(fn, local_rank, count, device=None):
    """The device id a rank uses: ``device`` if given, else its node rank modulo the
    ``count`` visible devices."""
    if device is None:
        return local_rank % count
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < count:
        raise ValueError(f"{fn}: device: expected an int with 0 <= device < {count} "
                         f"(the visible CUDA devices), got {device!r}")
    return device


def device_name(cupy, device_id):
    """The name CUDA gives device ``device_id`` ("NVIDIA H100 80GB HBM3")."""
    name = cupy.cuda.runtime.getDeviceProperties(device_id)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


def check_capability(fn, cupy, device_id):
    """Raise RuntimeError naming ``fn``, the device, its compute capability and the
    minimum when device ``device_id`` is older than ``MIN_CAPABILITY`` (sm_80)."""
    cc = str(cupy.cuda.Device(device_id).compute_capability)  # "75", "80", "120"
    major, minor = int(cc[:-1]), int(cc[-1])
    if (major, minor) < MIN_CAPABILITY:
        need = "".join(map(str, MIN_CAPABILITY))
        raise RuntimeError(
            f"{fn}: backend 'cuda': GPU {device_id} ({device_name(cupy, device_id)}) has compute capability "
            f"{major}.{minor} (sm_{cc}); burstmpi's kernels need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} "
            f"(sm_{need}, Ampere) or newer")


def _is_device_error(exc):
    """CUDA runtime/driver and NCCL errors, as CuPy raises them."""
    kind = type(exc)
    return kind.__module__.startswith(("cupy", "cupy_backends")) or kind.__name__ in (
        "CUDARuntimeError", "CUDADriverError", "NcclError")


@contextlib.contextmanager
def abort_on_device_error(comm):
    """Turn a CUDA or NCCL error on this rank into the end of the whole job.

    After such an error the device state is unknown and the other ranks may already wait
    inside a transfer that will never come: like mpi4jax, print the error prefixed with
    the rank, then MPI_Abort, instead of raising and leaving them to hang.
    """
    try:
        yield
    except Exception as e:
        if not _is_device_error(e):
            raise
        sys.stderr.write(f"{rank_prefix(comm)}{type(e).__name__}: {e}\n"
                         f"{rank_prefix(comm)}burstmpi: aborting the job (MPI_Abort)\n")
        sys.stderr.flush()
        # The launcher forwards output asynchronously and MPI_Abort tears its proxies down:
        # give it a moment, or the one line that says what went wrong can be lost (seen
        # under load in CI: the job ended with no output at all).
        time.sleep(0.5)
        MPI.COMM_WORLD.Abort(1)
