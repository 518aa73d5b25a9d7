"""The ring schedule and the bytes it moves: pure logic, checked for every rank at once,
plus the byte counts a real plan reports under MPI."""

import numpy as np
import pytest

import burstmpi
from burstmpi import reference as ref
from burstmpi.masks._layout import Layout
from burstmpi.masks._intervals import Bounds, Mask
from burstmpi._ring.flat import bytes_per_step
from burstmpi._ring.schedule import Schedule, interaction_matrix, ring_bytes
from burstmpi._transport.nodes import nodes

from conftest import COMM, NRANKS, RANK


def schedules(P, layout, causal=False, window=None, mode="forward", C=64):
    a = interaction_matrix(Layout(layout, P, P * C), Mask(Bounds(causal, window), P * C))
    needs = a.T if mode == "burst" else a
    return needs, [Schedule(needs, r, packet_bytes=10, partial_bytes=4) for r in range(P)]


@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("causal,window,mode", [(False, None, "forward"), (True, None, "forward"),
                                                (True, None, "burst"), (False, (3, 20), "ring"),
                                                (False, (70, 0), "burst"), (True, (1, -1), "ring")])
def test_every_send_meets_a_receive(P, layout, causal, window, mode):
    needs, sch = schedules(P, layout, causal, window, mode)
    d = sch[0].direction
    assert all(s.direction == d for s in sch), "ranks chose different directions"
    for r, s in enumerate(sch):
        nxt = sch[(r + d) % P]
        assert s.send == nxt.recv, f"rank {r} sends {s.send} but rank {(r + d) % P} receives {nxt.recv}"
        for t in range(1, P):
            if s.partial_send[t] and s.partial_to[t] != s.owners[t]:  # on to the next holder
                assert s.partial_to[t] == (r + d) % P and nxt.partial_recv[t + 1]
            elif s.partial_send[t]:  # its last contributor sends it home, which expects it then
                home = sch[s.owners[t]]
                assert home.partial_home and home.home_from == r and home.home_at == t + 1
            if t < P - 1:
                assert nxt.partial_recv[t + 1] <= s.partial_send[t]
        for o, home in enumerate(sch):  # every partial that exists comes home, once
            assert home.partial_home == any(needs[h, o] for h in range(P) if h != o)
        for t in range(P):
            assert s.compute[t] == bool(needs[r, s.owners[t]])
            # A rank computes only on a packet that reached it.
            if t > 0 and s.compute[t]:
                assert s.recv[t - 1], f"rank {r} computes at step {t} on a packet it never received"


def test_the_schedule_follows_its_rules_on_any_matrix():
    """The schedule's arrays (computed for every owner and step at once) against the rules
    of ``_ring/schedule.py`` read one owner and step at a time, on random, banded and
    triangular matrices, both directions, and ``ring_bytes`` with sizes that vary."""
    rng = np.random.default_rng(7)
    for trial in range(120):
        P = int(rng.integers(1, 10))
        needs = [rng.random((P, P)) < rng.random(), np.tril(np.ones((P, P), bool)),
                 abs(np.subtract.outer(np.arange(P), np.arange(P))) <= rng.integers(0, P)][trial % 3]
        needs = needs.T if trial % 2 else needs
        for d in (1, -1):
            seen = lambda o, s: bool(needs[(o + d * s) % P, o])  # the holder at step s computes
            later = lambda o, t: any(seen(o, s) for s in range(t + 1, P))
            started = lambda o, t: any(seen(o, s) for s in range(1, t + 1))
            last = [max((s for s in range(1, P) if seen(o, s)), default=0) for o in range(P)]
            hops = [sum(started(o, t) for t in range(1, last[o] + 1)) for o in range(P)]
            size = lambda o, t, d: 3 * o + t + 7
            assert ring_bytes(needs, d, 10, 4) == sum(10 * later(o, t) for o in range(P) for t in range(P - 1)) + 4 * sum(hops)
            assert ring_bytes(needs, d, size, lambda o, d: o + 1) == (
                sum(size(o, t + 1, d) for o in range(P) for t in range(P - 1) if later(o, t))
                + sum((o + 1) * hops[o] for o in range(P)))
            for r in range(P):
                sc = Schedule(needs, r, 10, 4, direction=d)
                own = sc.owners
                assert own == [(r - d * t) % P for t in range(P)]
                assert sc.send == [later(own[t], t) for t in range(P - 1)]
                assert sc.recv == [later(own[t + 1], t) for t in range(P - 1)]
                assert sc.partial_send == [1 <= t <= last[own[t]] and started(own[t], t) for t in range(P)]
                assert sc.partial_recv == [2 <= t <= last[own[t]] and started(own[t], t - 1) for t in range(P)]
                assert (sc.partial_home, sc.home_at, sc.home_from) == (P > 1 and last[r] > 0, last[r] + 1,
                                                                       (r + d * last[r]) % P)


