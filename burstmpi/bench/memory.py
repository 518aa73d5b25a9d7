"""The bench's memory: what a row will need, checked against what each node has free before
it runs, and what it took, per row.

A benchmark that admins run in nightly jobs must never take a node down: an out-of-memory
kill ends the job with no row printed and can take other jobs on the node with it. So each
mode describes a row as *stages* (``Stage``): what one rank holds at once while a part of
the row runs, its arrays, the row's own ones still alive, as the code keeps them. Before
the row, ``Budget.plan`` sums every stage over the ranks that share a node's memory (and,
on GPUs, a device's) and compares the sum with what is free there: a required stage that
does not fit refuses the row (``Refused``: a clear message, and the bench exits non-zero
at the end), an optional one (a baseline) is skipped with a ``#`` line saying what and
why. Ranks agree collectively, so every rank skips the same things.

Free memory is the smaller of the kernel's MemAvailable and what the process's cgroup
(v2 or v1: containers, Slurm jobs) still allows, times ``FIT`` for headroom, and no more
than ``--mem-limit`` per node when given (a nightly job sharing a node with others, or a
test).

Building a ``Budget`` and planning a row are collective; every wait has the watchdog's
deadline (``watchdog.timeout_of``: the bench's ``--timeout`` on its communicator), the
shared-memory split under ``watchdog.guard`` and the exchanges through its nonblocking
collectives, whatever the communicator given (mpi4py's pickled ``allreduce`` would hold the
GIL while it waits, and the watchdog could not end it).

Each row's peak is measured, not guessed: the kernel's high-water mark of the resident
set (``VmHWM``) is reset before the row (``/proc/self/clear_refs``) and read after, so a
sweep's rows do not inherit the peak of a larger row before them; the estimate printed
beside it is the resident set at the row's start plus the largest stage that ran. Pages
of a shared-memory window count in every rank that touches them (the ``shm`` transport's
packets read in place); stages say so with their ``shared`` bytes, summed once per node.
"""

import resource
from dataclasses import dataclass, field

from mpi4py import MPI

from .._transport import watchdog

__all__ = ["FIT", "Stage", "Refused", "Budget", "node_free_bytes", "reset_peak", "peak_bytes", "rss_bytes"]

# The fraction of the free memory a row may plan to use: allocators, page tables, MPI's own
# buffers and the libraries' first-touch pages are not in the estimate.
FIT = 0.85


def _read_int(path):
    try:
        with open(path) as fh:
            text = fh.read().strip()
    except OSError:
        return None
    return None if text in ("", "max") else int(text)


def _meminfo(key):
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                name, _, value = line.partition(":")
                if name == key:
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def node_free_bytes():
    """Bytes this process's node can still give: MemAvailable, capped by the cgroup's limit
    less its usage (cgroup v2, then v1). None where neither can be read (not Linux)."""
    free = _meminfo("MemAvailable")
    for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                         ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                          "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        lim, used = _read_int(limit), _read_int(usage)
        if lim is not None and used is not None and lim < (1 << 60):  # v1 says "no limit" with a huge number
            room = max(0, lim - used)
            free = room if free is None else min(free, room)
            break
    return free


