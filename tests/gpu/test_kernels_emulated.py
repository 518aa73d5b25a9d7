"""cuda/*.cu, run on the CPU emulator, against float64 and the NumPy backend.

Each case splits a global sequence into P blocks as the ring does (layout positions,
key blocks visited in ring order and merged into one running state), runs the forward,
finalize, preprocess, dQ and dK/dV kernels exactly as a GPU backend launches them, with
the per-row mask intervals of burstmpi.masks._intervals, and checks out, lse, dq, dk and dv against
the float64 reference with flash-attn's rule. Cases cover windows, packed documents
(``cu_seqlens``: empty and 1-token documents, one spanning every block, dozens in one
tile) and blocks of unequal lengths. The NumPy backend solves the same problem (one rank)
and the largest difference between the two is recorded. Skipped where no C++ compiler
exists.
"""

import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pytest
from mpi4py import MPI

import burstmpi
import kernel_harness as kh
from burstmpi._gpu import kernels
from burstmpi import reference as ref
from burstmpi.masks._layout import Layout
from burstmpi.masks._intervals import Bounds, Mask
from conftest import WORST, check_close, f64

pytestmark = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")

MASKS = {"none": (False, None), "causal": (True, None), "window": (False, (21, 6)),
         "causal-window": (True, (40, 0))}
SCHEDULES = list(kh.SCHEDULES)


@dataclass
class Case:
    dtype: str
    d: int
    dv: int
    mask: str
    P: int = 2
    C: int = 46           # rows per block: not a multiple of any tile (16, 32, 64)
    Z: int = 4
    Zkv: int = 2          # GQA: two query heads per KV head
    B: int = 1
    layout: str = "contiguous"
    schedule: str = "forward/late"
    arch: str = "sm_90"   # whose shared-memory limit picks the kernel configuration
    N: Optional[int] = None      # global length when not P * C: blocks then differ in length
    docs: Optional[tuple] = None  # cu_seqlens offsets of packed documents

    @property
    def seqlen(self):
        return self.P * self.C if self.N is None else self.N

    def __str__(self):
        size = f"P{self.P}xC{self.C}" if self.N is None else f"P{self.P}-N{self.N}"
        docs = "" if self.docs is None else f"-docs{len(self.docs) - 1}:{_digest(self.docs)}"
        return (f"{self.dtype}-d{self.d}x{self.dv}-{self.mask}-{size}{docs}-Z{self.Z}/{self.Zkv}"
                f"-B{self.B}-{self.layout}-{self.schedule}-{self.arch}")


def _digest(docs):
    """A short tag telling two sets of documents apart in a test id."""
    return f"{zlib.crc32(repr(tuple(docs)).encode()) & 0xffff:04x}"


def random_docs(n, count, seed):
    """cu_seqlens of ``count`` documents of random lengths over n tokens, one of them
    empty and one a single token (at random places)."""
    rng = np.random.default_rng(seed)
    cuts = np.sort(rng.integers(0, n, count - 3))  # repeats: more empty documents
    lengths = list(np.diff(np.concatenate([[0], cuts, [n - 1]])))
    for extra in (1, 0):
        lengths.insert(int(rng.integers(0, len(lengths) + 1)), extra)
    return tuple(int(x) for x in np.concatenate([[0], np.cumsum(lengths)]))