def test_causal_contiguous_forward_skips_and_stops_early():
    P = 4
    _, sch = schedules(P, "contiguous", causal=True)
    assert [s.steps_computed for s in sch] == [1, 2, 3, 4]
    assert sch[0].direction == 1
    assert not any(sch[P - 1].send), "the last rank's K/V is needed by nobody after it"
    assert not any(sch[0].recv), "rank 0 needs no other rank's K/V"
    # The burst backward sends queries the other way, where the keys that need them are.
    _, bsch = schedules(P, "contiguous", causal=True, mode="burst")
    assert bsch[0].direction == -1
    assert [s.steps_computed for s in bsch] == [4, 3, 2, 1]


def test_zigzag_balances_causal_work():
    _, sch = schedules(4, "zigzag", causal=True)
    assert [s.steps_computed for s in sch] == [4, 4, 4, 4]


def test_sliding_window_skips_whole_steps():
    # A window of 10 tokens with 64 tokens per rank touches one neighbour on each side.
    _, sch = schedules(6, "contiguous", window=(10, 10))
    assert [s.steps_computed for s in sch] == [2, 3, 3, 3, 3, 2]
    # A one-way ring must still carry block j round to rank j-1: 5 hops for blocks 1..5.
    assert sum(sum(s.send) for s in sch) == 5 * 5 + 1
    # A causal window needs the previous rank only: one hop per block, and none from the last.
    _, sch = schedules(6, "contiguous", causal=True, window=(10, 0))
    assert [s.steps_computed for s in sch] == [1, 2, 2, 2, 2, 2]
    assert [sum(s.send) for s in sch] == [1, 1, 1, 1, 1, 0]


@pytest.mark.parametrize("Z,Zkv,expect", [(8, 8, "burst"), (32, 8, "ring"), (4, 1, "ring")])
def test_auto_mode_picks_fewer_bytes(Z, Zkv, expect):
    dims = (1, 128, Z, Zkv, 128, 128)
    e = 2  # bfloat16/float16 inputs, float32 partials
    burst = (2 * e + 4) * 128 * Z * 128 + 8 * 128 * Z
    ring = (2 * e + 8) * 128 * Zkv * 128
    assert bytes_per_step("burst", dims, np.float16, np.float32) == burst
    assert bytes_per_step("ring", dims, np.float16, np.float32) == ring
    assert ("burst" if burst <= ring else "ring") == expect


def test_stats_bytes_match_algorithm_md():
    """Non-causal: every step moves a full block, so bytes = (P-1) x the formulas."""
    B, C, d = 1, 16, 32
    P = NRANKS
    for Z, Zkv, expect in [(4, 4, "burst"), (32, 8, "ring")]:
        q, k, v, do = [burstmpi.shard(x) for x in ref.random_problem(B, C * P, Z, Zkv, d,
                                                                     dtype=np.float16, seed=1)]
        e = 2
        for mode in ("burst", "ring", "auto"):
            plan = burstmpi.BurstAttention(bwd_comm=mode)
            out, lse = plan.forward(q, k, v)
            plan.backward(do, q, k, v, out, lse)
            st = plan.last_stats
            used = st.bwd_mode
            assert used == (expect if mode == "auto" else mode)
            fwd = 2 * e * B * C * Zkv * d
            bwd = ((2 * e + 4) * B * C * Z * d + 8 * B * C * Z if used == "burst"
                   else (2 * e + 8) * B * C * Zkv * d)
            assert st.forward.bytes_sent == st.forward.bytes_recv == (P - 1) * fwd
            assert st.backward.bytes_sent == st.backward.bytes_recv == (P - 1) * bwd
            assert st.forward.steps_computed == P and st.forward.steps_skipped == 0


