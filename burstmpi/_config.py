"""burstmpi's settings: one object, read once, from keywords and ``BURSTMPI_*`` defaults.

``Settings.resolve(fn, **keywords)`` is what a plan, a KV cache or the bench reads when it
is built: each setting is the keyword where one is given, else its environment variable,
else the default, and nothing is read again later (a job's behaviour cannot change under a
running plan). ``FIELDS`` lists every setting: its variable, its keyword (None: the
environment only, for the settings that are process-wide or simulation aids), default and
what it expects; ``docs/guide/configuration.md`` has the table a test checks against it.
This is the one module that reads ``BURSTMPI_*``.

The kernel rate ``topology="auto"`` plans with (``Settings.kernel_rate``) is the one
setting whose default is not a constant: where ``kernel_tflops`` is not given, the rate
``burstmpi-gpucheck`` measured on this GPU model, kept in the rate file (``rates_path``),
else a nominal one.
"""

import datetime
import json
import math
import numbers
import os
import tempfile
import warnings
from dataclasses import dataclass, fields, replace
from typing import NamedTuple, Optional, Tuple

__all__ = ["Field", "FIELDS", "Settings", "settings", "check_setting", "backend_name", "NOMINAL_TFLOPS",
           "rates_path", "stored_rate", "store_rate"]


class Field(NamedTuple):
    name: str          # the attribute of ``Settings``
    variable: str      # the environment variable
    keyword: Optional[str]  # the keyword of BurstAttention and KVCache, or None: environment only
    default: object
    kind: str          # "choice", "int", "float", "bool", "pair", "timeout", "rate"
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
    Field("kernel_tflops", "BURSTMPI_KERNEL_TFLOPS", "kernel_tflops", None, "rate"),
)

# topology="auto"'s kernel rate (TFLOP/s a rank, forward and backward) where neither the
# setting nor a measurement gives one: for host arrays about this project's CPU backend on
# one core, for GPU arrays a nominal rate of data-centre GPUs' attention kernels. Both
# rings compute the same pairs, so the rate only sets how much compute hides the transfers.
NOMINAL_TFLOPS = {"host": 0.05, "cuda": 200.0}
RATES_BY = "burstmpi-gpucheck"  # who writes the rate file

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
    kernel_tflops: Optional[float] = None

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

    def kernel_rate(self, where, device=None):
        """``(forward, backward, source)``: the TFLOP/s of one rank's kernels that
        ``topology="auto"`` plans with, for arrays on ``where`` ("host" or "cuda"; ``device``:
        the GPU's name). ``kernel_tflops`` where it is set (source "setting"); else for a
        GPU the rates ``burstmpi-gpucheck`` measured on one of its model (``stored_rate``;
        "measured by burstmpi-gpucheck on DATE"); else ``NOMINAL_TFLOPS`` ("nominal").
        The rate file is read here, when a plan first asks: the plan keeps the answer."""
        if self.kernel_tflops is not None:
            return self.kernel_tflops, self.kernel_tflops, "setting"
        entry = stored_rate(device) if where == "cuda" and device is not None else None
        if entry is not None:
            return entry["fwd_tflops"], entry["bwd_tflops"], f"measured by {RATES_BY} on {entry['date']}"
        nominal = NOMINAL_TFLOPS[where]
        return nominal, nominal, "nominal"


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


def rates_path():
    """The rate file: ``$XDG_CACHE_HOME/burstmpi/rates.json``, or
    ``~/.cache/burstmpi/rates.json`` where that variable is unset or not an absolute path
    (the XDG base directory rule)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "burstmpi", "rates.json")


def _read_rates(path):
    """The rate file's entries ({device name: entry}); {} where there is none. A file that
    is not one (not JSON, not an object) is ignored with a warning saying so: the job then
    plans with the nominal rate, which ``last_stats.rate_source`` says."""
    try:
        with open(path) as f:
            got = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"{path}: ignored, not a readable rate file of {RATES_BY} ({e})", RuntimeWarning, stacklevel=4)
        return {}
    if not isinstance(got, dict):
        warnings.warn(f"{path}: ignored, expected a JSON object {{device name: rates}}, got {type(got).__name__}",
                      RuntimeWarning, stacklevel=4)
        return {}
    return got


def _rate_ok(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < math.inf


def stored_rate(device, path=None):
    """The entry the rate file (``path``, default ``rates_path()``) holds for the GPU named
    ``device``: ``{"fwd_tflops", "bwd_tflops", "date", ...}``, or None. An entry without
    two positive rates and a date is ignored with a warning."""
    path = rates_path() if path is None else path
    entry = _read_rates(path).get(device)
    if entry is None:
        return None
    if not (isinstance(entry, dict) and _rate_ok(entry.get("fwd_tflops")) and _rate_ok(entry.get("bwd_tflops"))
            and isinstance(entry.get("date"), str)):
        warnings.warn(f"{path}: the entry of {device!r} is ignored: expected positive fwd_tflops and bwd_tflops "
                      f"and a date, got {entry!r}", RuntimeWarning, stacklevel=3)
        return None
    return entry


def store_rate(device, fwd_tflops, bwd_tflops, path=None, **about):
    """Record the rates measured on the GPU named ``device`` in the rate file (``path``,
    default ``rates_path()``), with today's date and ``about`` (what was timed), keeping
    the other devices' entries. Written to a temporary file and renamed, so a reader never
    sees half a file. Returns the path."""
    if not (_rate_ok(fwd_tflops) and _rate_ok(bwd_tflops)):
        raise ValueError(f"store_rate: expected two positive rates in TFLOP/s, got {fwd_tflops!r}, {bwd_tflops!r}")
    path = rates_path() if path is None else path
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    rates = _read_rates(path)
    rates[device] = dict(fwd_tflops=float(fwd_tflops), bwd_tflops=float(bwd_tflops),
                         date=datetime.date.today().isoformat(), by=RATES_BY, **about)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".rates-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(rates, f, indent=1, sort_keys=True)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return path


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
    if f.kind == "rate":
        if text:
            value = _number(float, value, where, -math.inf)  # a number; its range is checked below
        ok = not isinstance(value, bool) and isinstance(value, numbers.Real) and 0 < float(value) < math.inf
        if not ok:
            raise ValueError(f"{where}: expected a finite number of TFLOP/s > 0, got {got}")
        return float(value)
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
