"""The two-level ring (``BurstAttention(topology="two-level")``, ``burstmpi._ring.twolevel``):
results against float64 for every layout, dtype, GQA/MQA, masks, documents and backward
mode, on fake nodes of every size that divides the ranks (BURSTMPI_RANKS_PER_NODE:
one-rank nodes, one node, and all between); its schedule; its transfers paired in order
as NCCL pairs them (``ordered_transport``); its bytes across nodes, dense and causal; what "auto" picks; bad
combinations refused on every rank. Runs alone and under mpiexec (tests/test_mpi.py)."""

import numpy as np
import pytest
from mpi4py import MPI

import burstmpi
import kernel_harness as kh
from burstmpi import reference as ref
from burstmpi.masks import BlockSparse, Causal, Chunked, PerHead, Sinks, Window
from burstmpi._transport.nodes import Nodes
from burstmpi._config import settings
from burstmpi._ring.twolevel import block_owner
from conftest import COMM, NRANKS, RANK, check_against_float64, needs_ranks, random_docs
from ordered_transport import InOrderTransport, MisPaired

SIZES = [g for g in range(1, NRANKS + 1) if NRANKS % g == 0]  # node sizes that divide the ranks
SPREAD = [g for g in SIZES if 1 < g < NRANKS]  # several nodes of several ranks


@pytest.fixture
def per_node(monkeypatch):
    def set_size(g):
        monkeypatch.setenv("BURSTMPI_RANKS_PER_NODE", str(g))
    return set_size


@pytest.mark.parametrize("P,g", [(8, 2), (8, 4), (6, 3), (5, 1), (4, 4), (1, 1)])
def test_every_rank_meets_every_block_once_in_order(P, g):
    """Cycle o, step s: node n - o, rank i - s. Every rank sees all P blocks once; within a
    cycle the blocks are one node's (one network transfer a cycle brings them); and the
    holder of a block at step s + 1 is the next rank of the node (the inner ring's hop)."""
    nodes = Nodes.blocks(P, g)
    N = nodes.count
    for n in range(N):
        for i in range(g):
            seen = [block_owner(nodes.members, n, i, o, s) for o in range(N) for s in range(g)]
            assert sorted(seen) == list(range(P))
            for o in range(N):
                assert {nodes.node_of[block_owner(nodes.members, n, i, o, s)] for s in range(g)} == {(n - o) % N}
                for s in range(g - 1):
                    nxt = nodes.members[n][(i + 1) % g]
                    assert block_owner(nodes.members, n, (i + 1) % g, o, s + 1) == block_owner(nodes.members, n, i, o, s), nxt


CASES = [  # (layout, dtype, heads, kv heads, causal, window, backward mode)
    ("zigzag", "float32", 4, 2, True, None, "ring"),
    ("contiguous", "float16", 4, 1, True, None, "burst"),
    ("striped", "bfloat16", 2, 2, False, (5, 3), "two-way"),
    ("zigzag", "float64", 6, 3, False, None, "auto"),
]
MODES = ("ring", "burst", "two-way")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_two_level_against_float64(per_node, case):
    """Each case on one node size, the cases taking the sizes in turn (at 8 ranks: 8 x 1,
    4 x 2, 2 x 4 and 1 x 8 nodes), so every size meets some layout, dtype, GQA and
    backward mode."""
    layout, dtype, Z, Zkv, causal, window, mode = CASES[case]
    for g in [SIZES[case % len(SIZES)]]:
        per_node(g)
        plan, _ = check_against_float64(N=9 * NRANKS + 4, Z=Z, Zkv=Zkv, d=16, dtype=dtype, causal=causal,
                                        window=window, layout=layout, topology="two-level", bwd_comm=mode,
                                        tag=f"two-level {mode} ")
        st = plan.last_stats
        assert st.topology == "two-level" and st.bwd_mode in ((mode,) if mode != "auto" else ("burst", "ring"))
        assert st.forward.steps_computed + st.forward.steps_skipped == NRANKS


