"""The model of the causal balancing (``burstmpi._ring.balance``): a call re-sharded to a
balanced layout costs that layout's ring plus one all-to-all of the inputs and one of the
results.

The ring is simulated as ``model.flat`` does (lockstep steps of the exact pair matrix and the
bytes the schedules move); the all-to-all moves, per rank, the rows that change rank
(``_ring.balance.moved_rows``) in each direction, at the link between nodes where the ranks
span several (an all-to-all crosses them), else the node's. ``choose`` is what a plan asks
(``balance="auto"``); ``predict_balanced`` is the command line's and the bench's estimate.
"""

import numpy as np

from ..masks._intervals import Bounds, Mask
from ..masks._layout import Layout
from .._ring.balance import CANDIDATES, GAIN, even, moved_rows
from .._ring.schedule import pair_matrix
from .flat import _phase, dtypes, predict

__all__ = ["exchange_bytes", "predict_layout", "choose", "predict_resharded", "predict_balanced"]


def exchange_bytes(shape, leave, arrive):
    """(forward, backward) bytes a rank sends to re-shard and bring the results back, where
    ``leave`` of its tokens go to other ranks and ``arrive`` come from them: q, k, v of those
    that leave and out, lse of those that came; the backward's dout, q, k, v, out, lse, and
    dq, dk, dv back."""
    e = shape.dtype_bytes
    acc = np.dtype(dtypes(shape)[1]).itemsize
    B, Z, Zkv, d, dv = shape.batch, shape.heads, shape.kv_heads, shape.head_dim, shape.head_dim_v
    q, k, v, o, lse = Z * d * e, Zkv * d * e, Zkv * dv * e, Z * dv * e, Z * acc
    fwd = B * (leave * (q + k + v) + arrive * (o + lse))
    bwd = B * (leave * (o + q + k + v + o + lse) + arrive * (q + k + v))
    return fwd, bwd


def _seconds(machine, nbytes, spread):
    """One all-to-all of ``nbytes`` a rank: over the network where the ranks span nodes."""
    if not nbytes:
        return 0.0
    gbps, lat = ((machine.inter_gbps, machine.inter_latency_us) if spread
                 else (machine.intra_gbps, machine.intra_latency_us))
    return 2 * lat * 1e-6 + nbytes / (gbps * 1e9)


def predict_layout(shape, machine, P, pairs, rows=None, node_of=None, modes=("burst", "ring")):
    """Predicted (forward s, backward s, forward bytes, backward bytes) of the ring on a
    layout with ``pairs`` (its exact pair matrix), re-sharded to it from the caller's where
    ``rows`` is given: (the tokens each rank sends away, those it receives), per rank
    (``_ring.balance.moved_rows`` both ways); the backward's faster mode."""
    node_of = [r // machine.ranks_per_node for r in range(P)] if node_of is None else node_of
    needs = pairs > 0
    f = _phase(shape, machine, P, None, "forward", pairs, needs, node_of)
    b = min((_phase(shape, machine, P, None, m, pairs, needs, node_of) for m in modes), key=lambda x: x[0])
    fwd, bwd, fb, bb = f[0], b[0], float(f[3].max()), float(b[3].max())
    if rows is not None and P > 1:
        per_rank = [exchange_bytes(shape, int(a), int(b)) for a, b in zip(*rows)]
        xf, xb = max(x for x, _ in per_rank), max(x for _, x in per_rank)
        spread = len(set(node_of)) > 1
        fwd, bwd = fwd + _seconds(machine, xf, spread), bwd + _seconds(machine, xb, spread)
        fb, bb = fb + xf, bb + xb
    return fwd, bwd, fb, bb


def choose(shape, machine, P, caller, candidates, node_of=None, gain=GAIN):
    """The layout a call runs on, and every candidate's prediction: ``candidates`` maps a
    layout name to ``(pairs, rows)`` (``rows`` None for the caller's own layout, whose
    name is ``caller``). A re-shard is taken where its predicted forward + backward is
    ``gain`` below the caller's layout's; among those, the fastest, where ties (within 1 %,
    the model's own resolution) go to the first in the order given: zigzag moves fewer rows
    from a contiguous layout and skips more ring steps than striped. A caller's layout whose
    ranks' pairs are within ``gain`` of even is kept (``_ring.balance.even``: the runtime
    asks no further)."""
    pred = {name: predict_layout(shape, machine, P, pairs, rows, node_of) for name, (pairs, rows) in candidates.items()}
    if even(candidates[caller][0], gain):
        return caller, pred
    total = {name: p[0] + p[1] for name, p in pred.items()}
    others = [n for n in candidates if n != caller]
    fastest = min((total[n] for n in others), default=None)
    best = next((n for n in others if total[n] <= 1.01 * fastest), caller)
    return (best if best != caller and total[best] < (1 - gain) * total[caller] else caller), pred


def predict_resharded(shape, machine, P, layout, target, bwd_mode):
    """``model.flat.predict``'s row for a call on ``layout`` that runs on ``target``: the
    target's ring plus the exchange's time and bytes (none where they are the same layout)."""
    row = dict(predict(shape, machine, P, target, bwd_mode))
    row.update(layout=layout, ring_layout=target)
    if target == layout or P == 1:
        return row
    src, dst = Layout(layout, P, shape.seqlen), Layout(target, P, shape.seqlen)
    per_rank = [exchange_bytes(shape, int(a), int(b)) for a, b in zip(moved_rows(src, dst), moved_rows(dst, src))]
    spread = P > machine.ranks_per_node
    ring_ms = row["fwdbwd_ms"]
    for phase, i in (("fwd", 0), ("bwd", 1)):
        nbytes = max(x[i] for x in per_rank)
        row[f"{phase}_ms"] += 1e3 * _seconds(machine, nbytes, spread)
        row[f"{phase}_mb_sent"] += nbytes / 1e6
    row["fwdbwd_ms"] = row["fwd_ms"] + row["bwd_ms"]
    row["fwdbwd_tflops"] *= ring_ms / row["fwdbwd_ms"]  # the same pairs, in the time with the exchange
    return row


def predict_balanced(shape, machine, P, layout):
    """``model.flat.predict``'s row for ``layout`` as a plan with ``balance="auto"`` runs it:
    on the layout ``choose`` takes (``ring_layout``), in its faster backward mode, with the
    exchange's time and bytes."""
    win = Mask(Bounds(shape.causal, shape.window), shape.seqlen)
    lays = {n: Layout(n, P, shape.seqlen) for n in dict.fromkeys((layout,) + CANDIDATES)}
    cands = {n: (pair_matrix(lay, win), None if n == layout else (moved_rows(lays[layout], lay),
                                                                    moved_rows(lay, lays[layout])))
             for n, lay in lays.items()}
    target, _ = choose(shape, machine, P, layout, cands)
    return min((predict_resharded(shape, machine, P, layout, target, m) for m in ("burst", "ring")),
               key=lambda r: r["fwdbwd_ms"])
