"""Channels on an in-process loopback transport: swapping, misuse, partial buffers."""

import numpy as np
import pytest

from burstmpi.comm import Channel, PartialChannel


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

    def wait(self, reqs):
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
