"""Head parallelism (``BurstAttention(head_parallel=u)``, ``burstmpi._heads``) and the nodes
it works within (``burstmpi._transport.nodes``): results against float64 for every layout,
GQA/MQA with replicated K/V heads, masks (per-head ones cut per member), documents, both
backward modes, the emulated kernels; bytes across nodes; bad combinations refused on
every rank. Runs alone and under mpiexec (tests/test_mpi.py): each case takes every
group size u > 1 that divides the ranks, with the nodes faked by
BURSTMPI_RANKS_PER_NODE."""

import numpy as np
import pytest

import burstmpi
import kernel_harness as kh
from burstmpi import reference as ref
from burstmpi._heads import member_heads
from burstmpi.masks._layout import Layout
from burstmpi.masks import BlockSparse, Causal, PerHead, Sinks, Window, head_slice
from burstmpi._transport.nodes import Nodes, nodes
from conftest import COMM, NRANKS, RANK, check_against_float64, random_docs

GROUPS = [u for u in range(2, NRANKS + 1) if NRANKS % u == 0]
multirank = pytest.mark.skipif(not GROUPS, reason="head parallelism needs 2+ MPI ranks (run under mpiexec)")


@pytest.fixture
def per_node(monkeypatch):
    """Fake nodes of a given size for the plans made after the call."""
    def set_size(g):
        monkeypatch.setenv("BURSTMPI_RANKS_PER_NODE", str(g))
    return set_size


# -- the pieces, on one rank ------------------------------------------------------------