@pytest.mark.parametrize("name", ["per-head", "blocks", "sinks|window", "chunked", "docs"])
def test_two_level_with_masks_and_documents(per_node, name):
    N = 11 * NRANKS + 3
    nb = -(-N // 8)
    masks = {"per-head": PerHead([Causal(), Window(4, 0), Sinks(2) | Window(3, 0), Chunked(5)]),
             "blocks": BlockSparse(np.random.default_rng(1).random((nb, nb)) < 0.3, 8) & Causal(),
             "sinks|window": Sinks(2) | Window(6, 0), "chunked": Chunked(7) & Causal(), "docs": None}
    sizes = SPREAD or SIZES
    mode = MODES[len(name) % len(MODES)]
    for g in [sizes[len(name) % len(sizes)]]:
        per_node(g)
        check_against_float64(N=N, Z=4, Zkv=2, d=16, layout="zigzag", causal=name == "docs", mask=masks[name],
                              cu_seqlens=random_docs(N, seed=g) if name in ("docs", "chunked") else None,
                              topology="two-level", bwd_comm=mode, tag=f"two-level {mode} mask ")


@pytest.mark.timeout(60)
@needs_ranks(2)
def test_in_order_transport_reports_a_mispairing():
    """The ordered fake itself: two messages of one size from rank 0, received by rank 1 in
    the other order. MPI pairs them by tag; NCCL pairs them in order, wrongly."""
    t = InOrderTransport(COMM)
    if RANK == 0:
        with t.group():
            t.isend(np.arange(4.0), 1, 1)
            t.isend(np.arange(4.0) + 10, 1, 2)
    elif RANK == 1:
        second, first = np.empty(4), np.empty(4)
        with pytest.raises(MisPaired, match="expecting tag 2 .* sent as tag 1"):
            with t.group():
                t.irecv(second, 0, 2)
                t.irecv(first, 0, 1)
    COMM.Barrier()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", MODES)
def test_two_level_pairs_its_transfers_as_nccl_does(per_node, mode):
    """Every transfer of the two rings, the partials on the inner ring and the partials
    home, on ``InOrderTransport``: groups run in order, sends complete only when received,
    and messages pair first in first out without tags, as on NCCL. A rank whose groups do
    not pair up with its peers' deadlocks (the timeout), and one that queues transfers to
    a peer in another order than the peer receives them fails (``MisPaired``); over MPI,
    tags and eager sends would hide both. The rings take the plan's transport ``on`` their
    communicators (``MPITransport.on``), as they take NCCL on GPUs."""
    sizes = SPREAD or SIZES
    per_node(sizes[MODES.index(mode) % len(sizes)])
    plan, _ = check_against_float64(N=5 * NRANKS + 3, Z=4, Zkv=2, d=16, causal=True, layout="zigzag",
                                    topology="two-level", bwd_comm=mode, transport=InOrderTransport, record=False)
    assert plan.last_stats.transport.count("in-order") == 3 and plan.last_stats.bwd_mode == mode


pytest_kernels = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")


KERNEL_DTYPES = ["float32", "bfloat16", "float16"]


@pytest.fixture(scope="module")
def lib():
    return kh.library_on_every_rank(COMM, [(dt, 32, 32) for dt in KERNEL_DTYPES])


@pytest_kernels
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_two_level_on_emulated_kernels(per_node, lib, dtype):
    # The dtypes take the node sizes in turn (4 x 2 and 2 x 4 at 8 ranks).
    sizes = SPREAD or SIZES
    per_node(sizes[KERNEL_DTYPES.index(dtype) % len(sizes)])
    be = kh.EmulatedBackend(lib)
    plan, _ = check_against_float64(N=7 * NRANKS + 2, Z=4, Zkv=2, d=32, dtype=dtype, causal=True, layout="zigzag",
                                    backend=be, topology="two-level", bwd_comm="burst",
                                    tag="kernels two-level burst ")
    assert plan.backend is be


@pytest.mark.skipif(not SPREAD, reason="needs a rank count with a divisor g, 1 < g < P")
def test_bytes_across_nodes_fall_to_one_block_per_node(per_node):
    """Dense attention, no step skipped: the flat ring's busiest rank sends P - 1 blocks
    across nodes, the two-level ring's every rank N - 1, the outer ring's one a cycle."""
    g = SPREAD[0]
    per_node(g)
    N = 8 * NRANKS
    q, k, v, do = ref.random_problem(1, N, 2, 2, 16, seed=3)
    sh = burstmpi.shard
    busiest = lambda st: COMM.allreduce(st.bytes_internode, op=max)
    block = 2 * 8 * 2 * 16 * 4  # K and V of a rank's 8 tokens
    flat = burstmpi.BurstAttention(bwd_comm="ring")
    two = burstmpi.BurstAttention(topology="two-level", bwd_comm="ring")
    for plan in (flat, two):
        out, lse = plan.forward(sh(q), sh(k), sh(v))
        plan.backward(sh(do), sh(q), sh(k), sh(v), out, lse)
    assert busiest(flat.last_stats.forward) == (NRANKS - 1) * block
    assert two.last_stats.forward.bytes_internode == (NRANKS // g - 1) * block  # on every rank
    # backward: K/V blocks, plus one partial (dK, dV in float32: as many bytes here) home a cycle
    assert two.last_stats.backward.bytes_internode == 2 * (NRANKS // g - 1) * block


@pytest.mark.skipif(not SPREAD, reason="needs a rank count with a divisor g, 1 < g < P")
def test_network_carries_only_the_rows_later_nodes_read(per_node):
    """Causal: an outer hop carries the rows of its block that some rank of the nodes still
    ahead on the outer ring reads (a query at or after the key's position), no more. The
    forward's bytes across nodes, counted here from the token positions alone."""
    from burstmpi.masks._layout import layout_of

    g = SPREAD[-1]
    per_node(g)
    N = 8 * NRANKS + 5
    q, k, v, _ = ref.random_problem(1, N, 2, 2, 16, seed=4)
    sh = lambda x: burstmpi.shard(x, layout="zigzag")
    plan = burstmpi.BurstAttention(layout="zigzag", causal=True, topology="two-level")
    plan.forward(sh(q), sh(k), sh(v))
    lay, nodes = layout_of("zigzag", NRANKS, N), Nodes.blocks(NRANKS, g)
    count = nodes.count
    n = nodes.node_of[RANK]
    i = nodes.members[n].index(RANK)
    rows = whole = 0
    for o in range(count - 1):  # at cycle o we send the seed (n - o, i) on to node n + 1
        seed = lay.positions(nodes.members[(n - o) % count][i])
        ahead = [x for j in range(1, count - o) for x in nodes.members[(n + j) % count]]
        latest = max(int(lay.positions(x).max()) for x in ahead if len(lay.positions(x)))
        rows += int(np.count_nonzero(seed <= latest))
        whole += len(seed)
    row_bytes = 2 * 2 * 16 * 4  # K and V, 2 heads of 16, float32
    assert plan.last_stats.forward.bytes_internode == rows * row_bytes
    assert COMM.allreduce(rows) < COMM.allreduce(whole)  # some rows stay behind


@needs_ranks(2)
def test_auto_asks_the_model_only_across_equal_nodes(per_node, monkeypatch):
    """One node, or nodes of one rank: flat, whatever the links. Across equal nodes of 2+
    ranks the model chooses at the links' speeds: two-level where the network is slower
    than the node's links (configured, or capped by the simulation aid), flat where they
    are equal (both rings then hide their transfers alike and the flat ring is kept); the
    forward and the backward of one shape take the same ring, and every rank the same."""
    q, k, v, do = (burstmpi.shard(x) for x in ref.random_problem(1, 64 * NRANKS, 4, 2, 16, seed=2))
    cases = [(NRANKS, "1,1", "flat"), (1, "1,0.01", "flat")]
    cases += [(g, links, want) for g in SPREAD[:1] for links, want in (("8,0.05", "two-level"), ("8,8", "flat"))]
    for g, links, want in cases:
        per_node(g)
        monkeypatch.setenv("BURSTMPI_LINK_GBPS", links)
        plan = burstmpi.BurstAttention(topology="auto", causal=True, layout="contiguous")
        out, lse = plan.forward(q, k, v)
        assert plan.last_stats.topology == want, (g, links)
        plan.backward(do, q, k, v, out, lse)
        assert plan.last_stats.topology == want, (g, links)
    if SPREAD:  # measured links (this machine: alike), the network capped by the simulation aid
        per_node(SPREAD[0])
        monkeypatch.delenv("BURSTMPI_LINK_GBPS")
        monkeypatch.setenv("BURSTMPI_INTERNODE_GBPS", "0.05")
        plan = burstmpi.BurstAttention(topology="auto", causal=True, layout="contiguous")
        plan.forward(q, k, v)
        assert plan.last_stats.topology == "two-level"
        links = plan._links["host"]
        # The cap, or below it where the ranks really span hosts on a slower network
        # (tests/cluster: 1 Gbit/s shared by 2 ranks a host measures 0.044 GB/s).
        assert COMM.allgather(links) == [links] * NRANKS and 0 < links[1] <= 0.05


@pytest.mark.skipif(not SPREAD, reason="needs a rank count with a divisor g, 1 < g < P")
def test_auto_for_gpu_arrays_times_the_plans_own_transport(per_node, monkeypatch):
    """For GPU arrays ``auto`` measures the links with the plan's transport on the
    backend's buffers (NCCL on device memory there; here the plan's host transport and
    NumPy buffers stand in), apart from the host's figures, and asks the model at a GPU
    kernel rate: two-level where the network is slow. ``link_speeds`` over a transport
    agrees on every rank and honours the simulation aid's cap."""
    from burstmpi._transport.links import link_speeds
    from burstmpi._transport.mpi import MPITransport
    from burstmpi._transport.nodes import nodes

    per_node(SPREAD[0])
    monkeypatch.setenv("BURSTMPI_INTERNODE_GBPS", "0.05")
    alloc = lambda n: np.empty(n, np.uint8)
    intra, inter = link_speeds(COMM, nodes(COMM), nbytes=1 << 16, transport=MPITransport(COMM), alloc=alloc)
    assert COMM.allgather((intra, inter)) == [(intra, inter)] * NRANKS and intra > 0 and 0 < inter <= 0.05
    q, k, v = (burstmpi.shard(x) for x in ref.random_problem(1, 16 * NRANKS, 4, 2, 16, seed=2)[:3])
    plan = burstmpi.BurstAttention(topology="auto", causal=True, layout="contiguous")
    plan.forward(q, k, v)  # host arrays: measured by MPI
    assert plan.last_stats.topology == "two-level" and set(plan._links) == {"host"}
    assert plan._ring_topology("cuda", (1, 16, 4, 2, 16, 16), np.float32, 16 * NRANKS) == "two-level"
    assert set(plan._links) == {"host", "cuda"} and 0 < plan._links["cuda"][1] <= 0.05


@pytest.mark.skipif(NRANKS < 8 or NRANKS % 4, reason="needs 8+ ranks in 2 nodes of 4 or more (run under mpiexec)")
def test_auto_over_head_parallel_groups(per_node, monkeypatch):
    """With head_parallel=2 the ring over the groups asks the model with the nodes the
    groups span (2 nodes of NRANKS / 4 groups here): two-level where the network is slow,
    flat where the links are alike; the results stay exact."""
    per_node(NRANKS // 2)
    q, k, v, do = (burstmpi.shard(x, layout="zigzag")
                   for x in ref.random_problem(1, 64 * NRANKS, 4, 2, 16, dtype=np.float64, seed=4))
    ours = {}
    for links, want in (("8,0.05", "two-level"), ("8,8", "flat")):
        monkeypatch.setenv("BURSTMPI_LINK_GBPS", links)
        plan = burstmpi.BurstAttention(topology="auto", causal=True, layout="zigzag", head_parallel=2)
        out, lse = plan.forward(q, k, v)
        assert plan.last_stats.topology == want, links
        ours[want] = (out, *plan.backward(do, q, k, v, out, lse))
    for a, b in zip(ours["two-level"], ours["flat"]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def test_bad_link_speeds_name_the_variable(monkeypatch):
    monkeypatch.setenv("BURSTMPI_LINK_GBPS", "8")
    with pytest.raises(ValueError, match=r"BURSTMPI_LINK_GBPS: expected two positive numbers \(GB/s inside a node, between nodes\), got '8'"):
        settings()


def test_gpu_arrays_take_the_two_level_ring_but_not_slowed_links(monkeypatch):
    """GPU arrays run the two-level ring (its rings on the plan's transport ``on`` their
    communicators: NCCL there); the slowed links of ``--internode-gbps`` are a host-only
    simulation aid, so asking for them with GPU arrays names the setting."""
    from burstmpi._ring.twolevel import check_two_level
    from burstmpi._transport.nodes import Nodes

    two = Nodes([0, 0, 1, 1], 0)
    check_two_level("f", two, "cuda")
    monkeypatch.setenv("BURSTMPI_INTERNODE_GBPS", "2.5")
    check_two_level("f", two, "cpu")
    with pytest.raises(ValueError, match=r"f: topology: BURSTMPI_INTERNODE_GBPS .* GPU arrays .* 2\.5"):
        check_two_level("f", two, "cuda")


def test_gpu_arrays_refuse_slowed_links_on_the_flat_ring_too(monkeypatch):
    """The flat ring's GPU transports (NCCL, MPI) never pass through the slowed links either:
    a GPU call across (fake) nodes with the setting on is refused by name before any GPU
    set-up, where it used to run at the machine's own speed."""
    from burstmpi._runtime import Runtime

    monkeypatch.setenv("BURSTMPI_INTERNODE_GBPS", "2.5")
    rt = Runtime("f", MPI.COMM_SELF)
    rt.nodes = Nodes([0, 0, 1, 1], 0)
    with pytest.raises(ValueError, match=r"^f: BURSTMPI_INTERNODE_GBPS \(--internode-gbps\) .* GPU arrays .* 2\.5$"):
        rt.begin("f", "cuda", ())


def test_bad_topology_is_refused():
    with pytest.raises(ValueError, match="topology: expected one of"):
        burstmpi.BurstAttention(topology="ring")


@needs_ranks(3)
def test_unequal_nodes_raise_on_every_rank(per_node):
    per_node(2) if NRANKS % 2 else per_node(NRANKS - 1)
    q, k, v, _ = ref.random_problem(1, 4 * NRANKS, 2, 2, 8, seed=2)
    with pytest.raises(ValueError, match="'two-level' needs nodes of equal size"):
        burstmpi.BurstAttention(topology="two-level").forward(burstmpi.shard(q), burstmpi.shard(k), burstmpi.shard(v))


def test_two_level_with_ranks_holding_no_token(per_node):
    """N below the ranks: some ranks hold nothing, their packets are empty."""
    for g in SPREAD or SIZES:
        per_node(g)
        check_against_float64(N=max(1, NRANKS - 1), Z=2, Zkv=1, d=16, causal=True, layout="contiguous",
                              topology="two-level", bwd_comm="ring", tag="two-level ")


def test_calls_reuse_the_rings(per_node):
    """A plan's calls keep its buffers and give the same bits, and plans made call after
    call (the functional API makes one each) share their communicators: nothing grows."""
    from burstmpi._transport import lifetime

    per_node((SPREAD or SIZES)[0])
    q, k, v, do = ref.random_problem(1, 6 * NRANKS, 2, 2, 8, seed=4)
    sh = burstmpi.shard
    plan = burstmpi.BurstAttention(topology="two-level")
    sizes, results = [], []
    for _ in range(3):
        out, lse = plan.forward(sh(q), sh(k), sh(v))
        grads = plan.backward(sh(do), sh(q), sh(k), sh(v), out, lse)
        burstmpi.attention(sh(q), sh(k), sh(v), topology="two-level")
        sizes.append((plan.buffer_bytes, lifetime.live()["communicators"]))
        results.append([np.array(x, copy=True) for x in (out, lse, *grads)])
    assert sizes[0] == sizes[1] == sizes[2]
    assert all(np.array_equal(a, b) for r in results[1:] for a, b in zip(results[0], r))  # bitwise
    assert plan.last_stats.backward.bytes_recv > 0 or NRANKS == 1
    assert plan.last_stats.transport.startswith("two-level:")
