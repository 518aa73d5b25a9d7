"""What every mode of burstmpi-bench shares: sizes, devices, timing, the table, the footer,
JSON, JUnit, regression mode and the memory each row may take.

A mode (``burstmpi.bench.attention``: the ring's forward and backward; ``burstmpi.bench.
decode``: decode over a sharded KV cache) supplies its columns, its configurations and a
function that runs one of them and returns its row; ``sweep`` does the rest the same way for
every mode: the preamble (versions, parameters, threads, the CPU and its vector flags, each
rank's host and device), one line per row, the footer, the JSON rows (``-J``), JUnit XML
(``--junit``) and the comparison with a baseline (``--baseline``; these four in
``burstmpi.bench.results``), and the exit status: 1 if any value was wrong, 4 if a row was
refused because it does not fit in memory (``burstmpi.bench.memory``), 3 if a configuration
regressed, else 0; SIGINT or SIGTERM keep the rows done and exit 130 or 143
(``burstmpi.bench.interrupt``). ``legend`` gives a mode's columns, one line each, for
``--legend``.

Every wait of the bench on other ranks has the watchdog's deadline (``--timeout``;
``burstmpi._transport.watchdog``): its communicator is ``watchdog.guarded`` (the pickled
collectives), its barriers complete within ``deadline(comm)``, and the few blocking calls
that have no deadline of their own (splitting a communicator) run inside
``guard``. On expiry the job ends with exit 75.
"""

import contextlib
import json
import os
import socket
import sys
import time

import click
import numpy as np
from mpi4py import MPI

from .. import __version__
from .._backends.cpu.threads import cores, node_masks, shares_cores
from .._config import settings
from .._interop import bfloat16
from .._sizes import parse_bytes, parse_size
from .._transport import watchdog
from .._transport.mpi_library import library_version
from .._transport.nodes import nodes
from . import regress, results
from .results import say
from .binding import bind_ranks
from .interrupt import Interrupts
from .memory import Budget, Refused, peak_bytes, reset_peak

__all__ = ["DTYPES", "TOLERANCE", "REDUCE", "parse_size", "parse_window", "parse_counts", "comma_list", "choices", "cores",
           "say", "seqlens", "np_dtype", "cpu_line", "Device", "resolve_device", "timed", "barrier", "idle_barrier",
           "wall", "load_baseline", "sweep", "budget_for", "reads_in_place", "backend_line", "legend", "parse_bytes",
           "deadline", "guard"]

DTYPES = ["float16", "bfloat16", "float32", "float64"]


# |ours - float64| > atol + rtol |float64| counts as wrong (a regression check, not a
# precision study: the test suite holds the tight flash-attn style bounds).
TOLERANCE = {"float64": (1e-10, 1e-10), "float32": (1e-4, 1e-4),
             "float16": (1e-2, 1e-2), "bfloat16": (5e-2, 5e-2)}


REDUCE = {0: ("rank 0", lambda v: v[0]), 1: ("average", np.mean), 2: ("minimum", np.min),
          3: ("maximum", np.max)}


def comma_list(value, item, what):
    """``a,b,c`` -> [item(a), item(b), item(c)], in order, each once; ``item`` returns None
    (or raises ValueError) for a bad one, and then the whole option is refused, naming
    ``what`` it expected."""
    try:
        items = [item(x.strip()) for x in str(value).split(",") if x.strip()]
    except ValueError:
        items = [None]
    if not items or None in items:
        raise click.BadParameter(f"expected {what} separated by commas, got {value!r}")
    return list(dict.fromkeys(items))


def parse_counts(ctx, param, value):
    """``1,2,4`` -> [1, 2, 4]: positive integers, in order, each once."""
    return comma_list(value, lambda x: int(x) if int(x) >= 1 else None, "positive integers")


