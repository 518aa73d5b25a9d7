"""The causal balancing (``BurstAttention(balance=)``, ``burstmpi._ring.balance``): a call on
an unbalanced layout runs on a balanced one and returns the caller's layout. Against
float64 for every layout, dtype, backward mode, window, mask and documents; the same bits
as the balanced layout run directly; head parallelism, the two-level ring, the emulated
kernels and grouped point-to-point transfers; the model's choice, the bytes counted and
the errors. Runs alone and under mpiexec (tests/test_mpi.py)."""

import numpy as np
import pytest

import burstmpi
import kernel_harness as kh
from burstmpi import reference as ref
from burstmpi._ring.balance import moved_rows
from burstmpi._transport.alltoall import TokenExchange
from burstmpi.masks import Sinks, Window
from burstmpi.masks._intervals import Bounds, Mask
from burstmpi.masks._layout import Layout
from burstmpi.model.balance import choose, predict_balanced
from burstmpi.model.flat import Machine, Shape, predict
from burstmpi._ring.schedule import pair_matrix
from conftest import COMM, NRANKS, RANK, check_against_float64, random_docs

multirank = pytest.mark.skipif(NRANKS < 2, reason="balancing needs 2+ MPI ranks (run under mpiexec)")
CPU = Machine("cpu", fwd_tflops=0.05, bwd_tflops=0.05, intra_gbps=10.0, inter_gbps=10.0)


# -- the pieces, on one rank ------------------------------------------------------------


@pytest.mark.parametrize("P,N", [(2, 8), (3, 37), (4, 5), (8, 100)])
def test_moved_rows_count_the_tokens_that_change_rank(P, N):
    a, b = Layout("contiguous", P, N), Layout("zigzag", P, N)
    want = [len(np.setdiff1d(a.positions(r), b.positions(r))) for r in range(P)]
    assert moved_rows(a, b).tolist() == want
    assert moved_rows(a, a).sum() == 0


@pytest.mark.parametrize("P", [2, 4, 8])
def test_the_model_balances_contiguous_causal_and_nothing_else(P):
    shape = Shape(1, 16384, 8, 8, 64, 64, 4, causal=True)
    row = predict_balanced(shape, CPU, P, "contiguous")
    assert row["ring_layout"] == "zigzag"
    zig, cont = predict(shape, CPU, P, "zigzag", "burst"), predict(shape, CPU, P, "contiguous", "burst")
    assert row["fwdbwd_ms"] < 0.8 * cont["fwdbwd_ms"]  # the imbalance, gone
    assert row["fwdbwd_ms"] < 1.02 * zig["fwdbwd_ms"]  # at the cost of a small exchange
    assert row["fwd_mb_sent"] > zig["fwd_mb_sent"]     # which the bytes count
    assert predict_balanced(shape, CPU, P, "zigzag")["ring_layout"] == "zigzag"
    dense = Shape(1, 16384, 8, 8, 64, 64, 4, causal=False)
    assert predict_balanced(dense, CPU, P, "contiguous")["ring_layout"] == "contiguous"


def test_a_tiny_problem_is_not_worth_the_exchange():
    """On a GPU a short sequence's compute is microseconds: the exchange's latency costs more."""
    gpu = Machine("gpu", fwd_tflops=300.0, bwd_tflops=200.0, intra_gbps=100.0, inter_gbps=25.0)
    shape = Shape(1, 256, 8, 8, 64, 64, 2, causal=True)
    lays = {n: Layout(n, 4, 256) for n in ("contiguous", "zigzag", "striped")}
    win = Mask(Bounds(True, None), 256)
    cands = {n: (pair_matrix(l, win), None if n == "contiguous" else (moved_rows(lays["contiguous"], l),
                                                                     moved_rows(l, lays["contiguous"])))
             for n, l in lays.items()}
    assert choose(shape, gpu, 4, "contiguous", cands)[0] == "contiguous"


