"""``GuardedComm``: a program's communicator whose every blocking call has the deadline.

A program's bookkeeping (the bench's, ``burstmpi-gpucheck``'s) uses mpi4py's pickled
collectives; on a ``GuardedComm`` they are ``collectives``' (nonblocking collectives on
bytes, completed within the deadline), its blocking buffer collectives and the calls that
make communicators run under ``guard``, and a communicator made from it (``Dup``, ``Split``,
``Split_type``, ``Create``, ``Create_group``, ...) is a ``GuardedComm`` with the same
deadline and name: mpi4py makes those as plain ``Intracomm`` objects, or of the caller's
class through ``__new__`` without arguments (``Dup``, ``Idup``, ``Clone``), which would
get the default deadline.
"""

import functools

from mpi4py import MPI

from ..._config import settings
from .collectives import allgather, barrier, bcast
from .deadline import DEFAULT_TIMEOUT
from .monitor import guard

# The buffer collectives that block until every rank comes: they let go of the GIL while
# they wait (measured, as ``collectives`` says), so ``guard``'s monitor can end them.
BLOCKING_COLLECTIVES = ("Allgather", "Allgatherv", "Allreduce", "Alltoall", "Alltoallv", "Alltoallw", "Bcast",
                        "Exscan", "Gather", "Gatherv", "Reduce", "Reduce_scatter", "Reduce_scatter_block", "Scan",
                        "Scatter", "Scatterv")
# Calls that make a communicator: blocking and collective (``Create_group`` over its group).
MADE_AS_GUARDED = ("Dup", "Dup_with_info", "Clone", "Split", "Split_type", "Create", "Create_group")
MADE_OTHERWISE = ("Create_cart", "Create_graph", "Create_dist_graph", "Create_dist_graph_adjacent",
                  "Create_intercomm")


class GuardedComm(MPI.Intracomm):
    """An intracommunicator sharing another's handle whose pickled collectives and
    barriers wait within the deadline (nonblocking collectives completed by ``complete``),
    whose blocking collectives run under ``guard``, and whose derived communicators are
    ``GuardedComm`` too. Gathers and reductions go to every rank (the same bytes as a gather
    plus a broadcast; small objects: a program's bookkeeping)."""

    def __new__(cls, comm=None, timeout=DEFAULT_TIMEOUT, who="burstmpi"):
        # ``comm=None``: mpi4py's ``Dup`` makes its result of the caller's class, unargued.
        self = super().__new__(cls, comm)
        self._timeout, self._who = float(timeout), who
        return self

    def _what(self, name):
        return f"{self._who}: {name}"

    def _adopt(self, made):
        """``made`` (a communicator made from this one) with this one's deadline and name."""
        if made == MPI.COMM_NULL:  # a split's MPI.UNDEFINED color, a group without this rank
            return made
        if not isinstance(made, GuardedComm):
            made = GuardedComm(made)  # the same handle (mpi4py frees none of its own)
        made._timeout, made._who = self._timeout, self._who
        return made

    def Idup(self, *args, **kwargs):
        """A nonblocking duplicate (and its request) with the same deadline."""
        made, request = super().Idup(*args, **kwargs)
        return self._adopt(made), request

    def Idup_with_info(self, *args, **kwargs):
        made, request = super().Idup_with_info(*args, **kwargs)
        return self._adopt(made), request

    def allgather(self, sendobj):
        return allgather(self, sendobj, self._timeout, self._what("allgather"))

    def allreduce(self, sendobj, op=MPI.SUM):
        return functools.reduce(op, allgather(self, sendobj, self._timeout, self._what("allreduce")))

    def gather(self, sendobj, root=0):
        every = allgather(self, sendobj, self._timeout, self._what("gather"))
        return every if self.Get_rank() == root else None

    def reduce(self, sendobj, op=MPI.SUM, root=0):
        value = functools.reduce(op, allgather(self, sendobj, self._timeout, self._what("reduce")))
        return value if self.Get_rank() == root else None

    def scan(self, sendobj, op=MPI.SUM):
        every = allgather(self, sendobj, self._timeout, self._what("scan"))
        return functools.reduce(op, every[:self.Get_rank() + 1])

    def exscan(self, sendobj, op=MPI.SUM):
        every = allgather(self, sendobj, self._timeout, self._what("exscan"))[:self.Get_rank()]
        return functools.reduce(op, every) if every else None  # rank 0's is undefined: None, as mpi4py's

    def bcast(self, obj, root=0):
        return bcast(self, obj, root, self._timeout, self._what("bcast"))

    def scatter(self, sendobj, root=0):
        every = bcast(self, sendobj, root, self._timeout, self._what("scatter"))
        return every[self.Get_rank()]

    def alltoall(self, sendobj):
        every = allgather(self, sendobj, self._timeout, self._what("alltoall"))
        return [every[r][self.Get_rank()] for r in range(self.Get_size())]

    def Barrier(self):
        barrier(self, self._timeout, self._what("a barrier"))

    barrier = Barrier


def _guarded_call(name, adopt):
    """``GuardedComm.<name>``: mpi4py's, under ``guard`` with the communicator's deadline;
    with ``adopt``, its result (a communicator) made a ``GuardedComm`` like it."""
    method = getattr(MPI.Intracomm, name)

    def call(self, *args, **kwargs):
        with guard(self._what(f"MPI {name}"), self._timeout):
            made = method(self, *args, **kwargs)
        return self._adopt(made) if adopt else made

    call.__name__ = call.__qualname__ = name
    call.__doc__ = (f"mpi4py's ``{name}`` within the deadline (``guard``)"
                    + (", made a ``GuardedComm`` with the same deadline." if adopt else "."))
    return call


for _name in BLOCKING_COLLECTIVES + MADE_OTHERWISE:
    setattr(GuardedComm, _name, _guarded_call(_name, adopt=False))
for _name in MADE_AS_GUARDED:
    setattr(GuardedComm, _name, _guarded_call(_name, adopt=True))
del _name


def guarded(comm, timeout=DEFAULT_TIMEOUT, who="burstmpi"):
    """``comm`` (an mpi4py intracommunicator) with a deadline on its pickled collectives
    and barrier: a ``GuardedComm`` on the same handle, so it is the same communicator to
    MPI and to burstmpi's plans."""
    return GuardedComm(comm, timeout, who)


def timeout_of(comm):
    """Seconds a wait on the other ranks of ``comm`` may last: its own deadline where it is
    a ``GuardedComm``, else ``BURSTMPI_TIMEOUT``."""
    return comm._timeout if isinstance(comm, GuardedComm) else settings().timeout
