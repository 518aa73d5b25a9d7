"""The BurstAttention ring, written once for every backend.

Forward (GAO): Q stays, K/V circulate; each step merges its block into the running
(acc, m, l) state inside the backend's tile loop.

Backward: D = rowsum(dO * O) is computed once, locally. Then either
  "burst": Q, dO, D, lse circulate with the dQ partial one step behind; K, V, dK, dV
           stay home. Moves (2e + 4) B C Z d + 8 B C Z bytes a step.
  "ring":  K, V circulate with the dK, dV partials; Q, dO, D, lse, dQ stay home.
           Moves (2e + 8) B C Zkv d bytes a step.
Both use the same local block kernel, only the roles of "home" and "travelling"
operands swap. Every gradient is accumulated in the accumulation dtype (fp32, or fp64)
on every hop: the error then does not grow with the number of ranks.

Each step posts the next transfer before computing on the current buffers (double
buffering), and the kernels poll the transport between tiles so that MPI keeps moving
the message while NumPy computes.

Ranks may hold different numbers of tokens (any global length; see ``burstmpi.masks._layout``).
A packet carries only the owner's rows that some other rank sees (``Geometry.
travelling_rows``: rows of documents that stay home, or far from a narrow window's
reach, never travel), and each row only as far as its farthest reader: the rows are
ordered by how far they go (``Geometry.route``), and each hop sends the prefix still
needed, as one message of just those rows (``comm.Packet``; read in place on shared
memory, where a holder views the first rows of its owner's copy). Under sinks and a
window, rank 0's packet holds the sinks and its window's reach for one hop, then the
sinks alone. A holder computes on the runs of rows it was handed
(``Geometry.carried``); a rank's own step on its full local arrays. A gradient partial
carries every row its packet left home with, and goes straight home from its last
contributor. A packet that comes in to go on is sent on as soon as it is here, where the
transport allows, not after the step's compute: a packet crossing busy ranks waits for
none of them.

Why a ring and not a broadcast for rows that many ranks read (sinks, global tokens, a
prefix): with shrinking packets a row crosses each link between its owner and its
farthest reader once, so when every rank on the way reads it, as for those, the ring
moves exactly a broadcast's bytes, overlapped with compute and with no collective. It
moves more only for rows that skip the ranks in between, which the direction choice
(``schedule``) already weighs by these same bytes.
"""

import functools
import time

import numpy as np

from .._transport.comm import Channel, PartialChannel, field_bytes

__all__ = ["forward", "backward", "packet_fields", "packet_dims", "nbytes", "bytes_per_step",
           "Timer", "key_operands", "finish_forward", "backward_operands",
           "finish_gradients", "fwd_pieces", "bwd_pieces", "head_slices", "grouped_rows"]

TAG_FWD, TAG_BWD, TAG_PARTIAL = 11, 21, 22


def nbytes(fields):
    """Bytes of a packet of (name, shape, dtype) fields, as ``burstmpi._transport.comm`` packs them."""
    return sum(field_bytes(shape, dt) for _, shape, dt in fields)


# What a phase's packet holds: key rows (K/V travel) or query rows (Q/dO/D/lse travel).
ROLE = {"forward": "k", "ring": "k", "burst": "q"}


def packet_dims(call, dims, role):
    """``dims`` with the sequence length of a packet of ``role`` ("k" or "q")."""
    B, _, Z, Zkv, d, dv = dims
    return B, call.geometry.packet_rows(role), Z, Zkv, d, dv


def packet_fields(mode, dims, dtype, acc):
    """The packet and partial fields of a phase, in the working layouts of the backend
    (``dims``' sequence length is the packet's rows)."""
    B, C, Z, Zkv, d, dv = dims
    g = Z // Zkv
    kv = [("k", (B, Zkv, C, d), dtype), ("v", (B, Zkv, C, dv), dtype)]
    if mode == "forward":
        return kv, []
    if mode == "burst":
        return ([("q", (B, Zkv, C, g, d), dtype), ("do", (B, Zkv, C, g, dv), dtype),
                 ("D", (B, Zkv, C, g), acc), ("lse", (B, Zkv, C, g), acc)],
                [("dq", (B, Zkv, C, g, d), acc)])
    return kv, [("dk", (B, Zkv, C, d), acc), ("dv", (B, Zkv, C, dv), acc)]