def test_older_baselines_still_match():
    """The bench's ``balance`` key is None for "auto": a baseline row from before it has no
    such key and matches the same configuration run today; "off" is a row of its own."""
    from burstmpi.bench import CONFIG_KEYS
    from burstmpi.bench.regress import _key

    old = {k: 1 for k in CONFIG_KEYS if k != "balance"}
    assert _key(old, CONFIG_KEYS) == _key(dict(old, balance=None), CONFIG_KEYS)
    assert _key(old, CONFIG_KEYS) != _key(dict(old, balance="off"), CONFIG_KEYS)


@pytest.mark.parametrize("balance", ["on", "", None, 1, "Zigzag"])
def test_bad_balance_is_refused(balance):
    with pytest.raises(ValueError, match=r"BurstAttention: balance: expected one of \('auto', 'off'"):
        burstmpi.BurstAttention(balance=balance)
    with pytest.raises(ValueError, match="balance: expected one of"):
        q = np.zeros((1, 4, 2, 8), np.float32)
        burstmpi.attention(q, q, q, balance=balance)


# -- against float64 ----------------------------------------------------------------------


@multirank
@pytest.mark.parametrize("layout,balance", [("contiguous", "auto"), ("contiguous", "zigzag"),
                                            ("contiguous", "striped"), ("striped", "zigzag"),
                                            ("zigzag", "striped")])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
@pytest.mark.parametrize("mode", ["burst", "ring"])
def test_balanced_against_float64(layout, balance, dtype, mode):
    plan, _ = check_against_float64(N=29 * NRANKS + 3, Z=4, Zkv=2, d=16, dtype=dtype, causal=True, layout=layout,
                                    bwd_comm=mode, balance=balance, tag=f"balance {layout}>{balance} ")
    ran = plan.last_stats.ring_layout
    assert ran == (balance if balance != "auto" else "zigzag") or (balance == "auto" and ran in ("contiguous",
                                                                                                  "striped"))
    assert plan.last_stats.bwd_mode == mode


@multirank
@pytest.mark.parametrize("what", ["window", "sinks", "documents", "documents and window"])
def test_balanced_with_windows_masks_and_documents(what):
    N = 23 * NRANKS + 5
    kw = {"window": dict(window=(9, 0)), "sinks": dict(mask=Sinks(3) | Window(6, 0)),
          "documents": dict(cu_seqlens=random_docs(N, seed=5, mean=20)),
          "documents and window": dict(cu_seqlens=random_docs(N, seed=6, mean=30), window=(7, 0))}[what]
    for balance in ("zigzag", "striped", "auto"):
        plan, _ = check_against_float64(N=N, Z=2, Zkv=1, d=16, causal=True, layout="contiguous", balance=balance,
                                        tag=f"balance {what} {balance} ", **kw)
        if balance != "auto":
            assert plan.last_stats.ring_layout == balance


@multirank
def test_the_same_bits_as_the_balanced_layout_run_directly():
    """Re-sharding only moves rows: contiguous re-sharded to zigzag gives, bit for bit, what
    a zigzag call gives (same ring, same sums), in the caller's rows; repeated calls too."""
    N = 31 * NRANKS + 1
    q, k, v, do = ref.random_problem(2, N, 4, 2, 16, dtype=np.float32, seed=4)
    results = {}
    for layout, balance in (("contiguous", "zigzag"), ("zigzag", "off")):
        sh = lambda x: burstmpi.shard(x, layout=layout)
        un = lambda x, axis=1: burstmpi.unshard(x, layout=layout, axis=axis)
        plan = burstmpi.BurstAttention(causal=True, layout=layout, balance=balance)
        got = []
        for _ in range(2):
            ql, kl, vl, dol = sh(q), sh(k), sh(v), sh(do)
            before = [x.copy() for x in (ql, kl, vl, dol)]
            out, lse = plan.forward(ql, kl, vl)
            grads = plan.backward(dol, ql, kl, vl, out, lse)
            for x, y in zip((ql, kl, vl, dol), before):
                np.testing.assert_array_equal(x, y)  # inputs never modified
            got.append([un(out), un(lse, axis=2)] + [un(g) for g in grads])
        for a, b in zip(*got):
            np.testing.assert_array_equal(a, b)
        results[layout] = got[0]
    for a, b in zip(results["contiguous"], results["zigzag"]):
        np.testing.assert_array_equal(a, b)


