"""Ring packets read in place by the ranks of one node: no copy per ring step.

Over MPI every ring step copies each packet into the next rank's buffer. On one node that
copy is MPICH's single-copy path (``process_vm_readv``), done by the receiver inside the
``Testall`` polls between its tiles: it takes time from the tiles and slows the tiles
computed meanwhile (the copy streams the packet through the caches they work in). Yet
every rank of a node can map every other's memory, so nothing needs to move.

``ShmTransport`` puts the ring's buffers in memory every rank of the node maps
(``node_memory``: a POSIX shared-memory file of burstmpi's own, not an MPI window), and
``ShmChannel`` hands the rank holding a packet at step t views of the owner's own copy.
What travels around the ring is a token, the packet's owner (8 bytes), posted and waited
for exactly where the MPI ring sends and receives the packet: the schedule, the skipped
steps and the order of every phase stay ``burstmpi._ring.flat``'s, and a rank reads a
packet only after the token chain from its owner reached it.

Memory ordering comes from the tokens: a packet is read only after a token sent after it
was written has arrived (``node_memory`` says why an MPI message orders the bytes around
it, as ``Win_sync`` did when the memory was an MPI window). An owner rewrites its packet
in a later phase only: a phase ends with a nonblocking barrier (``finish``), and the next
one starts by completing it (``begin``), so no rank is still reading when its owner
writes again (the call's own agreement collective, ``validate.agree``, has ordered every
rank past the old phase by then, so the wait returns at once).

A gradient partial (``ShmPartialChannel``) is read in place too, by the one rank it goes
to, which adds it to its own; the sender alternates two buffers, so before it writes one
again it waits for the reader's acknowledgement that it has been added (a second token,
going back). A partial going home is the exception: its owner adds it only after its own
last step, so the sender copies it into the owner's home buffer and moves on.

Every plan on one communicator shares its transport (``transport_for``) and so one window
(the node's shared memory), grown to the largest phase any of them ran: plans made per
call (``burstmpi.attention``) neither allocate a window each nor leave one behind. The window belongs to the state of
the caller's communicator (``lifetime``): it goes when the caller frees that communicator,
or when a plan is released (``BurstAttention.release``, ``burstmpi.release_cached``),
never when the plan cache evicts a plan. Freeing it is collective (it waits for the fence
of the last phase), so those calls are too (every rank makes them, as every rank makes
the calls); the next phase of any plan allocates a new one. The memory itself goes when
the last rank of the node drops its views.
"""

import os

import numpy as np

from .comm import (HOME_TAG_OFFSET, Channel, Counted, Packet, PartialChannel, check_rows, check_send_rows,
                   packed_fields, rows_bytes)
from .mpi import MPITransport
from .lifetime import count, resource
from .node_memory import NotShared, map_node_memory
from .segments import SHM_DIR
from .watchdog import allgather

__all__ = ["ShmTransport", "ShmChannel", "ShmPartialChannel", "NoRoom", "transport_for", "free_shared_bytes"]

# A partial's acknowledgement travels back on its own tag: with two ranks the neighbour
# the partials come from is the one they go to.
ACK_TAG_OFFSET = 1000

def free_shared_bytes():
    """Bytes free in ``SHM_DIR``, or None where there is none to ask (not Linux)."""
    try:
        st = os.statvfs(SHM_DIR)
    except (OSError, AttributeError):
        return None
    return st.f_bavail * st.f_frsize


class NoRoom(RuntimeError):
    """The node's shared memory cannot hold the window, or some rank cannot map it (raised
    alike on every rank)."""


def transport_for(comm):
    """The ``ShmTransport`` of ``comm`` (burstmpi's private communicator), created on first
    use and kept by the state of the caller's communicator (``lifetime``): its window is
    freed when the caller frees that communicator, not when a plan goes."""
    return resource(comm, ("shm",), lambda: ShmTransport(comm), _free_transport)


def _free_transport(transport, collective):
    """The state's teardown: free the window (collective), or at exit only forget it."""
    if collective:
        transport.free()
    else:
        transport.forget()


