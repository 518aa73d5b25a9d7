"""A performance model of the ring: what a run will cost before the GPUs are booked.

From a device's local kernel throughput, the links' bandwidths and latencies (within a
node and between nodes) and the problem's shape, it predicts for every layout and backward
mode: per-step compute and transfer times, the exposed communication, memory per rank
and the total forward/backward time, and recommends the fastest.

The ring runs in lockstep: in step t every rank computes on the block it holds while the
next block travels (double buffering), so a step takes the longest of all ranks'
max(compute, transfer), and a rank's exposed time is what it spends beyond its own
compute. Compute counts exactly the visible (query, key) pairs of each (holder, owner)
block pair (causal, sliding windows, all three layouts) at the device's dense-block
throughput; transfers use the bytes ``burstmpi._ring.flat`` actually moves (the ``Schedule``
decides which steps send) over the slowest link of the ring, intra-node when the ring
stays in one node. What it leaves out: kernel efficiency on partly masked tiles, and
contention between the ranks that share a node's network link.

Its command line (``python -m burstmpi.model``) is ``burstmpi.model.cli``.
"""

from dataclasses import dataclass

import numpy as np

from ..masks._intervals import Bounds, Mask, count_visible
from ..masks._layout import LAYOUTS, Layout
from .._ring import flat as ring
from .._ring.schedule import Schedule, pair_matrix
from .._transport.comm import Channel, PartialChannel

__all__ = ["Machine", "MACHINES", "visible_pairs", "predict", "recommend"]


@dataclass
class Machine:
    """Per-rank hardware figures. Throughputs are the local kernel's on dense blocks."""
    name: str
    fwd_tflops: float
    bwd_tflops: float
    intra_gbps: float      # point-to-point, one direction, between ranks of a node
    inter_gbps: float      # between nodes, per rank
    intra_latency_us: float = 5.0
    inter_latency_us: float = 10.0
    ranks_per_node: int = 8


# Assumed figures (not measurements of ours): an NVLink node of 8 H100-class GPUs on a
# 400 Gb/s-per-GPU InfiniBand fabric, and an A100 one on 200 Gb/s. Kernel rates are
# FlashAttention-2-class bf16, head dim 128; replace them with burstmpi-bench's "local"
# figures from your own GPUs.
MACHINES = {
    "h100-ib": Machine("h100-ib", fwd_tflops=350.0, bwd_tflops=250.0, intra_gbps=150.0, inter_gbps=45.0),
    "a100-ib": Machine("a100-ib", fwd_tflops=190.0, bwd_tflops=150.0, intra_gbps=100.0, inter_gbps=22.0),
    # 8 H200 with NVLink 4 (900 GB/s both ways a GPU; ~375 one way measured by peers) and a
    # 400 Gb/s NDR NIC per GPU (~48 GB/s); FlashAttention-3-class bf16 kernel rates.
    "h200-ib": Machine("h200-ib", fwd_tflops=500.0, bwd_tflops=400.0, intra_gbps=375.0, inter_gbps=48.0),
}


def visible_pairs(layout, holder, owner, win):
    """(query, key) pairs of holder's queries and owner's keys that the mask lets through."""
    qb = Mask(win, layout.seqlen).query_block(layout.positions(holder))
    return count_visible(qb, layout.positions(owner))


@dataclass
class Shape:
    batch: int
    seqlen: int
    heads: int
    kv_heads: int
    head_dim: int
    head_dim_v: int
    dtype_bytes: int = 2
    causal: bool = False
    window: tuple = None


def dtypes(shape):
    """(element dtype, accumulation dtype) of a shape's ``dtype_bytes`` (2: half precision)."""
    e = shape.dtype_bytes
    return {2: np.float16, 4: np.float32, 8: np.float64}[e], (np.float64 if e == 8 else np.float32)


