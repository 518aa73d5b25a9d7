"""How long planning a mask takes at a million tokens, and what it holds.

    python examples/mask_planning.py [N] [RANKS]

Builds, for rank 0 of RANKS (every rank does the same for its own blocks), what a plan
computes before its first ring step: the lowered mask, which ring steps are needed, the
rows each packet carries hop by hop in both directions, the visible pairs and the pieces
each step computes. For a
random block-sparse mask (10 % of 128-token blocks, causal) and for attention sinks and
a window. Prints the seconds, and the resident memory planning added on top of what
the process held before (the caller's block array and mask included there).

Unlike the other examples, this one measures burstmpi's internals (the plan's geometry,
``burstmpi._ring.geometry``, and the bench's memory probes): planning has no public entry of
its own, it runs inside a plan's first call.
"""

import sys
import time

import numpy as np

from burstmpi.bench.memory import peak_bytes, reset_peak, rss_bytes
from burstmpi.masks import BlockSparse, Sinks, Window
from burstmpi.masks._intervals import Bounds
from burstmpi._ring.geometry import Geometry

N = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
P = int(sys.argv[2]) if len(sys.argv) > 2 else 4
BS = 128


def plan(mask):
    causal = Bounds(causal=True)
    t0 = time.perf_counter()
    geo = Geometry("zigzag", P, N, causal.lo, causal.hi, None, mask)
    needs = geo.needs("forward")
    # Every owner's route both ways (the schedule weighs the two directions by their bytes).
    routes = {d: [geo.route("k", o, d)[1] for o in range(P)] for d in (1, -1)}
    q = geo.block("q", 0)
    for o in range(P):  # the pieces rank 0 computes, on the runs of rows it is handed (direction +1)
        if needs[0, o]:
            kbs = [geo.block("k", 0)] if o == 0 else [b for _, _, b in geo.carried("k", o, 1, (0 - o) % P)]
            for kb in kbs:
                geo.pieces(q, kb)
    pairs = sum(geo.pairs(0, o) for o in range(P) if needs[0, o])
    return time.perf_counter() - t0, int(needs[0].sum()), routes[1], pairs


nb = -(-N // BS)
t0 = time.perf_counter()
rng = np.random.default_rng(0)
blocks = np.concatenate([rng.random((min(1024, nb - a), nb), dtype=np.float32) < 0.1 for a in range(0, nb, 1024)])
np.fill_diagonal(blocks, True)
sparse = BlockSparse(blocks, BS)
print(f"N = {N}, {P} ranks: a {nb} x {nb} block array ({blocks.nbytes / 1e6:.0f} MB) and its mask built in "
      f"{time.perf_counter() - t0:.2f} s (the caller's, not planning)")
for name, mask in (("block-sparse 10 % & causal", sparse), ("sinks(4) | window(1023, 0) & causal",
                                                           Sinks(4) | Window(1023, 0))):
    held, peaks = rss_bytes(), reset_peak()
    secs, steps, rows, pairs = plan(mask)
    added = f"{(peak_bytes() - held) / 1e6:.0f} MB" if peaks else "(this kernel cannot reset the peak)"
    print(f"{name}: planned in {secs:.2f} s; rank 0 computes {steps} of {P} steps, {pairs:.3e} visible pairs; "
          f"key rows each rank's packet holds hop by hop (direction +1) {[r[1:].tolist() for r in rows]}; "
          f"resident memory added at the peak {added}")