@multirank
def test_auto_balances_a_contiguous_causal_call_and_counts_the_exchange():
    N = 1024 * NRANKS
    q, k, v, do = ref.random_problem(1, N, 4, 4, 32, dtype=np.float32, seed=1)
    sh = lambda x: burstmpi.shard(x, layout="contiguous")
    st = {}
    for balance in ("auto", "off"):
        plan = burstmpi.BurstAttention(causal=True, layout="contiguous", balance=balance)
        out, lse = plan.forward(sh(q), sh(k), sh(v))
        plan.backward(sh(do), sh(q), sh(k), sh(v), out, lse)
        st[balance] = plan.last_stats
    # Zigzag, or striped where it moves fewer rows (3 ranks: zigzag moves all of ranks 1 and
    # 2) and this short sequence's compute does not hide the difference.
    ran = st["auto"].ring_layout
    assert ran in ("zigzag", "striped") and st["off"].ring_layout == "contiguous"
    pairs = {b: COMM.allgather(s.forward.pairs) for b, s in st.items()}
    assert sum(pairs["auto"]) == sum(pairs["off"])  # the same work, spread
    imbal = lambda p: max(p) / np.mean(p)
    assert imbal(pairs["auto"]) < 1.05 < imbal(pairs["off"])
    # The exchange's bytes: q, k, v of the tokens that leave, and out and lse coming back.
    src, dst = Layout("contiguous", NRANKS, N), Layout(ran, NRANKS, N)
    leave, arrive = moved_rows(src, dst)[RANK], moved_rows(dst, src)[RANK]
    ring_only = burstmpi.BurstAttention(causal=True, layout=ran, balance="off")
    zl = lambda x: burstmpi.shard(x, layout=ran)
    ring_only.forward(zl(q), zl(k), zl(v))
    extra = st["auto"].forward.bytes_sent - ring_only.last_stats.forward.bytes_sent
    assert extra == leave * 3 * 4 * 32 * 4 + arrive * (4 * 32 * 4 + 4 * 4)  # q, k, v there; out, lse back
    # Full attention: every layout computes every pair; nothing moves.
    plan = burstmpi.BurstAttention(layout="contiguous")
    plan.forward(sh(q), sh(k), sh(v))
    assert plan.last_stats.ring_layout == "contiguous"


@multirank
def test_functional_calls_and_the_balance_setting():
    N = 9 * NRANKS + 2
    q, k, v, do = ref.random_problem(1, N, 2, 2, 8, dtype=np.float64, seed=2)
    sh = lambda x: burstmpi.shard(x, layout="contiguous")
    un = lambda x: burstmpi.unshard(x, layout="contiguous")
    out, lse = burstmpi.attention(sh(q), sh(k), sh(v), causal=True, layout="contiguous", balance="zigzag",
                                  return_lse=True)
    dq, dk, dv = burstmpi.attention_backward(sh(do), sh(q), sh(k), sh(v), out, lse, causal=True,
                                             layout="contiguous", balance="zigzag")
    o64 = ref.forward(q, k, v, causal=True)[0]
    g64 = ref.backward(do, q, k, v, causal=True)
    np.testing.assert_allclose(un(out), o64, atol=1e-12)
    for g, e in zip((dq, dk, dv), g64):
        np.testing.assert_allclose(un(g), e, atol=1e-11)


# -- with the rest of the ring --------------------------------------------------------------