def work(shape, machine, mode):
    """(FLOPs per visible pair, the machine's rate in FLOP/s) of a phase: the backward does
    2.5x the forward's work, at its own rate."""
    fwd = mode == "forward"
    per_pair = 4.0 * shape.batch * shape.heads * shape.head_dim * (1.0 if fwd else 2.5)
    return per_pair, (machine.fwd_tflops if fwd else machine.bwd_tflops) * 1e12


def _link(machine, node_of, r, peer, nbytes):
    """Seconds ``nbytes`` take from ring rank r to ``peer``: the node's links or the network."""
    if node_of[r] == node_of[peer]:
        return machine.intra_latency_us * 1e-6 + nbytes / (machine.intra_gbps * 1e9)
    return machine.inter_latency_us * 1e-6 + nbytes / (machine.inter_gbps * 1e9)


def _two_way_phase(shape, machine, P, pairs, needs, node_of):
    """The two-way backward (``burstmpi._ring.twoway``) in lockstep: K/V and the query side each
    travel their arcs both ways, no partial; a rank computes dQ against every K/V block it
    receives (3 of the backward's 5 GEMMs) and dK/dV against every query block (4 of 5),
    its own block once in full. Each step's transfers to the two neighbours run side by
    side. Returns what ``_phase`` does."""
    from .._ring.twoway import TwoWaySchedule

    B, Z, Zkv, d, dv = shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.head_dim_v
    dt, acc = dtypes(shape)
    dims = (B, -(-shape.seqlen // P), Z, Zkv, d, dv)
    kv_b, q_b = (ring.nbytes(ring.packet_fields(m, dims, dt, acc)[0]) for m in ("forward", "burst"))
    per_pair, rate = work(shape, machine, "two-way")
    steps = max(max(TwoWaySchedule(needs, r).steps, TwoWaySchedule(needs.T, r).steps) for r in range(P))
    plans = [(TwoWaySchedule(needs, r, steps), TwoWaySchedule(needs.T, r, steps)) for r in range(P)]
    sent = np.zeros(P)

    def step(t):
        c, x = np.zeros(P), np.zeros(P)
        for r, (kv, qs) in enumerate(plans):
            if t == 0:
                c[r] = pairs[r][r] * per_pair / rate if kv.local else 0.0
            else:
                c[r] = sum(pairs[r][dd.owners[t]] * 0.6 for dd in (kv.up, kv.down) if dd.compute[t])
                c[r] += sum(pairs[dd.owners[t]][r] * 0.8 for dd in (qs.up, qs.down) if dd.compute[t])
                c[r] *= per_pair / rate
            if t < steps - 1:
                for sign, dirs in ((+1, (kv.up, qs.up)), (-1, (kv.down, qs.down))):
                    nbytes = sum(b for dd, b in zip(dirs, (kv_b, q_b)) if dd.send[t])
                    if nbytes:
                        x[r] = max(x[r], _link(machine, node_of, r, (r + sign) % P, nbytes))
                        sent[r] += nbytes
        return c, x
    return _lockstep(P, map(step, range(steps))) + (sent,)


def _lockstep(P, steps):
    """Sum a lockstep simulation: each of ``steps`` gives every rank's compute and transfer
    seconds (c, x), and lasts as long as its slowest rank's max(c, x). Returns (time,
    compute, exposed) per rank."""
    total, compute, exposed = 0.0, np.zeros(P), np.zeros(P)
    for c, x in steps:
        step = float(np.max(np.maximum(c, x)))
        total += step
        compute += c
        exposed += step - c
    return total, compute, exposed


def _phase(shape, machine, P, layout, mode, pairs, needs, node_of=None):
    """Lockstep simulation of one phase: (time, compute, exposed, bytes sent) per rank.
    ``node_of[r]``: the node of ring rank r (default: blocks of ``machine.ranks_per_node``)."""
    node_of = [r // machine.ranks_per_node for r in range(P)] if node_of is None else node_of
    if mode == "two-way":
        return _two_way_phase(shape, machine, P, pairs, needs, node_of)
    B, N, Z, Zkv, d, dv = (shape.batch, shape.seqlen, shape.heads, shape.kv_heads, shape.head_dim,
                           shape.head_dim_v)
    C = -(-N // P)  # packets are sized for the largest block
    dt, acc = dtypes(shape)
    dims = (B, C, Z, Zkv, d, dv)
    packet, partial = ring.packet_fields("forward" if mode == "forward" else mode, dims, dt, acc)
    pb, qb = ring.nbytes(packet), ring.nbytes(partial)
    per_pair, rate = work(shape, machine, mode)
    need = needs.T if mode == "burst" else needs
    scheds = [Schedule(need, r, pb, qb) for r in range(P)]
    sent = np.zeros(P)

    def step(t):
        c, x = np.zeros(P), np.zeros(P)
        for r, s in enumerate(scheds):
            o = s.owners[t]
            if s.compute[t]:
                h, w = (o, r) if mode == "burst" else (r, o)  # burst: the packet holds queries
                c[r] = pairs[h][w] * per_pair / rate
            nbytes = (pb if t < P - 1 and (s.send[t] or s.recv[t]) else 0) + (qb if t >= 1 and s.partial_send[t] else 0)
            if nbytes:
                x[r] = _link(machine, node_of, r, (r + s.direction) % P, nbytes)
                sent[r] += nbytes
        return c, x
    return _lockstep(P, map(step, range(P))) + (sent,)


def predict(shape, machine, P, layout, bwd_mode):
    """Predicted times (s), exposed communication, bytes and memory of one configuration."""
    lay = Layout(layout, P, shape.seqlen)
    C = lay.max_count
    pairs = pair_matrix(lay, Mask(Bounds(shape.causal, shape.window), shape.seqlen))
    needs = pairs > 0
    f = _phase(shape, machine, P, layout, "forward", pairs, needs)
    b = _phase(shape, machine, P, layout, bwd_mode, pairs, needs)
    B, Z, Zkv, d, dv, e = (shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.head_dim_v,
                           shape.dtype_bytes)
    dims = (B, C, Z, Zkv, d, dv)
    dt, acc = dtypes(shape)
    packet_f, _ = ring.packet_fields("forward", dims, dt, acc)
    packet_b, partial_b = ring.packet_fields(bwd_mode, dims, dt, acc)
    single = P == 1
    buffers = max(Channel.copies(single) * ring.nbytes(packet_f),
                  Channel.copies(single) * ring.nbytes(packet_b) + PartialChannel.copies(single) * ring.nbytes(partial_b))
    a = 4 if e != 8 else 8
    operands = (B * C * (2 * Z * d + 2 * Zkv * d + Zkv * dv + 2 * Z * dv) * e   # q k v, dq dk dv, out do
                + B * Z * C * a * 2)                                           # lse, D
    fp32_state = B * C * (Z * dv + Z * d + Zkv * (d + dv)) * a                  # acc, dq/dk/dv accumulators
    flops = sum(sum(r) for r in pairs) * 4.0 * B * Z * d
    fwd_s, bwd_s = f[0], b[0]
    return dict(layout=layout, bwd_mode=bwd_mode, ranks=P, seqlen=shape.seqlen,
                fwd_ms=1e3 * fwd_s, bwd_ms=1e3 * bwd_s, fwdbwd_ms=1e3 * (fwd_s + bwd_s),
                fwd_exposed_ms=1e3 * float(f[2].max()), bwd_exposed_ms=1e3 * float(b[2].max()),
                fwd_mb_sent=float(f[3].max()) / 1e6, bwd_mb_sent=float(b[3].max()) / 1e6,
                memory_mb=(operands + fp32_state + buffers) / 1e6,
                fwdbwd_tflops=3.5 * flops / P / (fwd_s + bwd_s) / 1e12)


def recommend(shape, machine, P, layouts=LAYOUTS, modes=("burst", "ring")):
    """All (layout, mode) predictions, fastest first."""
    rows = []
    for layout in layouts:
        for mode in modes:
            rows.append(predict(shape, machine, P, layout, mode))
    return sorted(rows, key=lambda r: r["fwdbwd_ms"])