def _cases():
    cases, i = [], 0
    for dtype in ("float16", "bfloat16", "float32"):
        for d in (64, 128):
            for mask in ("none", "causal", "window"):
                cases.append(Case(dtype, d, d, mask, layout=("zigzag" if mask == "causal" else "contiguous"),
                                  schedule=SCHEDULES[i % len(SCHEDULES)]))
                i += 1
    cases += [
        Case("float16", 32, 32, "causal", P=3, C=37, B=2),                       # odd rank count and length
        Case("bfloat16", 96, 96, "causal-window", P=2, C=50, Zkv=1),             # MQA
        Case("bfloat16", 192, 128, "causal", P=2, C=40, Z=2, Zkv=2, layout="zigzag"),  # V dim unlike QK
        Case("float16", 256, 256, "none", P=2, C=24, Z=2, Zkv=1),                # dK/dV in two launches
        Case("float32", 256, 256, "causal", P=2, C=24, Z=2, Zkv=2),
        Case("float32", 256, 256, "window", P=2, C=24, Z=2, Zkv=1, arch="sm_80"),  # 2-warp dQ, dK/dV
        Case("float16", 64, 64, "causal", P=2, C=150, layout="contiguous"),       # empty and full tiles
        Case("bfloat16", 128, 128, "window", P=2, C=140, Z=2, Zkv=1, layout="striped"),
        Case("float32", 64, 64, "causal", P=3, C=100, Z=2, Zkv=1, layout="zigzag"),
        Case("bfloat16", 64, 64, "causal", P=3, N=100, layout="zigzag"),          # blocks of 33, 33, 34
        Case("float16", 32, 32, "causal", P=4, N=3, Z=2, Zkv=1),                  # a rank without tokens
    ]
    # Packed documents: each query sees keys of its own document only (and of the window).
    for i, (dtype, d, mask, layout, docs, extra) in enumerate([
        ("float16", 64, "none", "contiguous", random_docs(92, 8, 1), {}),        # empty and 1-token docs
        ("bfloat16", 128, "causal", "zigzag", (0, 3, 115, 120), dict(P=3, C=40)),  # one spans every block
        ("float32", 64, "none", "contiguous", random_docs(92, 30, 2), {}),       # 30 documents in 2 x 46
        ("bfloat16", 64, "causal", "contiguous", random_docs(92, 30, 3), {}),    # ... under causal
        ("float16", 64, "causal", "zigzag", random_docs(92, 6, 4), {}),
        ("bfloat16", 64, "window", "striped", random_docs(92, 5, 5), {}),        # docs and a window
        ("float16", 128, "causal-window", "contiguous", (0, 60, 61, 61, 150, 200), dict(C=100)),
        # Empty, full and partial tiles in every kernel: full ones inside one long document.
        ("float16", 128, "causal", "contiguous", (0, 130, 131, 131, 300), dict(C=150)),
        ("bfloat16", 64, "none", "zigzag", (0, 1, 1, 200, 300), dict(C=150)),
        ("float32", 64, "causal", "zigzag", random_docs(100, 7, 6), dict(P=3, N=100)),  # unequal blocks
        ("float16", 32, "window", "zigzag", (0, 1, 1, 40, 41, 100), dict(P=3, N=100, Z=2, Zkv=1)),
    ]):
        cases.append(Case(dtype, d, d, mask, layout=layout, docs=docs,
                          schedule=SCHEDULES[i % len(SCHEDULES)], **extra))
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def libs():
    """One emulator library per (dtype, head dims) in use, built on first need."""
    built = {}

    def get(dtype, d, dv, source=None, arch="sm_90"):
        key = (dtype, d, dv, source, arch)
        if key not in built:
            built[key] = kh.build(kernels.kernel_names(dtype, d, dv, kernels.SMEM_LIMIT[arch]), source)
        return built[key]
    return get


def run_kernels(lib, c, seed=0):
    """Forward and backward of case ``c`` on the emulator: global (out, lse, dq, dk, dv)."""
    N = c.seqlen
    q, k, v, do = ref.random_problem(c.B, N, c.Z, c.Zkv, c.d, c.dv, dtype=kh.NP_DTYPES[c.dtype], seed=seed)
    lay = Layout(c.layout, c.P, N, cu_seqlens=c.docs)
    mask = Mask(Bounds(*MASKS[c.mask]), N, c.docs)
    scale = 1.0 / np.sqrt(c.d)
    em = kh.Emulated(lib, c.dtype, c.d, c.dv, c.schedule, seed, kernels.SMEM_LIMIT[c.arch])
    pos = [lay.positions(r) for r in range(c.P)]
    qbs, kbs = [mask.query_block(p) for p in pos], [mask.key_block(p) for p in pos]
    out = np.zeros((c.B, N, c.Z, c.dv), q.dtype)
    lse = np.zeros((c.B, c.Z, N), np.float32)
    for r in range(c.P):
        ring = [(r - t) % c.P for t in range(c.P)]  # the order a rank receives key blocks
        blocks = [(k[:, pos[j]], v[:, pos[j]], pos[j]) for j in ring]
        out[:, pos[r]], lse[:, :, pos[r]] = em.forward(q[:, pos[r]], blocks, qbs[r], scale)
    q_blocks = [(q[:, p], do[:, p], out[:, p], lse[:, :, p], qb) for p, qb in zip(pos, qbs)]
    k_blocks = [(k[:, p], v[:, p], kb) for p, kb in zip(pos, kbs)]
    dqs, dks, dvs = em.backward(q_blocks, k_blocks, scale)
    grads = [np.zeros(x.shape, np.float32) for x in (q, k, v)]
    for r, p in enumerate(pos):
        for g, part in zip(grads, (dqs[r], dks[r], dvs[r])):
            g[:, p] = part
    # The GPU backend converts the fp32 gradients to the input dtype at the end, as here.
    return (q, k, v, do), (out, lse, *(g.astype(q.dtype) for g in grads))


