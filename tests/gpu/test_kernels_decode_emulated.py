"""The decode kernels (cuda/attn_decode.cu), run on the CPU emulator through KernelBackend.

``KernelBackend.decode`` attends T new query tokens to the first n rows of a cache shard
(split-KV: burst_decode per chunk of the cache, then burst_decode_combine over the chunks)
and ``KernelBackend.combine`` merges normalised partials. Both are checked against a
float64 dense softmax over the visible rows written here, with flash-attn's rule (error at
most about 2x that of a plain same-dtype implementation, plus a small atol), on:
T = 1 and T > 1; g = 1, GQA and MQA; n = 0, 1, a few, lengths no tile divides, several
splits, 200k rows; cache positions in ring-buffer (wrapped) and random order, with the
newest rows invisible to earlier queries, windows, and queries that see nothing; every
dtype; head dims 32, 64, 96, 128, (192, 128), 256; strided and unaligned views. Every array
the kernels touch sits between guard zones (NaN before, unchanged after), rows of the cache
past n are NaN, and the workspace starts NaN, so a read or write out of place shows.
Seeded mistakes in the kernel source must each make a check fail.
"""

import numpy as np
import pytest

import kernel_harness as kh
from burstmpi._gpu import kernels
from conftest import REPORTS, check_close, f64

pytestmark = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")

SCHEDULES = list(kh.SCHEDULES)
DIMS = [(32, 32), (64, 64), (96, 96), (128, 128), (192, 128), (256, 256)]


def decode_names(dims, dtypes=tuple(kernels.DTYPES)):
    names = []
    for dt in dtypes:
        for d, dv in dims:
            names += [kernels._decode_name(dt, d, dv)] + [kernels._combine_name(x, dv) for x in kernels.DTYPES]
    return list(dict.fromkeys(names))


@pytest.fixture(scope="module")
def lib():
    """One emulator library with every decode and combine kernel the tests use."""
    return kh.build(decode_names(DIMS))


