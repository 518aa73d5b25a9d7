"""The two-way ring: pure schedule logic for every rank at once, its bytes, and the real
thing against float64 (alone and under mpiexec; it needs 3+ ranks to take effect)."""

import numpy as np
import pytest

from burstmpi._ring.geometry import Geometry
from burstmpi.masks._intervals import Bounds
from burstmpi._ring.flat import nbytes, packet_fields
from burstmpi._ring.schedule import Schedule
from burstmpi._ring.twoway import TwoWaySchedule, arcs, two_way_bytes

from conftest import NRANKS, check_against_float64
from ordered_transport import InOrderTransport


def needs_of(P, layout, N, causal=False, window=None, cu=None, mode="forward"):
    w = Bounds(causal, window)
    return Geometry(layout, P, N, w.lo, w.hi, cu).needs(mode)


CASES = [("contiguous", False, (10, 10), None), ("contiguous", False, (3, 70), None),
         ("contiguous", False, None, "docs"), ("zigzag", True, (5, 0), None),
         ("striped", False, (2, 2), None), ("contiguous", True, None, None)]


def _docs(N):
    """Non-causal documents across rank boundaries (and one inside a rank)."""
    return np.array([0, N // 10, N // 2, N // 2 + N // 12, (4 * N) // 5, N])


@pytest.mark.parametrize("P", [3, 4, 6, 7])
@pytest.mark.parametrize("layout,causal,window,docs", CASES)
@pytest.mark.parametrize("mode", ["forward", "burst"])
def test_every_send_meets_a_receive_and_every_needer_computes_once(P, layout, causal, window, docs, mode):
    N = 64 * P + 5
    needs = needs_of(P, layout, N, causal, window, _docs(N) if docs else None, mode)
    sch = [TwoWaySchedule(needs, r) for r in range(P)]
    steps = sch[0].steps
    assert all(s.steps == steps for s in sch)
    for r, s in enumerate(sch):
        assert s.up.send == sch[(r + 1) % P].up.recv
        assert s.down.send == sch[(r - 1) % P].down.recv
        seen = {r} if s.local else set()
        for t in range(1, steps):
            for d, prev in ((s.up, sch[(r - 1) % P].up), (s.down, sch[(r + 1) % P].down)):
                if d.compute[t]:
                    assert prev.send[t - 1], f"rank {r} computes at step {t} on a packet never sent to it"
                    assert d.owners[t] not in seen, "a block computed twice"
                    seen.add(d.owners[t])
        assert seen == {o for o in range(P) if needs[r, o]}, f"rank {r} misses a block it needs"


def test_symmetric_window_at_six_ranks_sends_two_hops_per_block():
    """Each block is needed by its two neighbours: one hop each way instead of P-1 = 5."""
    P, N = 6, 6 * 64
    needs = needs_of(P, "contiguous", N, window=(10, 10))
    assert [arcs(needs, o) for o in range(P)] == [(1, 0)] + [(1, 1)] * 4 + [(0, 1)]
    one_way = Schedule(needs, 0, packet_bytes=1).ring_bytes
    assert (one_way, two_way_bytes(needs, 1)) == (26, 10)


def test_one_way_is_kept_where_it_is_no_worse():
    """Causal contiguous: block o is needed by every later rank, 4 - o hops either way;
    two arcs save no byte (only steps: block 0 goes 2 up and 2 down), so the plan keeps
    the one-way ring, which needs strictly fewer bytes to switch."""
    needs = needs_of(5, "contiguous", 5 * 32, causal=True)
    assert [sum(arcs(needs, o)) for o in range(5)] == [4, 3, 2, 1, 0]
    assert arcs(needs, 0) == (2, 2)
    assert two_way_bytes(needs, 1) == Schedule(needs, 0, packet_bytes=1).ring_bytes


@pytest.mark.parametrize("layout,causal,window,docs", CASES)
def test_two_way_backward_against_float64(layout, causal, window, docs):
    N = 40 * NRANKS + 3
    cu = None if docs is None else _docs(N)
    plan, _ = check_against_float64(N=N, causal=causal, window=window, cu_seqlens=cu,
                                    layout=layout, bwd_comm="two-way", tag="two-way ")
    st = plan.last_stats
    assert st.bwd_mode == ("two-way" if NRANKS >= 3 else "burst")
    assert st.backward.direction == (0 if NRANKS >= 3 else st.backward.direction)


def test_symmetric_window_forward_takes_the_two_way_ring():
    N = 32 * NRANKS
    plan, _ = check_against_float64(N=N, window=(4, 4), layout="contiguous", bwd_comm="two-way",
                                    tag="two-way ")
    st = plan.last_stats
    if NRANKS >= 4:
        packet, _ = packet_fields("forward", (1, plan.last_call.geometry.layout.max_count, 4, 2, 32, 32), np.float32, np.float32)
        assert st.forward.direction == 0
        assert st.forward.bytes_sent <= 2 * nbytes(packet), "one packet up and one down at most"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("window", [(4, 4), (40, 3)])
def test_two_way_on_an_in_order_transport(window):
    plan, _ = check_against_float64(C=24, window=window, bwd_comm="two-way", transport=InOrderTransport,
                                    tag="in-order ")
    assert plan.transport.groups >= (1 if NRANKS > 1 else 0)

