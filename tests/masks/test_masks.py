"""burstmpi.masks: every piece alone and combined, against float64 dense attention built
from the masks' own definitions, on the NumPy backend and the emulated CUDA kernels, with
skipped steps and bytes checked and bad masks refused on every rank. Runs alone and under
mpiexec (tests/test_mpi.py)."""

import numpy as np
import pytest

import burstmpi
import kernel_harness as kh
from burstmpi import reference as ref
from burstmpi.masks import BlockSparse, Causal, Chunked, Mask, PerHead, Sinks, Window
from burstmpi.masks._intervals import UNBOUNDED, tile_mask
from burstmpi.masks._terms import Docs, lower
from conftest import COMM, NRANKS, RANK, check_against_float64, random_docs

N_ODD = 23 * max(NRANKS, 1) + 5  # divisible by neither the ranks nor the block sizes


def _blocks(n, bs, density, seed, heads=None):
    rng = np.random.default_rng(seed)
    nb = -(-n // bs)
    return rng.random((nb, nb) if heads is None else (heads, nb, nb)) < density


def patterns(n, heads=4):
    """Name -> mask for a sequence of ``n`` tokens with ``heads`` query heads."""
    return {
        "causal": Causal(),
        "window": Window(5, 2),
        "sinks": Sinks(3),
        "sinks|window": Sinks(2) | Window(6, 0),
        "prefix-lm": Sinks(7) | Causal(),
        "chunked&causal": Chunked(9) & Causal(),
        "chunked": Chunked(8),
        "block-sparse": BlockSparse(_blocks(n, 8, 0.35, 1), 8),
        "bigbird": BlockSparse(_blocks(n, 8, 0.15, 2), 8) | Window(4, 4) | Sinks(3),
        "per-head": PerHead([Causal(), Window(3, 3), Sinks(2) | Window(4, 0), Chunked(10) & Causal()][:heads]
                            + [Causal()] * max(0, heads - 4)),
        "per-head-blocks": BlockSparse(_blocks(n, 16, 0.4, 3, heads), 16) & Causal(),
        "nothing": Sinks(0),
    }


# -- the lowering, element by element ---------------------------------------------------


def _bits(f, rows, cols):
    """A term's block filter as a dense (rows, cols) matrix (all True without one)."""
    return np.ones((len(rows), len(cols)), bool) if f is None else f.plane[rows // f.bs][:, cols // f.bs]


def _union(lowered, pos, head):
    """The visible matrix the lowered terms give for ``head``; asserts they are disjoint."""
    for heads, blocks, filters in lowered.query_blocks(pos):
        if heads is None or head in heads:
            seen = np.zeros((len(pos), len(pos)), int)
            for b, f in zip(blocks, filters):
                assert (np.diff(b.first) >= 0).all() and (np.diff(b.last) >= 0).all(), "ends must not decrease"
                seen += tile_mask(b.first, b.last, pos) & _bits(f, pos, pos)
            assert seen.max(initial=0) <= 1, "terms overlap"
            return seen.astype(bool)
    raise AssertionError(f"head {head} is in no group")


def _key_union(lowered, pos, head):
    for heads, blocks, filters in lowered.key_blocks(pos):
        if heads is None or head in heads:
            seen = np.zeros((len(pos), len(pos)), bool)
            for b, f in zip(blocks, filters):
                assert (np.diff(b.first) >= 0).all() and (np.diff(b.last) >= 0).all()
                seen |= tile_mask(b.first, b.last, pos) & _bits(f, pos, pos).T  # [key, query]
            return seen.T


@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("n", [1, 37, 64])
def test_lowering_matches_the_definitions(n, docs):
    """Every pattern (and causal/window arguments on top) lowers to disjoint monotone
    terms whose union, query side and key side, is exactly the definition."""
    cu = random_docs(n, seed=n) if docs else None
    pos = np.arange(n)
    for name, mask in patterns(n).items():
        for lo, hi, causal, window in ((UNBOUNDED, UNBOUNDED, False, None), (4, 0, True, (4, 0))):
            low = lower(mask, lo, hi, Docs(n, cu))
            for h in range(4):
                want = ref.visible(pos, pos, causal, window, cu, mask, 4, n)
                want = want[h] if want.ndim == 3 else want
                assert np.array_equal(_union(low, pos, h), want), (name, h, lo)
                assert np.array_equal(_key_union(low, pos, h), want), (name, h, lo, "key side")


def test_combinations_with_and_or():
    n, pos = 50, np.arange(50)
    cu = np.array([0, 13, 13, 30, 50])
    pieces = [Causal(), Window(3, 1), Sinks(4), Chunked(7), BlockSparse(_blocks(n, 5, 0.3, 4), 5)]
    for i, a in enumerate(pieces):
        for b in pieces[i:]:
            for m in (a & b, a | b, (a | b) & Causal(), a | (b & Window(2, 2))):
                low = lower(m, UNBOUNDED, UNBOUNDED, Docs(n, cu))
                want = ref.visible(pos, pos, cu_seqlens=cu, mask=m, seqlen=n)
                assert np.array_equal(_union(low, pos, 0), want), m
                assert np.array_equal(_key_union(low, pos, 0), want), m


def test_causal_and_window_mask_is_the_arguments():
    """``mask=Causal() & Window(l, 0)`` gives the bits of ``causal=True, window=(l, 0)``."""
    n = 16 * NRANKS + 3
    q, k, v, do = ref.random_problem(1, n, 2, 1, 16, seed=5)
    sh = lambda x: burstmpi.shard(x, layout="zigzag")
    a = burstmpi.BurstAttention(causal=True, window=(5, 0), layout="zigzag")
    b = burstmpi.BurstAttention(mask=Causal() & Window(5, 0), layout="zigzag")
    ra = a.forward(sh(q), sh(k), sh(v))
    rb = b.forward(sh(q), sh(k), sh(v))
    assert all(np.array_equal(x, y) for x, y in zip(ra, rb))
    ga = a.backward(sh(do), sh(q), sh(k), sh(v), *ra)
    gb = b.backward(sh(do), sh(q), sh(k), sh(v), *rb)
    assert all(np.array_equal(x, y) for x, y in zip(ga, gb))
    assert a.last_stats.forward.bytes_sent == b.last_stats.forward.bytes_sent


# -- the ring against float64 -----------------------------------------------------------

NAMES = list(patterns(64))
LAYOUTS = ["contiguous", "zigzag", "striped"]
CASES = [(name, ["float32", "float16", "bfloat16", "float64"][i % 4], LAYOUTS[i % 3], ["burst", "ring", "two-way"][i % 3])
         for i, name in enumerate(NAMES)]


@pytest.mark.parametrize("name,dtype,layout,mode", CASES)
def test_ring_with_mask(name, dtype, layout, mode):
    N = N_ODD
    plan, _ = check_against_float64(N=N, Z=4, Zkv=2, d=16, dtype=dtype, layout=layout, bwd_comm=mode,
                                    mask=patterns(N)[name], tag="mask ")
    assert plan.last_stats.forward.steps_computed + plan.last_stats.forward.steps_skipped == NRANKS


@pytest.mark.parametrize("name", ["sinks|window", "chunked", "block-sparse", "per-head", "prefix-lm"])
def test_ring_with_mask_and_documents(name):
    N = N_ODD
    check_against_float64(B=2, N=N, Z=4, Zkv=1, d=16, dtype="float32", layout="zigzag", bwd_comm="ring",
                          mask=patterns(N)[name], cu_seqlens=random_docs(N, seed=7, mean=11), tag="mask ")


@pytest.mark.parametrize("Zkv", [1, 2, 4])
def test_per_head_masks_with_gqa_and_mqa(Zkv):
    N = 19 * NRANKS + 2
    heads = [Causal(), Window(2, 0), Sinks(3) | Causal(), Chunked(5)]
    check_against_float64(N=N, Z=4, Zkv=Zkv, d=16, dtype="float32", layout="striped", bwd_comm="burst",
                          mask=PerHead(heads), tag="mask ")


def test_rows_that_see_nothing():
    """Chunks inside a window that misses them: whole rows see no key (out 0, lse -inf)."""
    N = 12 * NRANKS
    mask = Chunked(4) & Window(-1, 0) & Sinks(2)  # only a chunk's first 2 tokens... of the document
    plan, _ = check_against_float64(N=N, Z=2, Zkv=2, d=16, dtype="float32", mask=mask, tag="mask ")


# -- the emulated CUDA kernels ---------------------------------------------------------

pytest_kernels = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")


@pytest.fixture(scope="module")
def lib():
    return kh.library_on_every_rank(COMM, [(dt, 32, 32) for dt in ("float16", "bfloat16", "float32")])


@pytest_kernels
@pytest.mark.parametrize("name,dtype,mode", [(n, ["float32", "float16", "bfloat16"][i % 3], ["burst", "ring"][i % 2])
                                             for i, n in enumerate(NAMES)])
def test_emulated_kernels_with_mask(lib, name, dtype, mode):
    N = 17 * NRANKS + 3
    be = kh.EmulatedBackend(lib)
    plan, _ = check_against_float64(N=N, Z=4, Zkv=2, d=32, dtype=dtype, layout=LAYOUTS[len(name) % 3],
                                    bwd_comm=mode, backend=be, mask=patterns(N)[name], tag="kernels mask ")
    assert plan.backend is be


def bitmap_masks(n):
    """Block-sparse masks whose blocks are as large as the kernels' tiles or larger, so the
    bitmap decides whole tiles (cuda/mask.cuh: FULL, EMPTY, and PARTIAL across a seam),
    alone, under a causal mask and beside a window, one per head too."""
    return {"blocks32&causal": BlockSparse(_blocks(n, 32, 0.5, 4), 32) & Causal(),
            "blocks64|window": BlockSparse(_blocks(n, 64, 0.4, 5), 64) | Window(3, 0),
            "per-head-blocks48": BlockSparse(_blocks(n, 48, 0.5, 6, 4), 48)}


@pytest_kernels
@pytest.mark.parametrize("name", list(bitmap_masks(64)))
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_emulated_kernels_read_the_bitmap(lib, name, dtype):
    """The kernels take a block-sparse mask as one launch per block pair, reading the
    bitmap (no launch per rectangle of set blocks), and match float64."""
    N = 100 * NRANKS + 17
    be = kh.EmulatedBackend(lib)
    layout = "zigzag" if "causal" in name else "contiguous"
    check_against_float64(N=N, Z=4, Zkv=2, d=32, dtype=dtype, layout=layout, bwd_comm="ring", backend=be,
                          mask=bitmap_masks(N)[name], tag="kernels bitmap ")
    # Forward: at most one launch per (head group, term) of each step, and the finalize.
    assert be.launches <= 2 * 4 * (NRANKS + 1) * 3 + 8, be.launches


SEEDED_BITMAP = [
    ("a tile is FULL when any of its blocks is set",
     "set == 0 ? TILE_EMPTY : (set == (b1 - b0 + 1) * (e1 - e0 + 1) ? TILE_FULL : TILE_PARTIAL)",
     "set == 0 ? TILE_EMPTY : TILE_FULL"),
    ("partial tiles ignore the bitmap", "return !on() || bits[roff + cblk[c] * cs] != 0;", "return true;"),
]


@pytest_kernels
@pytest.mark.parametrize("what,right,wrong", SEEDED_BITMAP)
def test_seeded_bitmap_mistakes_are_caught(what, right, wrong):
    """The bitmap test above catches a wrong tile class and a missing per-element test."""
    from burstmpi._gpu import kernels

    src, _ = kernels.program()
    assert src.count(right) == 1, what
    names = [n for n in kernels.kernel_names("float32", 32, 32) if "decode" not in n]
    if RANK == 0:
        kh.build(names, src.replace(right, wrong))
    COMM.Barrier()
    seeded = kh.build(names, src.replace(right, wrong))
    N = 100 * NRANKS + 17
    with pytest.raises(AssertionError):
        check_against_float64(N=N, Z=4, Zkv=2, d=32, dtype="float32", layout="zigzag", bwd_comm="ring",
                              backend=kh.EmulatedBackend(seeded), mask=bitmap_masks(N)["blocks32&causal"],
                              tag="seeded ", record=False)


# -- what is skipped --------------------------------------------------------------------


def _run(mask, N, layout="contiguous", mode="ring", causal=False):
    q, k, v, do = ref.random_problem(1, N, 2, 2, 16, seed=9)
    sh = lambda x: burstmpi.shard(x, layout=layout)
    plan = burstmpi.BurstAttention(mask=mask, layout=layout, bwd_comm=mode, causal=causal)
    out, lse = plan.forward(sh(q), sh(k), sh(v))
    plan.backward(sh(do), sh(q), sh(k), sh(v), out, lse)
    return plan.last_stats


def test_block_diagonal_mask_moves_nothing():
    """Blocks that follow the ranks' shards: no step but the own, 0 bytes."""
    bs = 8
    N = bs * 2 * NRANKS
    nb = N // bs
    blocks = np.zeros((nb, nb), bool)
    for r in range(NRANKS):
        blocks[2 * r:2 * r + 2, 2 * r:2 * r + 2] = True
    st = _run(BlockSparse(blocks, bs), N)
    for phase in (st.forward, st.backward):
        assert phase.bytes_sent == phase.bytes_recv == 0
        assert phase.steps_computed == 1 and phase.steps_skipped == NRANKS - 1
    assert st.forward.pairs == (2 * bs) ** 2


def test_sinks_and_window_bytes():
    """Sinks + a window shorter than a shard: the keys a rank's queries see are the sinks and
    the window's reach into its neighbour. The packets carry those rows, not the blocks, and
    shrink on the way: past its neighbour, rank 0's packet holds the sinks alone."""
    C, w, s = 32, 5, 2
    N = C * NRANKS
    st = _run(Sinks(s) | Window(w, 0), N, mode="ring")
    # Rank 0 sees its own keys, rank 1 rank 0's too, every later rank its neighbour's and the sinks.
    assert st.forward.steps_computed == min(RANK + 1, 3)
    per_row = 2 * 2 * 16 * 4  # K and V (or their float32 gradients), 2 KV heads, d 16
    rows = lambda o: s + w if o == 0 else w  # an owner's travelling rows
    # Rank 0 sends its sinks and window rows; a middle rank its own window rows, and the
    # sinks on to the next rank; the last rank's keys are seen by no one else.
    sent = (s + w if RANK == 0 else w + s) if RANK < NRANKS - 1 else 0
    assert st.forward.bytes_sent == sent * per_row, st.forward
    # "ring" backward: the same packets, and each partial goes from its first contributor to
    # its last, which sends it home: rank 0's (read by every rank) from every other rank,
    # a later rank's (read by its next rank alone) by that rank, straight home.
    partials = (rows(0) if RANK >= 1 else 0) + (w if RANK >= 2 else 0)
    assert st.backward.bytes_sent == (sent + partials) * per_row, st.backward


# -- bad masks ----------------------------------------------------------------------------


@pytest.mark.parametrize("make,match", [
    (lambda: Sinks(-1), r"Sinks: n: expected an integer >= 0, got -1"),
    (lambda: Chunked(0), r"Chunked: size: expected an integer >= 1, got 0"),
    (lambda: Window(-2, 0), r"Window: left: expected an integer >= -1, got -2"),
    (lambda: BlockSparse(np.ones((3, 3), int), 4), r"BlockSparse: blocks: expected a boolean array"),
    (lambda: BlockSparse(np.ones((3,), bool), 4), r"BlockSparse: blocks: expected a boolean array"),
    (lambda: BlockSparse(np.ones((3, 3), bool), 0), r"BlockSparse: block_size: expected an integer >= 1"),
    (lambda: PerHead([]), r"PerHead: masks: expected one mask per query head, got an empty list"),
    (lambda: PerHead([Causal(), "causal"]), r"PerHead: masks\[1\]: expected a burstmpi.masks mask, got str"),
    (lambda: PerHead([PerHead([Causal()])]), r"PerHead: masks\[0\]: expected a mask for one head"),
    (lambda: Causal() & "x", r"mask &: expected a burstmpi.masks mask"),
    (lambda: PerHead([Causal()] * 2) | PerHead([Causal()] * 3),
     r"mask \|: expected per-head masks for the same number of heads, got 2 and 3"),
    (lambda: BlockSparse(np.ones((4, 4), bool), 4) & BlockSparse(np.ones((2, 2), bool), 8),
     r"mask &: BlockSparse pieces: expected one block size and grid, got block_size 4 \(4x4 blocks\), block_size 8"),
])
def test_bad_masks_are_refused_by_name(make, match):
    with pytest.raises((TypeError, ValueError), match=match):
        make()


def _call(mask, Z=4, N=None):
    N = 8 * NRANKS if N is None else N
    q, k, v, _ = ref.random_problem(1, N, Z, 2 if Z % 2 == 0 else 1, 16)
    sh = lambda x: burstmpi.shard(x)
    return burstmpi.attention(sh(q), sh(k), sh(v), mask=mask, layout="contiguous")


@pytest.mark.parametrize("mask,match", [
    ("causal", r"BurstAttention: mask: expected None or a burstmpi.masks mask .* got str"),
    (BlockSparse(np.ones((3, 3), bool), 4), r"BurstAttention.forward: mask: BlockSparse blocks: expected shape \(\d+, \d+\)"),
    (BlockSparse(np.ones((2, 3, 3), bool), 4), r"BurstAttention.forward: mask: a per-head mask for 2 query heads, got q with 4"),
    (PerHead([Causal()] * 3), r"BurstAttention.forward: mask: a per-head mask for 3 query heads, got q with 4 heads"),
])
def test_bad_masks_raise_on_every_rank(mask, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _call(mask)


def test_a_mask_that_differs_on_one_rank_raises_everywhere():
    mask = Sinks(4) if RANK == NRANKS - 1 and NRANKS > 1 else Sinks(3)
    if NRANKS == 1:
        pytest.skip("needs 2+ ranks")
    with pytest.raises(ValueError, match=r"ranks disagree on mask: rank 0 has 'Sinks\(3\) #\w+', .*rank \d+ has 'Sinks\(4\) #\w+'"):
        _call(mask)


def test_masks_compare_and_describe():
    assert Causal() & Window(3, 0) == Causal() & Window(3, 0)
    assert Sinks(3) != Sinks(4)
    assert isinstance(Sinks(1) | Causal(), Mask)
    assert "Sinks(2)" in repr(Sinks(2) | Causal())
    blocks = np.eye(4, dtype=bool)
    a, b = BlockSparse(blocks, 2), BlockSparse(blocks.copy(), 2)
    assert a == b and a.digest() == b.digest()
    blocks[0, 1] = True  # the mask copied its array
    assert a == b


# -- NaN and Inf reach what they should, never a silent 0 ---------------------------------


def _nan_run(backend, dtype, inject, mask, layout="zigzag"):
    N = 16 * NRANKS + 5
    q, k, v, do = ref.random_problem(1, N, 2, 1, 32, dtype=np.float32, seed=3)
    q, k, v, do = (x.astype(dtype) for x in (q, k, v, do))
    for name, row, value in inject:
        {"q": q, "k": k, "v": v}[name][:, row] = value
    sh = lambda x: burstmpi.shard(x, layout=layout)
    plan = burstmpi.BurstAttention(mask=mask, layout=layout, causal=True, bwd_comm="ring",
                                   backend="auto" if backend is None else backend)
    out, lse = plan.forward(sh(q), sh(k), sh(v))
    dq, dk, dv = plan.backward(sh(do), sh(q), sh(k), sh(v), out, lse)
    un = lambda x, axis=1: np.asarray(burstmpi.unshard(x, layout=layout, axis=axis), np.float64)
    seen = ref.visible(np.arange(N), np.arange(N), causal=True, mask=mask, seqlen=N)
    return un(out), un(lse, 2), [un(g) for g in (dq, dk, dv)], seen


def _bad_rows(x):
    return ~np.isfinite(x).reshape(x.shape[0], x.shape[1], -1).all(axis=(0, 2))


@pytest.mark.parametrize("where", ["numpy", "numba", "kernels"])
def test_nan_and_inf_reach_the_rows_that_see_them(where, lib):
    """A NaN in q and an Inf in k reach exactly the rows dense attention lets them reach
    (those that see them) in out and lse. In the gradients, and from a NaN in v, they
    reach every row and key that sees them and may also reach a neighbour in the same
    partly masked tile (a masked pair's 0 times a NaN or an Inf inside a GEMM is NaN, as
    in flash-attn): never fewer, never a silent 0."""
    if where == "kernels" and not kh.available():
        pytest.skip("no C++ compiler for the CUDA emulator")
    backend = kh.EmulatedBackend(lib) if where == "kernels" else None
    dtype = np.float64 if where == "numpy" else np.float32
    mask = Sinks(2) | Window(6, 0)
    a, b = 9, 4
    with np.errstate(invalid="ignore", over="ignore"):
        out, lse, (dq, dk, dv), seen = _nan_run(backend, dtype, [("q", a, np.nan), ("k", b, np.inf)], mask)
    reach = seen[:, b].copy()
    reach[a] |= seen[a].any()
    assert np.array_equal(_bad_rows(out), reach)
    assert np.array_equal(~np.isfinite(lse).all(axis=(0, 1)), reach)
    assert _bad_rows(dq)[reach].all()
    key_reach = (seen & reach[:, None]).any(axis=0)
    assert _bad_rows(dk)[key_reach].all() and _bad_rows(dv)[key_reach].all()
    c = 3
    with np.errstate(invalid="ignore"):
        out, lse, _, seen = _nan_run(backend, dtype, [("v", c, np.nan)], mask)
    assert _bad_rows(out)[seen[:, c]].all() and np.isfinite(lse).all()
