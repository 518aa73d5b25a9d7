"""Which BLAS the compiled tile loops call (``BURSTMPI_BLAS``), and that the choice keeps
results within the flash-attn rule and bitwise reproducible.

The library is bound once per process (``cpu.blas``), so each setting runs in its own
interpreter; those run once, not on every rank of the MPI rerun."""

import ctypes
import glob
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from burstmpi import reference as ref

from conftest import NRANKS, check_close

pytestmark = pytest.mark.skipif(NRANKS > 1, reason="spawns its own interpreters; once is enough")


def _have_mkl():
    """Can this environment load a oneMKL runtime under the names ``cpu.blas`` looks for?"""
    from burstmpi._backends.cpu.blas import _MKL_NAMES

    if glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")):
        return True
    for name in _MKL_NAMES:
        try:
            ctypes.CDLL(name)
            return True
        except OSError:
            pass
    return False


HAVE_MKL = _have_mkl()

# Runs in a fresh interpreter: which sgemm was bound, then (with an output path) a causal
# GQA forward and backward at 2 tiles a side, saved for the parent to check.
_CHILD = r"""
import json, sys
import numpy as np
from burstmpi._backends.cpu import blas as cpu_blas
info = {"why": cpu_blas.available(), "library": list(cpu_blas.library or ())}
if len(sys.argv) > 1 and not info["why"]:
    import burstmpi
    from burstmpi import reference as ref
    from burstmpi._backends.cpu import tiles as cpu_tiles
    info["kernels"] = cpu_tiles.describe()
    q, k, v, do = ref.random_problem(1, 1000, 4, 2, 64, dtype=np.float32, seed=5)
    plan = burstmpi.BurstAttention(causal=True)
    out, lse = plan.forward(q, k, v)
    dq, dk, dv = plan.backward(do, q, k, v, out, lse)
    np.savez(sys.argv[1], out=out, lse=lse, dq=dq, dk=dk, dv=dv)
print(json.dumps(info))
"""


def _env(**settings):
    """This environment without an MPI launcher's variables (the child is a singleton), plus
    ``settings``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    env.update(settings)
    return env


def _child(blas, out=None):
    env = _env(BURSTMPI_BLAS=blas, BURSTMPI_TILE_Q="512", BURSTMPI_TILE_K="512", BURSTMPI_THREADS="2")
    res = subprocess.run([sys.executable, "-c", _CHILD] + ([str(out)] if out else []), env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_numpy_setting_binds_numpys_own_blas():
    from threadpoolctl import threadpool_info

    info = _child("numpy")
    assert info["why"] == "", info
    loaded = {i["filepath"] for i in threadpool_info() if i.get("user_api") == "blas"}
    assert info["library"][0] in loaded, (info, loaded)


def test_auto_takes_mkl_when_present():
    auto, numpy = _child("auto"), _child("numpy")
    assert auto["why"] == "", auto
    if HAVE_MKL:
        path, symbol, how = auto["library"]
        assert os.path.basename(path).startswith("libmkl_rt") and symbol.startswith("cblas_sgemm"), auto
        assert how.startswith("oneMKL") and ("sequential, reproducible" in how or "already loaded" in how), auto
    else:
        assert auto["library"] == numpy["library"], (auto, numpy)


@pytest.mark.skipif(HAVE_MKL, reason="this environment has oneMKL")
def test_mkl_setting_without_mkl_is_a_clear_error():
    info = _child("mkl")
    assert info["why"].startswith("BURSTMPI_BLAS=mkl, but no oneMKL runtime was found") and \
        "pip install mkl, or set BURSTMPI_BLAS=auto" in info["why"], info
    env = _env(BURSTMPI_BLAS="mkl")
    code = ("import numpy as np, burstmpi\nq = np.zeros((1, 4, 2, 8), np.float32)\n"
            "try:\n    burstmpi.attention(q, q, q)\nexcept RuntimeError as e:\n    print(e)")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "the compiled CPU tile loops are unavailable" in res.stdout and "BURSTMPI_BLAS=mkl" in res.stdout, \
        res.stdout + res.stderr


@pytest.mark.skipif(not HAVE_MKL, reason="needs oneMKL (pip install mkl)")
def test_mkl_results_within_the_rule_and_reproducible(tmp_path):
    """oneMKL's and NumPy's sgemm both within the flash-attn rule against float64, and
    oneMKL's bitwise the same from one process to the next."""
    runs = {}
    for name, blas in (("mkl", "mkl"), ("mkl again", "mkl"), ("numpy", "numpy")):
        info = _child(blas, tmp_path / f"{name}.npz")
        assert ("libmkl_rt" in info["kernels"]) == (blas == "mkl"), info
        runs[name] = np.load(tmp_path / f"{name}.npz")
    q, k, v, do = ref.random_problem(1, 1000, 4, 2, 64, dtype=np.float32, seed=5)
    o64, l64 = ref.forward(q, k, v, causal=True)
    op, lp = ref.forward(q, k, v, causal=True, precision="plain")
    exact = dict(zip(("dq", "dk", "dv"), ref.backward(do, q, k, v, causal=True)))
    plain = dict(zip(("dq", "dk", "dv"), ref.backward(do, q, k, v, causal=True, precision="plain")))
    for name in ("mkl", "numpy"):
        r = runs[name]
        check_close(f"{name} out", r["out"], o64, op, "float32")
        check_close(f"{name} lse", r["lse"], l64, lp, "float32")
        for g in ("dq", "dk", "dv"):
            check_close(f"{name} {g}", r[g], exact[g], plain[g], "float32")
    for key in ("out", "lse", "dq", "dk", "dv"):
        assert np.array_equal(runs["mkl"][key].view(np.uint8), runs["mkl again"][key].view(np.uint8)), key


def test_blas_setting_names_the_variable(monkeypatch):
    from burstmpi._config import settings

    monkeypatch.setenv("BURSTMPI_BLAS", "openblas")
    with pytest.raises(ValueError, match=r"BURSTMPI_BLAS: expected one of \['auto', 'mkl', 'numpy'\], got 'openblas'"):
        settings()
