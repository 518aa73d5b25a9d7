"""Channels on an in-process loopback transport: swapping, misuse, partial buffers."""

import numpy as np
import pytest

from burstmpi._transport.comm import Channel, PartialChannel
from burstmpi._transport.mpi import DeviceMPITransport, MPITransport, StagedMPITransport


class Loopback:
    """A transport whose 'neighbour' is itself: a send to any rank lands in the next
    receive posted with the same tag."""

    def __init__(self):
        self.queue = {}

    def isend(self, buf, dest, tag):
        self.queue.setdefault(tag, []).append(buf.copy())
        return ("send", tag)

    def irecv(self, buf, source, tag):
        return ("recv", tag, buf)

    def wait(self, reqs, peers=()):
        for r in reqs:
            if r[0] == "recv":
                r[2][...] = self.queue[r[1]].pop(0)

    def progress(self, reqs):
        return False


FIELDS = [("k", (2, 3), np.float16), ("lse", (2,), np.float32)]


def make(cls):
    return cls(Loopback(), FIELDS, send_to=0, recv_from=0, tag=7,
               alloc=lambda n: np.empty(n, dtype=np.uint8))


def test_channel_swaps_buffers_and_counts_bytes():
    chan = make(Channel)
    assert chan.nbytes == 16 + 16  # each field padded to a 16-byte boundary
    assert all(v.ctypes.data % 16 == 0 for v in chan.current.values())
    chan.current["k"][...] = 1
    chan.current["lse"][...] = 2
    first = chan.current["k"]
    chan.post(send=True, recv=True)
    chan.current["k"][...] = 5  # the send already took its copy in this transport
    chan.wait()
    assert chan.current["k"] is not first and (chan.current["k"] == 1).all()
    assert (chan.current["lse"] == 2).all()
    assert chan.bytes_sent == chan.bytes_recv == chan.nbytes
    chan.post(send=True, recv=False)
    chan.wait()
    assert (chan.current["k"] == 1).all(), "no receive: the current packet stays"


def test_channel_misuse_raises():
    chan = make(Channel)
    with pytest.raises(RuntimeError, match="nothing was posted"):
        chan.wait()
    chan.post(send=False, recv=True)
    with pytest.raises(RuntimeError, match="not been waited for"):
        chan.post(send=True, recv=True)


def test_partial_channel_alternates_and_zeroes_send_buffers():
    part = make(PartialChannel)
    a = part.send_buffer()
    assert (a["k"] == 0).all()
    a["k"][...] = 3
    part.post_send()
    b = part.send_buffer()
    assert b["k"] is not a["k"] and (b["k"] == 0).all()
    part.post_recv()
    assert (part.received()["k"] == 3).all()
    with pytest.raises(RuntimeError, match="no receive was posted"):
        part.received()
    part.post_send()
    part.drain()


def test_progress_says_whether_transfers_are_in_flight():
    """The compute loops poll while either channel says True: a partial still in flight
    must say so even after the packet has arrived."""
    chan, part = make(Channel), make(PartialChannel)
    assert not chan.progress() and not part.progress()
    chan.post(send=True, recv=True)
    part.send_buffer()
    part.post_send()
    part.post_recv()
    assert chan.progress() and part.progress()  # the loopback completes only in wait
    chan.wait()
    assert not chan.progress() and part.progress()
    part.received()
    part.drain()
    assert not part.progress()


class EagerLoopback(Loopback):
    """A loopback whose transfers are done as soon as posted, and which lets a packet go
    on as soon as it arrives (as MPI does)."""

    eager = True

    def irecv(self, buf, source, tag):
        buf[...] = self.queue[tag].pop(0)
        return ("done", tag)

    def progress(self, reqs):
        return True