def bytes_per_step(mode, dims, dtype, acc):
    """Bytes one rank sends in one full ring step of ``mode`` (packet + partial)."""
    packet, partial = packet_fields(mode, dims, dtype, acc)
    return nbytes(packet) + nbytes(partial)


class Timer:
    """Splits a phase's wall time into compute and waiting on transfers."""

    def __init__(self):
        self.compute = self.wait = 0.0

    def run(self, attr, fn, *args, **kw):
        t0 = time.perf_counter()
        out = fn(*args, **kw)
        setattr(self, attr, getattr(self, attr) + time.perf_counter() - t0)
        return out


def _steps(call, chan, sched, timer, partials=None, rows=(None, None)):
    """Yield the ring steps, posting each step's transfers before its compute and waiting
    after it: the double-buffering rhythm of every phase.

    A step's transfers (the packet for the next step and, through ``partials(t)``, the
    gradient partials) are posted as one group, and a last group follows the last step.
    Transports that run transfers in order on one stream (NCCL) need exactly this: every
    rank's t-th group then pairs with its neighbours' t-th groups, so no rank can wait
    on a transfer its neighbour has queued behind one that waits for it. ``rows``: the
    rows each step sends and receives (``routes``), or None for full packets. A packet
    that comes in to go on is sent on as soon as it is here where the transport allows
    (``Channel.post(forward=)``), not after this rank's compute.
    """
    P = call.nranks
    for t in range(P):
        more = t < P - 1
        with call.transport.group():
            if more:
                on = t + 1 < P - 1 and sched.send[t + 1]  # the packet coming in goes on
                chan.post(send=sched.send[t], recv=sched.recv[t],
                          send_rows=None if rows[0] is None else rows[0][t],
                          recv_rows=None if rows[1] is None else rows[1][t],
                          forward=on, forward_rows=None if rows[0] is None or not on else rows[0][t + 1])
            if partials is not None:
                partials(t)
        yield t
        if more:
            timer.run("wait", chan.wait)
    if partials is not None:
        with call.transport.group():
            partials(P)