def check_case(c, lib, record=True):
    (q, k, v, do), ours = run_kernels(lib, c)
    causal, window = MASKS[c.mask]
    opts = dict(causal=causal, window=window)
    cu = None if c.docs is None else np.array(c.docs)
    exact = ref.forward(q, k, v, cu_seqlens=cu, **opts) + ref.backward(do, q, k, v, cu_seqlens=cu, **opts)
    plain = (ref.forward(q, k, v, precision="plain", cu_seqlens=cu, **opts)
             + ref.backward(do, q, k, v, precision="plain", cu_seqlens=cu, **opts))
    plan = burstmpi.BurstAttention(comm=MPI.COMM_SELF, **opts)
    o_np, l_np = plan.forward(q, k, v, cu_seqlens=cu)
    numpy_backend = (o_np, l_np) + plan.backward(do, q, k, v, o_np, l_np, cu_seqlens=cu)
    errs, diffs = [], []
    for name, mine, e, p, nb in zip(("out", "lse", "dq", "dk", "dv"), ours, exact, plain, numpy_backend):
        errs.append(check_close(f"emulated {name}", mine, e, p, c.dtype, record))
        diffs.append(float(np.abs(f64(mine) - f64(nb))[np.isfinite(f64(e))].max()))
        if record:
            key = (c.dtype, f"emulated {name} vs NumPy backend")
            WORST[key] = max(WORST.get(key, 0.0), diffs[-1])
    if record:
        PER_CASE.append(f"  {str(c):84s} {' '.join(f'{x:.1e}' for x in errs)} | {' '.join(f'{x:.1e}' for x in diffs)}")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_match_reference(libs, case):
    check_case(case, libs(case.dtype, case.d, case.dv, arch=case.arch))


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_every_schedule(libs, dtype, schedule):
    c = Case(dtype, 64, 64, "causal", P=2, C=70, layout="zigzag", schedule=schedule)
    check_case(c, libs(dtype, 64, 64))


def test_backend_launches_nothing_for_blocks_without_rows(libs):
    """A rank may hold no token (a sequence shorter than the ring): the kernel backend then
    launches nothing (CUDA rejects a grid with a 0 dimension), leaves what it accumulates
    unchanged and returns empty results of the right shapes."""
    be = kh.EmulatedBackend(libs("float16", 64, 64))
    B, Zkv, g, d, f16, f32 = 1, 1, 2, 64, np.float16, np.float32
    mask, rng = Mask(Bounds(causal=True), 8), np.random.default_rng(0)
    qb = {n: mask.query_block(np.arange(n)) for n in (0, 6)}
    kb = {n: mask.key_block(np.arange(8 - n, 8)) for n in (0, 5)}
    q = {n: rng.standard_normal((B, Zkv, n, g, d)).astype(f16) for n in (0, 6)}
    k = {n: rng.standard_normal((B, Zkv, n, d)).astype(f16) for n in (0, 5)}
    for cq, ck in ((0, 5), (6, 0)):
        state = be.fwd_state(B, Zkv, cq, g, d, f32)
        be.fwd_block(q[cq], k[ck], k[ck], state, qb[cq], kb[ck], 0.3)
        assert (state[0] == 0).all() and (state[1] == -np.inf).all() and (state[2] == 0).all()
        grads = (np.zeros(q[cq].shape, f32), np.zeros(k[ck].shape, f32), np.zeros(k[ck].shape, f32))
        rows = np.zeros((B, Zkv, cq, g), f32)
        be.bwd_block(q[cq], q[cq], rows, rows, k[ck], k[ck], *grads, qb[cq], kb[ck], 0.3)
        assert all((x == 0).all() for x in grads)
    out, lse = be.fwd_finalize(be.fwd_state(B, Zkv, 0, g, d, f32), f16)
    assert out.shape == (B, Zkv, 0, g, d) and lse.shape == (B, Zkv, 0, g)
    D = be.bwd_preprocess(np.zeros((B, 0, g, d), f16), np.zeros((B, 0, g, d), f16), Zkv, f32)
    assert D.shape == (B, Zkv, 0, g)
    assert be.launches == 0
    with pytest.raises(ValueError, match=r"fwd_block: qb: expected 6 rows, got \(5, 5, 5\)"):
        be.fwd_block(q[6], k[5], k[5], be.fwd_state(B, Zkv, 6, g, d, f32), mask.query_block(np.arange(5)),
                     kb[5], 0.3)


