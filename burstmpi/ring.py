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

Ranks may hold different numbers of tokens (any global length; see ``burstmpi.layout``).
Packets are sized for the largest block and carry the owner's rows first: the kernels
only ever see the owner's ``count`` rows, so padding rows cost no compute and never
enter a result.
"""

import time

import numpy as np

from .comm import Channel, PartialChannel, field_bytes

__all__ = ["forward", "backward", "packet_fields", "packet_dims", "nbytes", "bytes_per_step",
           "Timer", "fill_packet", "key_operands", "finish_forward", "backward_operands",
           "finish_gradients"]

TAG_FWD, TAG_BWD, TAG_PARTIAL = 11, 21, 22


def nbytes(fields):
    """Bytes of a packet of (name, shape, dtype) fields, as ``burstmpi.comm`` packs them."""
    return sum(field_bytes(shape, dt) for _, shape, dt in fields)


def packet_dims(plan, dims):
    """``dims`` with the sequence length of a packet: the largest block of the layout."""
    B, _, Z, Zkv, d, dv = dims
    return B, plan.layout.max_count, Z, Zkv, d, dv


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


def _steps(plan, chan, sched, timer, partials=None):
    """Yield the ring steps, posting each step's transfers before its compute and waiting
    after it: the double-buffering rhythm of every phase.

    A step's transfers (the packet for the next step and, through ``partials(t)``, the
    gradient partials) are posted as one group, and a last group follows the last step.
    Transports that run transfers in order on one stream (NCCL) need exactly this: every
    rank's t-th group then pairs with its neighbours' t-th groups, so no rank can wait
    on a transfer its neighbour has queued behind one that waits for it.
    """
    P = plan.nranks
    for t in range(P):
        more = t < P - 1
        with plan.transport.group():
            if more:
                chan.post(send=sched.send[t], recv=sched.recv[t])
            if partials is not None:
                partials(t)
        yield t
        if more:
            timer.run("wait", chan.wait)
    if partials is not None:
        with plan.transport.group():
            partials(P)


def _rows(x, Zkv):
    """(B, C, Z, d) -> (B, Zkv, C, g, d) view: query heads grouped under their KV head."""
    B, C, Z, d = x.shape
    return x.reshape(B, C, Zkv, Z // Zkv, d).transpose(0, 2, 1, 3, 4)


def _from_rows(xp, x, dtype):
    """(B, Zkv, C, g, d) -> a new C-contiguous (B, C, Z, d) array of ``dtype``."""
    B, Zkv, C, g, d = x.shape
    out = xp.empty((B, C, Zkv, g, d), dtype=dtype)
    out[...] = x.transpose(0, 2, 1, 3, 4)
    return out.reshape(B, C, Zkv * g, d)


def _from_kv(xp, x, dtype):
    """(B, Zkv, C, d) -> a new C-contiguous (B, C, Zkv, d) array of ``dtype``."""
    out = xp.empty((x.shape[0], x.shape[2], x.shape[1], x.shape[3]), dtype=dtype)
    out[...] = x.transpose(0, 2, 1, 3)
    return out


def fill_packet(chan, home, C):
    """Copy this rank's operands (working layouts, ``C`` rows) into the channel's current
    packet, whose rows past ``C`` stay padding."""
    for name, view in chan.current.items():
        view[:, :, :C] = home[name]


def key_operands(k, v):
    """The key side {k, v} in the working layout (B, Zkv, C, d): views, no copies."""
    return {"k": k.transpose(0, 2, 1, 3), "v": v.transpose(0, 2, 1, 3)}


def finish_forward(be, state, dtype, dims):
    """(out, lse) in the caller's layouts from the running state (which it consumes)."""
    B, C, Z = dims[:3]
    out_rows, lse_rows = be.fwd_finalize(state, dtype)
    out = _from_rows(be.xp, out_rows, dtype)
    del out_rows
    return out, be.xp.ascontiguousarray(lse_rows.transpose(0, 1, 3, 2)).reshape(B, Z, C)


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
    home_q = {"q": _rows(q, Zkv), "do": _rows(dout, Zkv), "D": D, "lse": lse_rows}
    home_k = key_operands(k, v)
    grads = {"dq": xp.zeros((B, Zkv, C, g, d), acc), "dk": xp.zeros((B, Zkv, C, d), acc),
             "dv": xp.zeros((B, Zkv, C, dv), acc)}
    return home_q, home_k, grads


def finish_gradients(xp, grads, dtype, scale):
    """(dq, dk, dv) in the caller's layout and ``dtype``, from the accumulators (emptied)."""
    grads["dq"] *= grads["dq"].dtype.type(scale)
    # Convert one gradient at a time, dropping its fp32 accumulator as soon as it is done.
    dq = _from_rows(xp, grads.pop("dq"), dtype)
    dk = _from_kv(xp, grads.pop("dk"), dtype)
    dvv = _from_kv(xp, grads.pop("dv"), dtype)
    return dq, dk, dvv


