"""The asynchronous fake GPU and its stream sanitizer on their own (tests/gpu/fake_device.py,
stream_sanitizer.py): each hazard is found, each way of ordering two streams clears it,
byte ranges are told apart, and queued work runs when each policy says. One process."""

import numpy as np
import pytest
from mpi4py import MPI

import fake_cupy as fake
from conftest import NRANKS
from fake_device import DEVICE
from stream_sanitizer import Race, kernel_roles

pytestmark = pytest.mark.skipif(NRANKS > 1, reason="one process's fake device: run once, not per rank")

cp = fake.FakeCupy


@pytest.fixture
def dev():
    DEVICE.reset("late")
    yield DEVICE
    DEVICE.sanitizer.reset()


def _made():
    """The arrays made so far are ready for every stream (their allocation was a write on
    the null stream): the host waits for the device."""
    cp.cuda.Device(0).synchronize()


def _races():
    found = list(DEVICE.sanitizer.races)
    DEVICE.sanitizer.races.clear()  # the records stay
    return found


@pytest.mark.parametrize("first,then", [("write", "read"), ("read", "write"), ("write", "write")])
def test_each_hazard_between_two_streams_is_a_race(dev, first, then):
    a = cp.zeros(64, np.float32)
    _made()
    other = cp.cuda.Stream(non_blocking=True)
    do = {"write": lambda: a.fill(1), "read": lambda: a.sum()}
    with other:
        do[first]()
    do[then]()  # on the null stream, with no event between them
    found = _races()
    assert len(found) == 1 and f"{first} by" in found[0] and "not ordered after" in found[0], found
    assert "stream null" in found[0] and f"stream {other.name}" in found[0]
    assert "tests/gpu/test_fake_device.py" in found[0]  # where each access was made


def test_reads_on_two_streams_are_no_race(dev):
    a = cp.zeros(64, np.float32)
    _made()
    with cp.cuda.Stream(non_blocking=True):
        a.sum()
    a.sum()
    assert _races() == []


@pytest.mark.parametrize("order", ["event", "stream synchronize", "event synchronize", "event query",
                                   "device synchronize"])
def test_an_event_or_a_host_wait_orders_the_streams(dev, order):
    a = cp.zeros(64, np.float32)
    _made()
    other = cp.cuda.Stream(non_blocking=True)
    with other:
        a.fill(1)
        ev = other.record()
    null = cp.cuda.get_current_stream()
    if order == "event":
        null.wait_event(ev)
    elif order == "stream synchronize":
        other.synchronize()
    elif order == "event synchronize":
        ev.synchronize()
    elif order == "event query":
        assert ev.done
    else:
        cp.cuda.Device(0).synchronize()
    a.fill(2)
    assert _races() == []


def test_byte_ranges_not_allocations(dev):
    """Views carved out of one arena (as the ring's packets are) race only where they overlap."""
    arena = cp.zeros(256, np.uint8)
    strided = cp.zeros((8, 16), np.float32)
    _made()
    other = cp.cuda.Stream(non_blocking=True)
    with other:
        arena[:128].fill(1)
    arena[128:].fill(2)  # the other half: no race
    assert _races() == []
    arena[120:136].fill(3)  # overlaps the other stream's half
    assert len(_races()) == 1
    with other:
        strided[:, :4].fill(1)  # its extent: rows 0-7, the first 4 columns ... to the last row's 4th
    strided[7:, 8:].fill(2)  # past that extent
    assert _races() == []


def test_memory_back_in_the_pool_is_a_write_on_its_stream(dev):
    """An array freed while another stream may still read it: CuPy's pool may hand the memory
    to the next allocation on the array's stream."""
    a = cp.zeros(1 << 12, np.float32)
    _made()
    with cp.cuda.Stream(non_blocking=True):
        a.sum()
    del a
    cp.zeros(4, np.float32)  # the next operation takes the free up
    found = _races()
    assert any("memory freed to the pool" in r for r in found), found


def test_kernel_parameters_take_their_role_from_the_cuda_source():
    roles = kernel_roles()
    assert roles["burst_fwd"][:6] == (True, True, True, False, False, False)  # q, k, v read; acc, m, l written
    assert roles["burst_bwd_dq"][:7] == (True,) * 6 + (False,)  # dq written
    assert roles["burst_decode_combine"][:4] == (False, False, True, True)
    assert set(roles) >= {"burst_fwd", "burst_fwd_finalize", "burst_bwd_preprocess", "burst_bwd_dq",
                          "burst_bwd_dkdv", "burst_decode", "burst_decode_combine"}


