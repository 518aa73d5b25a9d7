"""BLAS's ``sgemm`` callable from numba-compiled code: the CPU tile loops' GEMMs.

The compiled tile loops (``tiles``) run a whole row of tiles (a query tile against
every key tile it sees) without returning to Python, so their GEMMs must be called from
machine code: this module finds ``cblas_sgemm`` in the BLAS library NumPy itself loaded
(threadpoolctl lists the loaded libraries), registers its address with LLVM under one
fixed name, and declares that name to numba. The compiled code refers to the name, not
the address, so numba's disk cache stays valid from one process to the next (the address
moves with every load).

Calling BLAS directly also does what NumPy's ``matmul`` cannot: ``beta = 1`` accumulates a
GEMM into its output (the running output, dq, dk, dv) with no temporary and no extra
sweep.

Integer arguments are declared 64-bit. That is right for ILP64 builds (NumPy's wheels
ship OpenBLAS with 64-bit integers, symbols ``scipy_cblas_sgemm64_``) and also for LP64
ones: x86-64 and AArch64 pass integers in 64-bit registers and 8-byte stack slots, and a
32-bit callee reads the low half. A check GEMM (transposes, alpha, beta, leading
dimensions) against NumPy decides whether the binding is used; if no library passes it,
``sgemm`` is None and the CPU backend runs its NumPy tile loops (``available()`` says why).

Which BLAS (``BURSTMPI_BLAS``, read once, when this module is first imported): ``auto``
takes Intel's oneMKL when the environment has its runtime (``libmkl_rt``: pip's ``mkl``
wheel, conda, or a cluster module on the loader path), else NumPy's own; ``mkl`` insists
on oneMKL; ``numpy`` takes NumPy's. On an AVX-512 Xeon oneMKL's sgemm ran the forward's
tile GEMMs 5-19 % faster than NumPy's OpenBLAS on one core; it is the library PyTorch's CPU
attention calls. A oneMKL this module loads
itself is private to it: switched to its sequential layer (the tile threads each run
one-threaded GEMMs) and to conditional numerical reproducibility (CNR, branch ``AUTO``: the
best code for this CPU, bitwise the same run to run at a fixed thread count, which a
sequential library always has, whatever the arrays' alignment). Not its ``STRICT`` mode:
that only adds results independent of the thread count, and it cost 6 % of the forward
and 10 % of the backward (8K tokens, two tile threads). A oneMKL that NumPy already loaded
(a conda NumPy) is NumPy's: used as it is, one thread per tile thread like any BLAS.
"""

import ctypes
import os
import sys

import numpy as np

from ..._config import settings

__all__ = ["sgemm", "available", "describe", "short_name", "library", "ROW_MAJOR", "NO_TRANS", "TRANS"]

ROW_MAJOR, NO_TRANS, TRANS = 101, 111, 112  # CBLAS_ORDER / CBLAS_TRANSPOSE
SYMBOL = "burstmpi_cblas_sgemm"  # the name compiled code calls
# tried in this order in each library: ILP64 (NumPy's wheels; other OpenBLAS builds), then LP64
_CANDIDATES = ("scipy_cblas_sgemm64_", "cblas_sgemm64_", "scipy_cblas_sgemm", "cblas_sgemm")
# oneMKL's single dynamic runtime: 2025 and later, 2021-2024, unversioned (a module's link)
_MKL_NAMES = ("libmkl_rt.so.3", "libmkl_rt.so.2", "libmkl_rt.so")
_MKL_SEQUENTIAL = 1  # MKL_THREADING_SEQUENTIAL
_MKL_CBWR = 2  # MKL_CBWR_AUTO (the module docstring says why not | MKL_CBWR_STRICT)

sgemm = None  # numba ExternalFunction, once bound
library = None  # (path, symbol, what oneMKL it is and how it runs, or "") bound, or None
_why = "not looked for yet"


def _libraries():
    """Paths of the BLAS libraries loaded in this process, NumPy's own first (the wheels'
    ``numpy.libs``, or inside the package; otherwise, as in conda, threadpoolctl's order)."""
    from threadpoolctl import threadpool_info

    home = os.path.realpath(os.path.dirname(np.__file__))
    paths = list(dict.fromkeys(i["filepath"] for i in threadpool_info() if i.get("user_api") == "blas"))
    return sorted(paths, key=lambda p: not os.path.realpath(p).startswith((home + os.sep, home + ".libs" + os.sep)))


def _check(fn):
    """Does ``fn`` compute C = alpha op(A) op(B) + beta C like NumPy, for every transpose
    the tile loops use and leading dimensions wider than the rows?"""
    rng = np.random.default_rng(7)
    for ta, tb in ((NO_TRANS, TRANS), (NO_TRANS, NO_TRANS), (TRANS, NO_TRANS)):
        M, N, K = 5, 6, 7
        a = rng.standard_normal((K, M) if ta == TRANS else (M, K)).astype(np.float32)
        b = rng.standard_normal((N, K) if tb == TRANS else (K, N)).astype(np.float32)
        c = np.zeros((M, N + 3), np.float32)  # ldc wider than N: the rest must stay 0
        c[:, :N] = rng.standard_normal((M, N))
        want = c.copy()
        opa, opb = (a.T if ta == TRANS else a), (b.T if tb == TRANS else b)
        want[:, :N] = 0.5 * (opa.astype(np.float64) @ opb) + 2.0 * want[:, :N]
        fn(ROW_MAJOR, ta, tb, M, N, K, 0.5, a.ctypes.data, a.shape[1], b.ctypes.data, b.shape[1],
           2.0, c.ctypes.data, c.shape[1])
        if not np.allclose(c, want, rtol=1e-5, atol=1e-5):
            return False
    return True


