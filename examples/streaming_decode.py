"""StreamingLLM decode over a sharded KV cache: attention sinks and a sliding window.

    mpiexec -n 4 python -m mpi4py examples/streaming_decode.py [STEPS]

A 3000-token prompt (longer than the cache) is prefilled with ``Sinks(4) | Window(1023, 0)``;
the cache keeps the 4 sinks and the window's tail, and ``capacity = 4 + 1023 + 1`` then
serves one-token decode calls forever. Every 500th step and the last are checked against
float64 attention over the whole sequence under the same mask; the script prints the
largest error, the bytes each call moved per rank, and whether every rank got the same bits.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

import burstmpi
from burstmpi import reference
from burstmpi.masks import Sinks, Window

comm = MPI.COMM_WORLD
B, H, HKV, D = 1, 8, 2, 64
SINKS, LEFT, PROMPT = 4, 1023, 3000
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 10000
total = PROMPT + steps
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((B, total, h, D), dtype=np.float32) for h in (H, HKV, HKV))

cache = burstmpi.KVCache(capacity=SINKS + LEFT + 1, batch=B, kv_heads=HKV, head_dim=D, window=(LEFT, 0),
                         sinks=SINKS)
shard = lambda x: burstmpi.shard(x[:, :PROMPT], layout="contiguous")
cache.prefill(shard(q), shard(k), shard(v), layout="contiguous")  # the layout it was sharded with

mask = Sinks(SINKS) | Window(LEFT, 0)
worst, moved, t0 = 0.0, set(), time.perf_counter()
for s in range(steps):
    p = PROMPT + s
    out = cache.decode(q[:, p:p + 1], k[:, p:p + 1], v[:, p:p + 1])
    moved.add(cache.last_stats.bytes_moved)
    if s % 500 == 499 or s == steps - 1:
        o64, _, _ = reference.rows(q[:, [p]], k[:, :p + 1], v[:, :p + 1], np.zeros((B, 1, H, D)), [p],
                                   causal=True, mask=mask)
        worst = max(worst, float(np.abs(out - o64).max()))
per_step = (time.perf_counter() - t0) / steps
same = len(set(comm.allgather(out.tobytes()))) == 1
if comm.Get_rank() == 0:
    print(f"streaming decode: {comm.Get_size()} ranks, {steps} steps after a {PROMPT}-token prompt, capacity "
          f"{SINKS + LEFT + 1}: largest error against float64 {worst:.2e}; bytes moved per call per rank "
          f"{sorted(moved)}; {1e3 * per_step:.2f} ms per step; the same bits on every rank: {same}")