def grouped_rows(x, Zkv):
    """(B, C, Z, d) -> (B, Zkv, C, g, d) view: query heads grouped under their KV head."""
    B, C, Z, d = x.shape
    return x.reshape(B, C, Zkv, Z // Zkv, d).transpose(0, 2, 1, 3, 4)


def _from_rows(be, x, dtype, scale=None):
    """(B, Zkv, C, g, d) -> a new C-contiguous (B, C, Z, d) array of ``dtype`` (``be.output``),
    times ``scale`` if given, written by ``be.store``. Always a copy, even where the layouts
    agree (one KV head): the backends' accumulators are their reused workspace, and what
    the caller gets must be its own."""
    B, Zkv, C, g, d = x.shape
    out = be.output((B, C, Zkv, g, d), dtype)
    be.store(out.transpose(0, 2, 1, 3, 4), x, scale)
    return out.reshape(B, C, Zkv * g, d)


def _from_kv(be, x, dtype):
    """(B, Zkv, C, d) -> a new C-contiguous (B, C, Zkv, d) array of ``dtype`` (as ``_from_rows``)."""
    out = be.output((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), dtype)
    be.store(out.transpose(0, 2, 1, 3), x)
    return out


def _select(be, rows, count):
    """An index for ``rows`` (distinct) of a block of ``count`` rows, for arrays of backend
    ``be``: a slice when it is all of them in order, else the rows themselves, on a GPU as
    the backend's device copy (``KernelBackend.device_rows``: kept, so that a call copies
    no index to the device once the plan's first call has)."""
    if _in_order(rows, count):
        return slice(0, count)
    return rows if be.xp is np else be.device_rows(rows)


def _in_order(rows, count):
    """Are ``rows`` (distinct local rows) all ``count`` of them, in order?"""
    return len(rows) == count and bool(np.all(rows[1:] > rows[:-1]))


def routes(geo, role, sched):
    """How this phase's packets shrink (``Geometry.route``): the packet of this rank in
    packet order (its local rows), and per step the rows sent and the rows received."""
    own, d, P = sched.owners, sched.direction, sched.P
    held = lambda o, t: int(geo.route(role, o, d)[1][t])
    mine = geo.travelling_rows(role, own[0])[geo.route(role, own[0], d)[0]]
    return mine, ([held(own[t], t + 1) for t in range(P - 1)], [held(own[t + 1], t + 1) for t in range(P - 1)])


def load_packet(chan, home, rows, be):
    """Write this rank's packet of ``rows`` (its local rows, in packet order) into the
    channel, laid out for just those rows (``comm.Packet``); ``be``: the arrays' backend."""
    for name, view in chan.fill(len(rows)).items():
        src = home[name]
        view[...] = src[:, :, _select(be, rows, src.shape[2])]


def runs(geo, role, owner, direction, t, *packets, arc=None):
    """For each run of rows the holder at step t computes on from ``owner``'s packet
    (``Geometry.carried``): (the run's rows of each of ``packets``, dicts of views such as
    the packet and its partial, BlockSet)."""
    return cut_runs(geo.carried(role, owner, direction, t, arc), *packets)


def cut_runs(carried, *packets):
    """``carried``'s runs (a, b, BlockSet) as (rows a..b-1 of each of ``packets``, BlockSet)."""
    cut = lambda fields, a, b: {name: v[:, :, a:b] for name, v in fields.items()}
    return [(tuple(cut(f, a, b) for f in packets), blk) for a, b, blk in carried]


@functools.lru_cache(maxsize=256)
def head_slices(heads, Zkv, g):
    """(KV heads, heads within the group) slices covering the query heads ``heads`` (None:
    all): whole groups where a KV head's every query head is in, single heads elsewhere,
    and runs of consecutive KV heads with the same selection merged into one slice.
    Slicing views costs no copy, and K/V are never repeated per head."""
    if heads is None:
        return ((slice(None), slice(None)),)
    by_kv = {}
    for h in heads:
        by_kv.setdefault(h // g, []).append(h % g)
    items = []
    for z in sorted(by_kv):
        gis = sorted(by_kv[z])
        items += [(z, slice(None))] if len(gis) == g else [(z, slice(gi, gi + 1)) for gi in gis]
    items.sort(key=lambda it: ((it[1].start or 0), it[0]))
    out = []
    for z, gs in items:
        if out and out[-1][1] == gs and out[-1][0].stop == z:
            out[-1] = (slice(out[-1][0].start, z + 1), gs)
        else:
            out.append((slice(z, z + 1), gs))
    return tuple(out)


def fwd_pieces(be, q, k, v, state, pieces, scale, poll=None):
    """Merge a block pair into the running state, piece by piece (``Geometry.pieces``:
    a head group's term of the mask, with its block-sparse filter if any). The terms are
    disjoint, so merging each one's keys into the same online softmax is attention over
    their union."""
    acc, m, l = state
    Zkv, g = q.shape[1], q.shape[3]
    for heads, qb, kb, blocks in pieces:
        for zs, gs in head_slices(heads, Zkv, g):
            be.fwd_block(q[:, zs, :, gs], k[:, zs], v[:, zs], (acc[:, zs, :, gs], m[:, zs, :, gs], l[:, zs, :, gs]),
                         qb, kb, scale, poll=poll, blocks=blocks)


def bwd_pieces(be, q, do, D, lse, k, v, dq, dk, dv, pieces, scale, poll=None):
    """Add a block pair's gradients, piece by piece (as ``fwd_pieces``): with P rebuilt
    from the global lse, each term's contribution is its own and they add."""
    Zkv, g = q.shape[1], q.shape[3]
    cut_q = lambda x, zs, gs: None if x is None else x[:, zs, :, gs]
    cut_k = lambda x, zs: None if x is None else x[:, zs]
    for heads, qb, kb, blocks in pieces:
        for zs, gs in head_slices(heads, Zkv, g):
            be.bwd_block(q[:, zs, :, gs], do[:, zs, :, gs], D[:, zs, :, gs], lse[:, zs, :, gs], k[:, zs], v[:, zs],
                         cut_q(dq, zs, gs), cut_k(dk, zs), cut_k(dv, zs), qb, kb, scale, poll=poll, blocks=blocks)


def _add_home(timer, part, grads, at):
    """Add our travelling rows' partial, home from its last contributor, to those rows
    (``at``). Our accumulators take no other term for them after step 0, so it is added
    after our last step: waiting for it earlier would hold up our own later steps until
    its sender's step (a partial lands in a home buffer of its own, so its sender never
    waits for us)."""
    for name, view in timer.run("wait", part.received, home=True).items():
        grads[name][:, :, at] += view
    part.done()


def key_operands(k, v):
    """The key side {k, v} in the working layout (B, Zkv, C, d): views, no copies."""
    return {"k": k.transpose(0, 2, 1, 3), "v": v.transpose(0, 2, 1, 3)}


def finish_forward(be, state, dtype, dims):
    """(out, lse) in the caller's layouts from the running state (the backend may reuse it
    afterwards)."""
    B, C, Z, Zkv, _, dv = dims
    # A new array in the caller's layout, which the backend normalises the rows into.
    out = be.output((B, C, Zkv, Z // Zkv, dv), dtype)
    _, lse_rows = be.fwd_finalize(state, dtype, out=out.transpose(0, 2, 1, 3, 4))
    return out.reshape(B, C, Z, dv), be.xp.ascontiguousarray(lse_rows.transpose(0, 1, 3, 2)).reshape(B, Z, C)


def backward_operands(be, dout, q, k, v, out, lse, dims, acc):
    """The backward's home operands in working layouts and its zeroed accumulators:
    (query side {q, do, D, lse}, key side {k, v}, gradients {dq, dk, dv})."""
    xp = be.xp
    B, C, Z, Zkv, d, dv = dims
    g = Z // Zkv
    # D = rowsum(dO * O), once and locally, so O itself never travels.
    D = be.bwd_preprocess(dout, out, Zkv, acc)                         # (B, Zkv, C, g)
    lse_rows = lse.astype(acc).reshape(B, Zkv, g, C).transpose(0, 1, 3, 2)
    # Rows that saw no key have lse = -inf; +inf makes exp(s - lse) exactly 0 there.
    lse_rows = xp.where(lse_rows == -np.inf, np.inf, lse_rows)
    home_q = {"q": grouped_rows(q, Zkv), "do": grouped_rows(dout, Zkv), "D": D, "lse": lse_rows}
    home_k = key_operands(k, v)
    return home_q, home_k, be.bwd_state(B, Zkv, C, g, d, dv, acc)


def finish_gradients(call, grads, dtype):
    """(dq, dk, dv) in the caller's layout and ``dtype``, from the accumulators (emptied:
    they are the backend's, and a backend may drop or reuse each once it is copied). dK and
    dV stay in the accumulation dtype where ``call.kv_grads_accumulated`` (head parallelism
    adds replicated K/V heads' shares before rounding once)."""
    be = call.backend
    kv_dtype = be.acc_dtype(dtype) if call.kv_grads_accumulated else dtype
    dq = _from_rows(be, grads.pop("dq"), dtype, call.scale)
    dk = _from_kv(be, grads.pop("dk"), kv_dtype)
    dvv = _from_kv(be, grads.pop("dv"), kv_dtype)
    return dq, dk, dvv


def forward(call, q, k, v, dims):
    """Return (out, lse, stats) for this rank's q, k, v."""
    be = call.backend
    B, C, Z, Zkv, d, dv = dims
    acc = be.acc_dtype(q.dtype)
    geo = call.geometry
    packet, _ = packet_fields("forward", packet_dims(call, dims, "k"), q.dtype, acc)
    sched = call.schedule("forward", dims, q.dtype)
    (chan,) = call.channels("forward", [(Channel, packet, TAG_FWD, sched.direction)])
    timer, t_start = Timer(), time.perf_counter()

    home_k = key_operands(k, v)
    mine, rows = routes(geo, "k", sched)
    if sched.send and sched.send[0]:  # our keys leave (not at 1 rank, nor where no one needs them)
        load_packet(chan, home_k, mine, be)
        if _in_order(mine, C):  # all of them, in order: our own step reads that copy too
            home_k = chan.current
    q_rows = grouped_rows(q, Zkv)
    state = be.fwd_state(B, Zkv, C, Z // Zkv, dv, acc)
    qb = geo.block("q", call.rank)
    owners = [o for o, c in zip(sched.owners, sched.compute) if c]
    for t in _steps(call, chan, sched, timer, rows=rows):
        if sched.compute[t]:
            owner = sched.owners[t]
            if owner == call.rank:
                parts = [(home_k, geo.block("k", owner))]
            else:
                parts = [(ks, kb) for (ks,), kb in runs(geo, "k", owner, sched.direction, t, chan.current)]
            for ks, kb in parts:
                timer.run("compute", fwd_pieces, be, q_rows, ks["k"], ks["v"], state, geo.pieces(qb, kb),
                          call.scale, poll=chan.progress)
    out, lse = finish_forward(be, state, q.dtype, dims)
    pairs = sum(geo.pairs(call.rank, o) for o in owners)
    return out, lse, call.phase_stats([chan], owners, pairs, sched.direction, timer, t_start)


def backward(call, mode, dout, q, k, v, out, lse, dims):
    """Return (dq, dk, dv, stats) in ``mode`` ("burst" or "ring")."""
    be = call.backend
    C = dims[1]
    acc = be.acc_dtype(q.dtype)
    geo = call.geometry
    role = ROLE[mode]
    packet, partial = packet_fields(mode, packet_dims(call, dims, role), q.dtype, acc)
    sched = call.schedule(mode, dims, q.dtype)
    chan, part = call.channels(mode, [(Channel, packet, TAG_BWD, sched.direction),
                                      (PartialChannel, partial, TAG_PARTIAL, sched.direction)])
    timer, t_start = Timer(), time.perf_counter()

    home_q, home_k, grads = backward_operands(be, dout, q, k, v, out, lse, dims, acc)
    if mode == "burst":  # K and V stay home for every step: as the tiles read them, once
        home_k = be.resident_keys(home_k["k"], home_k["v"], acc)
    mine, rows = routes(geo, role, sched)
    home = home_q if mode == "burst" else home_k
    if sched.send and sched.send[0]:
        load_packet(chan, home, mine, be)
    # A partial holds every row its packet left home with, in packet order: a holder adds
    # to the first rows, those it was handed.
    leaves = lambda o: int(geo.route(role, o, sched.direction)[1][0])

    def partials(t):
        # The partial finished at step t-1 leaves with step t's packet (on, or home from its
        # last contributor); the partial that step t adds to arrives with it, and so does
        # our own, home from our packet's last contributor, in the group after its step
        # (added after the last step: ``_add_home``).
        if t >= 2 and sched.partial_send[t - 1]:
            to = sched.partial_to[t - 1]
            part.post_send(dest=to, home=to == sched.owners[t - 1])
        if t < sched.P and sched.partial_recv[t]:
            part.post_recv(rows=leaves(sched.owners[t]))
        if sched.partial_home and t == sched.home_at:
            part.post_recv(source=sched.home_from, rows=len(mine), home=True)

    poll = lambda: any([chan.progress(), part.progress()])
    for t in _steps(call, chan, sched, timer, partials, rows):
        owner = sched.owners[t]
        partial = part.send_buffer(leaves(owner)) if t > 0 and sched.partial_send[t] else None
        if sched.compute[t]:
            if owner == call.rank:  # our own step: the full local arrays
                parts = [(home, geo.block(role, owner), grads)]
            else:  # each run of the rows it was handed, and their rows of the partial
                parts = [(views, blk, {**grads, **rows_of_partial})
                         for (views, rows_of_partial), blk in runs(geo, role, owner, sched.direction, t,
                                                                   chan.current, partial)]
            for travelling, block, target in parts:
                if mode == "burst":
                    qs, ks, qb, kb = travelling, home_k, block, geo.block("k", call.rank)
                else:
                    qs, ks, qb, kb = home_q, travelling, geo.block("q", call.rank), block
                timer.run("compute", bwd_pieces, be, qs["q"], qs["do"], qs["D"], qs["lse"],
                          ks["k"], ks["v"], target["dq"], target["dk"], target["dv"],
                          geo.pieces(qb, kb), call.scale, poll=poll)
        if t > 0 and sched.partial_recv[t]:
            for name, view in timer.run("wait", part.received).items():
                partial[name] += view
            part.done()
    if sched.partial_home:  # posted with group home_at, added last (it has its own buffer)
        _add_home(timer, part, grads, _select(be, mine, C))
    timer.run("wait", part.drain)

    del partial
    dq, dk, dvv = finish_gradients(call, grads, q.dtype)
    owners = [o for o, c in zip(sched.owners, sched.compute) if c]
    # The holder's pairs: its queries against the owner's keys, or (burst) the owner's
    # queries against its keys.
    pairs = sum(geo.pairs(o, call.rank) if mode == "burst" else geo.pairs(call.rank, o) for o in owners)
    return dq, dk, dvv, call.phase_stats([chan, part], owners, pairs, sched.direction, timer, t_start)