class ShmTransport(MPITransport):
    """MPI transfers (the gradient partials), plus a shared window for the ring buffers.

    ``comm``'s ranks must share one node's memory."""

    name = "shm"

    def __init__(self, comm):
        super().__init__(comm)
        self.rank = comm.Get_rank()
        self._arenas = None  # every rank's part of the window, as bytes (peers' read-only)
        self._fence = None   # the Ibarrier that ended the last phase
        self._open = False   # a phase began and has not finished

    def on(self, comm):
        """Plain MPI over another communicator: the window is this one's (its ranks map it)."""
        return self._like(MPITransport(comm))

    @staticmethod
    def channel_for(cls):
        """The channel class that carries ``cls``'s traffic here."""
        return {Channel: ShmChannel, PartialChannel: ShmPartialChannel}.get(cls, cls)

    def arena(self, nbytes):
        """This rank's part of the window, at least ``nbytes`` (collective when it grows:
        every rank asks for the same size, as ``Runtime.channels`` does). A new window is a
        new array: views of the old one are gone with it."""
        if self._arenas is None or self._arenas[self.rank].nbytes < nbytes:
            self._alloc(nbytes)
        return self._arenas[self.rank]

    def _alloc(self, nbytes):
        """A new shared window of ``nbytes`` per rank, the previous one freed; ``NoRoom``
        on every rank if some rank's ``SHM_DIR`` could not hold the whole node's (with a
        tenth to spare, for the MPI's own segments)."""
        self.free()
        P = self.comm.Get_size()
        free = free_shared_bytes()
        room = min(allgather(self.comm, -1 if free is None else free, self.timeout, "the check of the node's room"))
        if 0 <= room < 1.1 * P * nbytes:
            raise NoRoom(f"transport 'shm': the ring's buffers need {P * nbytes / 1e6:.1f} MB of shared "
                         f"memory on this node ({P} ranks x {nbytes / 1e6:.1f} MB), but {SHM_DIR} has "
                         f"{room / 1e6:.1f} MB free; enlarge it (docker run --shm-size=...) or use "
                         "transport='mpi'")
        try:
            arenas = map_node_memory(self.comm, nbytes, self.timeout, "the ring buffers' shared memory")
        except NotShared as e:
            raise NoRoom(f"transport 'shm': {e}; use transport='mpi'") from None
        count("windows")
        self._arenas = arenas
        return arenas[self.rank]

    def peer(self, rank, view, write=False):
        """Rank ``rank``'s bytes at the place of ``view`` (bytes of this rank's arena):
        read-only, as a peer's packet is read in place, unless ``write`` (a partial going
        home is written into its owner's home buffer)."""
        off = view.ctypes.data - self._arenas[self.rank].ctypes.data
        out = self._arenas[rank][off:off + view.nbytes]
        if rank != self.rank and not write:
            out = out.view()
            out.flags.writeable = False
        return out

    def begin(self):
        """A phase starts: every rank has finished reading the last phase's packets."""
        if self._fence is None and self._open:  # the last phase raised before finish(): fence now
            self._fence = self.comm.Ibarrier()
        self._settle()
        self._open = True

    def finish(self):
        """A phase ends (``Runtime.finish``): its fence starts, the next ``begin`` completes it."""
        if self._open:
            self._fence = self.comm.Ibarrier()
            self._open = False

    def _settle(self):
        """Complete the fence that ended the last phase, if one is pending."""
        if self._fence is not None:
            self.complete([self._fence], "the fence that ends a phase (a barrier of every rank of the node)")
            self._fence = None

    def free(self):
        """Drop the window once the last phase's fence is complete (collective); a phase
        that began stays begun (a window grown inside ``Runtime.channels`` serves the phase
        being set up). The memory goes when the node's last rank drops its views."""
        if self._arenas is not None:
            self._settle()
            self._arenas = None
            count("windows", -1)

    def forget(self):
        """Drop the window without waiting for the other ranks (at exit: ranks exit at
        different times)."""
        if self._arenas is not None:
            self._arenas = self._fence = None
            count("windows", -1)