def _mkl(loaded):
    """A oneMKL runtime (path, CDLL or None, how it runs): one already ``loaded`` (a conda
    NumPy's) as it is; else one from the environment's ``lib/`` or the loader path, which
    is then this module's own, made sequential and reproducible before its first call
    (both settings take only before one); None if there is none."""
    for path in loaded:
        if os.path.basename(path).startswith("libmkl_rt"):
            return path, None, "already loaded, used as it is"
    for path in [os.path.join(sys.prefix, "lib", n) for n in _MKL_NAMES] + list(_MKL_NAMES):
        if os.sep in path and not os.path.exists(path):
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        sequential = lib.MKL_Set_Threading_Layer(_MKL_SEQUENTIAL) == _MKL_SEQUENTIAL
        reproducible = lib.MKL_CBWR_Set(_MKL_CBWR) == 0  # MKL_CBWR_SUCCESS
        return path, lib, ", ".join(["sequential" if sequential else "threaded",
                                     "reproducible" if reproducible else "not in reproducible mode"])
    return None


def _mkl_version(lib):
    """"oneMKL 2026.2" from the library's own version string, for ``describe``."""
    buf = ctypes.create_string_buffer(256)
    try:
        lib.MKL_Get_Version_String(buf, len(buf))
    except AttributeError:
        return "oneMKL"
    words = buf.value.decode(errors="replace").split()  # "Intel(R) oneAPI Math Kernel Library Version 2026.2-Product Build ..."
    return "oneMKL " + words[words.index("Version") + 1].split("-")[0] if "Version" in words[:-1] else "oneMKL"


def _bind():
    global sgemm, library, _why
    i64 = ctypes.c_int64
    tried = []
    choice = settings().blas
    loaded = _libraries()
    libs = [] if choice == "mkl" else [(p, None, "") for p in loaded]
    mkl = None if choice == "numpy" else _mkl(loaded)
    if mkl is not None:
        libs = [mkl] + [x for x in libs if x[0] != mkl[0]]
    elif choice == "mkl":
        _why = (f"BURSTMPI_BLAS=mkl, but no oneMKL runtime was found ({', '.join(_MKL_NAMES)} in "
                f"{os.path.join(sys.prefix, 'lib')} or on the loader path): pip install mkl, or set BURSTMPI_BLAS=auto")
        return
    for path, lib, how in libs:
        try:
            lib = lib or ctypes.CDLL(path)
        except OSError as e:
            tried.append(f"{path}: {e}")
            continue
        for symbol in _CANDIDATES:
            fn = getattr(lib, symbol, None)
            if fn is None:
                continue
            fn.restype = None
            fn.argtypes = [ctypes.c_int] * 3 + [i64] * 3 + [ctypes.c_float, ctypes.c_size_t, i64,
                                                            ctypes.c_size_t, i64, ctypes.c_float, ctypes.c_size_t, i64]
            if not _check(fn):
                tried.append(f"{path}:{symbol} failed the check GEMM")
                continue
            import llvmlite.binding as llvm
            from numba import types

            llvm.add_symbol(SYMBOL, ctypes.cast(fn, ctypes.c_void_p).value)
            i32, i64t, f32, p = types.int32, types.int64, types.float32, types.uintp
            sgemm = types.ExternalFunction(SYMBOL, types.void(i32, i32, i32, i64t, i64t, i64t, f32, p, i64t,
                                                              p, i64t, f32, p, i64t))
            library = (path, symbol, f"{_mkl_version(lib)}: {how}" if how else "")
            _why = ""
            return
    _why = ("no cblas_sgemm found in the loaded BLAS libraries"
            + (f" ({'; '.join(tried)})" if tried else f" ({', '.join(_libraries()) or 'none listed by threadpoolctl'})"))


def describe():
    """Which ``sgemm`` the compiled loops call, for the bench's preamble."""
    if library is None:
        return f"no sgemm ({available()})"
    path, symbol, how = library
    return f"{symbol} ({os.path.basename(path)}{'; ' + how if how else ''})"


def short_name():
    """The bound BLAS in a word or two (the bench's backend line): "OpenBLAS", "oneMKL
    2026.2", or the library's file name."""
    if library is None:
        return "no"
    path, _, how = library
    base = os.path.basename(path).lower()
    if how.startswith("oneMKL"):
        return how.split(":")[0]
    if "openblas" in base:
        return "OpenBLAS"
    if "mkl" in base:
        return "oneMKL"
    return os.path.basename(path)


def available():
    """"" when ``sgemm`` is bound, else why not (one line)."""
    if sgemm is None and library is None and _why == "not looked for yet":
        _bind()
    return _why


available()