def test_stats_count_skipped_causal_steps():
    C = 8
    q, k, v, _ = [burstmpi.shard(x) for x in ref.random_problem(1, C * NRANKS, 2, 2, 16, seed=2)]
    plan = burstmpi.BurstAttention(causal=True, layout="contiguous")
    plan.forward(q, k, v)
    st = plan.last_stats.forward
    assert st.steps_computed == RANK + 1 and st.steps_skipped == NRANKS - RANK - 1
    sent = 2 * 4 * C * 2 * 16  # k and v, float32
    assert st.bytes_sent == (0 if RANK == NRANKS - 1 else (RANK + 1) * sent)
    assert st.wall_s >= st.compute_s >= 0 and st.wait_s >= 0


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("causal,window,docs", [(False, (3, 20), None), (True, None, "docs"),
                                                (False, (0, 0), "docs"), (True, (7, 0), None),
                                                (False, None, "docs")])
def test_interaction_matrix_is_where_pairs_are_visible(layout, causal, window, docs):
    """The fast interaction matrix (merged visible ranges) says exactly where the exact
    pair counts are non-zero, on 7 ranks with 1-token, empty and long documents."""
    from burstmpi._ring.schedule import pair_matrix

    P, N = 7, 7 * 23 + 4
    cu = np.array([0, 1, 1, 40, 41, 150, 151, 152, N]) if docs else None
    lay, mask = Layout(layout, P, N, cu), Mask(Bounds(causal, window), N, cu)
    np.testing.assert_array_equal(interaction_matrix(lay, mask), pair_matrix(lay, mask) > 0)


@pytest.mark.skipif(NRANKS < 2, reason="one rank moves nothing")
def test_auto_backward_balances_the_ranks_on_one_node(monkeypatch):
    """The first rank's queries see every key, the others' only their own block: as
    queries that rank computes far more pairs than any rank does as keys. With four query
    heads per K/V head "ring" moves fewer bytes, and across nodes (here a node per rank)
    "auto" takes it; on one node, where bytes move through memory, it takes "burst", whose
    busiest rank is the lighter, over either transport (the same bits), and the gradients
    agree with the other mode's.

    Where the ranks really span several nodes (MPI's shared-memory split says so, as on
    ``tests/cluster``'s emulated hosts) there is no one-node run to make: "shm" is refused
    on every rank, and over MPI "auto" takes "ring" as it does with a node per rank, the
    same bits."""
    C, bs, Z, Zkv, d = 16, 8, 4, 1, 16
    N, nb = C * NRANKS, C * NRANKS // bs
    bi, bj = np.indices((nb, nb))
    blocks = (bi < C // bs) | (bi == bj)
    mask = burstmpi.masks.BlockSparse(blocks, bs)
    visible = np.kron(blocks, np.ones((bs, bs), bool))  # the loads from the mask's definition
    as_queries = [int(visible[r * C:(r + 1) * C].sum()) for r in range(NRANKS)]
    as_keys = [int(visible[:, r * C:(r + 1) * C].sum()) for r in range(NRANKS)]
    assert max(as_keys) < 0.98 * max(as_queries)
    q, k, v, do = [burstmpi.shard(x) for x in ref.random_problem(1, N, Z, Zkv, d, seed=3)]

    def run(transport):
        plan = burstmpi.BurstAttention(mask=mask, transport=transport, layout="contiguous")
        out, lse = plan.forward(q, k, v)
        grads = plan.backward(do, q, k, v, out, lse)
        return plan.last_stats.bwd_mode, grads

    if nodes(COMM).count > 1:  # several real nodes (collective; BURSTMPI_RANKS_PER_NODE unset)
        with pytest.raises(ValueError, match="'shm' needs every rank on one node"):
            run("shm")
        mpi_mode, mpi = run("mpi")
        monkeypatch.setenv("BURSTMPI_RANKS_PER_NODE", "1")
        apart_mode, apart = run("mpi")
        assert (mpi_mode, apart_mode) == ("ring", "ring")
        for a, c in zip(mpi, apart):
            assert np.array_equal(a, c)
        return
    (shm_mode, shm), (mpi_mode, mpi) = run("shm"), run("mpi")
    monkeypatch.setenv("BURSTMPI_RANKS_PER_NODE", "1")
    apart_mode, apart = run("mpi")
    assert (shm_mode, mpi_mode, apart_mode) == ("burst", "burst", "ring")
    for a, b, c in zip(shm, mpi, apart):
        assert np.array_equal(a, b)
        np.testing.assert_allclose(a, c, rtol=1e-5, atol=1e-6)
