"""The shared memory a process maps in ``/dev/shm``: MPICH's node segments, burstmpi's own.

MPICH keeps the memory the ranks of a node share (its node segment) in a file
``/dev/shm/mpich_shm_*`` that it removes only in ``MPI_Finalize``: a job that ends in
``MPI_Abort`` or is killed leaves 2 MB or more per node in a tmpfs until someone deletes
it. ``unlink_node_segments`` removes the names this process maps; the runtime calls it
once every rank has mapped them (its first call), and the watchdog as the job ends
(``watchdog.expiry``), which covers jobs that end before any burstmpi call ran. The same
call removes a name of burstmpi's own node memory (``node_memory``: ``burstmpi_*``, unlinked
as soon as the node's ranks mapped it) should the job end in between. ``mapped_bytes`` is
what the soak run and the examples watch.
"""

import os

__all__ = ["SHM_DIR", "OWN_PREFIX", "unlink_node_segments", "mapped_bytes"]

# Where MPICH and Open MPI put shared windows on Linux. A tmpfs: a window larger than its
# free space maps without error and then dies of SIGBUS on the first page past it (Docker
# gives containers 64 MB unless told --shm-size), so ``transport.shm`` checks the room first.
SHM_DIR = "/dev/shm"
# The names of burstmpi's own node memory (``node_memory``), of MPICH's node segments and of
# Open MPI 5's shared-memory BTL segments (``sm_segment.HOST.UID.JOBID.RANK``).
OWN_PREFIX = "burstmpi_"
MPICH_PREFIX = "mpich_shm_"
OPENMPI_PREFIX = "sm_segment."


def _mapped(maps):
    """``[(address range, inode, path)]`` of this process's mappings of files in SHM_DIR."""
    found = []
    try:
        with open(maps) as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and parts[5].startswith(f"{SHM_DIR}/"):
                    found.append((parts[0], parts[4], parts[5].strip()))
    except OSError:
        pass
    return found


def unlink_node_segments(maps="/proc/self/maps", ending=True, attached=False):
    """Unlink the names of the node segments that this process maps: MPICH's always; where
    the job is ``ending``, burstmpi's own and Open MPI's too; Open MPI's also where every
    rank of the host has ``attached`` every other's (``node_memory.drop_segment_names``).

    Once every rank of the node has mapped MPICH's (MPI_Init attaches them all before any
    returns), its name is no longer needed: the memory stays until the last rank unmaps
    it. Measured with MPICH 5.0.2: shared windows still work after it, ``MPI_Finalize`` is
    silent. burstmpi's own is unlinked as soon as the node's ranks mapped it, but while
    the job goes on another thread may be making one. Open MPI 5's ranks attach each
    other's ``sm_segment.*`` at their first message to each other, so its names stay until
    that happened; measured with 5.0.11: its launcher removes them after a normal end or an
    ``MPI_Abort``, but not when a host's processes were killed, and a process started
    without a launcher (``python prog.py``) leaves its own behind. Not Linux: nothing to
    do. Makes no MPI call (the watchdog's helper threads may call it)."""
    prefixes = [MPICH_PREFIX]
    if ending:
        prefixes += [OWN_PREFIX, OPENMPI_PREFIX]
    elif attached:
        prefixes.append(OPENMPI_PREFIX)
    prefixes = tuple(f"{SHM_DIR}/{p}" for p in prefixes)
    names = {path for _, _, path in _mapped(maps) if path.startswith(prefixes)}
    for name in names:
        if not name.endswith("(deleted)"):
            try:
                os.unlink(name)
            except OSError:  # another rank of the node was first
                pass


def mapped_bytes(maps="/proc/self/maps"):
    """Bytes of SHM_DIR files (deleted ones too) this process maps, each file once."""
    seen = {}
    for span, inode, _ in _mapped(maps):
        lo, hi = (int(x, 16) for x in span.split("-"))
        seen[inode] = seen.get(inode, 0) + hi - lo
    return sum(seen.values())
