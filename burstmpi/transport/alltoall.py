"""Sequence shards to head shards and back, inside a group of ranks: one all-to-all each way.

Head parallelism (``burstmpi.heads``, DeepSpeed-Ulysses' exchange) gives each of the u
ranks of a group all the group's tokens for 1/u of the heads: rank i sends member j the
heads j serves of its own tokens, and receives from every member that member's tokens of
the heads it serves itself. The group's tokens are kept in increasing position (the
merged layout ``NAME/u`` of ``burstmpi.masks.layout``), so each member's rows land at their
places in that order, not one member after another.

One ``MPI.Alltoallv`` of bytes per array and direction. GPU arrays are staged through host
memory (CUDA-aware MPI and NCCL's all-to-all would skip the copies: not done yet). Counts
are bytes, so a member's share over 2**31 - 1 bytes needs MPI-4's large-count routines,
which mpi4py 4 calls where the MPI library has them: a 2 GiB + 64 B exchange between 2
ranks arrived intact with mpi4py 4.1.2 and MPICH 5.0.2. An MPI without them was not tried.
"""

import numpy as np
from mpi4py import MPI

__all__ = ["HeadExchange"]


class HeadExchange:
    """The all-to-all of one group: ``comm`` (the group's ranks, in group order) and the
    positions each member holds (``positions[m]``, increasing)."""

    def __init__(self, comm, positions):
        self.comm = comm
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        merged = np.sort(np.concatenate(positions)) if positions else np.zeros(0, np.int64)
        self.counts = [len(p) for p in positions]
        self.rows = len(merged)
        # Where member m's rows sit among the group's.
        self.places = [np.searchsorted(merged, p) for p in positions]
        self.bytes_sent = 0

    def _exchange(self, parts, recv_shapes, dtype):
        """Send ``parts[j]`` (arrays) to member j; return the arrays received from each member,
        of ``recv_shapes`` and ``dtype``."""
        item = np.dtype(dtype).itemsize
        send = np.concatenate([np.ascontiguousarray(p).reshape(-1).view(np.uint8) for p in parts]) \
            if parts else np.zeros(0, np.uint8)
        scounts = [p.size * item for p in parts]
        rcounts = [int(np.prod(s)) * item for s in recv_shapes]
        recv = np.empty(sum(rcounts), np.uint8)
        self.comm.Alltoallv([send, (scounts, _displs(scounts)), MPI.BYTE],
                            [recv, (rcounts, _displs(rcounts)), MPI.BYTE])
        self.bytes_sent += sum(c for j, c in enumerate(scounts) if j != self.rank)
        out, at = [], 0
        for shape, n in zip(recv_shapes, rcounts):
            out.append(recv[at:at + n].view(dtype).reshape(shape))
            at += n
        return out

    def to_heads(self, x, heads):
        """``x`` (B, C_me, H, ...), this rank's tokens of every head, to (B, C_group, h, ...):
        the group's tokens of the heads ``heads[self.rank]`` (``heads[j]``: the slice of
        head indices member j serves; replicated heads may repeat between members)."""
        x = np.asarray(x)
        B, rest = x.shape[0], x.shape[3:]
        mine = heads[self.rank]
        h = mine.stop - mine.start
        parts = [x[:, :, heads[j]] for j in range(self.size)]
        got = self._exchange(parts, [(B, c, h) + rest for c in self.counts], x.dtype)
        out = np.empty((B, self.rows, h) + rest, x.dtype)
        for place, part in zip(self.places, got):
            out[:, place] = part
        return out

    def to_tokens(self, y, heads, nheads, add=False):
        """The way back: ``y`` (B, C_group, h, ...), the group's tokens of this rank's heads, to
        (B, C_me, nheads, ...), this rank's tokens of every head. Heads served by several
        members (replicated K/V heads) are summed in member order where ``add`` (in ``y``'s
        dtype: the caller hands unrounded shares), else taken from the first member."""
        y = np.asarray(y)
        B, rest = y.shape[0], y.shape[3:]
        parts = [y[:, place] for place in self.places]
        mine = self.counts[self.rank]
        got = self._exchange(parts, [(B, mine, h.stop - h.start) + rest for h in heads], y.dtype)
        if add:
            out = np.zeros((B, mine, nheads) + rest, y.dtype)
            for sl, part in zip(heads, got):
                out[:, :, sl] += part
            return out
        out = np.empty((B, mine, nheads) + rest, y.dtype)
        for sl, part in reversed(list(zip(heads, got))):  # the first member's copy wins
            out[:, :, sl] = part
        return out


def _displs(counts):
    return np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64).tolist() if counts else []
