"""Ring communication: packets, and double-buffered channels.

A ``Channel`` owns two copies of one packet (several named tensors packed into one
contiguous buffer, so a ring step is a single message) and has an explicit
post / wait API:

    chan.post(send=True, recv=True)   # Isend(current -> next), Irecv(prev -> spare)
    ... compute on chan.current ...   # call chan.progress() now and then
    chan.wait()                       # both done; spare becomes current

A ``PartialChannel`` carries a gradient partial one step behind its packet: it is
received into one buffer and sent from two alternating ones, so the send of step t may
still be in flight while step t+1 fills the other; a rank's own partial comes home into a
fourth. A packet that a rank passes on may go ahead of its step (``Channel.post(forward=)``).

Misuse (posting twice, waiting with nothing posted) raises instead of corrupting data.
A channel moves its buffers through a transport (``mpi``, ``shm``, ``nccl``).
"""

import numpy as np


__all__ = ["Channel", "PartialChannel", "field_bytes", "Packet", "packed_fields",
           "rows_bytes"]

# A partial going home travels on its own tag, so that it can never pair with a receive
# meant for a partial passing through from the same rank (with two ranks the next rank is
# the previous one), whatever order the two are posted in.
HOME_TAG_OFFSET = 500

# Every field of a packet starts on a 16-byte boundary: the CUDA kernels copy rows with
# 16-byte cp.async, and views into one buffer keep the alignment only if each field does.
FIELD_ALIGN = 16

