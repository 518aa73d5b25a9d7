"""Which ranks share a node: the topology the ring's traffic is counted (and routed) by.

A node is the set of ranks that MPI's shared-memory split puts together
(``MPI.COMM_TYPE_SHARED``, under MPICH and Open MPI alike), unless
``BURSTMPI_RANKS_PER_NODE=g`` says otherwise: then consecutive blocks of g ranks form a
node (the last one shorter when g does not divide the ranks). The override lets one
machine play a cluster: 8 ranks as 4 "nodes" of 2 in tests, CI and the bench.

This is the logical topology. What a process can physically share (a shared-memory
window, the cores its threads use, which GPU it picks) still follows the real node.
"""

from mpi4py import MPI

from .._config import settings
from .watchdog import DEFAULT_TIMEOUT, allgather, guard

__all__ = ["Nodes", "nodes"]


class Nodes:
    """The node of every rank of a communicator. ``node_of[r]``: the node index of rank r,
    nodes numbered in the order of their lowest rank; ``members[n]``: node n's ranks in
    increasing order."""

    def __init__(self, node_of, rank=0, hosts=None):
        self.node_of = tuple(int(n) for n in node_of)
        # Every rank's processor name (what the watchdog names hosts by), where known.
        self.hosts = None if hosts is None else tuple(hosts)
        count = max(self.node_of, default=-1) + 1
        self.members = tuple(tuple(r for r, n in enumerate(self.node_of) if n == i) for i in range(count))
        self.rank = rank

    @classmethod
    def blocks(cls, nranks, per_node, rank=0, hosts=None):
        """Consecutive blocks of ``per_node`` ranks (``BURSTMPI_RANKS_PER_NODE``)."""
        return cls([r // per_node for r in range(nranks)], rank, hosts)

    @property
    def count(self):
        """How many nodes."""
        return len(self.members)

    @property
    def node(self):
        """This rank's node."""
        return self.node_of[self.rank]

    @property
    def local_rank(self):
        """This rank's index among the ranks of its node."""
        return self.members[self.node].index(self.rank)

    @property
    def equal(self):
        """Do all nodes hold as many ranks?"""
        return len({len(m) for m in self.members}) <= 1

    @property
    def spread(self):
        """Several nodes of equal size, each of 2+ ranks: where a two-level ring has two levels."""
        return self.count > 1 and self.equal and len(self.members[0]) > 1

    def remote(self, a, b):
        """Are ranks ``a`` and ``b`` on different nodes?"""
        return self.node_of[a] != self.node_of[b]

    def internode(self, bytes_to, rank=None):
        """Bytes of ``bytes_to`` ({destination rank: bytes}, a channel's counts) that left
        the node of ``rank`` (default this rank)."""
        me = self.rank if rank is None else rank
        return sum(n for dest, n in bytes_to.items() if self.remote(me, dest))

    def describe(self):
        """``4 nodes x 2 ranks`` (or the sizes, when they differ)."""
        sizes = sorted({len(m) for m in self.members})
        if len(sizes) == 1:
            return f"{self.count} node{'s' if self.count != 1 else ''} x {sizes[0]} rank{'s' if sizes[0] != 1 else ''}"
        return f"{self.count} nodes of " + ", ".join(str(len(m)) for m in self.members) + " ranks"

    def __repr__(self):
        return f"Nodes({self.describe()})"


def nodes(comm, timeout=DEFAULT_TIMEOUT, ranks_per_node=None):
    """The ``Nodes`` of ``comm`` (collective, each step within ``timeout`` seconds):
    ``BURSTMPI_RANKS_PER_NODE`` if set, else the shared-memory split; with every rank's
    processor name."""
    per_node = settings().ranks_per_node if ranks_per_node is None else ranks_per_node
    every = allgather(comm, (per_node, MPI.Get_processor_name()), timeout,
                      "node discovery: the allgather of every rank's host")
    hosts = [host for _, host in every]
    if len({g for g, _ in every}) > 1:  # a setting that differs between ranks raises on every rank
        raise ValueError(f"BURSTMPI_RANKS_PER_NODE: expected the same on every rank, got {[g for g, _ in every]} "
                         "(by rank)")
    if per_node:
        return Nodes.blocks(comm.Get_size(), per_node, comm.Get_rank(), hosts)
    with guard("node discovery: the shared-memory split", timeout):
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:  # the node's lowest rank names it
        lowest = min(allgather(node, comm.Get_rank(), timeout, "node discovery: the ranks of a node"))
    finally:
        node.Free()
    leaders = allgather(comm, lowest, timeout, "node discovery: the allgather of the nodes' lowest ranks")
    order = {r: i for i, r in enumerate(sorted(set(leaders)))}
    return Nodes([order[r] for r in leaders], comm.Get_rank(), hosts)
