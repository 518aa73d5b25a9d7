"""Any sequence length and packed documents (cu_seqlens), against the float64 reference.

Runs alone and under mpiexec (tests/test_mpi.py: 2, 3, 4 and 8 ranks), so every case
meets odd rank counts, lengths that do not divide, and ranks that hold no token.
"""

import numpy as np
import pytest

import burstmpi
from burstmpi import reference as ref
from burstmpi.masks._layout import Layout, split_sizes
from burstmpi.masks._intervals import Bounds, Mask

from conftest import COMM, DTYPES, NRANKS, RANK, check_against_float64, needs_ranks, random_docs

pytestmark = pytest.mark.timeout(120)
LAYOUTS = ["contiguous", "zigzag", "striped"]
MASKS = {"none": (False, None), "causal": (True, None), "window": (False, (5, 3)),
         "causal-window": (True, (7, 0))}


# -- where tokens live ---------------------------------------------------------------------

@pytest.mark.parametrize("P", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("N", [1, 2, 7, 16, 37, 100])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_split_any_length_evenly(P, N, layout):
    lay = Layout(layout, P, N)
    every = lay.all_positions()
    assert sorted(every.tolist()) == list(range(N)), "each token lives on exactly one rank"
    for r in range(P):
        pos = lay.positions(r)
        assert (np.diff(pos) > 0).all() and len(pos) == lay.count(r)
    assert lay.counts.max() - lay.counts.min() <= (2 if layout == "zigzag" else 1)
    if layout == "contiguous":
        assert lay.counts.tolist() == split_sizes(N, P).tolist()


@pytest.mark.parametrize("P", [2, 3, 4, 7])
@pytest.mark.parametrize("spec", ["lognormal:300", "fixed:40", "mixed"])
def test_zigzag_places_documents_whole_or_zigzagged_and_balances_work(P, spec):
    """Each document lies on one rank, or is zigzagged (rank r: chunks r and 2P-1-r, the
    middle two merged on rank P-1, chunk sizes within one token); documents shorter than
    2P are whole; causal work is balanced within a few percent."""
    from burstmpi.masks import _packing as packing
    from burstmpi._ring.schedule import pair_matrix

    N = 4000
    cu = (np.array([0, 1500, 1503, 1900, 2300, 2301, 2700, 3100, 3500, N]) if spec == "mixed"
          else packing.pack(spec, N, seed=P))
    lay = Layout("zigzag", P, N, cu)
    owner = np.empty(N, dtype=int)
    for r in range(P):
        owner[lay.positions(r)] = r
    zigzagged = 0
    for a, b in zip(cu[:-1], cu[1:]):
        doc = owner[a:b]
        runs = np.split(doc, np.nonzero(np.diff(doc))[0] + 1) if b > a else []
        if len(runs) > 1:
            zigzagged += 1
            assert b - a >= 2 * P
            assert [int(x[0]) for x in runs] == list(range(P)) + list(range(P - 1))[::-1]
            sizes = [len(x) for i, x in enumerate(runs) if i != P - 1]
            assert max(sizes) - min(sizes) <= 1
    pairs = pair_matrix(lay, Mask(Bounds(causal=True), N, cu)).sum(axis=1)
    assert pairs.max() / pairs.mean() <= 1.06, pairs
    assert lay.counts.max() <= 1.1 * N / P + 2 * P
    if spec == "fixed:40":
        assert zigzagged == 0, "short documents stay whole"
    if spec == "mixed":
        assert zigzagged >= 1, "the 1500-token document cannot stay whole"


def test_zigzag_pack_of_short_documents_sends_nothing():
    N = 48 * NRANKS
    cu = np.arange(0, N + 1, 12)  # 4 documents per rank's share
    for causal in (False, True):
        plan, _ = check_against_float64(N=N, cu_seqlens=cu, causal=causal, layout="zigzag", tag="docs ")
        assert plan.last_stats.forward.bytes_sent == 0 and plan.last_stats.backward.bytes_sent == 0


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("N", [1, max(1, NRANKS - 1), 2 * NRANKS + 1, 29])
def test_shard_indices_shard_and_unshard_agree(layout, N):
    cu = random_docs(N, seed=N) if layout == "zigzag" else None
    x = np.arange(2 * N * 3, dtype=np.float32).reshape(2, N, 3)
    idx = burstmpi.shard_indices(N, layout=layout, cu_seqlens=cu)
    part = burstmpi.shard(x, layout=layout, cu_seqlens=cu)
    np.testing.assert_array_equal(part, x[:, idx])
    np.testing.assert_array_equal(burstmpi.unshard(part, layout=layout, cu_seqlens=cu), x)
    counts = COMM.allgather(len(idx))
    assert sum(counts) == N and sorted(np.concatenate(COMM.allgather(idx)).tolist()) == list(range(N))


# -- against float64 ----------------------------------------------------------------------------

@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("mode", ["burst", "ring"])
def test_documents_against_float64(layout, mask, mode):
    causal, window = MASKS[mask]
    N = 23 * NRANKS + 5
    check_against_float64(N=N, cu_seqlens=random_docs(N, seed=1), causal=causal, window=window,
                          layout=layout, bwd_comm=mode, tag="docs ")


@pytest.mark.parametrize("N", [1, 2, max(1, NRANKS - 1), NRANKS + 1, 2 * NRANKS - 1, 2 * NRANKS + 3, 41])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_uneven_lengths_against_float64(N, layout):
    """Lengths that divide by neither P nor 2P, and below P (ranks without a token)."""
    check_against_float64(N=N, causal=True, layout=layout, bwd_comm="auto", tag="uneven ")
    check_against_float64(N=N, window=(2, 1), layout=layout, bwd_comm="ring", tag="uneven ")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_with_uneven_lengths(dtype):
    check_against_float64(N=2 * NRANKS + 3, causal=True, d=64, layout="zigzag", dtype=dtype,
                          bwd_comm="auto", tag="uneven ")
    check_against_float64(N=max(1, NRANKS - 1), window=(1, 1), layout="striped", dtype=dtype,
                          bwd_comm="ring", tag="uneven ")


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_with_documents(dtype):
    N = 17 * NRANKS + 3
    check_against_float64(N=N, cu_seqlens=random_docs(N, seed=2, mean=10), causal=True, d=64,
                          layout="zigzag", dtype=dtype, bwd_comm="auto", tag="docs ")


@pytest.mark.parametrize("Z,Zkv", [(4, 2), (6, 1)])
def test_gqa_mqa_batch_and_scale_with_documents(Z, Zkv):
    N = 19 * NRANKS + 1
    check_against_float64(B=2, N=N, Z=Z, Zkv=Zkv, cu_seqlens=random_docs(N, seed=3), causal=True,
                          softmax_scale=0.4, layout="striped", bwd_comm="auto", tag="docs ")


def test_document_spanning_every_rank_and_many_per_tile(monkeypatch):
    monkeypatch.setenv("BURSTMPI_TILE_Q", "16")
    monkeypatch.setenv("BURSTMPI_TILE_K", "8")
    N = 30 * NRANKS + 7
    long_doc = np.array([0, 2, 2, N - 3, N])  # one document over every rank, short ones around it
    for layout in LAYOUTS:
        check_against_float64(N=N, cu_seqlens=long_doc, causal=True, layout=layout, tag="docs ")
    many = np.unique(np.concatenate([np.arange(0, N, 3), [N]]))  # ~10 documents in every tile
    check_against_float64(N=N, cu_seqlens=many, window=(2, 2), layout="contiguous", bwd_comm="ring",
                          tag="docs ")


def test_documents_change_per_call_on_one_plan():
    """cu_seqlens is per call: one plan, three packings, three different answers, each right."""
    N = 16 * NRANKS + 2
    q, k, v, do = ref.random_problem(1, N, 2, 2, 16, seed=7)
    plan = burstmpi.BurstAttention(causal=True, layout="zigzag")
    for seed in range(3):
        cu = random_docs(N, seed=10 + seed)
        sh = lambda x: burstmpi.shard(x, layout="zigzag", cu_seqlens=cu)
        out, lse = plan.forward(sh(q), sh(k), sh(v), cu_seqlens=cu)
        exact, _ = ref.forward(q, k, v, causal=True, cu_seqlens=cu)
        full = burstmpi.unshard(out, layout="zigzag", cu_seqlens=cu)
        np.testing.assert_allclose(full, exact, atol=2e-5)


def test_deterministic_with_documents():
    N = 21 * NRANKS + 4
    cu = random_docs(N, seed=4)
    q, k, v, do = (burstmpi.shard(x, cu_seqlens=cu) for x in ref.random_problem(1, N, 4, 2, 16, seed=5))
    plan = burstmpi.BurstAttention(causal=True, layout="contiguous", bwd_comm="burst")
    runs = []
    for _ in range(2):
        out, lse = plan.forward(q, k, v, cu_seqlens=cu)
        runs.append((out, lse) + tuple(plan.backward(do, q, k, v, out, lse, cu_seqlens=cu)))
    for a, b in zip(*runs):
        assert np.array_equal(a, b)


# -- paying only for what is visible ----------------------------------------------------------

def test_documents_that_stay_on_their_rank_send_nothing():
    """A pack whose documents each lie inside one rank's chunk: 0 bytes, no remote step."""
    N = 20 * NRANKS + NRANKS // 2
    counts = Layout("contiguous", NRANKS, N).counts
    bounds = np.concatenate([[0], np.cumsum(counts)])
    cu = np.unique(np.concatenate([bounds, bounds[:-1] + counts // 3]))  # two documents per rank
    for mode in ("burst", "ring"):
        plan, _ = check_against_float64(N=N, cu_seqlens=cu, causal=False, layout="contiguous",
                                        bwd_comm=mode, tag="docs ")
        st = plan.last_stats
        for phase in (st.forward, st.backward):
            assert phase.bytes_sent == 0 and phase.bytes_recv == 0
            assert phase.steps_computed == 1 and phase.steps_skipped == NRANKS - 1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stats_count_the_visible_pairs(layout):
    N = 25 * NRANKS + 3
    cu = random_docs(N, seed=6, mean=12)
    plan, _ = check_against_float64(N=N, cu_seqlens=cu, causal=True, layout=layout, bwd_comm="burst")
    pos = np.arange(N)
    total = int(Mask(Bounds(causal=True), N, cu).visible(pos, pos).sum())
    st = plan.last_stats
    assert COMM.allreduce(st.forward.pairs) == total
    assert COMM.allreduce(st.backward.pairs) == total


# -- bad documents ---------------------------------------------------------------------------

def _local(N):
    x = ref.random_problem(1, N, 2, 2, 8, seed=RANK)[0]
    return burstmpi.shard(x)


@pytest.mark.parametrize("cu,exc,words", [
    (lambda N: [1, N], ValueError, ["cu_seqlens", "starting at 0", "cu_seqlens[0] = 1"]),
    (lambda N: [0, 5, 3, N], ValueError, ["non-decreasing", "cu_seqlens[1] = 5 > cu_seqlens[2] = 3"]),
    (lambda N: [0, N + 1], ValueError, ["cu_seqlens[-1]", "global length"]),
    (lambda N: np.array([0.0, N]), TypeError, ["cu_seqlens.dtype", "integer", "float64"]),
    (lambda N: np.array([[0, N]]), ValueError, ["cu_seqlens", "1-D", "(1, 2)"]),
    (lambda N: np.array([], dtype=np.int64), ValueError, ["cu_seqlens", "empty"]),
])
def test_bad_cu_seqlens_raise_on_every_rank(cu, exc, words):
    N = 8 * NRANKS
    q = _local(N)
    with pytest.raises(exc) as info:
        burstmpi.attention(q, q, q, layout="contiguous", cu_seqlens=cu(N))
    for w in words:
        assert w in str(info.value), f"{w!r} missing from: {info.value}"
    with pytest.raises(exc):
        burstmpi.shard(np.zeros((1, N, 2)), cu_seqlens=cu(N))


@needs_ranks(2)
def test_cu_seqlens_different_on_one_rank_raise_everywhere():
    N = 8 * NRANKS
    q = _local(N)
    cu = [0, 3, N] if RANK == 1 else [0, 4, N]
    with pytest.raises(ValueError, match=r"ranks disagree on cu_seqlens: rank 0 has .*rank 1 has"):
        burstmpi.attention(q, q, q, layout="contiguous", cu_seqlens=cu)


@needs_ranks(2)
def test_local_lengths_that_do_not_match_the_layout_raise_everywhere():
    N = 8 * NRANKS
    q = _local(N)[:, : (4 if RANK == 0 else None)]  # rank 0 drops 4 of its 8 tokens
    with pytest.raises(ValueError, match=r"rank 0 has 4, expected"):
        burstmpi.attention(q, q, q, layout="zigzag")


def test_only_rows_other_ranks_see_travel():
    """A packet carries the rows some other rank sees, not the whole block: with a window
    of 3 on 40-token blocks, the 3 rows at each end of a block; with documents, the rows
    of the documents that cross a rank boundary."""
    from burstmpi._ring.flat import nbytes, packet_fields

    C = 40
    plan, _ = check_against_float64(N=C * NRANKS, C=C, window=(3, 3), layout="contiguous", d=16,
                                    bwd_comm="burst", tag="docs ")
    rows = plan.last_call.geometry.packet_rows("k")
    assert rows == (0 if NRANKS == 1 else 3 if NRANKS == 2 else 6)
    packet, _ = packet_fields("forward", (1, rows, 4, 2, 16, 16), np.float32, np.float32)
    st = plan.last_stats.forward
    assert st.bytes_sent <= 2 * nbytes(packet)
    if st.direction == 0:  # the two-way ring: each way, just the 3 rows that neighbour sees
        neighbours = len({RANK - 1, RANK + 1} & set(range(NRANKS)))
        assert st.bytes_sent == 3 * neighbours * nbytes(packet) // rows
    # Documents inside each rank's chunk, but one that crosses from rank 0 into rank 1.
    N = C * NRANKS
    cu = np.unique(np.concatenate([np.arange(0, N + 1, C), [C - 5, C + 7] if NRANKS > 1 else [0]]))
    cu = cu[(cu != C)] if NRANKS > 1 else cu  # the document [C-5, C+7) spans the boundary
    for mode in ("burst", "ring"):
        plan, _ = check_against_float64(N=N, C=C, cu_seqlens=cu, causal=True, layout="contiguous", d=16,
                                        bwd_comm=mode, tag="docs ")
        geo = plan.last_call.geometry
        if NRANKS > 1:
            assert geo.travelling_rows("k", 0).tolist() == list(range(C - 5, C))  # seen by rank 1
            assert geo.travelling_rows("q", 1).tolist() == list(range(7))         # see rank 0's keys
            assert all(len(geo.travelling_rows("k", r)) == 0 for r in range(1, NRANKS))
