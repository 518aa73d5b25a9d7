"""burstmpi's settings: one object, read once, from keywords and ``BURSTMPI_*`` defaults.

``Settings.resolve(fn, **keywords)`` is what a plan, a KV cache or the bench reads when it
is built: each setting is the keyword where one is given, else its environment variable,
else the default, and nothing is read again later (a job's behaviour cannot change under a
running plan). ``FIELDS`` lists every setting: its variable, its keyword (None: the
environment only, for the settings that are process-wide or simulation aids), default and
what it expects; ``docs/guide/configuration.md`` has the table a test checks against it.
This is the one module that reads ``BURSTMPI_*``.
"""

import math
import numbers
import os
import warnings
from dataclasses import dataclass, fields, replace
from typing import NamedTuple, Optional, Tuple

__all__ = ["Field", "FIELDS", "Settings", "settings", "check_setting", "backend_name"]


class Field(NamedTuple):
    name: str          # the attribute of ``Settings``
    variable: str      # the environment variable
    keyword: Optional[str]  # the keyword of BurstAttention and KVCache, or None: environment only
    default: object
    kind: str          # "choice", "int", "float", "bool", "pair", "timeout"
    spec: object = None  # a choice's choices; a number's minimum


FIELDS = (
    Field("backend", "BURSTMPI_BACKEND", "backend", "auto", "choice", ("auto", "cpu", "cuda")),
    Field("tile_q", "BURSTMPI_TILE_Q", "tile_q", 512, "int", 1),
    Field("tile_k", "BURSTMPI_TILE_K", "tile_k", 512, "int", 1),
    Field("cpu_kernels", "BURSTMPI_CPU_KERNELS", "cpu_kernels", "auto", "choice", ("auto", "numba", "numpy")),
    Field("cpu_gemm", "BURSTMPI_CPU_GEMM", "cpu_gemm", "auto", "choice", ("auto", "blas", "packed")),
    # Which BLAS the compiled loops bind to is fixed when they are first compiled: per process.
    Field("blas", "BURSTMPI_BLAS", None, "auto", "choice", ("auto", "mkl", "numpy")),
    Field("threads", "BURSTMPI_THREADS", "threads", 0, "int", 0),
    Field("check", "BURSTMPI_CHECK", "check", True, "bool"),
    Field("cuda_aware_mpi", "BURSTMPI_CUDA_AWARE_MPI", "cuda_aware_mpi", False, "bool"),
    Field("timeout", "BURSTMPI_TIMEOUT", "timeout", 300.0, "timeout", 1e-3),
    Field("ranks_per_node", "BURSTMPI_RANKS_PER_NODE", "ranks_per_node", 0, "int", 0),
    # A simulation aid (slowed host transfers between fake nodes): environment only.
    Field("internode_gbps", "BURSTMPI_INTERNODE_GBPS", None, 0.0, "float", 0),
    Field("link_gbps", "BURSTMPI_LINK_GBPS", "link_gbps", None, "pair"),
)

_BY_NAME = {f.name: f for f in FIELDS}


@dataclass(frozen=True)
class Settings:
    """Every setting of one plan, cache or bench run (``FIELDS``); immutable."""

    backend: str = "auto"
    tile_q: int = 512
    tile_k: int = 512
    cpu_kernels: str = "auto"
    cpu_gemm: str = "auto"
    blas: str = "auto"
    threads: int = 0
    check: bool = True
    cuda_aware_mpi: bool = False
    timeout: float = 300.0
    ranks_per_node: int = 0
    internode_gbps: float = 0.0
    link_gbps: Optional[Tuple[float, float]] = None

    @classmethod
    def from_env(cls):
        """Every setting from its environment variable, or its default."""
        return cls(**{f.name: _from_env(f) for f in FIELDS})

    @classmethod
    def resolve(cls, fn, **keywords):
        """The settings of a call to ``fn``: each keyword that is not None (checked, its
        errors naming ``fn`` and the keyword), the environment for the rest. Only settings
        with a keyword in ``FIELDS`` are accepted."""
        given = {}
        for name, value in keywords.items():
            f = _BY_NAME.get(name)
            if f is None or f.keyword is None:
                raise TypeError(f"{fn}: unexpected setting {name!r}")
            if value is not None:
                given[name] = _check(f, value, f"{fn}: {f.keyword}")
        return replace(cls.from_env(), **given)