class ShmChannel(Channel):
    """``comm.Channel`` for a packet that its holders read where its owner wrote it: one
    copy per rank, views of the owner's at each step, and tokens naming the owner where
    ``Channel`` sends and receives the packet itself.

    The owner writes its rows into a packet laid out for the most rows, and a holder views
    the first rows it is told of (``recv_rows``): nothing is copied when a packet shrinks
    (the bytes counted are those a copying ring would have moved)."""

    @staticmethod
    def copies(single):
        """Packet-sized buffers it allocates: this rank's own packet."""
        return 1

    def __init__(self, transport, fields, *, send_to, recv_from, tag, alloc, single=False, stage=None):
        self.transport = transport
        self.send_to, self.recv_from, self.tag = send_to, recv_from, tag
        self._packet = Packet(fields, alloc)
        self._raw, self.rows = self._packet.raw, self._packet.rows
        self._views = {transport.rank: self._packet.views(self.rows)}
        self._owner = transport.rank
        self._held = self._next = self.rows
        self._tokens = np.zeros(2, dtype=np.int64)  # [sent, received]
        self._pending = self._forward = self._ahead = None
        self.reset_counts()

    def begin(self):
        """A phase starts with this rank's own packet current (``Runtime.channels``)."""
        if self._pending is not None or self._ahead is not None:
            raise RuntimeError("ShmChannel.begin: the last phase left a transfer posted")
        self._forward = None
        self.step = 0
        self._owner = self.transport.rank
        self._held = self.rows
        self.reset_counts()

    @property
    def current(self):
        """The views of the packet the ring step computes on (its owner's memory)."""
        views = self._views.get(self._owner)
        if views is None:
            theirs = self.transport.peer(self._owner, self._raw)
            views = self._views[self._owner] = packed_fields(self._packet.fields, lambda n: theirs[:n])[1]
        if self._held == self.rows:
            return views
        return {name: v[:, :, :self._held] for name, v in views.items()}

    def fill(self, n):
        check_rows(self, "fill", n, self.rows)
        self._held = n
        return self.current

    def _outgoing(self, n, ahead=False):  # the token leaves after the packet's bytes were written
        held = self._next if ahead else self._held
        check_send_rows(self, n, held)
        self._tokens[0] = self._tokens[1] if ahead else self._owner
        return self._tokens[0:1], self._packet.nbytes(held if n is None else n)

    def _incoming(self, n):
        self._next = self.rows if n is None else n
        return self._tokens[1:2], self._packet.nbytes(self._next)

    def _arrived(self):  # and is read only after the token came
        self._owner, self._held = int(self._tokens[1]), self._next


