"""All-to-all exchanges of token rows: sequence shards to head shards and back inside a group
of ranks (``HeadExchange``), and tokens from one layout to another (``TokenExchange``: the
causal balancing of ``burstmpi._ring.balance``); one all-to-all each way.

Head parallelism (``burstmpi._heads``, DeepSpeed-Ulysses' exchange) gives each of the u
ranks of a group all the group's tokens for 1/u of the heads: rank i sends member j the
heads j serves of its own tokens, and receives from every member that member's tokens of
the heads it serves itself. The group's tokens are kept in increasing position (the
merged layout ``NAME/u`` of ``burstmpi.masks._layout``), so each member's rows land at their
places in that order, not one member after another.

Either way the shares move as point-to-point transfers, every share to its member and
every share from it posted as one group, one exchange per array and direction; a member's
own share is a local copy, and empty shares are sent by nobody and awaited by nobody (both
sides know the counts):

- On host arrays, MPI's ``Isend``/``Irecv`` of bytes completed within the deadline (GPU
  arrays are staged through host memory when the ring's transport is MPI). Not
  ``MPI.Ialltoallv``: MPICH 5.0.2 progresses a nonblocking all-to-all a little per test,
  so 4 MiB a peer took 46 ms at 2 ranks with the wait spinning and 576 ms with it sleeping
  between tests (as the watchdog's waits do where ranks share cores), against 0.5-0.6 ms
  for the same bytes as point-to-point transfers either way (4 ranks: 4.6 ms; a blocking
  ``Alltoallv`` 1.9 and 7.0 ms). Counts are bytes, so a share over 2**31 - 1 bytes needs
  MPI-4's large-count routines, which mpi4py 4 calls where the MPI library has them.
- A transport's transfers (``transport=``: NCCL on GPUs, the plan's transport ``on`` the
  group's communicator): NCCL runs the group as one all-to-all on its stream, ordered after
  the kernels that wrote the shares and before those that read them, with no copy through
  the host. NCCL has no all-to-all call of its own; grouped sends and receives are how it
  is written.
"""

import numpy as np

from .._transfers import to_device
from .mpi import MPITransport

__all__ = ["AllToAll", "HeadExchange", "TokenExchange"]


TAG = 51  # the exchange's messages (after the ring's, which have completed: no other message is pending)


class AllToAll:
    """One all-to-all of byte parts over ``comm``. ``transport``: None for MPI's transfers of
    host arrays (``waits``, a host transport over ``comm``: its waits have the deadline), or
    a transport over ``comm`` whose grouped point-to-point transfers carry the parts (NCCL:
    arrays of ``xp``, CuPy). ``bytes_sent`` counts what
    left this rank; ``bytes_to`` per destination (``Nodes.internode`` reads it)."""

    what = "the all-to-all"

    def __init__(self, comm, transport=None, xp=np, waits=None):
        self.comm, self.transport, self.xp = comm, transport, xp
        self.waits = MPITransport(comm) if waits is None else waits
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.bytes_sent, self.bytes_to = 0, {}

    def reset(self):
        self.bytes_sent, self.bytes_to = 0, {}

    def _exchange(self, parts, recv_shapes, dtype):
        """Send ``parts[j]`` (arrays) to member j; return the arrays received from each member,
        of ``recv_shapes`` and ``dtype``. Each part travels as it lies (no packing into one
        buffer), and this rank's own part is handed back as received, uncopied."""
        xp, me = self.xp, self.rank
        parts = [xp.ascontiguousarray(p) for p in parts]
        recvs = [parts[j].reshape(s) if j == me else xp.empty(s, dtype) for j, s in enumerate(recv_shapes)]
        self._point_to_point(parts, recvs)
        for j, p in enumerate(parts):
            if j != me and p.size:
                self.bytes_sent += p.nbytes
                self.bytes_to[j] = self.bytes_to.get(j, 0) + p.nbytes
        return recvs

    def _point_to_point(self, parts, recvs):
        """The exchange as one group of sends and receives on ``transport`` (or MPI's,
        ``waits``), waited for (on NCCL: the compute stream waits; the host does not)."""
        me = self.rank
        as_bytes = lambda a: a.reshape(-1).view(self.xp.uint8)
        t, reqs, peers = self.transport or self.waits, [], []
        with t.group():
            for j in range(self.size):
                if j != me and parts[j].size:
                    reqs.append(t.isend(as_bytes(parts[j]), j, TAG))
                    peers.append((f"send {self.what}'s part to", j))
                if j != me and recvs[j].size:
                    reqs.append(t.irecv(as_bytes(recvs[j]), j, TAG))
                    peers.append((f"receive {self.what}'s part from", j))
        t.wait(reqs, peers)


