"""The performance model across nodes: the flat ring, the two-level ring and head
parallelism, for any ranks, node size and machine (``burstmpi.model.flat``'s lockstep
simulation, extended).

* **flat**: ``flat._phase`` with each hop's link (NVLink-class inside a node, the
  network between nodes) taken from the ranks' nodes.
* **two-level** (``burstmpi._ring.twolevel``): per cycle, g lockstep steps whose inner hops run
  inside the node, against one network transfer per rank overlapped with the whole cycle
  (the backward's: the travelling block and, from the second cycle, the last cycle's
  partial going home; the last partial is exposed). "two-way" moves the K/V and query
  packets each way and no partial, and computes the backward as two passes (7 GEMMs a
  block pair instead of 5, as the host backend does).
* **head parallelism** (``burstmpi._heads``): the ring of P/u groups with u times the
  tokens and 1/u of the heads per rank, plus its all-to-alls inside the node (not
  overlapped: they run before and after the ring).

Compute counts each rank's visible pairs at the machine's dense-block rate, as the flat
model does; what it leaves out is the same (partly masked tiles' efficiency, contention
between a node's NICs).
"""

from dataclasses import replace

import numpy as np

from ..masks._intervals import Bounds, Mask
from ..masks._layout import Layout
from .._ring import flat as ring
from .._ring.schedule import pair_matrix
from .._ring.twolevel import block_owner, choose_mode
from .._transport.nodes import Nodes
from .flat import _phase, dtypes, work

__all__ = ["predict_ring", "choose_topology", "scale_row", "RINGS"]

RINGS = ("flat", "two-level", "head-parallel")  # what ``scale_row`` compares


def _two_level_phase(shape, machine, nodes, layout, mode, pairs):
    """(time, compute per rank, inter-node bytes per rank) of one two-level phase (``mode``:
    "forward", or the backward's "burst", "ring" or "two-way")."""
    P, N, g = len(nodes.node_of), nodes.count, len(nodes.members[0])
    dt, acc = dtypes(shape)
    dims = (shape.batch, layout.max_count, shape.heads, shape.kv_heads, shape.head_dim, shape.head_dim_v)
    if mode == "two-way":  # K/V one way, the query side the other, nothing home
        pb, qb = sum(ring.nbytes(ring.packet_fields(m, dims, dt, acc)[0]) for m in ("forward", "burst")), 0
    else:
        pb, qb = (ring.nbytes(f) for f in ring.packet_fields(mode, dims, dt, acc))
    per_pair, rate = work(shape, machine, mode)
    if mode == "two-way":
        per_pair *= 7 / 5
    if mode == "burst":  # the holder's keys against the travelling queries
        pairs = np.asarray(pairs).T
    x_in = machine.intra_latency_us * 1e-6 + (pb + qb) / (machine.intra_gbps * 1e9)
    link = lambda nbytes: machine.inter_latency_us * 1e-6 + nbytes / (machine.inter_gbps * 1e9)
    total, compute, inter = 0.0, np.zeros(P), np.zeros(P)
    where = [(nodes.node_of[r], nodes.members[nodes.node_of[r]].index(r)) for r in range(P)]
    for o in range(N):
        cycle = 0.0
        for s in range(g):
            c = np.array([pairs[r][block_owner(nodes.members, n, i, o, s)] * per_pair / rate for r, (n, i) in enumerate(where)])
            cycle += float(np.max(np.maximum(c, x_in if s < g - 1 else 0.0)))
            compute += c
        if o < N - 1:  # the next seed (and, after the first cycle, the last cycle's partial home)
            out = pb + (qb if o > 0 else 0)
            cycle = max(cycle, link(out))
            inter += out
        total += cycle
    if qb and N > 1:  # the last cycle's partial goes home after it: exposed
        total += link(qb)
        inter += qb
    return total, compute, inter