class ShmPartialChannel(Counted):
    """``comm.PartialChannel``'s interface for gradient partials read in place: sent from
    two alternating buffers, each written again only after its reader acknowledged it (on
    a tag of the buffer's own, so acknowledgements never pair with the wrong buffer). A
    partial going home is instead copied into its owner's home buffer (one per rank and
    phase, as one partial comes home to each rank) and needs no acknowledgement."""

    @staticmethod
    def copies(single):
        """Partial-sized buffers it allocates: the two it sends from (it reads the sender's),
        and its home buffer."""
        return 3

    def __init__(self, transport, fields, *, send_to, recv_from, tag, alloc, single=False, stage=None):
        self.transport = transport
        self.send_to, self.recv_from, self.tag = send_to, recv_from, tag
        self._fields = fields
        # Laid out for the most rows; a partial of fewer is their first rows (``comm.Packet``
        # counts the bytes a copying ring would move).
        self._send = [packed_fields(fields, alloc) for _ in range(2)]
        # Our own partial comes home into this buffer, written by its last contributor: we
        # add it after our last step (``ring.backward``), so it is copied rather than read in
        # its sender's buffer, which the sender could not write again until then.
        self._home = packed_fields(fields, alloc)
        self.rows = fields[0][1][2]
        self._send_rows = self.rows
        self._next = 0
        self._ids = np.arange(2, dtype=np.int64)    # the tokens: which buffer a partial is in
        self._got = np.zeros(2, dtype=np.int64)     # received tokens: [passing, home]
        self._acked = np.zeros(2, dtype=np.int64)   # acknowledgements' landing places
        self._acks = [None, None]  # per send buffer: the receive of its acknowledgement
        self._readers = [None, None]  # per send buffer: the rank it was sent to (the watchdog names it)
        self._sends = []           # tokens and acknowledgements in flight
        self._recvs = {}           # home? -> (request, source, rows) of a posted receive
        self._unacked = []         # (source, buffer) of partials added, not yet acknowledged
        self._views = {}
        self.reset_counts()

    def begin(self):
        """A phase starts (``Runtime.channels``): its byte counts start from zero."""
        self.reset_counts()

    def _acknowledge(self):
        """Tell the senders of the partials read that they have been added (their reads
        are done before the tokens leave)."""
        if self._unacked:
            for src, i in self._unacked:
                self._sends.append(self.transport.isend(self._ids[i:i + 1], src, self.tag + ACK_TAG_OFFSET + i))
            self._unacked = []

    def post_recv(self, source=None, rows=None, home=False):
        if home in self._recvs:
            raise RuntimeError("ShmPartialChannel.post_recv: the previous receive is still pending")
        check_rows(self, "rows", rows, self.rows)
        self._acknowledge()  # those read were added before this step began
        src = self.recv_from if source is None else source
        rows = self.rows if rows is None else rows
        slot = self._got[int(home):int(home) + 1]
        self._recvs[home] = (self.transport.irecv(slot, src, self.tag + (HOME_TAG_OFFSET if home else 0)), src, rows)
        self.bytes_recv += rows_bytes(self._fields, rows)

    def received(self, home=False):
        """Wait for the posted receive (the home one: ``home``) and return views of the
        partial: in its sender's memory (read-only; acknowledged by ``done``, or at the next
        ``post_recv`` or ``drain``), or for ``home`` in our home buffer."""
        if home not in self._recvs:
            raise RuntimeError("ShmPartialChannel.received: no receive was posted")
        req, src, rows = self._recvs.pop(home)
        self.transport.wait([req], [("receive a partial's token from", src)])
        if home:  # written here by its sender (``post_send``)
            return _first(self._home[1], rows, self.rows)
        key = (src, int(self._got[0]))
        views = self._views.get(key)
        if views is None:
            theirs = self.transport.peer(src, self._send[key[1]][0])
            views = self._views[key] = packed_fields(self._fields, lambda n: theirs[:n])[1]
        self._unacked.append(key)
        return _first(views, rows, self.rows)

    def done(self):
        """The partials received have been added: acknowledge them now, so that their
        senders may write those buffers again."""
        self._acknowledge()

    def send_buffer(self, rows=None):
        """Return zeroed views of the next send buffer, for ``rows`` rows (once its last
        reader is done)."""
        check_rows(self, "rows", rows, self.rows)
        i = self._next
        if self._acks[i] is not None:
            self.transport.wait([self._acks[i]], [("receive an acknowledgement from", self._readers[i])])
            self._acks[i] = None  # the reader's reads are done: we may write
        self._send_rows = self.rows if rows is None else rows
        views = _first(self._send[i][1], self._send_rows, self.rows)
        for v in views.values():
            v.fill(0)
        return views

    def post_send(self, dest=None, home=False):
        """Send the buffer last returned by ``send_buffer`` (to ``dest``, default the next
        rank): its token, then await its reader; or (``home``: to its owner) copy it into
        the owner's home buffer and send the token."""
        i = self._next
        dest = self.send_to if dest is None else dest
        if home:  # into the owner's home buffer: ours is free again at once
            theirs = self.transport.peer(dest, self._home[0], write=True)
            views = _first(packed_fields(self._fields, lambda n: theirs[:n])[1], self._send_rows, self.rows)
            for name, view in _first(self._send[i][1], self._send_rows, self.rows).items():
                views[name][...] = view
        self._sends.append(self.transport.isend(self._ids[i:i + 1], dest, self.tag + (HOME_TAG_OFFSET if home else 0)))
        if not home:
            self._acks[i] = self.transport.irecv(self._acked[i:i + 1], dest, self.tag + ACK_TAG_OFFSET + i)
            self._readers[i] = dest
        self.count_sent(dest, rows_bytes(self._fields, self._send_rows))
        self._next = 1 - i

    def progress(self):
        """As ``PartialChannel.progress``: True while some token is still in flight."""
        reqs = [r for r in (*self._sends, *self._acks, *(req for req, _, _ in self._recvs.values())) if r]
        return bool(reqs) and not self.transport.progress(reqs)

    def drain(self):
        """Complete every token of the phase: the partials read are acknowledged, and
        every partial sent has been added by its reader."""
        self._acknowledge()
        reqs = [r for r in (*self._sends, *self._acks) if r is not None]
        if reqs:
            self.transport.wait(reqs)
        self._sends, self._acks = [], [None, None]


def _first(views, n, rows):
    """The first ``n`` rows of a packet's views (laid out for ``rows``)."""
    return views if n == rows else {name: v[:, :, :n] for name, v in views.items()}