# -- seeded mistakes: each must make a test fail -------------------------------------------

# (what, the right text in the program source, the mistake replacing it); each right text
# occurs exactly once in the program.
SPACES = " " * 35
MISTAKES = [
    ("fragment: A registers 1 and 2 swapped when P becomes an A operand",
     f"pack2<T>(p[2 * i][2], p[2 * i][3]),\n{SPACES}pack2<T>(p[2 * i + 1][0], p[2 * i + 1][1]),",
     f"pack2<T>(p[2 * i + 1][0], p[2 * i + 1][1]),\n{SPACES}pack2<T>(p[2 * i][2], p[2 * i][3]),"),
    ("ldmatrix: B row addresses take the k half from the wrong lane bit",
     "kk + ((lane >> 3) & 1) * 8);", "kk + ((lane >> 4) & 1) * 8);"),
    ("missing __syncthreads before the warps read V",
     "cp_async_wait<0>();\n        __syncthreads();  // V is here for every thread, and every warp is done with K",
     "cp_async_wait<0>();"),
    ("missing __syncthreads before the next V tile overwrites the last",
     "        __syncthreads();  // every warp is done with the previous V tile\n", ""),
    ("missing cp.async wait for the K tile",
     "cp_async_wait<1>();  // Q and K are here (V may still be in flight) ...", ""),
    ("off-by-one mask: the last visible key excluded", "return p >= first && p <= last;",
     "return p >= first && p < last;"),
    ("tile classification: FULL from the first row's interval alone",
     "if (cmin >= first1 && cmax <= last0)", "if (cmin >= first0 && cmax <= last0)"),
    ("tail tile loads one row past the end", "const bool ok = r < rows_valid;", "const bool ok = r <= rows_valid;"),
    ("online softmax: accumulator not rescaled", "o[j][2 * i] *= alpha;", "o[j][2 * i] *= 1.f;"),
    ("dK/dV: D read for the wrong column", "p[j][e] *= dp[j][e] - D_s[col];", "p[j][e] *= dp[j][e] - D_s[g];"),
    ("dQ: rows g+8 masked with row g's interval",
     "!in_interval(qf[i], ql[i], kpos[c0 + col])\n",
     "!in_interval(qf[0], ql[0], kpos[c0 + col])\n"),
]


def seeded_source(right, wrong):
    src, _ = kernels.program()
    assert src.count(right) == 1, f"seeded mistake: expected the text once in the program, found {src.count(right)}"
    return src.replace(right, wrong)


def run_until_caught(lib, dtype):
    """Run a small, sensitive set of cases under every schedule; return what failed first."""
    # The last case's query-row tiles straddle a document boundary next to key tiles inside
    # the first document: only documents make the tile's rows differ in where they start.
    for c in (Case(dtype, 64, 64, "causal", P=2, C=70, layout="zigzag"), Case(dtype, 64, 64, "none", P=1, C=45),
              Case(dtype, 64, 64, "causal", P=2, C=70, docs=(0, 100, 101, 101, 140))):
        for schedule in SCHEDULES:
            c.schedule = schedule
            try:
                check_case(c, lib, record=False)
            except (AssertionError, kh.EmulatorError) as exc:
                return f"{c}: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


@pytest.mark.parametrize("mistake", MISTAKES, ids=[m[0] for m in MISTAKES])
def test_seeded_mistake_is_caught(libs, mistake):
    name, right, wrong = mistake
    # The float path has no fragments; the tensor-core path shows every mistake listed.
    caught = run_until_caught(libs("float16", 64, 64, seeded_source(right, wrong)), "float16")
    assert caught, f"seeded mistake '{name}' went unnoticed"
    CAUGHT.append(f"  {name:58s} <- {caught[:150]}")


CAUGHT = []
PER_CASE = []


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    from conftest import REPORTS
    if PER_CASE:
        REPORTS.append(("emulated kernels, largest |error| per case: against float64 (out lse dq dk dv) "
                        "| against the NumPy backend (same order)", list(PER_CASE)))
    if CAUGHT:
        REPORTS.append(("seeded mistakes in cuda/ and the check that caught each", list(CAUGHT)))
