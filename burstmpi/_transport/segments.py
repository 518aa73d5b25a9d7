"""The shared memory a process maps in ``/dev/shm``: MPICH's node segments and their names.

MPICH keeps the memory the ranks of a node share (its node segment, burstmpi's windows
included) in a file ``/dev/shm/mpich_shm_*`` that it removes only in ``MPI_Finalize``: a job
that ends in ``MPI_Abort`` or is killed leaves 2 MB or more per node in a tmpfs until
someone deletes it. ``unlink_node_segments`` removes the names this process maps; the
runtime calls it once every rank has mapped them (its first call), and the watchdog as the
job ends (``watchdog.expiry``), which covers jobs that end before any burstmpi call ran.
``mapped_bytes`` is what the soak run and the examples watch.
"""

import os

__all__ = ["SHM_DIR", "unlink_node_segments", "mapped_bytes"]

# Where MPICH and Open MPI put shared windows on Linux. A tmpfs: a window larger than its
# free space maps without error and then dies of SIGBUS on the first page past it (Docker
# gives containers 64 MB unless told --shm-size), so ``transport.shm`` checks the room first.
SHM_DIR = "/dev/shm"


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


def unlink_node_segments(maps="/proc/self/maps"):
    """Unlink the names of MPICH's node segments that this process maps.

    Once every rank of the node has mapped it (MPI_Init attaches them all before any
    returns), the name is no longer needed: the memory stays until the last rank unmaps
    it. Measured with MPICH 5.0.2: shared windows still work after it, ``MPI_Finalize`` is
    silent. Not Linux, or not MPICH: nothing to do. Makes no MPI call (the watchdog's
    helper threads may call it)."""
    names = {path for _, _, path in _mapped(maps) if path.startswith(f"{SHM_DIR}/mpich_shm_")}
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
