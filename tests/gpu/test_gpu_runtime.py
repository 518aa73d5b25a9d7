"""The GPU runtime's parts that run without a GPU: errors when there is none, the NCCL
unique-id bootstrap over MPI, transport choice, the NCCL transport's stream/event
protocol (with fakes), and host staging through the real ring. Runs alone and under
mpiexec; the CuPy/NCCL tests skip where CuPy or the NCCL wheel is not installed."""

import numpy as np
import pytest

import burstmpi
from burstmpi._transport import nccl
from burstmpi._transport.mpi import StagedMPITransport
from burstmpi._gpu.device import pick_device
from conftest import COMM, NRANKS, RANK, check_against_float64

try:
    import cupy
except ImportError:  # pragma: no cover - depends on the machine
    cupy = None

pytestmark = pytest.mark.extras  # again in .ci/run's second phase, with CuPy and NCCL installed


def _gpu_usable():
    try:
        return cupy is not None and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


no_gpu = pytest.mark.skipif(_gpu_usable(), reason="a GPU is present: the no-GPU errors do not apply")


@no_gpu
def test_cuda_backend_without_a_gpu_is_one_clear_error_on_every_rank():
    q = np.zeros((1, 8, 2, 32), np.float16)
    plan = burstmpi.BurstAttention(backend="cuda")
    if cupy is None:
        kind, match = NotImplementedError, r"rank 0: BurstAttention.forward: backend 'cuda' needs CuPy: pip install"
    else:
        kind, match = RuntimeError, r"rank 0: BurstAttention.forward: backend 'cuda': no usable CUDA device"
    with pytest.raises(kind, match=match):
        plan.forward(q, q, q)
    # The plan is still usable on the host afterwards.
    plan2 = burstmpi.BurstAttention(backend="cpu")
    out, _ = plan2.forward(q, q, q)
    assert out.shape == q.shape


def test_transport_options_are_checked():
    with pytest.raises(ValueError, match=r"transport: expected 'auto', 'nccl', 'mpi' or 'shm', got 'tcp'"):
        burstmpi.BurstAttention(transport="tcp")
    with pytest.raises(ValueError, match=r"transport: 'nccl' moves GPU buffers; backend='cpu'"):
        burstmpi.BurstAttention(transport="nccl", backend="cpu")


@pytest.mark.parametrize("requested,ok,shared,expect", [
    ("auto", True, False, "nccl"), ("auto", True, True, "mpi"), ("auto", False, False, "mpi"),
    ("mpi", True, False, "mpi"), ("nccl", True, False, "nccl"),
    ("nccl", True, True, ValueError), ("nccl", False, False, NotImplementedError),
])
def test_transport_choice(requested, ok, shared, expect):
    if isinstance(expect, str):
        assert nccl.choose_transport("f", requested, ok, shared) == expect
    else:
        with pytest.raises(expect, match="transport: 'nccl' needs"):
            nccl.choose_transport("f", requested, ok, shared)