class HeadExchange(AllToAll):
    """The all-to-all of one group: ``comm`` (the group's ranks, in group order) and the
    positions each member holds (``positions[m]``, increasing). ``transport``: None for MPI's
    transfers of host arrays, or a transport over ``comm`` whose grouped point-to-point
    transfers carry the shares (NCCL: arrays of ``xp``, CuPy)."""

    what = "the all-to-all of head parallelism"

    def __init__(self, comm, positions, transport=None, xp=np, waits=None):
        super().__init__(comm, transport, xp, waits)
        merged = np.sort(np.concatenate(positions)) if positions else np.zeros(0, np.int64)
        self.counts = [len(p) for p in positions]
        self.rows = len(merged)
        # Where member m's rows sit among the group's (as indices of the arrays' module).
        self.places = [to_device(xp, np.searchsorted(merged, p)) for p in positions]

    def to_heads(self, x, heads):
        """``x`` (B, C_me, H, ...), this rank's tokens of every head, to (B, C_group, h, ...):
        the group's tokens of the heads ``heads[self.rank]`` (``heads[j]``: the slice of
        head indices member j serves; replicated heads may repeat between members)."""
        x = self.xp.asarray(x)
        B, rest = x.shape[0], x.shape[3:]
        mine = heads[self.rank]
        h = mine.stop - mine.start
        parts = [x[:, :, heads[j]] for j in range(self.size)]
        got = self._exchange(parts, [(B, c, h) + rest for c in self.counts], x.dtype)
        out = self.xp.empty((B, self.rows, h) + rest, x.dtype)
        for place, part in zip(self.places, got):
            out[:, place] = part
        return out

    def to_tokens(self, y, heads, nheads, add=False):
        """The way back: ``y`` (B, C_group, h, ...), the group's tokens of this rank's heads, to
        (B, C_me, nheads, ...), this rank's tokens of every head. Heads served by several
        members (replicated K/V heads) are summed in member order where ``add`` (in ``y``'s
        dtype: the caller hands unrounded shares), else taken from the first member."""
        xp = self.xp
        y = xp.asarray(y)
        B, rest = y.shape[0], y.shape[3:]
        parts = [y[:, place] for place in self.places]
        mine = self.counts[self.rank]
        got = self._exchange(parts, [(B, mine, h.stop - h.start) + rest for h in heads], y.dtype)
        if add:
            out = xp.zeros((B, mine, nheads) + rest, y.dtype)
            for sl, part in zip(heads, got):
                out[:, :, sl] += part
            return out
        out = xp.empty((B, mine, nheads) + rest, y.dtype)
        for sl, part in reversed(list(zip(heads, got))):  # the first member's copy wins
            out[:, :, sl] = part
        return out



class TokenExchange(AllToAll):
    """Tokens from one layout to another over all the ranks of ``comm``: ``source[r]`` and
    ``target[r]`` are the global positions rank r holds before and after (increasing, a
    partition of the sequence each). ``forth`` moves a rank's rows from the source layout
    to the target's, ``back`` the other way; each is one all-to-all, and a token that
    stays on its rank is copied locally. Only the tokens that change rank travel, in
    increasing position on both sides, so the exchange is irregular where documents make
    the layouts so (``masks._layout``)."""

    what = "the all-to-all of the causal balancing"

    def __init__(self, comm, source, target, transport=None, xp=np, waits=None):
        super().__init__(comm, transport, xp, waits)
        me, P = self.rank, self.size
        n = sum(len(p) for p in source)
        owner, index = np.empty(n, np.int64), np.empty(n, np.int64)  # target rank and row of each token
        for r, p in enumerate(target):
            owner[p], index[p] = r, np.arange(len(p))
        mine = np.asarray(source[me])
        # sends[j]: my source rows going to rank j; recvs[j]: my target rows coming from rank j.
        self.sends = [np.flatnonzero(owner[mine] == j) for j in range(P)]
        self.recvs = [index[np.asarray(source[j])[owner[source[j]] == me]] for j in range(P)]
        self.rows = (len(source[me]), len(target[me]))
        self._sends = [to_device(xp, s) for s in self.sends]
        self._recvs = [to_device(xp, s) for s in self.recvs]

    def forth(self, x, axis=1):
        """This rank's rows of the source layout (on ``axis``) to its rows of the target's."""
        return self._move(x, axis, self._sends, self._recvs, self.rows[1])

    def back(self, y, axis=1):
        """This rank's rows of the target layout to its rows of the source's."""
        return self._move(y, axis, self._recvs, self._sends, self.rows[0])

    def _move(self, x, axis, take, put, rows):
        xp = self.xp
        x = xp.asarray(x)
        parts = [xp.take(x, idx, axis=axis) for idx in take]
        shape = lambda c: x.shape[:axis] + (c,) + x.shape[axis + 1:]
        got = self._exchange(parts, [shape(len(idx)) for idx in put], x.dtype)
        out = xp.empty(shape(rows), x.dtype)
        lead = (slice(None),) * axis
        for idx, part in zip(put, got):
            if len(idx):
                out[lead + (idx,)] = part
        return out

