"""Ranks named as a user sees them: their ``MPI.COMM_WORLD`` rank and their host.

``mpiexec``'s output names ranks of COMM_WORLD, whatever communicator the wait was on, and a
host is its processor name (``learn_hosts``, told by the runtimes once they know them).
"""

from mpi4py import MPI

from . import identity

_hosts = {}           # COMM_WORLD rank -> processor name, learned by the runtimes


def learn_hosts(comm, names):
    """Remember the processor name of every rank of ``comm`` (``names`` in rank order), to
    name the hosts of ranks a wait expires on."""
    identity.remember()  # on the caller's thread: the monitor then needs no MPI call to name this rank
    world = _world_ranks(comm, range(comm.Get_size()))
    _hosts.update(zip(world, names))


def _world_ranks(comm, ranks):
    ranks = list(ranks)
    if comm is None or comm == MPI.COMM_WORLD:
        return ranks
    return [int(r) for r in MPI.Group.Translate_ranks(comm.Get_group(), ranks, MPI.COMM_WORLD.Get_group())]


def who(comm, ranks):
    """``rank 3 (node-b)`` / ``ranks [1, 2] (node-a, node-b)``: ranks of ``comm`` named by
    their COMM_WORLD rank and, where known, their hosts. Calls MPI (a group translation):
    only on the caller's thread."""
    world = sorted(set(_world_ranks(comm, ranks)))
    hosts = sorted({_hosts[r] for r in world if r in _hosts})
    where = f" ({', '.join(hosts)})" if hosts else ""
    if len(world) == 1:
        return f"rank {world[0]}{where}"
    return f"ranks {world}{where}"


def _me():
    """``rank 2 (node-c)``: this rank, from what ``identity.remember`` read (no MPI call: the
    monitor thread prints it too)."""
    known = identity.remember()
    if known is None:  # never read on a thread that may call MPI (MPI not initialised there yet)
        return "rank ? (host unknown)"
    rank, name, _ = known
    return f"rank {rank} ({_hosts.get(rank) or name})"
