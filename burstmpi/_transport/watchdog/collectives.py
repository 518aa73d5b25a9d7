"""Pickled collectives and barriers that wait within the deadline.

mpi4py's own pickled collectives block inside MPI, and its reductions (``allreduce``,
``reduce``, ``scan``, ``exscan``) hold the GIL while they do on their first call on a
communicator (mpi4py makes itself a duplicate of it then, with the GIL held: measured with
mpi4py 4.1.2, a thread that ticks every 10 ms stops for the whole wait), so no thread could
end them. These are built from nonblocking collectives on bytes instead, completed by
``deadline.complete``.

A barrier or an allgather cannot say who has not arrived. Records sent to rank 0 can
(``gather_on_root``): it names the ranks whose records did not come, and the others name
rank 0 if it does not answer (a little later, so rank 0's line comes first when it can
print one).
"""

import pickle

import numpy as np
from mpi4py import MPI

from . import expiry, hosts
from .deadline import DEFAULT_TIMEOUT, collective, complete

TAG_ARRIVE = 9  # on the communicator given; burstmpi's rings use tags 11 and up


def gather_on_root(comm, record, timeout=DEFAULT_TIMEOUT, doing="arrive", idle=False):
    """Every rank's ``record`` (a 1-D int64 array, the same length everywhere), in rank
    order, on every rank: sent to rank 0, which broadcasts them all. A rank whose record
    does not come within ``timeout`` seconds is named: ``ranks [1, 2] (node-b) did not
    {doing} within 300 s``. Point-to-point on ``TAG_ARRIVE`` of ``comm``."""
    record = np.ascontiguousarray(record, dtype=np.int64)
    P = comm.Get_size()
    every = np.empty((P, record.size), dtype=np.int64)
    if comm.Get_rank() == 0:
        every[0] = record
        reqs = [comm.Irecv([every[r], MPI.INT64_T], source=r, tag=TAG_ARRIVE) for r in range(1, P)]

        def missing(pending, waited):  # they may wait on the failed peer: let them say so
            expiry.expire(f"{hosts.who(comm, [i + 1 for i in pending])} did not {doing} within {waited:.0f} s (or "
                          "cannot be reached)", wait=expiry.linger(timeout))
        complete(reqs, idle, timeout, missing)
        collective(comm, [comm.Ibcast([every, MPI.INT64_T], root=0)], timeout,
                   f"the broadcast of every rank's arrival (to {doing})", idle)
    else:
        reqs = [comm.Isend([record, MPI.INT64_T], dest=0, tag=TAG_ARRIVE), comm.Ibcast([every, MPI.INT64_T], root=0)]

        def unanswered(pending, waited):
            expiry.expire(f"{hosts.who(comm, [0])}, which collects every rank's arrival, did not answer within "
                          f"{waited:.0f} s (a rank did not {doing}, or a host cannot be reached)",
                          wait=expiry.linger(timeout))
        complete(reqs, idle, timeout + min(5.0, 0.25 * timeout), unanswered)
    return every


def barrier(comm, timeout=DEFAULT_TIMEOUT, what="a barrier", idle=False):
    """A barrier that names the ranks that did not reach it (``gather_on_root``)."""
    gather_on_root(comm, np.zeros(1, np.int64), timeout, f"reach {what}", idle)


def allgather(comm, obj, timeout=DEFAULT_TIMEOUT, what="an allgather"):
    """Every rank's ``obj`` (picklable), in rank order, within ``timeout`` seconds."""
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    sizes = np.empty(comm.Get_size(), np.int64)
    collective(comm, [comm.Iallgather([np.array([data.size], np.int64), MPI.INT64_T], [sizes, MPI.INT64_T])],
               timeout, what)
    displs = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    got = np.empty(int(sizes.sum()), np.uint8)
    collective(comm, [comm.Iallgatherv([data, MPI.BYTE], [got, (sizes.tolist(), displs.tolist()), MPI.BYTE])],
               timeout, what)
    return [pickle.loads(got[d:d + n].tobytes()) for d, n in zip(displs.tolist(), sizes.tolist())]


def bcast(comm, obj, root=0, timeout=DEFAULT_TIMEOUT, what="a broadcast"):
    """``obj`` of rank ``root`` on every rank, within ``timeout`` seconds."""
    data = np.frombuffer(pickle.dumps(obj), np.uint8) if comm.Get_rank() == root else None
    size = np.array([0 if data is None else data.size], np.int64)
    collective(comm, [comm.Ibcast([size, MPI.INT64_T], root=root)], timeout, what)
    if data is None:
        data = np.empty(int(size[0]), np.uint8)
    collective(comm, [comm.Ibcast([data, MPI.BYTE], root=root)], timeout, what)
    return obj if comm.Get_rank() == root else pickle.loads(data.tobytes())