@multirank
@pytest.mark.skipif(NRANKS % 2, reason="head parallelism in pairs needs an even rank count")
def test_balanced_with_head_parallelism(monkeypatch):
    monkeypatch.setenv("BURSTMPI_RANKS_PER_NODE", "2")
    N = 17 * NRANKS + 1
    for mode in ("burst", "ring"):
        plan, _ = check_against_float64(N=N, Z=4, Zkv=1, d=16, causal=True, layout="contiguous", balance="zigzag",
                                        head_parallel=2, bwd_comm=mode, tag="balance heads ")
        assert plan.last_stats.ring_layout == "zigzag"


@multirank
@pytest.mark.skipif(NRANKS % 2 or NRANKS < 4, reason="two nodes of 2+ ranks need 4, 6, 8 ... ranks")
def test_balanced_on_the_two_level_ring(monkeypatch):
    monkeypatch.setenv("BURSTMPI_RANKS_PER_NODE", "2")
    for mode in ("burst", "ring", "two-way"):
        plan, _ = check_against_float64(N=13 * NRANKS + 3, Z=2, Zkv=2, d=16, causal=True, layout="contiguous",
                                        balance="zigzag", topology="two-level", bwd_comm=mode,
                                        tag="balance two-level ")
        assert plan.last_stats.ring_layout == "zigzag" and plan.last_stats.topology == "two-level"


@multirank
def test_over_the_shm_transport():
    plan, _ = check_against_float64(N=19 * NRANKS, Z=2, Zkv=2, d=16, causal=True, layout="contiguous",
                                    balance="zigzag", transport="shm", tag="balance shm ")
    assert plan.last_stats.transport == "shm" and plan.last_stats.ring_layout == "zigzag"


@multirank
def test_token_exchange_over_grouped_point_to_point_transfers():
    """``TokenExchange`` over a transport's grouped sends and receives (NCCL's way on GPUs)
    moves what ``MPI.Alltoallv`` moves, irregular documents included; there and back again."""
    from ordered_transport import InOrderTransport

    N = 11 * NRANKS + 3
    cu = random_docs(N, seed=3, mean=2 * NRANKS + 1)
    src, dst = Layout("contiguous", NRANKS, N, cu), Layout("zigzag", NRANKS, N, cu)
    pos = lambda lay: [lay.positions(r) for r in range(NRANKS)]
    x = np.random.default_rng(0).standard_normal((2, N, 3, 4)).astype(np.float32)
    mine = x[:, src.positions(RANK)]
    got = []
    for transport in (None, InOrderTransport(COMM)):
        ex = TokenExchange(COMM, pos(src), pos(dst), transport=transport)
        y = ex.forth(mine)
        np.testing.assert_array_equal(y, x[:, dst.positions(RANK)])
        lse = np.ascontiguousarray(np.moveaxis(y, 1, 2))  # tokens on axis 2, as lse has them
        np.testing.assert_array_equal(ex.back(lse, axis=2), np.moveaxis(mine, 1, 2))
        got.append(ex.bytes_sent)
    # There: the rows that leave; back: the rows that came (2 batch rows of 3 x 4 floats a token).
    assert got[0] == got[1] == (moved_rows(src, dst)[RANK] + moved_rows(dst, src)[RANK]) * 2 * 3 * 4 * 4


pytest_kernels = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")


@pytest.fixture(scope="module")
def lib():
    return kh.library_on_every_rank(COMM, [(dt, 32, 32) for dt in ("float16", "bfloat16")])


@multirank
@pytest_kernels
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_balanced_on_emulated_kernels(lib, dtype):
    be = kh.EmulatedBackend(lib)
    plan, _ = check_against_float64(N=7 * NRANKS + 1, Z=2, Zkv=1, d=32, dtype=dtype, causal=True,
                                    layout="contiguous", balance="zigzag", backend=be, tag="kernels balance ")
    assert plan.last_stats.ring_layout == "zigzag"