def settings():
    """The settings the environment gives now (``Settings.from_env``)."""
    return Settings.from_env()


def check_setting(fn, name, value):
    """``value`` of the keyword ``name`` as ``Settings`` holds it, or the error naming ``fn``
    and the keyword (what ``Settings.resolve`` raises; the functional calls check their own
    ``timeout`` with it)."""
    return _check(_BY_NAME[name], value, f"{fn}: {name}")


def backend_name(value, where):
    """``value``, with the CPU backend's old name "numpy" taken as "cpu" and a warning
    naming ``where`` (the keyword or variable that said it)."""
    if value == "numpy":
        warnings.warn(f"{where}: 'numpy' is the CPU backend's old name; say 'cpu' (it runs numba's compiled "
                      "tiles over BLAS, or NumPy where numba is missing)", FutureWarning, stacklevel=5)
        return "cpu"
    return value


def _from_env(f):
    raw = os.environ.get(f.variable, "")
    if f.name == "timeout" and not raw and os.environ.get("BURSTMPI_NCCL_TIMEOUT"):
        warnings.warn("BURSTMPI_NCCL_TIMEOUT is replaced by BURSTMPI_TIMEOUT, which bounds every wait on other "
                      "ranks (not only NCCL's); set that instead", FutureWarning, stacklevel=4)
        return _check(f, os.environ["BURSTMPI_NCCL_TIMEOUT"], "environment variable BURSTMPI_NCCL_TIMEOUT", True)
    if raw == "":
        return f.default
    return _check(f, raw, f"environment variable {f.variable}", True)


def _check(f, value, where, text=False):
    """``value`` (a keyword's, or an environment variable's ``text``) as setting ``f``
    expects it, or ValueError/TypeError saying ``where``, what it expected and what it got."""
    got = repr(value)
    if f.name == "backend":
        value = backend_name(value, where)
    if f.kind == "choice":
        if value not in f.spec:
            raise ValueError(f"{where}: expected one of {list(f.spec)}, got {got}")
        return value
    if f.kind == "bool":
        if text:
            value = _number(int, value, where, 0)
            return value != 0
        if not isinstance(value, bool):
            raise TypeError(f"{where}: expected True or False, got {got}")
        return value
    if f.kind == "pair":
        if text:
            try:
                value = tuple(float(x) for x in value.split(","))
            except ValueError:
                value = ()
        ok = (isinstance(value, (tuple, list)) and len(value) == 2
              and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf for x in value))
        if not ok:
            raise ValueError(f"{where}: expected two positive numbers (GB/s inside a node, between nodes), got {got}")
        return tuple(float(x) for x in value)
    if f.kind == "timeout" and not text:
        ok = (not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 < float(value) < math.inf)
        if not ok:
            raise ValueError(f"{where}: expected a finite number of seconds > 0 (or None: {f.variable}, default "
                             f"{f.default:.0f}), got {got}")
        return float(value)
    kind = int if f.kind == "int" else float
    return kind(_number(kind, value, where, f.spec))


def _number(kind, value, where, minimum):
    what = "an integer" if kind is int else "a finite number"
    if isinstance(value, str):
        try:
            value = kind(value)
        except ValueError:
            raise ValueError(f"{where}: expected {what}, got {value!r}") from None
    elif isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise TypeError(f"{where}: expected {what}, got {value!r}")
    if not (minimum <= value < math.inf):
        raise ValueError(f"{where}: expected {what} >= {minimum}, got {value!r}")
    return value


assert [f.name for f in FIELDS] == [f.name for f in fields(Settings)]