def test_device_choice():
    assert [pick_device("f", r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    assert pick_device("f", 3, 4, device=1) == 1
    for bad in (4, -1, "0", True):
        with pytest.raises(ValueError, match=r"f: device: expected an int with 0 <= device < 4"):
            pick_device("f", 0, 4, device=bad)


@pytest.mark.skipif(not nccl.available(), reason="CuPy's NCCL bindings are not installed")
def test_nccl_unique_id_is_broadcast_over_mpi():
    """Rank 0 makes the id, MPI broadcasts it: no TCP store, no port (no GPU needed)."""
    uid = nccl.unique_id(COMM)
    everyone = COMM.allgather(uid)
    assert len(uid) == 128 and all(u == everyone[0] for u in everyone)
    assert any(b != 0 for b in uid)


# -- the NCCL transport's protocol, with fakes standing in for CuPy and NCCL ---------------------

class _Log(list):
    def __call__(self, *entry):
        self.append(entry)


class _Event:
    def __init__(self, log, name):
        self.name, self.done = name, True


class _Stream:
    count = 0

    def __init__(self, log, name):
        self.log, self.name, self.ptr = log, name, id(self)

    def record(self):
        _Stream.count += 1
        ev = _Event(self.log, f"{self.name}#{_Stream.count}")
        self.log("record", self.name, ev.name)
        return ev

    def wait_event(self, ev):
        self.log("wait", self.name, ev.name)

    def __enter__(self):  # current (``with stream``): what a kernel launched now runs on
        _CURRENT.append(self.name)

    def __exit__(self, *exc):
        _CURRENT.pop()


_CURRENT = []


def _fakes():
    log = _Log()
    compute = _Stream(log, "compute")

    class Cuda:
        class Device:
            def __init__(self, i):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

        @staticmethod
        def Stream(non_blocking):
            return _Stream(log, "comm")

        @staticmethod
        def get_current_stream():
            return compute

    class Cupy:
        cuda = Cuda

    class Nccl:
        NCCL_UINT8 = 7

        @staticmethod
        def groupStart():
            log("groupStart")

        @staticmethod
        def groupEnd():
            log("groupEnd")

    class Comm:
        @staticmethod
        def allGather(send, recv, n, dt, stream):
            log("allGather", n, stream == t.stream.ptr)

        @staticmethod
        def send(ptr, n, dt, peer, stream):
            log("send", peer, n, stream == t.stream.ptr)

        @staticmethod
        def recv(ptr, n, dt, peer, stream):
            log("recv", peer, n, stream == t.stream.ptr)

    class Buf:
        def __init__(self, n):
            self.nbytes, self.data = n, type("D", (), {"ptr": 1234})()

    t = nccl.NCCLTransport(None, 0, _cupy=Cupy, _nccl=Nccl, _nccl_comm=Comm)
    return t, log, Buf


def test_nccl_transport_orders_a_step_with_events():
    t, log, Buf = _fakes()
    with t.group():
        s = t.isend(Buf(64), 1, 11)
        r = t.irecv(Buf(64), 2, 11)
    t.wait([s, r])
    steps = [e[0] if e[0] in ("groupStart", "groupEnd") else e[:2] for e in log]
    assert steps == ["groupStart", ("send", 1), ("recv", 2), ("record", "compute"), ("wait", "comm"),
                     "groupEnd", ("record", "comm"), ("wait", "compute")]
    # The comm stream waits for the compute stream's event (recorded as the group closes, so
    # after any packing queued inside it); the compute stream for the group's.
    assert log[4][2] == log[3][2] and log[-1][2] == log[-2][2]
    assert all(e[3] for e in log if e[0] in ("send", "recv")), "transfers must run on the comm stream"
    assert s.event is r.event
    t.finish()  # completed event: returns at once


def test_nccl_on_another_communicator_has_a_communicator_and_stream_of_its_own(monkeypatch):
    """The two-level ring's inner and outer rings and head parallelism's all-to-all
    (``NCCLTransport.on``): an NCCL communicator per MPI communicator (bootstrapped there)
    and a comm stream each, the device and timeout kept, so transfers of one ring can never
    pair with another's."""
    t, log, Buf = _fakes()
    made = []
    monkeypatch.setattr(nccl, "communicator", lambda comm, dev, timeout: made.append((comm, dev)) or f"nccl of {comm}")
    inner, outer = t.on("inner"), t.on("outer")
    assert made == [("inner", 0), ("outer", 0)]
    assert (inner.nccl_comm, outer.nccl_comm) == ("nccl of inner", "nccl of outer")
    assert len({id(inner.stream), id(outer.stream), id(t.stream)}) == 3
    assert inner.device_id == t.device_id and inner.timeout_s == t.timeout_s
    assert inner._cupy is t._cupy and inner._nccl is t._nccl


def test_nccl_allgather_is_ordered_after_the_kernels_and_before_the_merge():
    # The decode's one collective: the comm stream waits for the partial's kernels, the
    # compute stream (the merge) waits for the allgather; no host synchronisation.
    t, log, Buf = _fakes()
    t.allgather(Buf(96), Buf(96 * 4))
    steps = [e[:2] for e in log]
    assert steps == [("record", "compute"), ("wait", "comm"), ("allGather", 96), ("record", "comm"),
                     ("wait", "compute")]
    assert log[1][2] == log[0][2] and log[-1][2] == log[-2][2] and log[2][2]
    t.finish()


@pytest.mark.parametrize("which", ["comm", "compute"])
def test_gpucheck_holds_back_the_stream_asked_for_where_a_missing_wait_would_show(monkeypatch, which):
    """``NCCLTransport.delay`` (burstmpi-gpucheck's ordering check): the comm stream held back
    after its wait for the kernels and before the transfers (they land late); the compute
    stream after the event the comm stream waits for (the next transfers' producers run
    late), and after each phase's host wait; never before that event (which would hold the
    comm stream back with it)."""
    from burstmpi._gpu import kernels

    t, log, Buf = _fakes()
    monkeypatch.setattr(kernels, "delay", lambda device, ns: log("delay", _CURRENT[-1] if _CURRENT else "compute", ns))
    monkeypatch.setattr(nccl.NCCLTransport, "delay", (which, 5000))
    with t.group():
        t.isend(Buf(64), 1, 11)
    t.allgather(Buf(8), Buf(32))
    t.finish()
    steps = [e[0] if e[0] in ("groupStart", "groupEnd", "allGather") else e[:2] for e in log]
    held = ("delay", which)
    assert steps == ["groupStart", ("send", 1), ("record", "compute"), ("wait", "comm"), held, "groupEnd",
                     ("record", "comm"), ("record", "compute"), ("wait", "comm"), held, "allGather",
                     ("record", "comm"), ("wait", "compute")] + ([held] if which == "compute" else []), steps
    assert all(e[2] == 5000 for e in log if e[0] == "delay")


def test_nccl_transport_refuses_transfers_outside_a_group():
    t, _, Buf = _fakes()
    with pytest.raises(RuntimeError, match="must be posted inside group"):
        t.isend(Buf(8), 0, 0)


# -- host staging, through the real ring ----------------------------------------------------------

class _CopyingTransport(StagedMPITransport):
    """Host staging with NumPy arrays standing in for device buffers."""

    def __init__(self, comm):
        self.copies = 0

        def to_host(buf, out):
            out[...] = buf.view(np.uint8)
            self.copies += 1

        def to_device(host, buf):
            buf.view(np.uint8)[...] = host
            self.copies += 1

        super().__init__(comm, to_host, to_device)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["burst", "ring"])
@pytest.mark.parametrize("causal", [False, True])
def test_staged_transport_through_the_ring(mode, causal):
    plan, _ = check_against_float64(C=12, Z=4, Zkv=2, d=16, dtype="float16", causal=causal, layout="zigzag",
                                    bwd_comm=mode, transport=_CopyingTransport, tag="staged ")
    assert plan.transport.name == "mpi-staged"
    assert (plan.transport.copies > 0) == (NRANKS > 1)
    assert RANK < NRANKS


@pytest.mark.timeout(120)
def test_staged_transport_through_the_decode():
    """The decode's allgather staged through host buffers, as GPU caches without NCCL do."""
    from decode_harness import run_cache

    cache = run_cache(dtype="float32", N0=2 * NRANKS + 1, Ts=(1, 2, 1), transport=_CopyingTransport,
                      tag="staged ")
    assert cache.runtime.transport.name == "mpi-staged" and cache.runtime.transport.copies > 0


@no_gpu
@pytest.mark.skipif(NRANKS > 1, reason="spawns its own process; run once, not per rank")
def test_gpucheck_without_a_gpu_says_so():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, str(root / "bin" / "burstmpi-gpucheck"), "--quick"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "backend 'cuda'" in res.stdout and "nothing checked: FAILED" in res.stdout