def reset_peak():
    """Start a new high-water mark of the resident set (Linux 4.0+); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _status(key):
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_bytes():
    """The resident set's high-water mark since ``reset_peak`` (the process's lifetime
    maximum where the kernel cannot reset it)."""
    peak = _status("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_bytes():
    rss = _status("VmRSS")
    return rss if rss is not None else peak_bytes()


@dataclass
class Stage:
    """What one rank holds at once during a part of a row, in bytes.

    ``host``: private host memory (arrays, this stage's and the row's still alive);
    ``shared``: host memory in a shared-memory window, counted once per node but resident
    in every rank that reads it (``peers``: bytes of other ranks' windows this rank reads,
    which its resident set counts and the node's total does not); ``device``: GPU memory.
    ``ranks``: the ranks that run the stage (None: all; a baseline on rank 0 alone: [0]).
    ``required``: the row cannot run without it; otherwise it is a baseline to skip.
    """

    what: str
    host: int = 0
    shared: int = 0
    peers: int = 0
    device: int = 0
    required: bool = True
    ranks: list = None
    why: str = ""

    def runs_on(self, rank):
        return self.ranks is None or rank in self.ranks


class Refused(Exception):
    """A row whose required stages do not fit in the memory its nodes have free."""


@dataclass
class Plan:
    """``Budget.plan``'s answer: which stages run, the estimated peak resident set of this
    rank (bytes: at the row's start plus its largest stage that runs; ``stages``: the same
    per stage that runs; ``device_estimate``: GPU bytes), and ``#`` lines."""

    runs: dict
    estimate: int
    lines: list = field(default_factory=list)
    stages: dict = field(default_factory=dict)
    device_estimate: int = 0  # GPU bytes of the largest stage that runs here

    def __getitem__(self, what):
        return self.runs[what]


class Budget:
    """The memory pools of a job (each node's host memory; each GPU's) and the checks of a
    row's stages against them. Collective to build and to plan with.

    ``limit``: bytes per node the bench may use at most (``--mem-limit``), or None.
    ``device_free``: a callable giving this rank's GPU's free bytes, or None on hosts.
    """

    def __init__(self, comm, limit=None, device_free=None, device_id=None):
        self.comm, self.limit, self.device_free = comm, limit, device_free
        self.timeout = watchdog.timeout_of(comm)
        with watchdog.guard("burstmpi-bench: the split of the ranks by node (memory)", self.timeout):
            node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:  # the node's lowest rank names it
            self.node = min(watchdog.allgather(node, comm.Get_rank(), self.timeout,
                                               "burstmpi-bench: the ranks of a node (memory)"))
            self.node_size = node.Get_size()
        finally:
            node.Free()
        self.device_key = None if device_id is None else (self.node, device_id)

    def free(self):
        """(host bytes this node may give the row, device bytes or None, and whether
        ``--mem-limit`` is what bounds the host's)."""
        host = node_free_bytes()
        budget = None if host is None else int(FIT * host)
        limited = self.limit is not None and (budget is None or self.limit < budget)
        if limited:
            budget = self.limit
        dev = None if self.device_free is None else int(FIT * self.device_free())
        return budget, dev, limited

    def plan(self, stages, label):
        """Check ``stages`` (this rank's ``Stage`` list; the same names on every rank) against
        the pools. Raises ``Refused`` (the same on every rank) when a required stage does not
        fit; returns a ``Plan`` whose ``runs[what]`` says whether each stage runs."""
        comm, rank = self.comm, self.comm.Get_rank()
        base = rss_bytes()
        free_host, free_dev, limited = self.free()
        mine = [(s.what, s.host if s.runs_on(rank) else 0, s.shared if s.runs_on(rank) else 0,
                 s.device if s.runs_on(rank) else 0) for s in stages]
        everyone = watchdog.allgather(comm, (self.node, self.device_key, free_host, free_dev, limited, mine),
                                      self.timeout, f"burstmpi-bench: the memory plan of {label}")
        runs, lines, refused = {}, [], []
        for i, stage in enumerate(stages):
            worst = None  # (need, free, where, bound by --mem-limit) of the pool short the most
            pools = {}
            for node, dkey, fh, fd, lim, needs in everyone:
                _, host, shared, device = needs[i]
                for key, need, free, bound in ((("node", node), host + shared, fh, lim),
                                               (("gpu", dkey), device, fd, False)):
                    if key[1] is None:
                        continue
                    pool = pools.setdefault(key, [0, free, bound])
                    pool[0] += need
                    if free is not None and (pool[1] is None or free < pool[1]):
                        pool[1:] = [free, bound]
            for (kind, key), (need, free, bound) in pools.items():
                if free is None or need <= free:
                    continue
                where = f"node of rank {key}" if kind == "node" else f"GPU {key[1]} on the node of rank {key[0]}"
                if worst is None or need - free > worst[0] - worst[1]:
                    worst = (need, free, where, bound)
            runs[stage.what] = worst is None
            if worst is not None:
                need, free, where, bound = worst
                text = (f"{stage.what} needs {need / 2**30:.2f} GiB on the {where}, which has "
                        f"{free / 2**30:.2f} GiB to give ({'--mem-limit' if bound else f'{FIT:.0%} of its free memory'})")
                if stage.required:
                    refused.append(text + (f"; {stage.why}" if stage.why else ""))
                else:
                    lines.append(f"# {label}: skipped {text}" + (f"; {stage.why}" if stage.why else ""))
        if refused:
            raise Refused(f"{label}: refused, it does not fit in memory: " + "; ".join(refused))
        per_stage = {s.what: base + (s.host + s.shared + s.peers if s.runs_on(rank) else 0)
                     for s in stages if runs[s.what]}
        device = max((s.device for s in stages if runs[s.what] and s.runs_on(rank)), default=0)
        return Plan(runs=runs, estimate=max(per_stage.values(), default=base), lines=lines, stages=per_stage,
                    device_estimate=device)
