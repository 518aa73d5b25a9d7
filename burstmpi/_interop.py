"""Arrays in, arrays out: DLPack and the array API, so callers keep their own array type.

``to_host`` turns anything with ``__dlpack__`` (or ``__array__``) into a NumPy view
without copying where the producer allows it; ``like`` turns a NumPy result back into
the caller's type (NumPy in, NumPy out; torch in, torch out; JAX in, JAX out) through
array-api-compat. bfloat16 has no DLPack path into NumPy, so it crosses as raw 16-bit
words and is reinterpreted on the other side (ml_dtypes provides NumPy's bfloat16).
Where CuPy arrays cross between host and device memory, the copy is counted
(``burstmpi._transfers``).
"""

import numpy as np

from . import _transfers

__all__ = ["bfloat16", "to_host", "to_numpy", "to_device", "like", "is_host", "cupyx_pinned"]

try:
    from ml_dtypes import bfloat16
except ImportError:  # pragma: no cover - ml_dtypes is a dependency, but stay importable
    bfloat16 = None

_KDLCPU = 1


def _is_torch(x):
    return type(x).__module__.startswith("torch")


def is_host(x):
    """True if ``x`` lives in host memory (NumPy, or a DLPack producer on the CPU)."""
    if isinstance(x, np.ndarray):
        return True
    dev = getattr(x, "__dlpack_device__", None)
    return dev is None or dev()[0] == _KDLCPU


def to_host(x, name, fn):
    """Return a NumPy view (or copy) of ``x``; error messages name ``fn`` and ``name``."""
    if isinstance(x, np.ndarray):
        return x
    if not (hasattr(x, "__dlpack__") or hasattr(x, "__array__")):
        raise TypeError(f"{fn}: {name}: expected an array (NumPy, or any object with __dlpack__), "
                        f"got {type(x).__name__}")
    if not is_host(x):
        raise TypeError(f"{fn}: {name}: expected host (CPU) memory for backend 'cpu', got an "
                        f"array on DLPack device {x.__dlpack_device__()}")
    if _is_torch(x):
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:
            if bfloat16 is None:
                raise TypeError(f"{fn}: {name}: bfloat16 needs the ml_dtypes package")
            return x.view(torch.int16).numpy().view(bfloat16)
        return x.numpy()
    try:
        return np.from_dlpack(x)
    except (BufferError, TypeError, RuntimeError, AttributeError):
        pass
    return np.asarray(x)


def to_numpy(x, name, fn):
    """A NumPy array of a small argument (document offsets) wherever it lives: host
    arrays as ``to_host`` gives them, GPU arrays copied to the host, lists and tuples
    converted. The plan needs such arguments on the host to lay the ring out."""
    if isinstance(x, (list, tuple)):
        return np.asarray(x)
    if is_host(x):
        return to_host(x, name, fn)
    if hasattr(x, "get"):  # CuPy
        return np.asarray(_transfers.to_host(x))
    if _is_torch(x):
        a = x.detach().cpu().numpy()
    else:
        a = np.asarray(x)  # JAX and other array-API producers copy to the host
    _transfers.copied_to_host(a.nbytes)
    return a


def to_device(x, name, fn, cupy):
    """Return a CuPy array for ``x``: itself, a zero-copy DLPack view of a GPU array (CuPy
    hands its current stream to the producer, so the data is ordered on it), or a copy of
    a host array on the current device."""
    if isinstance(x, cupy.ndarray):
        return x
    if is_host(x):
        return _transfers.to_device(cupy, to_host(x, name, fn))
    try:
        return cupy.from_dlpack(x)
    except Exception as e:
        raise TypeError(f"{fn}: {name}: expected a CUDA array CuPy can take through DLPack, "
                        f"got {type(x).__name__} ({e})") from None


def cupyx_pinned(cupy, nbytes):
    """A page-locked host buffer of ``nbytes`` (fast, asynchronous-capable copies)."""
    mem = cupy.cuda.alloc_pinned_memory(nbytes)
    return np.frombuffer(mem, dtype=np.uint8, count=nbytes)


def _is_cupy(x):
    return type(x).__module__.startswith("cupy")


def like(result, ref):
    """Return ``result`` (NumPy, or CuPy from the "cuda" backend) as the array type of
    ``ref``: NumPy in, NumPy out; CuPy in, CuPy out; torch in, torch out; any array-API
    array in, the same kind out (on the GPU through DLPack, without a copy)."""
    if _is_cupy(result):
        if _is_cupy(ref):
            return result
        if is_host(ref):
            return like(_transfers.to_host(result), ref)
        if _is_torch(ref):
            import torch

            return torch.from_dlpack(result)
        import array_api_compat

        return array_api_compat.array_namespace(ref).from_dlpack(result)
    if isinstance(ref, np.ndarray):
        return result
    if _is_torch(ref):
        import torch

        if bfloat16 is not None and result.dtype == bfloat16:
            return torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(result)
    import array_api_compat

    try:
        xp = array_api_compat.array_namespace(ref)
    except TypeError:
        return result
    return xp.asarray(result)
