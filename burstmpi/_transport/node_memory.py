"""Memory the ranks of one node share: a POSIX shared-memory file of burstmpi's own.

The ``shm`` transport's ring buffers are read in place by every rank of a node. They came
from an MPI-3 shared window (``MPI_Win_allocate_shared``) until 2026-12; they come from here
now, for three reasons measured on the pip wheels of MPICH 5.0.2, Open MPI 5.0.11 and Intel
MPI 2021.18:

- Open MPI asks each of its one-sided (``osc``) components whether it can serve a new
  window, and its UCX component answers every ``Win_allocate_shared`` on one node with
  ``osc_ucx_component.c:375  Error: OSC UCX component priority set inside component query
  failed``, once per rank and window, in a run that is healthy (the window works: another
  component serves it). ``OMPI_MCA_osc=^ucx`` silences it, but only when set before
  ``MPI_Init``, which a ``python -m mpi4py`` program runs before burstmpi is imported.
- A window's memory has the MPI's own name in ``/dev/shm`` (MPICH's ``mpich_shm_*``), which
  only ``MPI_Finalize`` removes: an aborted or killed job left it behind.
- Nothing here needs MPI's one-sided semantics: a token sent through MPI already says when
  a packet may be read (``shm``'s module notes).

The file is created by the node's first rank, opened and mapped by the others, and
unlinked as soon as every rank has mapped it: the memory lives as long as some rank maps
it, and nothing is left in ``SHM_DIR`` whatever ends the job (for the few milliseconds
between create and unlink, the watchdog's exit unlinks it: ``segments``). Each rank's part
starts on a page of its own and is written first by that rank (first touch: its own NUMA
node).

Memory ordering: a rank reads another's bytes only after an MPI message (the ring's token)
sent after they were written has arrived, and writes bytes again only after a message from
their reader says it is done. An MPI that moves a message through shared memory publishes
its payload with a release and reads it with an acquire, which orders every earlier store
of the sender before every later load of the receiver: the same guarantee the window's
``Win_sync`` gave (on x86, total store order gives it anyway).
"""

import mmap
import os
import secrets

import numpy as np
from mpi4py import MPI

from .segments import OWN_PREFIX, SHM_DIR, unlink_node_segments
from .watchdog import allgather, barrier, collective

__all__ = ["NotShared", "map_node_memory", "drop_segment_names"]

TAG = 52  # the messages by which Open MPI's ranks of one host attach each other's segments


class NotShared(RuntimeError):
    """Some rank of the node could not map the node's file (its ``SHM_DIR`` is not the
    others': raised alike on every rank)."""


def _page(n):
    return -(-max(n, 1) // mmap.PAGESIZE) * mmap.PAGESIZE


def map_node_memory(comm, nbytes, timeout, what="the node's shared memory"):
    """Every rank of ``comm``'s ``nbytes`` of shared memory, as a list of uint8 arrays in
    rank order (collective; every rank asks for the same ``nbytes``). The memory is freed
    when the last array over it (on every rank) is gone. ``NotShared`` on every rank when
    some rank could not open the file the first rank made."""
    rank, P = comm.Get_rank(), comm.Get_size()
    part = _page(nbytes)
    path, mapping, error = None, None, None
    if rank == 0:
        path = os.path.join(SHM_DIR, f"{OWN_PREFIX}{os.getpid()}_{secrets.token_hex(6)}")
        try:
            mapping = _map(path, P * part, create=True)
        except OSError as e:
            error = f"rank 0 could not make {path} ({P * part / 1e6:.1f} MB): {e}"
    try:
        path, error = allgather(comm, (path, error), timeout, what)[0]
        if error is not None:
            raise NotShared(error)  # rank 0's error, on every rank
        if rank != 0:
            try:
                mapping = _map(path, P * part, create=False)
            except OSError as e:
                error = str(e)
        failed = [(r, e) for r, e in enumerate(allgather(comm, error, timeout, what)) if e is not None]
    finally:
        if mapping is not None and rank == 0:
            _unlink(path)  # every rank has mapped it (or failed to): the name is not needed
    if failed:
        raise NotShared("rank(s) " + ", ".join(f"{r} ({e})" for r, e in failed) + f" could not open {path}, "
                        f"which rank 0 made: their {SHM_DIR} is not rank 0's (containers with a private "
                        f"{SHM_DIR} each?)")
    whole = np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive, and so the memory
    return [whole[r * part:r * part + nbytes] for r in range(P)]


def _map(path, size, create):
    """A shared mapping of ``size`` bytes of the file ``path`` (made first if ``create``:
    removed again if that fails half-way)."""
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError:
        if create:
            _unlink(path)
        raise
    finally:
        os.close(fd)


def _unlink(path):
    try:
        os.unlink(path)
    except OSError:
        pass


def drop_segment_names(comm, hosts, timeout):
    """Unlink the names of the MPI's node segments (``segments``), so that a job that ends
    in ``MPI_Abort`` or is killed leaves nothing in ``SHM_DIR`` (collective over ``comm``,
    every rank of the job; ``hosts``: every rank's processor name).

    MPICH's ranks map them all in ``MPI_Init``. Open MPI 5's attach a peer's
    ``sm_segment.*`` at their first message to it, so one message each way between every
    two ranks of a host comes first (once per job: a few messages a rank), and a barrier
    (no rank unlinks a name another has yet to attach), then its names go too. Measured
    with Open MPI 5.0.11: a job killed or cut off otherwise left 16 MB per rank in the
    host's ``/dev/shm``."""
    if MPI.Get_library_version().startswith("Open MPI"):
        me = comm.Get_rank()
        peers = [r for r, h in enumerate(hosts) if h == hosts[me] and r != me]
        if peers:
            token, got = np.zeros(1, np.uint8), np.zeros(len(peers), np.uint8)
            reqs = [comm.Isend(token, r, TAG) for r in peers]
            reqs += [comm.Irecv(got[i:i + 1], r, TAG) for i, r in enumerate(peers)]
            collective(comm, reqs, timeout, "the first message between the ranks of each host")
        barrier(comm, timeout, "the barrier after the ranks of each host attached each other's memory")
        unlink_node_segments(ending=False, attached=True)
    else:
        unlink_node_segments(ending=False)
