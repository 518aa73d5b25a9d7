"""``burstmpi-gpucheck``'s stream-ordering check (burstmpi/bench/ordering.py) on the
asynchronous fake device: the held-back stream is the one asked for at every group and
allgather, the delayed runs give the undelayed bits, and with a wait taken out the check
reports the run whose bits changed. Needs 2+ ranks and g++ for the emulated kernels."""

import pytest

import fake_cupy as fake
import kernel_harness as kh
from burstmpi._gpu import kernels
from burstmpi._transport import comm as channels
from burstmpi.bench import ordering
from conftest import COMM, NRANKS
from mutation import without

pytestmark = [pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator"),
              pytest.mark.skipif(NRANKS < 2, reason="one rank transfers nothing (run under mpiexec)")]
D = 32


@pytest.fixture
def held(monkeypatch):
    """The fake device (``late``), with ``stream_delay`` as an operation on the stream it is
    queued on (which it records) that holds nothing back: the fake's interleavings do that."""
    xp = fake.emulated(monkeypatch, COMM, [("float32", D, D)], "late")
    streams = []

    def delay(device_id, ns):
        s = fake.DEVICE.current[-1]
        streams.append(s.name)
        fake.DEVICE.eager([], "kernel stream_delay", stream=s)

    monkeypatch.setattr(kernels, "delay", delay)
    return xp, streams


@pytest.mark.timeout(300)
def test_held_back_streams_give_the_same_bits(held):
    xp, streams = held
    assert ordering.delayed_runs_differ(xp, COMM, 8 * NRANKS + 3, d=D) == []
    assert any(s.startswith("comm#") for s in streams) and "null" in streams, set(streams)
    assert not fake.DEVICE.sanitizer.races


@pytest.mark.timeout(300)
def test_a_missing_wait_changes_the_bits(held, monkeypatch):
    """Channel.wait taken out: the packet is read before its transfer lands, in the runs
    where the comm stream is late (on the fake: always, ``late``), and the check says so."""
    xp, _ = held
    without(monkeypatch, channels, "Channel.wait", "self.transport.wait(reqs, peers)")
    bad = COMM.allgather(ordering.delayed_runs_differ(xp, COMM, 8 * NRANKS + 3, d=D))
    fake.DEVICE.sanitizer.reset()
    assert any(bad), "no run's bits changed"