def test_a_packet_to_forward_goes_on_as_soon_as_it_arrives():
    """``post(forward=True)``: once the step's transfers are done, ``progress`` sends the
    packet just received on, and the next step's ``post`` takes that send as its own."""
    chan = Channel(EagerLoopback(), FIELDS, send_to=0, recv_from=0, tag=7, alloc=lambda n: np.empty(n, np.uint8))
    chan.current["k"][...] = 1
    chan.post(send=True, recv=True, forward=True)
    assert chan.progress(), "the packet sent ahead is in flight"
    queue = chan.transport.queue[7]
    assert len(queue) == 1 and (queue[0][16:28].view(np.float16) == 1).all()  # k after lse
    assert chan.bytes_sent == 2 * chan.nbytes
    assert not chan.progress(), "sent once"
    chan.wait()
    chan.post(send=True, recv=False)
    assert chan.bytes_sent == 2 * chan.nbytes and len(queue) == 1, "not sent a second time"
    chan.wait()
    # Without the transport's leave (``eager``), the packet waits for its step.
    plain = Channel(EagerLoopback(), FIELDS, send_to=0, recv_from=0, tag=7, alloc=lambda n: np.empty(n, np.uint8))
    plain.transport.eager = False
    plain.post(send=True, recv=True, forward=True)
    assert not plain.progress() and not plain.transport.queue[7] and plain.bytes_sent == plain.nbytes
    plain.wait()


def test_a_packet_sent_ahead_must_be_sent_by_the_next_step():
    chan = Channel(EagerLoopback(), FIELDS, send_to=0, recv_from=0, tag=7, alloc=lambda n: np.empty(n, np.uint8))
    chan.post(send=True, recv=True, forward=True)
    chan.progress()
    chan.wait()
    with pytest.raises(RuntimeError, match="went ahead, but send is False"):
        chan.post(send=False, recv=True)


def test_row_counts_are_checked_by_name():
    rows = [("k", (1, 1, 2, 3), np.float16)]  # ring fields: rows on axis 2
    chan, part = (cls(Loopback(), rows, send_to=0, recv_from=0, tag=7, alloc=lambda n: np.empty(n, np.uint8))
                  for cls in (Channel, PartialChannel))
    with pytest.raises(ValueError, match=r"Channel: recv_rows: expected a row count in \[0, 2\], got 3"):
        chan.post(send=False, recv=True, recv_rows=3)
    with pytest.raises(ValueError, match=r"Channel: fill: expected a row count in \[0, 2\], got -1"):
        chan.fill(-1)
    with pytest.raises(ValueError, match=r"PartialChannel: rows: expected a row count in \[0, 2\], got 5"):
        part.send_buffer(5)


def test_a_cuda_aware_mpi_send_waits_for_the_stream_first():
    """MPI does not order a send after the GPU work queued on a stream (a packing copy):
    the transport synchronises before each send, and never sends a packet ahead."""
    from mpi4py import MPI
    calls = []
    t = DeviceMPITransport(MPI.COMM_SELF, lambda: calls.append("sync"))
    out, into = np.arange(4, dtype=np.uint8), np.zeros(4, np.uint8)
    r = t.irecv(into, 0, 5)
    s = t.isend(out, 0, 5)
    t.wait([s, r])
    assert calls == ["sync"] and (into == out).all() and not t.eager


def test_a_transport_on_another_communicator_keeps_its_kind():
    """``on``: the two-level ring's inner and outer rings and head parallelism's all-to-all
    run on sub-communicators with the plan's kind of transport (its waits too); a shared
    window and slowed links belong to the plan's communicator, so theirs are plain MPI."""
    from mpi4py import MPI

    from burstmpi._transport.nodes import Nodes
    from burstmpi._transport.shm import ShmTransport
    from burstmpi._transport.slowlinks import SlowLinksTransport
    from ordered_transport import InOrderTransport

    comm = MPI.COMM_SELF
    sync, to_host, to_dev = (lambda *a: None), (lambda *a: None), (lambda *a: None)
    for t, kind in [(MPITransport(comm), MPITransport), (InOrderTransport(comm), InOrderTransport),
                    (DeviceMPITransport(comm, sync), DeviceMPITransport),
                    (StagedMPITransport(comm, to_host, to_dev), StagedMPITransport),
                    (ShmTransport(comm), MPITransport), (SlowLinksTransport(comm, Nodes([0], 0), 1.0), MPITransport)]:
        t.idle = True
        other = t.on(comm)
        assert type(other) is kind and other.comm is comm and other.idle, type(t).__name__
    staged = StagedMPITransport(comm, to_host, to_dev).on(comm)
    assert staged._to_host is to_host and staged._to_device is to_dev
    assert DeviceMPITransport(comm, sync).on(comm)._synchronize is sync