@pytest.mark.parametrize("name", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("P,u,N", [(4, 2, 21), (8, 4, 3), (6, 3, 100), (2, 2, 1)])
def test_merged_layout_is_the_union_of_the_groups(name, P, u, N):
    merged, base = Layout(f"{name}/{u}", P // u, N), Layout(name, P, N)
    for j in range(P // u):
        want = np.sort(np.concatenate([base.positions(r) for r in range(j * u, (j + 1) * u)]))
        assert np.array_equal(merged.positions(j), want)
    assert merged.counts.sum() == N


def test_merged_layout_with_documents():
    cu = np.array([0, 5, 17, 40])
    merged, base = Layout("zigzag/2", 2, 40, cu), Layout("zigzag", 4, 40, cu)
    assert np.array_equal(merged.positions(1), np.sort(np.concatenate([base.positions(2), base.positions(3)])))


def test_member_heads():
    assert member_heads(2, 8, 8) == ([slice(0, 4), slice(4, 8)], [slice(0, 4), slice(4, 8)])
    assert member_heads(4, 8, 2)[1] == [slice(0, 1), slice(0, 1), slice(1, 2), slice(1, 2)]  # replicated
    assert member_heads(4, 4, 1)[1] == [slice(0, 1)] * 4  # MQA


def test_head_slice_of_a_per_head_mask():
    m = PerHead([Causal(), Window(2, 0), Sinks(1), Causal()])
    part = head_slice(m, 2, 2)
    pos = np.arange(9)
    for h in range(2):
        assert np.array_equal(part.visible(pos, pos, 9, head=h), m.visible(pos, pos, 9, head=h + 2))
    assert part.heads == 2 and part != head_slice(m, 0, 2)
    assert head_slice(Causal(), 1, 1) == Causal()


def test_nodes_by_blocks():
    n = Nodes.blocks(7, 3, rank=4)
    assert n.members == ((0, 1, 2), (3, 4, 5), (6,)) and n.node == 1 and n.local_rank == 1
    assert not n.equal and n.describe() == "3 nodes of 3, 3, 1 ranks"
    assert n.internode({3: 10, 5: 20, 6: 40, 0: 80}) == 120
    assert Nodes.blocks(4, 2).describe() == "2 nodes x 2 ranks"


def test_nodes_follow_the_setting(per_node):
    assert nodes(COMM).count >= 1  # the shared-memory split (one machine: one node)
    per_node(1)
    assert nodes(COMM).count == NRANKS and nodes(COMM).node == RANK


# -- against float64 --------------------------------------------------------------------

CASES = [  # (heads, kv_heads as a function of u, layout, dtype, bwd mode)
    ("mha", lambda u: 2 * u, "zigzag", "float32", "burst"),
    ("gqa", lambda u: u, "striped", "float16", "ring"),
    ("replicated", lambda u: 1, "contiguous", "bfloat16", "burst"),
    ("replicated-2", lambda u: 2 if u % 2 == 0 else 1, "zigzag", "float64", "ring"),
]


@multirank
@pytest.mark.parametrize("name,kv,layout,dtype,mode", CASES)
def test_head_parallel_against_float64(per_node, name, kv, layout, dtype, mode):
    # Each case on one group size, the cases taking the sizes in turn.
    for u in [GROUPS[[c[0] for c in CASES].index(name) % len(GROUPS)]]:
        per_node(u)
        Z = 2 * u
        plan, _ = check_against_float64(N=11 * NRANKS + 3, Z=Z, Zkv=kv(u), d=16, dtype=dtype, causal=True,
                                        layout=layout, bwd_comm=mode, head_parallel=u, tag=f"heads {name} ")
        assert plan.last_stats.backward.steps_computed + plan.last_stats.backward.steps_skipped == NRANKS // u


@multirank
@pytest.mark.parametrize("mask", ["per-head", "blocks", "sinks|window"])
def test_head_parallel_with_masks_and_documents(per_node, mask):
    N = 13 * NRANKS + 5
    for u in [GROUPS[len(mask) % len(GROUPS)]]:
        per_node(u)
        Z = 2 * u
        masks = {"per-head": PerHead([Causal(), Window(4, 0), Sinks(2) | Window(3, 0), Causal()] * (Z // 4)
                                     + [Causal()] * (Z % 4)),
                 "blocks": BlockSparse(np.random.default_rng(u).random((Z, -(-N // 8), -(-N // 8))) < 0.4, 8),
                 "sinks|window": Sinks(2) | Window(5, 0)}
        check_against_float64(N=N, Z=Z, Zkv=u, d=16, layout="zigzag", mask=masks[mask], head_parallel=u,
                              cu_seqlens=random_docs(N, seed=u), tag="heads mask ")


@multirank
def test_head_parallel_with_the_two_level_ring(per_node):
    """Groups of u inside nodes of 2u ranks: the ring over the groups is itself two-level
    (two groups a node), with replicated K/V heads and a per-head mask."""
    groups = [u for u in GROUPS if NRANKS % (2 * u) == 0 and NRANKS // (2 * u) > 1]
    if not groups:
        pytest.skip("needs ranks that hold at least two nodes of two groups")
    u = groups[0]
    per_node(2 * u)
    Z = 2 * u
    N = 9 * NRANKS + 1
    mask = PerHead([Causal(), Window(3, 0)] * u)
    plan, _ = check_against_float64(N=N, Z=Z, Zkv=1, d=16, layout="zigzag", mask=mask, head_parallel=u,
                                    topology="two-level", bwd_comm="ring", tag="heads two-level ")
    assert plan.last_stats.topology == "two-level"


def test_functional_calls_share_the_group_communicators(per_node):
    from burstmpi._transport import lifetime

    if not GROUPS:
        pytest.skip("needs 2+ MPI ranks")
    u = GROUPS[0]
    per_node(u)
    q, k, v, _ = ref.random_problem(1, 4 * NRANKS, u, u, 8, seed=6)
    counts = []
    for _ in range(3):
        burstmpi.attention(burstmpi.shard(q), burstmpi.shard(k), burstmpi.shard(v), head_parallel=u)
        counts.append(lifetime.live()["communicators"])
    assert counts[0] == counts[1] == counts[2]


pytest_kernels = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")


@pytest.fixture(scope="module")
def lib():
    return kh.library_on_every_rank(COMM, [(dt, 32, 32) for dt in ("float16", "float32", "bfloat16")])


@multirank
@pytest_kernels
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_head_parallel_on_emulated_kernels(per_node, lib, dtype):
    u = GROUPS[0]
    per_node(u)
    be = kh.EmulatedBackend(lib)
    plan, _ = check_against_float64(N=7 * NRANKS + 1, Z=2 * u, Zkv=1, d=32, dtype=dtype, causal=True,
                                    layout="zigzag", backend=be, head_parallel=u, tag="kernels heads ")
    assert plan._groups()._last.backend is be


# -- bytes across nodes -----------------------------------------------------------------


@pytest.mark.skipif(not [u for u in GROUPS if u < NRANKS], reason="needs a rank count with a divisor u, 1 < u < P")
def test_bytes_across_nodes_fall_to_the_ring_of_groups(per_node):
    """Dense attention, no step skipped: the flat ring's busiest rank sends P - 1 packets
    across nodes, head parallelism's P/u - 1 of the same size (u times the tokens, 1/u of
    the heads), and its all-to-all stays inside the node."""
    u = max(u for u in GROUPS if u < NRANKS)
    per_node(u)
    N = 8 * NRANKS
    q, k, v, _ = ref.random_problem(1, N, 2 * u, 2 * u, 16, seed=3)
    sh = lambda x: burstmpi.shard(x)
    flat = burstmpi.BurstAttention()
    flat.forward(sh(q), sh(k), sh(v))
    heads = burstmpi.BurstAttention(head_parallel=u)
    heads.forward(sh(q), sh(k), sh(v))
    f, h = flat.last_stats.forward, heads.last_stats.forward
    busiest = lambda st: COMM.allreduce(st.bytes_internode, op=max)
    packet = 2 * 8 * (2 * u) * 16 * 4  # K and V of 8 tokens a rank
    assert busiest(f) == (NRANKS - 1) * packet
    assert busiest(h) == (NRANKS // u - 1) * packet
    assert h.bytes_sent > h.bytes_internode  # the all-to-all's bytes, inside the node


# -- the all-to-all as NCCL runs it ----------------------------------------------------


@multirank
def test_point_to_point_exchange_matches_mpis():
    """``HeadExchange`` over a transport's grouped sends and receives (NCCL's way on GPUs)
    moves what MPI's transfers move, with a member that holds no tokens (no message to or
    from it) and unequal shares; the bytes counted are the same."""
    from burstmpi._transport.alltoall import HeadExchange
    from ordered_transport import InOrderTransport

    P = NRANKS
    positions = [np.arange(m) * P + m for m in range(P)]  # member m: m tokens, interleaved (none for 0)
    H = 2 * P
    heads = [slice(2 * m, 2 * m + 2) for m in range(P)]
    x = np.random.default_rng(RANK).standard_normal((2, len(positions[RANK]), H, 5)).astype(np.float32)
    got = []
    for transport in (None, InOrderTransport(COMM)):
        ex = HeadExchange(COMM, positions, transport=transport)
        y = ex.to_heads(x, heads)
        back = ex.to_tokens(y * 2, heads, H)
        got.append((y, back, ex.bytes_sent))
    (y0, b0, n0), (y1, b1, n1) = got
    assert y0.shape == (2, sum(len(p) for p in positions), 2, 5)
    np.testing.assert_array_equal(y0, y1)
    np.testing.assert_array_equal(b0, b1)
    np.testing.assert_array_equal(b1, 2 * x)
    assert n0 == n1


@multirank
def test_head_parallel_over_grouped_point_to_point_transfers(per_node, monkeypatch):
    """The whole head-parallel call with its all-to-alls on a transport of the group's own
    (``exchange_transport``, NCCL on GPUs), here one that pairs transfers in order without
    tags (tests/ordered_transport.py): against float64, with replicated K/V heads, documents
    and both backward modes; the transport is made once per group."""
    from burstmpi import _heads as heads
    from ordered_transport import InOrderTransport

    made = []

    def mover(transport, group):
        made.append(group.Get_size())
        return InOrderTransport(group)

    monkeypatch.setattr(heads, "exchange_transport", mover)
    u = GROUPS[-1]
    per_node(u)
    N = 9 * NRANKS + 4
    for mode in ("burst", "ring"):
        check_against_float64(N=N, Z=2 * u, Zkv=1, d=16, causal=True, layout="zigzag", head_parallel=u,
                              bwd_comm=mode, cu_seqlens=random_docs(N, seed=u), tag="heads p2p ")
    assert made == [u, u]  # one per plan (each check makes its own), for the group


# -- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("u", [0, -2, 1.5, True, "2"])
def test_bad_head_parallel_is_refused(u):
    with pytest.raises(ValueError, match="head_parallel: expected an integer >= 1"):
        burstmpi.BurstAttention(head_parallel=u)


def _raises_everywhere(plan, Z, Zkv, match):
    q, k, v, _ = ref.random_problem(1, 4 * NRANKS, Z, Zkv, 8, seed=1)
    with pytest.raises(ValueError, match=match):
        plan.forward(burstmpi.shard(q), burstmpi.shard(k), burstmpi.shard(v))


@multirank
def test_bad_combinations_raise_on_every_rank(per_node):
    u = GROUPS[0]
    per_node(u)
    _raises_everywhere(burstmpi.BurstAttention(head_parallel=NRANKS + 1), 2 * u, 1, "divisor of the")
    _raises_everywhere(burstmpi.BurstAttention(head_parallel=u), 2 * u + 1, 1, "query heads")
    if u > 2:
        _raises_everywhere(burstmpi.BurstAttention(head_parallel=u), 2 * u, 2 if u % 2 else 4 * u, "K/V heads")


@multirank
def test_a_group_across_nodes_raises_on_every_rank(per_node):
    per_node(1)  # every rank a node of its own
    u = GROUPS[0]
    _raises_everywhere(burstmpi.BurstAttention(head_parallel=u), 2 * u, u, "inside one node")
