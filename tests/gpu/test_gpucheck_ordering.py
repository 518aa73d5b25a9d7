"""``burstmpi-gpucheck``'s stream-ordering check (burstmpi/bench/ordering.py) on the
asynchronous fake device: its runs (the ring in three modes, the decode) go through, the
stream asked for is the one held back, and the held-back runs give the undelayed bits.
What the check can catch needs a GPU: on the fake, work queued on the comm stream already
runs as late as allowed (``late``), so holding it back changes nothing, and where each
stream is held back is test_gpu_runtime.py's transcript test. Needs 2+ ranks and g++ for
the emulated kernels."""

import pytest

import fake_cupy as fake
import kernel_harness as kh
from burstmpi._gpu import kernels
from burstmpi.bench import ordering
from conftest import COMM, NRANKS

pytestmark = [pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator"),
              pytest.mark.skipif(NRANKS < 2, reason="one rank transfers nothing (run under mpiexec)")]
D = 32


@pytest.fixture
def held(monkeypatch):
    """The fake device (``late``), with ``stream_delay`` recording the stream it would be
    queued on, and doing nothing: the fake's interleavings hold streams back."""
    xp = fake.emulated(monkeypatch, COMM, [("float32", D, D)], "late")
    streams = []

    def delay(device_id, ns):
        streams.append(fake.DEVICE.current[-1].name)

    monkeypatch.setattr(kernels, "delay", delay)
    return xp, streams


@pytest.mark.timeout(300)
def test_held_back_streams_give_the_same_bits(held):
    xp, streams = held
    assert ordering.delayed_runs_differ(xp, COMM, 8 * NRANKS + 3, d=D) == []
    assert any(s.startswith("comm#") for s in streams) and "null" in streams, set(streams)
    assert not fake.DEVICE.sanitizer.races