def field_bytes(shape, dtype):
    """Bytes one packet field takes, padded to the next field's 16-byte boundary."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return -(-n // FIELD_ALIGN) * FIELD_ALIGN


def check_rows(who, arg, n, most):
    """A packet's row count ``n`` (None: all ``most``): ValueError naming ``arg`` unless
    0 <= n <= most (``most`` None: fields without rows, nothing to check)."""
    if n is not None and most is not None and not (isinstance(n, (int, np.integer)) and 0 <= n <= most):
        raise ValueError(f"{type(who).__name__}: {arg}: expected a row count in [0, {most}], got {n!r}")


def check_send_rows(who, n, held):
    """The rows ``n`` a step sends on (None: all) of a packet holding ``held``: ValueError
    unless n <= held (``held`` None: fields without rows, all or nothing)."""
    if n is not None and n != held and (held is None or n > held):
        raise ValueError(f"{type(who).__name__}.post: send_rows: expected at most the {held} rows held, got {n}")


def _address(buf):
    data = getattr(buf, "data", None)
    ptr = getattr(data, "ptr", None)  # CuPy
    return int(ptr) if ptr is not None else int(buf.ctypes.data)


def packed_fields(fields, alloc):
    """One contiguous byte buffer holding every field, plus a view per field."""
    order = sorted(fields, key=lambda f: -np.dtype(f[2]).itemsize)
    sizes = [field_bytes(shape, dt) for _, shape, dt in order]
    raw = alloc(sum(sizes))
    views, off = {}, 0
    for (name, shape, dt), n in zip(order, sizes):
        used = int(np.prod(shape)) * np.dtype(dt).itemsize
        views[name] = raw[off:off + used].view(dt).reshape(shape)
        off += n
    return raw, views


def _with_rows(fields, n):
    """``fields`` with ``n`` rows (every ring field has its rows on axis 2)."""
    return [(name, (*shape[:2], n, *shape[3:]), dt) for name, shape, dt in fields]


def rows_bytes(fields, n):
    """Bytes of a packet of ``fields`` holding ``n`` rows."""
    return sum(field_bytes(shape, dt) for _, shape, dt in _with_rows(fields, n))


class Packet:
    """A buffer for one packet of up to ``rows`` rows (the fields' axis 2).

    A packet of n rows lies at the start of the buffer with its fields back to back, each
    shaped for n rows: it is one message of ``nbytes(n)`` bytes, and the kernels read every
    field as if it had been allocated for n rows. That is what lets a packet shrink on its
    way around the ring (``Geometry.route``) while staying a single contiguous message."""

    def __init__(self, fields, alloc):
        # Fields without a rows axis (tests' toy packets) make a packet of fixed size.
        self.fields = fields
        self.rows = fields[0][1][2] if all(len(shape) > 2 for _, shape, _ in fields) else None
        self.raw, full = packed_fields(fields, alloc)
        self._views = {self.rows: full}

    def nbytes(self, n):
        return self.raw.nbytes if n == self.rows else rows_bytes(self.fields, n)

    def message(self, n):
        """The bytes of a packet of ``n`` rows."""
        return self.raw[:self.nbytes(n)]

    def views(self, n):
        """The fields of a packet of ``n`` rows (cached)."""
        v = self._views.get(n)
        if v is None:
            raw = self.raw
            v = self._views[n] = packed_fields(_with_rows(self.fields, n), lambda size: raw[:size])[1]
        return v


class Counted:
    """A channel's byte counts for one phase: sent (in all, and to each rank: what
    ``PhaseStats.bytes_internode`` sums over the ranks of other nodes) and received."""

    def reset_counts(self):
        self.bytes_sent = self.bytes_recv = 0
        self.bytes_to = {}

    def count_sent(self, dest, n):
        self.bytes_sent += n
        self.bytes_to[dest] = self.bytes_to.get(dest, 0) + n


class Channel(Counted):
    """Two copies of one packet circulating around the ring.

    A packet may hold fewer rows than the most (``Packet``): the owner says how many it
    fills (``fill``), and each step how many rows go on (``post(send_rows=...)``, the
    farthest-reaching first, so they are a prefix) and how many arrive (``recv_rows``).
    When fewer rows go on than arrived, they are first copied into a staging packet
    allocated on first use by ``stage``; without row counts every packet is full."""

    step = 0  # the transfers posted since the phase began (the watchdog names the ring step)

    @staticmethod
    def copies(single):
        """Packet-sized buffers it allocates: a ring of one rank never receives, so its
        spare would never be used."""
        return 1 if single else 2

    def __init__(self, transport, fields, *, send_to, recv_from, tag, alloc, single=False, stage=None):
        self.transport = transport
        self.send_to, self.recv_from, self.tag = send_to, recv_from, tag
        bufs = [Packet(fields, alloc) for _ in range(self.copies(single))]
        self._bufs = bufs * 2 if single else bufs  # current and spare
        self.rows = bufs[0].rows
        self.nbytes = bufs[0].raw.nbytes
        self._held = [self.rows, self.rows]  # rows of the packet in each buffer
        self._stage_alloc, self._stage = stage, None
        self._cur = 0
        self._pending = self._forward = self._ahead = None
        self.reset_counts()

    def begin(self):
        """A phase starts (``Runtime.channels``): its byte counts start from zero, and the
        packets are full until told otherwise."""
        if self._ahead is not None:  # sent ahead, always posted by the next step of its phase
            raise RuntimeError(f"{type(self).__name__}.begin: the last phase left a packet sent ahead")
        self._forward = None
        self.step = 0
        self.reset_counts()
        self._held = [self.rows, self.rows]

    @property
    def current(self):
        """The views of the packet the ring step computes on."""
        return self._bufs[self._cur].views(self._held[self._cur])

    def fill(self, n):
        """The views of this rank's own packet of ``n`` rows, to write it (step 0)."""
        check_rows(self, "fill", n, self.rows)
        self._held[self._cur] = n
        return self.current

    def post(self, *, send, recv, send_rows=None, recv_rows=None, forward=False, forward_rows=None):
        """Post the send of the current packet (its first ``send_rows`` rows) and the
        receive into the spare one (a packet of ``recv_rows`` rows).

        ``forward``: the next step sends the packet being received on (its first
        ``forward_rows``). Where the transport allows it (``eager``), ``progress`` sends it
        as soon as it is here instead: a packet that crosses several ranks then waits for
        none of their computations, only for its transfers."""
        if self._pending is not None:
            raise RuntimeError(f"{type(self).__name__}.post: the previous transfer has not been waited for")
        for arg, n in (("send_rows", send_rows), ("recv_rows", recv_rows), ("forward_rows", forward_rows)):
            check_rows(self, arg, n, self.rows)
        self.step += 1
        reqs, peers = [], []
        if send:
            peers.append((f"send the ring's packet of step {self.step} to", self.send_to))
            if self._ahead is not None:  # already on its way (``progress``)
                req, rows = self._ahead
                if rows != send_rows:
                    raise RuntimeError(f"{type(self).__name__}.post: send_rows: the packet went ahead with "
                                       f"{rows} rows, got {send_rows}")
                reqs.append(req)
                self._ahead = None
            else:
                out, n = self._outgoing(send_rows)
                reqs.append(self.transport.isend(out, self.send_to, self.tag))
                self.count_sent(self.send_to, n)
        elif self._ahead is not None:
            raise RuntimeError(f"{type(self).__name__}.post: a packet went ahead, but send is False")
        if recv:
            into, n = self._incoming(recv_rows)
            reqs.append(self.transport.irecv(into, self.recv_from, self.tag))
            peers.append((f"receive the ring's packet of step {self.step} from", self.recv_from))
            self.bytes_recv += n
        eager = recv and forward and getattr(self.transport, "eager", False)
        self._forward = (forward_rows,) if eager else None
        self._pending = (reqs, recv, peers)

    # What a step sends and receives into (each with the packet bytes it stands for), and
    # what an arrival changes (``shm.ShmChannel`` moves tokens instead of packets). The
    # packet sent is the current one, or (``ahead``) the one just received.
    def _outgoing(self, n, ahead=False):
        i = 1 - self._cur if ahead else self._cur
        held, packet = self._held[i], self._bufs[i]
        check_send_rows(self, n, held)
        n = held if n is None else n
        if n == held:
            out = packet.message(n)
            return out, out.nbytes
        if self._stage is None:  # the rows going on are a prefix of a packet laid out for more
            self._stage = Packet(packet.fields, self._stage_alloc or (lambda size: np.empty(size, np.uint8)))
        views = self._stage.views(n)
        for name, view in packet.views(held).items():
            views[name][...] = view[:, :, :n]
        out = self._stage.message(n)
        return out, out.nbytes

    def _incoming(self, n):
        n = self.rows if n is None else n
        self._held[1 - self._cur] = n
        into = self._bufs[1 - self._cur].message(n)
        return into, into.nbytes

    def _arrived(self):
        self._cur = 1 - self._cur

    def progress(self):
        """Move the posted transfers along; True while some are still in flight (the
        caller's cue to call again), False once none are (or the transport needs no help).
        Once this step's are done, a packet to forward goes on at once (``post``): the
        send it replaces read the staging buffer or token this one reuses, so not before."""
        reqs = (self._pending[0] if self._pending else []) + ([self._ahead[0]] if self._ahead else [])
        if not reqs:
            return False
        if not self.transport.progress(reqs):
            return True
        if self._forward is None or self._ahead is not None:
            return False
        (rows,), self._forward = self._forward, None
        out, n = self._outgoing(rows, ahead=True)
        self._ahead = (self.transport.isend(out, self.send_to, self.tag), rows)
        self.count_sent(self.send_to, n)
        return True

    def wait(self):
        """Wait for the posted transfers; a received packet becomes current (a packet sent
        ahead is the next step's transfer: ``post`` waits for it with that one's)."""
        if self._pending is None:
            raise RuntimeError(f"{type(self).__name__}.wait: nothing was posted")
        reqs, received, peers = self._pending
        self._pending = self._forward = None
        if reqs:
            self.transport.wait(reqs, peers)
        if received:
            self._arrived()