def parse_window(ctx, param, value):
    if value is None:
        return None
    try:
        left, right = (int(x) for x in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected LEFT,RIGHT (e.g. 256,0), got {value!r}")
    return (left, right)


def choices(value, allowed):
    return list(allowed) if value == "all" else [value]


def deadline(comm):
    """Seconds a wait on the other ranks of ``comm`` may last: the bench's ``--timeout`` on
    its communicator (``watchdog.guarded`` keeps it there), else ``BURSTMPI_TIMEOUT``."""
    return watchdog.timeout_of(comm)


def guard(comm, what):
    """A blocking call on ``comm`` without a deadline of its own (a communicator split) run
    under the watchdog's (``watchdog.guard``); none alone (no one to wait for)."""
    if comm.Get_size() == 1:
        return contextlib.nullcontext()
    return watchdog.guard(f"burstmpi-bench: {what}", deadline(comm))


def threads_note():
    """The preamble's word on MPI's thread level below MPI_THREAD_MULTIPLE, where the
    watchdog's monitor and the signal thread may not call MPI: the main thread ends the job
    (``watchdog.on_callers_thread``). Empty at MULTIPLE."""
    level = MPI.Query_thread()
    if level >= MPI.THREAD_MULTIPLE:
        return ""
    return (f"; MPI at {watchdog.identity.level_name(level)}: the main thread ends the job, at its next wait "
            "on other ranks")


def blas_threads(comm):
    """Cap BLAS threads so the ranks on one node do not oversubscribe its cores.

    OpenBLAS starts one thread per core in every rank; four ranks on four cores would
    then run sixteen threads and go several times slower. Returns a threadpoolctl
    limiter (keep it alive for the run) and a line for the preamble.
    """
    from threadpoolctl import threadpool_info, threadpool_limits

    with guard(comm, "the split of the ranks by node (BLAS threads)"):
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    ranks_here = local.Get_size()
    local.Free()
    ncores = cores()
    share = max(1, ncores // ranks_here)
    now = max([p.get("num_threads", 1) for p in threadpool_info() if p.get("user_api") == "blas"],
              default=1)
    limiter = threadpool_limits(limits=share, user_api="blas") if now > share else None
    return limiter, (f"#  BLAS threads per rank: {min(now, share)} ({ncores} cores, "
                     f"{ranks_here} ranks on rank 0's node); torch, when asked for, gets {ncores}")


def _cpu_ops():
    """The CPU backend's tile loops as configured (``cpu.numpy_tiles`` or ``cpu.tiles``) and its
    packed path (``cpu.packed`` or None), or why they are unavailable (a string)."""
    from .._backends.cpu import CpuBackend

    try:
        backend = CpuBackend(kernels=settings().cpu_kernels, gemm=settings().cpu_gemm)
    except RuntimeError as e:
        return str(e)
    return backend.ops, backend.packed


def cpu_kernels_line(comm):
    """The CPU backend's tile loops (compiled, and over which sgemm, or NumPy's), its threads
    per rank, and what their first use cost (compiling, or loading from numba's disk cache)."""
    from .._backends.cpu.threads import threads_per_rank

    with guard(comm, "the split of the ranks by node (tile threads)"):
        threads = threads_per_rank(comm, settings().threads)
    ops = _cpu_ops()
    if isinstance(ops, str):
        return f"#  CPU kernels: unavailable ({ops})"
    ops, packed = ops
    how = ops.describe() if hasattr(ops, "describe") else ("NumPy tile loops (BURSTMPI_CPU_KERNELS=numpy, or the "
                                                           "compiled ones unavailable: numba or BLAS's sgemm missing)")
    if packed is not None:
        how += f"; float32 blocks on {packed.describe()}"
    return (f"#  CPU kernels: {how}; {threads} tile thread(s) per rank, each with 1-threaded BLAS "
            f"(BURSTMPI_THREADS to change)")


def seqlens(minseq, maxseq, factor):
    out, n = [], minseq
    while n <= maxseq:
        out.append(n)
        if factor <= 1:
            break
        n *= factor
    return out


def np_dtype(name):
    return bfloat16 if name == "bfloat16" else np.dtype(name)


def cpu_line():
    """The CPU's model and vector extensions: NumPy's exp and every CPU figure depend on them."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ["avx", "avx2", "fma", "avx512f", "avx512_bf16", "amx_tile"]
    have = [f for f in wanted if f in flags]
    return (f"#  CPU: {model}, {os.cpu_count()} cores visible; vector flags: {' '.join(have) or 'none found'}"
            + ("" if "avx512f" in flags else " (no AVX-512)"))


def peak_mb():
    """The resident set's peak since the row began (``memory.reset_peak``), in MB."""
    return peak_bytes() / 1e6


class Device:
    """Where the bench's arrays live: the host (NumPy) or this rank's GPU (CuPy)."""

    def __init__(self, backend, cupy=None):
        self.backend, self.cupy = backend, cupy
        self.xp = cupy if cupy is not None else np
        self.idle = False  # ranks take turns on cores: the bench's barriers sleep (``sweep``)

    def put(self, x):
        return x if self.cupy is None else self.cupy.asarray(x)

    @staticmethod
    def host(x):
        get = getattr(x, "get", None)
        return np.asarray(get() if get is not None else x)

    def sync(self):
        if self.cupy is not None:
            self.cupy.cuda.get_current_stream().synchronize()

    def peak_mb(self):
        """Host: the resident set's peak since the row began (``memory.reset_peak``). GPU:
        bytes CuPy's pool holds."""
        if self.cupy is None:
            return peak_mb()
        return self.cupy.get_default_memory_pool().total_bytes() / 1e6

    def describe(self):
        if self.cupy is None:
            return "cpu"
        dev = self.cupy.cuda.Device()
        name = self.cupy.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
        return f"cuda:{dev.id} {name}"


def backend_line(comm, dev, transport="auto"):
    """What runs the local work, in a few words: ``cpu (numba tiles over OpenBLAS sgemm)``,
    ``cpu (NumPy tile loops over NumPy's BLAS)``, ``cuda (burstmpi kernels, NCCL)``.
    Collective on GPUs: the transport is chosen from every rank's facts, as the runtime
    chooses it (NCCL where every rank has it and no two ranks share a GPU)."""
    if dev.backend == "cuda":
        from .._transport import nccl

        facts = comm.allgather((socket.gethostname(), dev.cupy.cuda.Device().id, nccl.available()))
        shared = len({(host, gpu) for host, gpu, _ in facts}) < len(facts)
        try:
            ring = nccl.choose_transport("burstmpi-bench", transport if transport in ("nccl", "mpi") else "auto",
                                         all(ok for *_, ok in facts), shared)
        except (ValueError, NotImplementedError) as e:  # the first row raises it, on every rank
            ring = f"{transport}: {e}"
        return f"cuda (burstmpi kernels, {ring.upper() if ring in ('nccl', 'mpi') else ring})"
    ops = _cpu_ops()
    if isinstance(ops, str):
        return "cpu (unavailable: see the CPU kernels line)"
    if not hasattr(ops[0], "describe"):
        return "cpu (NumPy tile loops over NumPy's BLAS)"
    from .._backends.cpu import blas as cpu_blas

    packed = "burstmpi's packed micro-kernel and " if ops[1] is not None else ""
    return f"cpu (numba tiles over {packed}{cpu_blas.short_name()} sgemm)"


# The unit of a column, from the last word of its header's second line.
UNITS = {"ms": "ms", "(ms)": "ms", "MB/rk": "MB", "MB": "MB", "MB/call": "MB", "/call": "KB", "GB/s": "GB/s",
         "(TF/s)": "TF/s", "TF/s": "TF/s", "all": "TF/s", "(tok)": "tokens"}


def legend(columns, definitions):
    """``--legend``: one line per column: its header, its unit and what it is."""
    lines = [f"# {'column':18s} {'unit':7s} definition"]
    for key, head, unit, _, _ in columns:
        name = head if unit.startswith("(") or not unit else f"{head} {unit}"
        lines.append(f"# {name:18s} {UNITS.get(unit.split()[-1] if unit else '', ''):7s} {definitions[key]}")
    return lines


def reads_in_place(comm, dev, budget, transport="auto"):
    """Will the ring's host packets live in a shared window (``burstmpi._transport.shm``), as the
    runtime's ``transport="auto"`` (or ``"shm"``) picks: host arrays, ranks all on one node?"""
    return dev.backend == "cpu" and comm.Get_size() > 1 and transport in ("auto", "shm") \
        and budget.node_size == comm.Get_size()


def budget_for(comm, dev, limit):
    """The job's memory pools for ``memory.Budget`` (collective): each node's host memory,
    and each rank's GPU when the arrays live there. Its waits have ``deadline(comm)``."""
    if dev.cupy is None:
        return Budget(comm, limit)
    cp = dev.cupy
    return Budget(comm, limit, device_free=lambda: cp.cuda.runtime.memGetInfo()[0], device_id=cp.cuda.Device().id)


def resolve_device(comm, backend):
    """Resolve --backend on every rank alike: "cuda" only if every rank has a GPU."""
    cupy = None
    if backend in ("auto", "cuda"):
        try:
            from .._gpu.device import import_cupy

            cupy = import_cupy("burstmpi-bench")
        except (NotImplementedError, RuntimeError) as e:
            if backend == "cuda":
                raise click.UsageError(str(e))
    everyone = comm.allreduce(cupy is not None, op=MPI.LAND)
    if backend == "cuda" and not everyone:
        raise click.UsageError("--backend cuda: some rank has no usable GPU")
    return Device("cuda", cupy) if everyone else Device("cpu")


def timed(comm, fn, dev=None):
    if dev is not None:
        dev.sync()
    barrier(comm, getattr(dev, "idle", False))
    t0 = time.perf_counter()
    result = fn()
    if dev is not None:
        dev.sync()
    return time.perf_counter() - t0, result


def barrier(comm, idle=False):
    """MPI_Barrier within ``deadline(comm)``, and with ``idle`` one that sleeps between tests
    (``watchdog.complete``). MPI_Barrier busy-polls: where ranks take turns on a core, a rank
    done early would take half of its core from the rank still working there, and time that
    rank's phase slower."""
    # Nonblocking everywhere (``idle`` may differ by node), and it names who did not come.
    watchdog.barrier(comm, deadline(comm), "a barrier of burstmpi-bench", idle)


def idle_barrier(comm):
    """A barrier that sleeps: MPI_Barrier busy-polls, and would steal cores from torch."""
    barrier(comm, idle=True)


def wall(fn, sync=lambda: None):
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def progress(comm, done, total, row, secs, elapsed, work_done):
    """One progress line on rank 0's stderr: rewritten in place on a terminal, a plain
    line otherwise (batch logs stay readable). ``work_done`` is the fraction of the
    sweep's work finished (FLOPs: lengths grow quadratically in cost), so the estimate of
    the time left weighs configurations by their work, not by their count."""
    if comm.Get_rank() != 0:
        return
    eta = elapsed / work_done * (1.0 - work_done) if work_done > 0 else float("nan")
    what = " ".join(f"{k} {row[k]}" for k in ("seqlen", "tokens", "dtype", "causal", "layout", "bwd_mode")
                    if k in row)
    text = f"# [{done}/{total}] {what}: {secs:.1f} s, elapsed {elapsed:.0f} s, eta {eta:.0f} s"
    if sys.stderr.isatty():
        sys.stderr.write("\r" + text + ("\n" if done == total else ""))
    else:
        sys.stderr.write(text + "\n")
    sys.stderr.flush()


def format_row(columns, row):
    cells = []
    for key, _, _, width, fmt in columns:
        value = row.get(key)
        if isinstance(value, bool):
            value = int(value)
        cells.append(f"{'-':>{width}}" if value is None else f"{value:>{width}{fmt}}")
    return "  " + " ".join(cells)


def header_lines(columns):
    first = " ".join(f"{h:>{w}}" for _, h, _, w, _ in columns)
    second = " ".join(f"{u:>{w}}" for _, _, u, w, _ in columns)
    return ["#" + " " + first[1:], "#" + " " + second[1:]]


def load_baseline(comm, baseline):
    """The rows of a ``--baseline`` file on every rank, or the same error everywhere.

    Rank 0 reads it and every rank gets the rows: the file need not be on a shared file
    system, and a missing one cannot leave ranks waiting."""
    if baseline is None:
        return None
    loaded = None
    if comm.Get_rank() == 0:
        try:
            loaded = regress.load_rows(baseline)
        except (ValueError, OSError, json.JSONDecodeError) as e:
            loaded = str(e)
    loaded = comm.bcast(loaded, root=0)
    if isinstance(loaded, str):
        raise click.BadParameter(loaded, param_hint="--baseline")
    return loaded


def sweep(comm, *, bind="auto", torch=False, **kw):
    """Run ``run_one(cfg)`` for every configuration and print the table, nccl-tests style;
    then the footer, regression verdicts, JSON and JUnit; exit with the bench's status.
    ``bind``, ``torch``: where the ranks run meanwhile (``binding.bind_ranks``; the
    process's own placement comes back afterwards); the rest: ``_sweep``'s."""
    limiter, threads_line = blas_threads(comm)  # noqa: F841 (kept alive for the run)
    with guard(comm, "the ranks' placement (their cores, by node)"):
        bind_line, placement = bind_ranks(comm, bind, torch)  # after: the BLAS line counts the node's cores
        kw["dev"].idle = shares_cores(node_masks(comm)[0])  # as placed now
    if kw["dev"].idle:
        bind_line += "; ranks share cores, so the bench's barriers sleep instead of spinning"
    try:
        _sweep(comm, placed=(threads_line, bind_line), **kw)
    finally:
        if placement is not None:
            os.sched_setaffinity(0, placement)


def _sweep(comm, *, mode, params, dev, columns, configs, run_one, work, footer, config_keys, metric,
           check, show_progress, placed, json_path=None, junit_path=None, baseline=None, tolerance=0.1,
           transport="auto"):
    """``sweep`` with the ranks placed (``placed``: the preamble's lines on BLAS threads and binding).

    ``work``: each configuration's relative cost (for the progress line's time left);
    ``footer(rows)``: the mode's summary lines; ``metric``: the row key (milliseconds) that
    regression mode compares; ``config_keys``: the keys that match rows with a baseline's.
    """
    P = comm.Get_size()
    base_rows = load_baseline(comm, baseline)
    who = comm.gather((socket.gethostname(), os.getpid(), dev.describe()), root=0)
    where = nodes(comm, deadline(comm))  # collective
    cfg = settings()
    how = "BURSTMPI_RANKS_PER_NODE" if cfg.ranks_per_node else "MPI's shared-memory split"
    if cfg.internode_gbps and where.count > 1:
        how += f"; links between nodes slowed to {cfg.internode_gbps:g} GB/s (--internode-gbps, a simulation)"
    say(comm, f"# burstmpi-bench {__version__} ({mode}): backend {backend_line(comm, dev, transport)}, {P} rank(s), "
              f"{library_version()}",
        "#  " + " ".join(f"{k} {v}" for k, v in params.items()),
        *placed, *([cpu_kernels_line(comm)] if dev.backend == "cpu" else []), cpu_line(),
        f"#  Nodes: {where.describe()} ({how})",
        *([f"#  Rank {r:3d} Pid {pid:7d} on {host} device {d}" for r, (host, pid, d) in enumerate(who)]
          if who else []),
        f"#  Watchdog: a wait on other ranks longer than {deadline(comm):g} s ends the job with exit 75 "
        "(--timeout, BURSTMPI_TIMEOUT); SIGINT/SIGTERM keep the rows done and exit 130/143" + threads_note(),
        "#  Columns: burstmpi-bench --legend" + (" --decode" if mode == "decode" else "")
        + " prints one line per column with its unit and definition",
        "#")
    say(comm, *header_lines(columns))
    rows, refused, t_start = [], [], time.perf_counter()
    end = dict(mode=mode, params=params, configs=configs, rows=rows, refused=refused, footer=footer, check=check,
               config_keys=config_keys, metric=metric, base_rows=base_rows, baseline=baseline, tolerance=tolerance,
               json_path=json_path, junit_path=junit_path)
    # SIGINT/SIGTERM meanwhile: rank 0 reports the rows so far and the job ends (``interrupt``).
    with Interrupts(comm, lambda signame: results.finish(comm, interrupted=signame, **end)) as guard:
        for i, cfg in enumerate(configs):
            t0 = time.perf_counter()
            reset_peak()  # this row's peak, not the largest row's before it
            try:
                row = run_one(cfg)
            except Refused as e:  # the same on every rank, before anything was allocated
                with guard.lock:
                    refused.append(dict(cfg, why=str(e)))
                    say(comm, f"# REFUSED {e}")
                continue
            with guard.lock:
                rows.append(row)
                say(comm, format_row(columns, row))
            if show_progress:
                progress(comm, i + 1, len(configs), row, time.perf_counter() - t0, time.perf_counter() - t_start,
                         sum(work[:i + 1]) / sum(work))
            watchdog.checkpoint()  # below MPI_THREAD_MULTIPLE a signal's report and abort wait for this thread
        with guard.lock:
            guard.finish()  # a signal from here on lets the run end with its own status
    sys.exit(results.finish(comm, **end))
