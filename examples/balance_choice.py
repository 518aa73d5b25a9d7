"""How long a plan takes to choose the layout a causal call runs on (``balance="auto"``).

    python examples/balance_choice.py [RANKS,...] [TOKENS,...]

For contiguous causal shards at each count of ranks and tokens (default 8,32,64 ranks and
65536,1048576 tokens), what every rank computes once per new geometry before the first
ring step: the caller's layout's visible-pair matrix, the candidates' (zigzag, striped)
with the rows each would move, and the performance model's simulated rings
(``burstmpi.model.balance.choose``, at a nominal 0.1 TFLOP/s and 1 GB/s). Prints the
seconds of each part and the layout chosen. A training loop pays this once per shape;
packed documents change the geometry every batch.

Unlike the other examples, this one measures burstmpi's internals (``burstmpi._ring``):
the choice has no public entry of its own, it runs inside a plan's first call.
"""

import sys
import time

from burstmpi._ring.balance import CANDIDATES, moved_rows, pair_matrix
from burstmpi._ring.geometry import geometry
from burstmpi.masks._intervals import Bounds
from burstmpi.model.balance import choose
from burstmpi.model.flat import Machine, Shape

RANKS = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8,32,64").split(",")]
TOKENS = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "65536,1048576").split(",")]
CAUSAL = Bounds(causal=True)
MACHINE = Machine("nominal", fwd_tflops=0.1, bwd_tflops=0.1, intra_gbps=1.0, inter_gbps=1.0)

print(f"{'ranks':>5} {'tokens':>8} {'caller':>9} {'candidates':>11} {'model':>9}  chosen")
for N in TOKENS:
    for P in RANKS:
        t0 = time.perf_counter()
        mine = geometry("contiguous", P, N, CAUSAL)
        cands = {"contiguous": (pair_matrix(mine), None)}
        t1 = time.perf_counter()
        for name in CANDIDATES:
            g = geometry(name, P, N, CAUSAL)
            cands[name] = (pair_matrix(g), (moved_rows(mine.layout, g.layout), moved_rows(g.layout, mine.layout)))
        t2 = time.perf_counter()
        chosen, _ = choose(Shape(1, N, 8, 8, 64, 64, 4), MACHINE, P, "contiguous", cands)
        t3 = time.perf_counter()
        print(f"{P:5d} {N:8d} {1e3 * (t1 - t0):7.0f} ms {1e3 * (t2 - t1):8.0f} ms {1e3 * (t3 - t2):6.0f} ms  {chosen}",
              flush=True)
