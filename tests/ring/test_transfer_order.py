"""The ring's transfers pair up step by step, as a transport that runs them in order on
one stream (NCCL) needs: every case here runs on ``InOrderTransport``, which deadlocks on
any mismatch (hence the timeouts). Runs alone and under mpiexec."""

import pytest

from conftest import NRANKS, check_against_float64
from ordered_transport import InOrderTransport

CASES = [(layout, causal, window, mode)
         for layout in ("contiguous", "zigzag", "striped")
         for causal, window in ((False, None), (True, None), (False, (5, 2)), (True, (11, 0)))
         for mode in ("burst", "ring")]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("layout,causal,window,mode", CASES)
def test_ring_on_an_in_order_transport(layout, causal, window, mode):
    plan, _ = check_against_float64(C=12, Z=4, Zkv=2, d=16, layout=layout, causal=causal, window=window,
                                    bwd_comm=mode, transport=InOrderTransport, tag="in-order ")
    assert plan.transport.groups >= (1 if NRANKS > 1 else 0)


@pytest.mark.timeout(60)
def test_transfers_outside_a_group_are_refused():
    t = InOrderTransport(None)
    with pytest.raises(RuntimeError, match="must be posted inside group"):
        t.isend(bytearray(1), 0, 0)