def _alltoall_seconds(shape, machine, u, C, names):
    """The head-parallel exchange of one phase: each rank keeps 1/u of every array (B, C,
    heads, d) named and sends the rest to its group, inside the node."""
    if u == 1:
        return 0.0
    B, Z, Zkv, d, dv, e = (shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.head_dim_v,
                           shape.dtype_bytes)
    rep = max(1, u // Zkv)  # K/V heads replicated to the members that share them
    size = {"q": Z * d * e, "out": Z * dv * e, "do": Z * dv * e, "dq": Z * d * e, "lse": Z * 4,
            "k": Zkv * d * e * rep, "v": Zkv * dv * e * rep, "dk": Zkv * d * e * rep, "dv": Zkv * dv * e * rep}
    nbytes = sum(B * C * size[n] for n in names) * (u - 1) / u
    return 2 * machine.intra_latency_us * 1e-6 + nbytes / (machine.intra_gbps * 1e9)


def predict_ring(shape, machine, P, layout, topology="flat", head_parallel=1, ranks_per_node=None, bwd_mode=None):
    """Predicted forward and backward times (s) and the busiest rank's inter-node bytes for
    one topology. ``ranks_per_node`` defaults to the machine's."""
    g = machine.ranks_per_node if ranks_per_node is None else ranks_per_node
    nodes = Nodes.blocks(P, g)
    u = head_parallel
    Pr = P // u
    lay = Layout(layout if u == 1 else f"{layout}/{u}", Pr, shape.seqlen)
    inner = shape if u == 1 else replace(shape, heads=shape.heads // u, kv_heads=max(1, shape.kv_heads // u))
    pairs = pair_matrix(lay, Mask(Bounds(shape.causal, shape.window), shape.seqlen))
    ring_nodes = Nodes([nodes.node_of[j * u] for j in range(Pr)])
    a2a_f = _alltoall_seconds(shape, machine, u, -(-shape.seqlen // P), ("q", "k", "v", "out", "lse"))
    a2a_b = _alltoall_seconds(shape, machine, u, -(-shape.seqlen // P),
                              ("do", "q", "k", "v", "out", "lse", "dq", "dk", "dv"))
    if topology == "two-level" and ring_nodes.spread:
        dims = (inner.batch, lay.max_count, inner.heads, inner.kv_heads, inner.head_dim, inner.head_dim_v)
        mode = choose_mode(bwd_mode or "auto", dims, dtypes(inner)[0])
        f = _two_level_phase(inner, machine, ring_nodes, lay, "forward", pairs)
        b = _two_level_phase(inner, machine, ring_nodes, lay, mode, pairs)
        inter = float((f[2] + b[2]).max())
    else:
        mode = bwd_mode or "burst"
        needs = pairs > 0
        f = _phase(inner, machine, Pr, lay, "forward", pairs, needs, ring_nodes.node_of)
        b = _phase(inner, machine, Pr, lay, mode, pairs, needs, ring_nodes.node_of)
        inter = _flat_inter(f, b, ring_nodes)
    fwd, bwd = f[0] + a2a_f, b[0] + a2a_b
    return dict(topology=topology if topology != "two-level" or ring_nodes.spread else "flat", head_parallel=u, ranks=P,
                ranks_per_node=g, seqlen=shape.seqlen, bwd_mode=mode, fwd_ms=1e3 * fwd, bwd_ms=1e3 * bwd,
                fwdbwd_ms=1e3 * (fwd + bwd), exposed_ms=1e3 * float(((f[0] - f[1]) + (b[0] - b[1])).max()),
                inter_mb=inter / 1e6)


def choose_topology(shape, machine, P, layout, ranks_per_node, bwd_mode=None, margin=0.05):
    """``topology="auto"``'s choice: "two-level" where the model predicts its forward +
    backward at least ``margin`` faster than the flat ring's, else "flat" (the simpler ring
    wins a tie). Both rings compute the same pairs, so the choice turns on the links: the
    two-level ring keeps all but one transfer a cycle inside the nodes and hides that one
    behind the cycle."""
    flat, two = (predict_ring(shape, machine, P, layout, t, ranks_per_node=ranks_per_node, bwd_mode=bwd_mode)
                 for t in ("flat", "two-level"))
    return "two-level" if two["fwdbwd_ms"] < (1 - margin) * flat["fwdbwd_ms"] else "flat"


def _flat_inter(f, b, nodes):
    """The busiest rank's bytes to another node on the flat ring (each sends to its
    neighbour: all of them across the network, or none)."""
    P = len(nodes.node_of)
    crosses = np.array([nodes.remote(r, (r + 1) % P) or nodes.remote(r, (r - 1) % P) for r in range(P)])
    return float(((f[3] + b[3]) * crosses).max()) if P > 1 else 0.0


# -- at scale: dense causal attention under zigzag, in closed form ---------------------------


def scale_row(shape, machine, P, topology):
    """Closed-form f+b time (s), exposed communication (s), efficiency and the tokens per
    rank that hide the transfers, for dense causal attention under zigzag at any P (the
    lockstep simulation above is exact but costs O(P^2)): with zigzag every step of a rank
    sees about half of a block pair, so each step computes the phase's work / (ring
    length) and moves one packet. ``topology``: "flat", "two-level" or "head-parallel"
    (u = the node size)."""
    g = min(machine.ranks_per_node, P)
    N_nodes = max(1, P // g)
    B, Z, Zkv, d, e = shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.dtype_bytes
    u = g if topology == "head-parallel" else 1
    ring_len, zkv = P // u, (Zkv // u if Zkv % u == 0 else 1) if u > 1 else Zkv
    C = shape.seqlen / ring_len  # tokens of a ring block
    intra, inter = machine.intra_gbps * 1e9, machine.inter_gbps * 1e9
    total = exposed = 0.0
    hide = 0.0
    for phase, rate, partial in (("fwd", machine.fwd_tflops * 1e12, 0), ("bwd", machine.bwd_tflops * 1e12, 1)):
        work = (1.0 if phase == "fwd" else 2.5) * 4.0 * B * (Z / u) * d * C * C / 2  # a block pair, half visible
        c = work / rate
        kv = B * C * zkv * d * (2 * e + partial * 2 * 4)  # K/V (+ fp32 dK/dV partial in the backward)
        if topology == "two-level" and N_nodes > 1 and g > 1:
            step = max(c, machine.intra_latency_us * 1e-6 + kv / intra)
            cycle = max(g * step, machine.inter_latency_us * 1e-6 + kv / inter)
            t = N_nodes * cycle
            need = kv / inter / g / c  # the cycle's compute must cover one network transfer
        else:
            crosses = N_nodes > 1 and (u == 1 or ring_len > 1)
            bw, lat = (inter, machine.inter_latency_us) if crosses else (intra, machine.intra_latency_us)
            x = lat * 1e-6 + kv / bw
            t = c + (ring_len - 1) * max(c, x)
            need = (kv / bw) / c
            t += _alltoall_seconds(shape, machine, u, shape.seqlen / P,
                                   ("q", "k", "v", "out", "lse") if phase == "fwd" else
                                   ("do", "q", "k", "v", "out", "lse", "dq", "dk", "dv"))
        total += t
        exposed += t - ring_len * c
        hide = max(hide, need)
    # compute per step grows as C^2 and a packet as C: the tokens per rank that hide the
    # transfers scale as the ratio (``need`` > 1: C must grow by that factor).
    tokens_to_hide = shape.seqlen / P * hide
    return dict(topology=topology, ranks=P, seqlen=shape.seqlen, fwdbwd_ms=1e3 * total, exposed_ms=1e3 * max(exposed, 0),
                efficiency=(total - max(exposed, 0)) / total, hide_tokens=tokens_to_hide)
