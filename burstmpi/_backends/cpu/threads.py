"""Threads for the CPU backend: a rank runs its tiles on the cores it owns.

A tile's work is two or five GEMMs and a few elementwise sweeps; each is too small for
BLAS to split well over threads (two tiles on two threads of one-threaded BLAS outrun one
tile at a time on two-threaded OpenBLAS by a fifth or more). So the backend runs whole
work items (a query tile of one KV head against the block, or a band of them in the
backward; outside the tile loops, a range of tokens of a whole-block sweep) on ``n``
threads, each with one-threaded BLAS, and the compiled elementwise kernels release the GIL
as NumPy's GEMMs do. An item writes only its own rows, and its tiles run in a fixed order,
so the result does not depend on which thread ran what.

``n`` is the cores this process may use divided by the ranks on its node
(``BURSTMPI_THREADS`` overrides it), so ranks never oversubscribe their node; with one
thread everything runs on the caller's thread.
"""

import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

from mpi4py import MPI

from ..._transport.watchdog import DEFAULT_TIMEOUT, allgather

from .workspace import Workspace

__all__ = ["Workers", "cores", "threads_per_rank", "node_masks", "shares_cores", "one_blas_thread"]


def cores():
    """The cores this process may use (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def threads_per_rank(comm, setting=0):
    """Threads for this rank (collective on ``comm``): ``setting`` if positive, else the
    cores this process may use divided by the ranks of ``comm`` on its node, at least 1."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        here = node.Get_size()
    finally:
        node.Free()
    return setting if setting > 0 else max(1, cores() // here)


def node_masks(comm, timeout=DEFAULT_TIMEOUT):
    """The affinity masks (frozensets of cores; None where the OS has none) of the ranks of
    ``comm`` on this node, in node-rank order, and this rank's node rank (collective; the
    split under the callers' ``guard``, the allgather within ``timeout`` seconds)."""
    mask = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return allgather(node, mask, timeout, "the allgather of the node's cores"), node.Get_rank()
    finally:
        node.Free()


def shares_cores(masks):
    """Do the ranks of a node (``node_masks``' masks) outnumber the cores their masks cover
    together, so that some take turns on a core?"""
    covered = (os.cpu_count() or 1) if None in masks else len(frozenset().union(*masks))
    return len(masks) > covered


_blas = None


class one_blas_thread:
    """Context manager: BLAS runs on the calling thread while the workers compute (their
    GEMMs run side by side), and gets its thread count back afterwards."""

    def __enter__(self):
        global _blas
        if _blas is None:
            from threadpoolctl import ThreadpoolController

            _blas = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
        self.saved = [(c, c.num_threads) for c in _blas]
        for c, n in self.saved:
            if n != 1:
                c.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        for c, n in self.saved:
            if n != 1:
                c.set_num_threads(n)
        return False


_pools = {}
_pools_lock = threading.Lock()


class Workers:
    """``n`` threads that run work items, polling the transport meanwhile.

    The threads of every ``Workers(n)`` of one size are one pool per process (started on
    first use), so plans do not each hold idle threads of their own. Each ``Workers`` keeps
    one ``Workspace`` of scratch per thread, ``scratch``, from run to run: its runs must not
    overlap (a backend runs one at a time)."""

    def __init__(self, n):
        self.n = max(1, int(n))
        self.scratch = [Workspace() for _ in range(self.n)]
        self._pool = None
        if self.n > 1:
            with _pools_lock:
                if self.n not in _pools:
                    _pools[self.n] = ThreadPoolExecutor(self.n, thread_name_prefix=f"burstmpi-{self.n}")
                self._pool = _pools[self.n]

    def run(self, items, fn, poll=None):
        """``fn(item, scratch)`` for every item, on the workers (each with its own
        ``Workspace``, ``scratch``); ``poll()`` runs on the caller's thread meanwhile, so MPI keeps
        moving the ring's transfers, until it returns False (nothing left in flight). The
        first exception is re-raised."""
        items = list(items)
        with one_blas_thread():
            if self._pool is None or len(items) < 2:
                scratch = self.scratch[0]
                for item in items:
                    fn(item, scratch)
                    if poll is not None:
                        poll()
                return
            queue, lock, failed = iter(items), threading.Lock(), []

            def worker(scratch):
                while not failed:
                    with lock:
                        item = next(queue, None)
                    if item is None:
                        return
                    try:
                        fn(item, scratch)
                    except BaseException as e:  # stop the others, re-raise on the caller
                        failed.append(e)
                        raise

            futures = [self._pool.submit(worker, s) for s in self.scratch[:len(items)]]
            # Poll every 2 ms while the transport has transfers in flight, then just wait
            # (a third thread waking every 2 ms on 2 cores cost ~5 % of a forward).
            polling = poll is not None and poll()
            while True:
                done, pending = wait(futures, timeout=0.002 if polling else None)
                if polling:
                    polling = poll()
                if not pending:
                    break
            for f in futures:
                f.result()