class GuardedBackend(kh.EmulatedBackend):
    """The emulated kernel backend with its workspace between guard zones and NaN-filled,
    checking every guarded array after each launch."""

    def __init__(self, lib, schedule="forward/late"):
        super().__init__(lib, schedule)
        self.guarded, self.allocated = [], 0

    def guard(self, values, dtype):
        g = kh.Guarded(values, dtype)
        self.guarded.append(g)
        return g.array

    def alloc(self, nbytes):
        assert nbytes % 4 == 0
        self.allocated += nbytes
        return self.guard(np.full(nbytes // 4, np.nan), np.float32).view(np.uint8)

    def launch(self, spec):
        super().launch(spec)
        bad = [i for i, g in enumerate(self.guarded) if not g.intact()]
        assert not bad, f"{spec.kernel} wrote outside its arrays (guard zones of arrays {bad} changed)"


# -- the reference -------------------------------------------------------------------------------

def visible(kpos, qpos0, T, left):
    """(T, n) boolean: query token t (at qpos0 + t) sees cache row j, from the definition."""
    qp = qpos0 + np.arange(T, dtype=np.int64)[:, None]
    kp = np.asarray(kpos, np.int64)[None, :]
    seen = kp <= qp
    if left >= 0:
        seen &= kp >= qp - left
    return seen


def dense(q, k, v, kpos, n, qpos0, left, scale, dtype, precision="float64"):
    """(out, lse) of the decode by a dense softmax over the visible rows: in float64, or
    "plain": what a same-dtype implementation gets (scores, probabilities and outputs
    rounded to the dtype, sums in float32), as burstmpi.reference does."""
    if precision == "float64":
        ct, rnd = np.float64, (lambda x: x)
    else:
        dt = kh.NP_DTYPES[dtype]
        ct, rnd = np.float32, (lambda x: x.astype(dt).astype(np.float32))
    q, k, v = (np.asarray(x, ct) for x in (q, k[:, :, :n], v[:, :, :n]))
    s = rnd(np.einsum("bhtgd,bhjd->bhtgj", q, k) * ct(scale))
    s = np.where(visible(kpos[:n], qpos0, q.shape[2], left)[None, None, :, None, :], s, -np.inf)
    m = s.max(axis=-1, keepdims=True, initial=-np.inf)
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(axis=-1, keepdims=True)
    seen = l > 0
    p = rnd(p / np.where(seen, l, 1))
    out = rnd(np.einsum("bhtgj,bhjd->bhtgd", p, v))
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(np.where(seen, l, 1)), -np.inf)[..., 0]
    return out, lse


def ring_positions(S, n, last):
    """Positions of a cache of S slots whose first n hold the n newest tokens up to
    ``last`` in ring-buffer order (wrapped: the oldest is not in slot 0). Slots past n
    hold junk that every query would see, were it read."""
    kpos = np.full(S, -7, np.int64)
    kpos[:n] = np.roll(np.arange(last - n + 1, last + 1), n // 3 + 1)
    return kpos


# -- decode cases ----------------------------------------------------------------------------------

CASES = [
    # dtype, (d, dv), B, Zkv, T, g, S, n, left, order, extra
    ("float16", (128, 128), 2, 2, 1, 4, 720, 700, -1, "ring", {}),        # GQA, 3 splits
    ("bfloat16", (64, 64), 2, 1, 3, 8, 40, 37, 20, "ring", {}),           # MQA, T > 1, 2 row groups, window
    ("float32", (192, 128), 2, 2, 2, 1, 310, 301, -1, "random", {}),      # V dim unlike QK, 2 splits
    ("float32", (64, 64), 2, 2, 4, 4, 8, 5, 1, "ring", {}),               # a few rows, a 2-token window
    ("bfloat16", (256, 256), 2, 1, 1, 2, 3, 1, -1, "ring", {}),           # n = 1
    ("float16", (64, 64), 2, 2, 2, 4, 4, 0, -1, "ring", {}),              # n = 0: out 0, lse -inf
    ("float16", (96, 96), 2, 2, 4, 2, 60, 50, -1, "late", dict(split_rows=16)),  # tokens 0, 1 see nothing
    ("float32", (32, 32), 2, 1, 5, 4, 460, 450, 10, "random", dict(split_rows=16)),  # 8 splits, -inf partials
    ("float16", (64, 64), 1, 1, 8, 32, 96, 90, -1, "ring", {}),           # 256 rows: 16 row groups
    ("bfloat16", (128, 128), 2, 2, 2, 2, 80, 77, 30, "ring", dict(layout="strided")),
    ("float16", (64, 64), 2, 2, 3, 2, 70, 66, -1, "random", dict(layout="unaligned")),
    ("float32", (96, 96), 2, 1, 2, 3, 50, 45, 7, "ring", dict(layout="unaligned")),
    ("float32", (32, 32), 1, 2, 3, 1, 40, 40, 2 ** 31 - 1, "ring", dict(qpos0=2 ** 31 - 3)),  # int32 edge
]


def _case_id(c):
    dtype, (d, dv), B, Zkv, T, g, S, n, left, order, extra = c
    tags = "".join(f"-{k}{v}" for k, v in extra.items())
    return f"{dtype}-d{d}x{dv}-B{B}-Zkv{Zkv}-T{T}-g{g}-n{n}-left{left}-{order}{tags}"


def make_problem(be, case, seed=0):
    """Guarded inputs and outputs of a decode case, in the layout the case names."""
    dtype, (d, dv), B, Zkv, T, g, S, n, left, order, extra = case
    dt = kh.NP_DTYPES[dtype]
    rng = np.random.default_rng(seed)
    qpos0 = extra.get("qpos0", 1000)
    last = qpos0 + T - 1  # the T new tokens are already in the cache
    if order == "late":  # every row sits after the first two query tokens
        kpos = np.full(S, -7, np.int64)
        kpos[:n] = qpos0 + 2 + rng.permutation(n) % 2
    else:
        kpos = ring_positions(S, n, last)
        if order == "random":
            kpos[:n] = rng.permutation(kpos[:n])
    q = rng.standard_normal((B, Zkv, T, g, d))
    k = rng.standard_normal((B, Zkv, S, d))
    v = rng.standard_normal((B, Zkv, S, dv))
    k[:, :, n:] = v[:, :, n:] = np.nan  # rows past n must never be read
    layout = extra.get("layout", "contiguous")
    if layout == "contiguous":
        gq, gk, gv = be.guard(q, dt), be.guard(k, dt), be.guard(v, dt)
        out = be.guard(np.full((B, Zkv, T, g, dv), np.nan), np.float32)
        lse = be.guard(np.full((B, Zkv, T, g), np.nan), np.float32)
    elif layout == "strided":
        # q, out, lse as in the caller's (B, T, heads, ...) layout; the cache every other
        # KV head of a twice as wide one; out with every other feature (copied back).
        gq = be.guard(q.transpose(0, 2, 1, 3, 4), dt).transpose(0, 2, 1, 3, 4)

        def every_other_head(x):  # (B, S, 2 Zkv, d) storage, viewed (B, Zkv, S, d)
            storage = np.full((B, S, 2 * Zkv, x.shape[3]), np.nan)
            storage[:, :, ::2] = x.transpose(0, 2, 1, 3)
            return be.guard(storage, dt).transpose(0, 2, 1, 3)[:, ::2]
        gk, gv = every_other_head(k), every_other_head(v)
        out = be.guard(np.full((B, T, Zkv, g, 2 * dv), np.nan), np.float32).transpose(0, 2, 1, 3, 4)[..., ::2]
        lse = be.guard(np.full((B, T, Zkv, g), np.nan), np.float32).transpose(0, 2, 1, 3)
    else:  # "unaligned": cache rows padded by one element, so no row starts 16-byte aligned
        pad = lambda x: np.concatenate([x, np.full(x.shape[:3] + (1,), np.nan)], axis=3)
        gq = be.guard(q, dt)
        gk, gv = be.guard(pad(k), dt)[..., :d], be.guard(pad(v), dt)[..., :dv]
        out = be.guard(np.full((B, Zkv, T, g, dv), np.nan), np.float32)
        lse = be.guard(np.full((B, Zkv, T, g), np.nan), np.float32)
    gkpos = be.guard(kpos.astype(np.int32), np.int32)
    return dict(q=gq, k=gk, v=gv, kpos=gkpos, n=n, qpos0=qpos0, left=left, scale=1 / np.sqrt(d),
                out=out, lse=lse)


def run_decode(be, case, seed=0):
    prob = make_problem(be, case, seed)
    be.decode(**prob)
    return prob


def check_decode(prob, dtype, record=True):
    args = (prob["q"], prob["k"], prob["v"], prob["kpos"], prob["n"], prob["qpos0"], prob["left"],
            prob["scale"], dtype)
    exact, plain = dense(*args), dense(*args, precision="plain")
    assert not np.isnan(prob["out"]).any() and not np.isnan(prob["lse"]).any()
    errs = [check_close(f"decode {name}", mine, e, p, dtype, record)
            for name, mine, e, p in zip(("out", "lse"), (prob["out"], prob["lse"]), exact, plain)]
    return errs, exact


PER_CASE = []


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_matches_float64(lib, case, monkeypatch):
    dtype, (d, dv), B, Zkv, T, g, S, n, left, order, extra = case
    if "split_rows" in extra:  # many splits over a short cache
        monkeypatch.setattr(kernels, "DECODE_SPLIT_ROWS", extra["split_rows"])
    i = CASES.index(case)
    be = GuardedBackend(lib, SCHEDULES[i % len(SCHEDULES)])
    prob = run_decode(be, case, seed=i)
    errs, (o64, l64) = check_decode(prob, dtype)
    splits, _ = kernels.decode_splits(n, B * Zkv * -(-T * g // kernels.DECODE_ROWS), kernels.decode_tile(dtype, d, dv))
    assert be.launches == (2 if splits > 1 else 1)
    assert (be.allocated > 0) == (splits > 1)
    unseen = ~visible(prob["kpos"][:n], prob["qpos0"], T, left).any(axis=1)  # tokens that see no row
    assert (prob["lse"][:, :, unseen] == -np.inf).all() and (prob["out"][:, :, unseen] == 0).all()
    assert np.isfinite(prob["lse"][:, :, ~unseen]).all()
    if order == "late":
        assert unseen[:2].all() and not unseen[2:].any()
    PER_CASE.append(f"  {_case_id(case):78s} splits {splits:3d}  out {errs[0]:.1e}  lse {errs[1]:.1e}")


def test_decode_long_cache_bounded_workspace(lib):
    """200k cache rows, one (batch, KV head), one query: the most splits there are; the
    workspace is bounded by DECODE_MAX_SPLITS x rows x (dv + 1) fp32, not by n."""
    case = ("float16", (32, 32), 1, 1, 1, 1, 200_000, 200_000, -1, "ring", {})
    be = GuardedBackend(lib, "shuffled/late")
    prob = run_decode(be, case)
    check_decode(prob, "float16")
    splits, chunk = kernels.decode_splits(200_000, 1, kernels.decode_tile("float16", 32, 32))
    assert splits > 100 and be.allocated == splits * 1 * (32 + 1) * 4
    assert be.allocated <= kernels.DECODE_MAX_SPLITS * (32 + 1) * 4
    PER_CASE.append(f"  {_case_id(case):78s} splits {splits:3d}")


def test_decode_split_choice_is_bounded():
    """decode_splits for n up to 2**31 - 1: never more than DECODE_MAX_SPLITS splits, no
    empty split, chunks a multiple of the tile, at least DECODE_SPLIT_ROWS rows a split
    (unless one split holds all), and about DECODE_TARGET_BLOCKS blocks when n allows."""
    for tile in (16, 32, 64):
        for blocks in (1, 3, 8, 64, 500, 528, 5000):
            for n in (0, 1, 15, 16, 255, 256, 257, 1000, 4097, 10 ** 5, 10 ** 6, 2 ** 31 - 1):
                splits, chunk = kernels.decode_splits(n, blocks, tile)
                assert 1 <= splits <= kernels.DECODE_MAX_SPLITS and chunk % tile == 0
                if n:
                    assert (splits - 1) * chunk < n <= splits * chunk
                    assert splits == 1 or chunk >= kernels.DECODE_SPLIT_ROWS
                    if n >= kernels.DECODE_MAX_SPLITS * kernels.DECODE_SPLIT_ROWS * 2:
                        assert splits * blocks >= min(kernels.DECODE_TARGET_BLOCKS,
                                                      kernels.DECODE_MAX_SPLITS * blocks) // 2


def test_decode_is_bitwise_reproducible(lib, monkeypatch):
    """Two identical calls give the same bits, and so do different warp and block orders
    and cp.async timings: no result depends on a schedule (no atomics, fixed orders)."""
    monkeypatch.setattr(kernels, "DECODE_SPLIT_ROWS", 32)
    case = ("bfloat16", (64, 64), 2, 2, 2, 4, 300, 290, 100, "random", {})
    results = []
    for schedule in (SCHEDULES[0], SCHEDULES[0], SCHEDULES[1], SCHEDULES[3]):
        be = GuardedBackend(lib, schedule)
        prob = run_decode(be, case)
        assert be.launches == 2
        results.append((prob["out"].tobytes(), prob["lse"].tobytes()))
    assert all(r == results[0] for r in results[1:])


def test_decode_refuses_bad_arguments(lib):
    be = GuardedBackend(lib)
    prob = make_problem(be, ("float16", (64, 64), 1, 1, 2, 2, 8, 8, -1, "ring", {}))
    with pytest.raises(ValueError, match=r"decode: n: expected 0 <= n <= S = 8, got 9"):
        be.decode(**{**prob, "n": 9})
    with pytest.raises(ValueError, match=r"decode: kpos: expected a contiguous int32 array of length >= 8"):
        be.decode(**{**prob, "kpos": prob["kpos"].astype(np.int64)})
    with pytest.raises(ValueError, match=r"decode: k: expected q's dtype float16, got float32"):
        be.decode(**{**prob, "k": prob["k"].astype(np.float32)})
    with pytest.raises(ValueError, match=r"decode: out: expected a float32 array of shape \(1, 1, 2, 2, 64\)"):
        be.decode(**{**prob, "out": prob["out"].astype(np.float16)})
    with pytest.raises(ValueError, match=r"decode: qpos0 \+ tokens - 1: expected an int32 value"):
        be.decode(**{**prob, "qpos0": 2 ** 31 - 1, "n": 0})
    assert be.launches == 0


# -- combine ------------------------------------------------------------------------------------

def merge(parts_out, parts_lse, precision):
    """The log-sum-exp merge in float64, or "plain" in float32."""
    ct = np.float64 if precision == "float64" else np.float32
    po, pl = np.asarray(parts_out, ct), np.asarray(parts_lse, ct)
    m = pl.max(axis=0, initial=-np.inf)
    seen = np.isfinite(m)
    w = np.where(np.isfinite(pl), np.exp(pl - np.where(seen, m, 0)), 0)
    total = w.sum(axis=0)
    out = np.where(w[..., None] > 0, w[..., None] * np.where(np.isfinite(pl)[..., None], po, 0), 0).sum(axis=0)
    out = out / np.where(seen, total, 1)[:, None]
    with np.errstate(divide="ignore"):
        lse = np.where(seen, m + np.log(np.where(seen, total, 1)), -np.inf)
    return out, lse


def combine_problem(be, P, R, dv, dtype, seed):
    rng = np.random.default_rng(seed)
    pl = rng.normal(3.0, 4.0, (P, R))
    po = rng.standard_normal((P, R, dv))
    if P:
        pl[rng.random((P, R)) < 0.3] = -np.inf      # partials that saw nothing
        pl[:, 1] = -np.inf                          # a row no partial saw
        pl[0, 2], pl[-1, 2] = 80.0, -60.0           # weights far apart
        po[np.isinf(pl)] = np.nan                   # what a partial that saw nothing holds is not read
    return (be.guard(po, np.float32), be.guard(pl, np.float32),
            be.guard(np.full((R, dv), np.nan), kh.NP_DTYPES[dtype]), be.guard(np.full(R, np.nan), np.float32))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("P", [0, 1, 2, 5])
def test_combine_matches_float64(lib, P, dtype):
    R, dv = 7, 64 if dtype != "float32" else 128
    be = GuardedBackend(lib, SCHEDULES[P % len(SCHEDULES)])
    po, pl, out, lse = combine_problem(be, P, R, dv, dtype, seed=P)
    be.combine(po, pl, out, lse)
    assert be.launches == 1
    (o64, l64), (op, lp) = merge(po, pl, "float64"), merge(po, pl, "plain")
    op = op.astype(kh.NP_DTYPES[dtype])  # a plain implementation writes the dtype too
    check_close("combine out", out, o64, op, dtype)
    check_close("combine lse", lse, l64, lp, "float32" if dtype != "float32" else dtype)
    assert (f64(out)[1] == 0).all() and lse[1] == -np.inf
    if P == 0:
        assert (f64(out) == 0).all() and (lse == -np.inf).all()
    # the same inputs, the same bits
    out2, lse2 = (be.guard(np.full(x.shape, np.nan), x.dtype) for x in (out, lse))
    be.combine(po, pl, out2, lse2)
    assert out2.tobytes() == out.tobytes() and lse2.tobytes() == lse.tobytes()


def test_combine_of_decoded_shards_is_the_whole_decode(lib):
    """What KVCache does across ranks: decode each shard of a cache on its own, combine
    the shards' partials, and get the decode of the whole cache."""
    case = ("float16", (128, 128), 2, 2, 2, 4, 900, 900, 600, "random", {})
    be = GuardedBackend(lib, "reverse/early")
    whole = make_problem(be, case)
    shards, cut = [], (0, 250, 251, 900)  # the middle shard has a single row
    for a, b in zip(cut[:-1], cut[1:]):
        part = dict(whole, k=whole["k"][:, :, a:b], v=whole["v"][:, :, a:b], kpos=whole["kpos"][a:b].copy(), n=b - a)
        part["out"], part["lse"] = (be.guard(np.full(x.shape, np.nan), np.float32) for x in (whole["out"], whole["lse"]))
        be.decode(**part)
        shards.append(part)
    R, dv = whole["out"].size // 128, 128
    out = be.guard(np.full((R, dv), np.nan), np.float16)
    lse = be.guard(np.full(R, np.nan), np.float32)
    be.combine(np.stack([s["out"].reshape(R, dv) for s in shards]), np.stack([s["lse"].reshape(R) for s in shards]),
               out, lse)
    whole["out"], whole["lse"] = out.reshape(whole["out"].shape), lse.reshape(whole["lse"].shape)
    check_decode(whole, "float16")


# -- seeded mistakes: each must make a check fail ---------------------------------------------

MISTAKES = [
    ("mask off by one: a query does not see its own token", "ql[i] = qpos0 + t;", "ql[i] = qpos0 + t - 1;"),
    ("window one row short", "const long long lo = (long long)qpos0 + t - left;",
     "const long long lo = (long long)qpos0 + t - left + 1;"),
    ("split merge in base 2 (natural-log lse merged with exp2)", "const float w = expf(lp - m);",
     "const float w = exp2f(lp - m);"),
    ("split merge: partials averaged, not weighted by exp(lse)", "const float w = expf(lp - m);",
     "const float w = 1.f;"),
    ("split range: each split drops its last row",
     "(int)(split_begin + chunk) : n;", "(int)(split_begin + chunk - 1) : n;"),
    ("online softmax: accumulator not rescaled", "for (int c = 0; c < CW; ++c) o[i][c] *= a;",
     "for (int c = 0; c < CW; ++c) o[i][c] *= 1.f;"),
    ("missing __syncthreads before the softmax reads the scores", "__syncthreads();  // S is complete", ""),
    ("missing cp.async wait for the tile",
     "cp_async_wait<1>();  // tile it is here, tile it+1 may still be in flight ...", ""),
]
# Splits of 2-3 tiles (DECODE_SPLIT_ROWS = 128 below), each holding rows some query sees.
MISTAKE_CASES = [("float16", (64, 64), 1, 2, 3, 2, 310, 300, 150, "ring", {}),
                 ("float16", (64, 64), 1, 1, 2, 1, 400, 400, -1, "random", {})]
CAUGHT = []


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_seeded_mistake_is_caught(mistake, monkeypatch):
    name, right, wrong = mistake
    src, _ = kernels.program()
    assert src.count(right) == 1, f"seeded mistake: expected the text once in the program, found {src.count(right)}"
    bad = kh.build(decode_names([(64, 64)], ("float16",)), src.replace(right, wrong))
    monkeypatch.setattr(kernels, "DECODE_SPLIT_ROWS", 128)  # several splits of several tiles
    caught = None
    for case in MISTAKE_CASES:
        for schedule in SCHEDULES:
            try:
                check_decode(run_decode(GuardedBackend(bad, schedule), case), "float16", record=False)
            except (AssertionError, kh.EmulatorError) as exc:
                caught = f"{_case_id(case)} {schedule}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                break
        if caught:
            break
    assert caught, f"seeded mistake '{name}' went unnoticed"
    CAUGHT.append(f"  {name:58s} <- {caught[:150]}")


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    if PER_CASE:
        REPORTS.append(("emulated decode kernels, largest |error| against float64 per case", list(PER_CASE)))
    if CAUGHT:
        REPORTS.append(("seeded mistakes in cuda/attn_decode.cu and the check that caught each", list(CAUGHT)))