def _self_transfer(dev, policy):
    """A group sending 8 bytes to this rank itself on a comm stream; returns (sent, received,
    the group's event, the comm stream)."""
    dev.reset(policy)
    fake.FakeNccl.bootstrap = MPI.COMM_SELF
    try:
        nc = fake.FakeNccl.NcclCommunicator(1, bytes(range(128)), 0)
    finally:
        fake.FakeNccl.bootstrap = None
    comm = cp.cuda.Stream(non_blocking=True)
    src, dst = cp.arange(8, dtype=np.uint8), cp.zeros(8, np.uint8)
    comm.wait_event(cp.cuda.get_current_stream().record())
    fake.FakeNccl.groupStart()
    nc.send(src.data.ptr, 8, 7, 0, comm.ptr)
    nc.recv(dst.data.ptr, 8, 7, 0, comm.ptr)
    fake.FakeNccl.groupEnd()
    return src, dst, comm.record(), comm


def test_late_runs_queued_work_only_when_something_needs_it(dev):
    src, dst, ev, comm = _self_transfer(dev, "late")
    assert comm.queue, "late: the group is still queued"
    src.view(np.ndarray)[...] = 9  # behind the fake's back: the send's snapshot is taken when it runs
    assert ev.done  # a query runs what it must
    cp.cuda.get_current_stream().wait_event(ev)
    assert dst.get().tolist() == [9] * 8 and not comm.queue
    assert _races() == []


def test_early_runs_queued_work_at_once(dev):
    src, dst, ev, comm = _self_transfer(dev, "early")
    assert not comm.queue, "early: the group ran as soon as it could"
    src.view(np.ndarray)[...] = 9
    cp.cuda.get_current_stream().wait_event(ev)
    assert dst.get().tolist() == list(range(8))


def test_a_read_of_a_receive_without_its_event_is_a_race_and_stale(dev):
    src, dst, ev, comm = _self_transfer(dev, "late")
    assert dst.get().tolist() == [0] * 8  # not arrived: the null stream did not wait for it
    found = _races()
    assert len(found) == 1 and "read by get()" in found[0] and "NCCL recv from rank 0" in found[0], found
    ev.synchronize()


def test_policies_are_checked():
    with pytest.raises(ValueError, match=r"fake device: policy: expected one of \('late', 'early', 'random'\), "
                                         r"got 'eager'"):
        DEVICE.reset("eager")
    DEVICE.reset("late")


def test_the_sanitizer_raises_with_every_race(dev):
    a = cp.zeros(8, np.float32)
    _made()
    with cp.cuda.Stream(non_blocking=True):
        a.fill(1)
    a.fill(2)
    with pytest.raises(Race, match=r"1 stream race\(s\) on the fake GPU:\n  stream race on device bytes"):
        DEVICE.sanitizer.check()
    DEVICE.sanitizer.check()  # forgotten once raised


def test_an_array_dropped_while_a_queued_send_reads_it_goes_back_to_the_pool_at_once(dev):
    """CuPy's pool takes the memory back when the last array over it goes, though a queued
    transfer still reads it: the fake keeps the bytes (for the transfer) but counts the free."""
    src, dst, ev, comm = _self_transfer(dev, "late")
    del src
    cp.zeros(4, np.float32)  # the next operation takes the free up
    found = _races()
    assert any("memory freed to the pool" in r and "NCCL send to rank 0" in r for r in found), found
    ev.synchronize()


def test_out_of_a_module_function_is_written(dev):
    a, b = cp.zeros(8, np.uint64), cp.ones(8, np.uint64)
    _made()
    with cp.cuda.Stream(non_blocking=True):
        cp.bitwise_xor(a, b, out=a)  # as the decode's header fingerprint
    a.sum()
    found = _races()
    assert len(found) == 1 and "read by sum()" in found[0] and "write by cupy.bitwise_xor" in found[0], found


def test_reshape_that_copies_runs_on_the_device(dev):
    a = cp.zeros((4, 6), np.float32)[:, :4]
    _made()
    with cp.cuda.Stream(non_blocking=True):
        a.fill(1)
    assert a.reshape(16).shape == (16,)  # not contiguous: a copy, which reads a
    assert len(_races()) == 1
    assert a[:2].reshape(2, 2, 2).base is not None and _races() == []  # a view: no access


def test_an_indexed_copy_reads_after_the_streams_waits(dev):
    src, dst, ev, comm = _self_transfer(dev, "late")
    cp.cuda.get_current_stream().wait_event(ev)
    assert dst[cp.arange(8)].get().tolist() == list(range(8))  # the gather waits for the receive
    assert _races() == []


def test_an_mpi_transfer_touches_its_buffer_until_the_host_waits(dev):
    """A CUDA-aware MPI receive writes device memory from its post to its wait: a kernel
    reading it between the two races; after the wait, it does not."""
    buf = cp.zeros(8, np.float32)
    _made()
    req = object()
    DEVICE.mpi_posted(req, buf.data.ptr, buf.data.ptr + buf.nbytes, True, "MPI Irecv into device memory")
    buf.sum()
    found = _races()
    assert len(found) == 1 and "write by MPI Irecv into device memory on stream MPI's" in found[0], found
    DEVICE.mpi_waited(req)
    buf.sum()
    assert _races() == []