def forward(plan, q, k, v, dims):
    """Return (out, lse, stats) for this rank's q, k, v."""
    be = plan.backend
    B, C, Z, Zkv, d, dv = dims
    acc = be.acc_dtype(q.dtype)
    geo = plan.geometry
    packet, _ = packet_fields("forward", packet_dims(plan, dims), q.dtype, acc)
    sched = plan.schedule("forward", nbytes(packet), 0)
    (chan,) = plan.channels("forward", [(Channel, packet, TAG_FWD, sched.direction)])
    timer, t_start = Timer(), time.perf_counter()

    fill_packet(chan, key_operands(k, v), C)
    q_rows = _rows(q, Zkv)
    state = be.fwd_state(B, Zkv, C, Z // Zkv, dv, acc)
    qb = geo.query_block(plan.rank)
    owners = [o for o, c in zip(sched.owners, sched.compute) if c]
    for t in _steps(plan, chan, sched, timer):
        if sched.compute[t]:
            owner = sched.owners[t]
            n = plan.layout.count(owner)
            cur = chan.current
            timer.run("compute", be.fwd_block, q_rows, cur["k"][:, :, :n], cur["v"][:, :, :n], state,
                      qb, geo.key_block(owner), plan.scale, poll=chan.progress)
    out, lse = finish_forward(be, state, q.dtype, dims)
    pairs = sum(geo.pairs(plan.rank, o) for o in owners)
    return out, lse, plan.phase_stats([chan], owners, pairs, sched.direction, timer, t_start)


def backward(plan, mode, dout, q, k, v, out, lse, dims):
    """Return (dq, dk, dv, stats) in ``mode`` ("burst" or "ring")."""
    be, xp = plan.backend, plan.backend.xp
    C = dims[1]
    acc = be.acc_dtype(q.dtype)
    geo = plan.geometry
    packet, partial = packet_fields(mode, packet_dims(plan, dims), q.dtype, acc)
    sched = plan.schedule(mode, nbytes(packet), nbytes(partial))
    chan, part = plan.channels(mode, [(Channel, packet, TAG_BWD, sched.direction),
                                      (PartialChannel, partial, TAG_PARTIAL, sched.direction)])
    timer, t_start = Timer(), time.perf_counter()

    home_q, home_k, grads = backward_operands(be, dout, q, k, v, out, lse, dims, acc)
    fill_packet(chan, home_q if mode == "burst" else home_k, C)

    def partials(t):
        # The partial finished at step t-1 leaves with step t's packet; the partial that
        # step t adds to (or, after the last step, the one coming home) arrives with it.
        if t >= 2 and sched.partial_send[t - 1]:
            part.post_send()
        if (t < sched.P and sched.partial_recv[t]) or (t == sched.P and sched.partial_home):
            part.post_recv()

    for t in _steps(plan, chan, sched, timer, partials):
        owner = sched.owners[t]
        n = plan.layout.count(owner)  # the packet's valid rows; the rest is padding
        rows = lambda fields: {name: view[:, :, :n] for name, view in fields.items()}
        if mode == "burst":
            qs, ks, qrank, krank = rows(chan.current), home_k, owner, plan.rank
        else:
            qs, ks, qrank, krank = home_q, rows(chan.current), plan.rank, owner
        target = dict(grads)
        if t > 0 and sched.partial_send[t]:
            target.update(rows(part.send_buffer()))
        if sched.compute[t]:
            timer.run("compute", be.bwd_block, qs["q"], qs["do"], qs["D"], qs["lse"],
                      ks["k"], ks["v"], target["dq"], target["dk"], target["dv"],
                      geo.query_block(qrank), geo.key_block(krank), plan.scale,
                      poll=lambda: (chan.progress(), part.progress()))
        if t > 0 and sched.partial_recv[t]:
            for name, view in timer.run("wait", part.received).items():
                target[name] += view[:, :, :n]
    if sched.partial_home:
        for name, view in timer.run("wait", part.received).items():
            grads[name] += view[:, :, :C]
    timer.run("wait", part.drain)

    del target, qs, ks
    dq, dk, dvv = finish_gradients(xp, grads, q.dtype, plan.scale)
    owners = [o for o, c in zip(sched.owners, sched.compute) if c]
    # The holder's pairs: its queries against the owner's keys, or (burst) the owner's
    # queries against its keys.
    pairs = sum(geo.pairs(o, plan.rank) if mode == "burst" else geo.pairs(plan.rank, o) for o in owners)
    return dq, dk, dvv, plan.phase_stats([chan, part], owners, pairs, sched.direction, timer, t_start)