class PartialChannel(Counted):
    """A gradient partial travelling one ring step behind its packet.

    A partial holds as many rows as its packet had when it left its owner (``rows`` in
    ``post_recv`` and ``send_buffer``; all of them when not given), in the same layout as
    ``Packet``: one message of just those rows. The last rank to add to a partial sends it
    straight home (``post_send(dest=)``); the owner receives its own into a buffer of its
    own (``home=True``), as that may arrive while another partial passes through."""

    @staticmethod
    def copies(single):
        """Partial-sized buffers it allocates: one receive, two alternating sends and the
        home one; a ring of one rank has no partials, so one (unused) buffer stands for all."""
        return 1 if single else 4

    def __init__(self, transport, fields, *, send_to, recv_from, tag, alloc, single=False, stage=None):
        self.transport = transport
        self.send_to, self.recv_from, self.tag = send_to, recv_from, tag
        bufs = [Packet(fields, alloc) for _ in range(self.copies(single))]
        if single:
            bufs = bufs * 4
        self._recv, self._send, self._home = bufs[0], bufs[1:3], bufs[3]
        self.rows = bufs[0].rows
        self._send_reqs, self._dests = [None, None], [None, None]
        self._next = 0
        self._recvs = {}  # home? -> (request, buffer, rows)
        self._sources = {}  # home? -> the rank a posted receive waits for (the watchdog names it)
        self._send_rows = self.rows
        self.nbytes = self._recv.raw.nbytes
        self.reset_counts()

    def begin(self):
        """A phase starts (``Runtime.channels``): its byte counts start from zero."""
        self.reset_counts()

    def post_recv(self, source=None, rows=None, home=False):
        if home in self._recvs:
            raise RuntimeError("PartialChannel.post_recv: the previous receive is still pending")
        check_rows(self, "rows", rows, self.rows)
        src = self.recv_from if source is None else source
        rows = self.rows if rows is None else rows
        buf = self._home if home else self._recv
        into = buf.message(rows)
        self._recvs[home] = (self.transport.irecv(into, src, self.tag + (HOME_TAG_OFFSET if home else 0)), buf, rows)
        self._sources[home] = src
        self.bytes_recv += into.nbytes

    def received(self, home=False):
        """Wait for the posted receive (the home one: ``home``) and return its views."""
        if home not in self._recvs:
            raise RuntimeError("PartialChannel.received: no receive was posted")
        req, buf, rows = self._recvs.pop(home)
        self.transport.wait([req], [("receive a gradient partial from", self._sources.pop(home))])
        return buf.views(rows)

    @staticmethod
    def done():
        """The last partial received has been added (its buffer is free here already)."""

    def send_buffer(self, rows=None):
        """Return zeroed views of the next send buffer, for ``rows`` rows (waiting for its
        last send)."""
        check_rows(self, "rows", rows, self.rows)
        i = self._next
        if self._send_reqs[i] is not None:
            self.transport.wait([self._send_reqs[i]], [("send a gradient partial to", self._dests[i])])
            self._send_reqs[i] = None
        self._send_rows = self.rows if rows is None else rows
        self._send[i].message(self._send_rows).fill(0)
        return self._send[i].views(self._send_rows)

    def post_send(self, dest=None, home=False):
        """Send the buffer last returned by ``send_buffer`` to the next rank, or to
        ``dest``; ``home``: it goes to its owner, which receives it with ``home=True``."""
        i = self._next
        out = self._send[i].message(self._send_rows)
        dest = self.send_to if dest is None else dest
        self._send_reqs[i] = self.transport.isend(out, dest, self.tag + (HOME_TAG_OFFSET if home else 0))
        self._dests[i] = dest
        self.count_sent(dest, out.nbytes)
        self._next = 1 - i

    def progress(self):
        """Move the partial's transfers along; True while some are still in flight (as
        ``Channel.progress``: the compute loop keeps polling until both say False)."""
        reqs = [r for r in (*self._send_reqs, *(req for req, _, _ in self._recvs.values())) if r is not None]
        return bool(reqs) and not self.transport.progress(reqs)

    def drain(self):
        """Complete every outstanding send (at the end of a phase)."""
        sent = [(r, ("send a gradient partial to", d)) for r, d in zip(self._send_reqs, self._dests) if r is not None]
        if sent:
            self.transport.wait([r for r, _ in sent], [p for _, p in sent])
        self._send_reqs = [None, None]
