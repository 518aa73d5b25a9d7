"""Arrays in, arrays out: DLPack and the array API, so callers keep their own array type.

``to_host`` turns anything with ``__dlpack__`` (or ``__array__``) into a NumPy view
without copying where the producer allows it; ``like`` turns a NumPy result back into
the caller's type (NumPy in, NumPy out; torch in, torch out; JAX in, JAX out) through
array-api-compat. bfloat16 has no DLPack path into NumPy, so it crosses as raw 16-bit
words and is reinterpreted on the other side (ml_dtypes provides NumPy's bfloat16).
"""

import numpy as np

__all__ = ["bfloat16", "to_host", "like", "is_host"]

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
        raise TypeError(f"{fn}: {name}: expected host (CPU) memory for backend 'numpy', got an "
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


def like(result, ref):
    """Return NumPy ``result`` as the array type of ``ref``."""
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
