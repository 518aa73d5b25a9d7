"""What a row of each bench mode holds, per rank, while each of its parts runs: the stages
``memory.Budget`` checks against the node's free memory before the row runs.

Each figure is the arrays the code keeps alive at once, counted from the configuration;
what cannot be counted (the plan's fp32 accumulators, converted blocks and the bench's
local-kernel reference: ``WORK_Q``, ``WORK_KV``) is fitted to the peaks the bench measured.
The bench prints every estimate beside the measured peak (``est MB/rk``, ``peak MB/rk``;
decode rows also per stage in the JSON), so a figure that drifts shows.
"""

import numpy as np

from .. import reference
from .common import np_dtype
from .memory import Stage

__all__ = ["WORK_Q", "WORK_KV", "PIECE_BYTES", "CHECK_BYTES", "ONE_RANK", "attention_stages", "decode_stages",
           "per_token", "capacity", "piece_tokens"]

# The plan's working memory beyond its inputs, results and ring buffers, in float32 copies
# of a rank's q and of its k (or v). Fitted on the CPU backend at 1 and 4 ranks, MHA and
# GQA, float32 and bfloat16: with the ring buffers below, within 2 % of the measured peak.
WORK_Q, WORK_KV = 3.2, 4.1

# Decode mode: bytes of keys and values per rank in one piece of the cache's random fill,
# and per chunk of the float64 check: what a row needs beyond the cache stays this small.
PIECE_BYTES = 64 << 20
CHECK_BYTES = 32 << 20
ONE_RANK = "one rank holding the whole cache (1rk)"


def _item(cfg):
    return np.dtype(np_dtype(cfg["dtype"])).itemsize


# -- attention mode ---------------------------------------------------------------------

def _ring_buffers(cfg, C, P, shm, gpu):
    """(own, peers) bytes of the ring's buffers on one rank: its packets and gradient
    partials (double-buffered over MPI; one packet and two partials in a shared window with
    ``shm``, where a rank also maps the packets of every peer it reads and its neighbour's
    partials: its resident set counts those pages too). ``bwd_comm="auto"`` takes the mode
    that moves fewer bytes on GPUs, as the plan does (two-way at 3+ ranks); with host arrays
    the plan may take the other one-way mode for balance (on one node), so the larger counts."""
    B, Z, Zkv, d = cfg["batch"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    item = _item(cfg)
    kv = (B * C * Zkv * 2 * d * item + 8 * C, B * C * Zkv * 2 * d * 4)  # (packet, partial)
    q = (B * C * Z * 2 * d * item + 2 * B * Z * C * 4, B * C * Z * d * 4)
    both = (max(kv[0], q[0]), max(kv[1], q[1]))
    modes = {"burst": q, "ring": kv, "two-way": both, "either one-way": both}
    mode = cfg["bwd_comm"]
    if mode == "auto":  # host arrays: either one-way mode may run (``burstmpi._choices.balanced_mode``)
        mode = ("either one-way" if not gpu else "two-way" if P >= 3
                else min(("burst", "ring"), key=lambda m: sum(modes[m])))
    packet, partial = modes[mode]
    packet = max(packet, kv[0])  # the forward's K/V packets share the arena
    if P == 1:  # one rank reads its own K/V where they are, and sends nothing
        return 0, 0
    if shm:
        return packet + 2 * partial, (P - 1) * packet + 2 * partial
    return 2 * packet + 3 * partial, 0


def attention_stages(comm, cfg, C, *, gpu, check, use_torch, padded_C, shm):
    """The ring (inputs, results, the plan's working memory and ring buffers), the float64
    check (the ring's arrays and the global q, k, v, dout it gathers), torch (every rank
    gathers the global problem; rank 0 adds torch's copies and gradients), the padded way
    (the ring's arrays and the largest padded document's)."""
    P = comm.Get_size()
    B, N, Z, Zkv, d = cfg["batch"], cfg["seqlen"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    item = _item(cfg)

    def ring(c):
        """(private, shared, peers) bytes of the ring on c tokens per rank."""
        q, kv = B * c * Z * d, B * c * Zkv * d  # elements
        arrays = (4 * q + 4 * kv) * item + B * Z * c * 4  # q, do, k, v; out, dq, dk, dv; lse
        own, peers = _ring_buffers(cfg, c, P, shm, gpu)
        work = int(4 * (WORK_Q * q + WORK_KV * kv))
        return (arrays + work, own, peers) if shm else (arrays + work + own, 0, 0)

    mine, shared, peers = ring(C)
    glob_q, glob_kv = B * N * Z * d * item, B * N * Zkv * d * item
    local_host = (2 * B * C * (Z + Zkv) * d * item) if gpu else 0  # the host copies of the inputs

    def stage(what, host=0, extra=0, **kw):
        """``extra`` where the row's arrays live (the GPU or the host), ``host`` on the host."""
        if gpu:
            return Stage(what, device=mine + shared + extra, host=local_host + host, **kw)
        return Stage(what, host=mine + extra + host, shared=shared, peers=peers, **kw)

    stages = [stage("the ring")]
    if check:
        # The global q, do, k, v it gathers, and the larger of a copy of the one being
        # gathered and a block of the float64 reference's rows (``reference.CHUNK``).
        gather = 2 * glob_q + 2 * glob_kv + max(glob_q, 5 * min(reference.CHUNK, N) * B * Z * d * 8)
        stages.append(stage("the float64 check", host=gather + 3 * B * Z * N * 8, why="-c 0 runs the row unchecked"))
    if use_torch:
        # Every rank gathers the global q, k, v, dout; rank 0 also holds torch's contiguous
        # copies (4), leaf clones and their gradients (6) and two outputs: about 7 q-sized
        # and 6 k-sized arrays at once.
        gathered = 2 * glob_q + 2 * glob_kv
        torch = 5 * glob_q + 4 * glob_kv if comm.Get_rank() == 0 else 0
        stages.append(stage("torch on rank 0", host=gathered + (0 if gpu else torch), extra=torch if gpu else 0,
                            required=False, why="its columns show -"))
    if padded_C:
        stages.append(stage("the padded way", extra=sum(ring(padded_C)), required=False, why="its columns show -"))
    return stages


# -- decode mode ------------------------------------------------------------------------

def per_token(cfg):
    """Bytes of one cached token's keys and values."""
    return cfg["batch"] * cfg["kv_heads"] * 2 * cfg["head_dim"] * _item(cfg)


def capacity(cfg, window, extra, N):
    """The cache's capacity for N cached tokens and ``extra`` more (with a window: its tail,
    and the sinks)."""
    return N + extra if window is None else min(N, window[0]) + extra + (cfg.get("sinks") or 0)


def piece_tokens(cfg, P):
    """Global tokens per piece of the fill: a multiple of P, about PIECE_BYTES per rank."""
    return P * max(1, PIECE_BYTES // per_token(cfg))


def decode_stages(comm, cfg, *, window, calls, one_rank_calls, gpu, shm):
    """The decode itself (its cache share, and the largest of a fill piece, a check chunk
    and the call's buffers), the ring way (the cache and the ring's packets), rank 0's whole
    cache for ``1rk``."""
    P, N, T = comm.Get_size(), cfg["seqlen"], cfg["tokens"]
    B, Z, d = cfg["batch"], cfg["heads"], cfg["head_dim"]
    tok = per_token(cfg) + 4  # keys, values and the int32 position
    share = lambda cap, ranks: (-(-cap // ranks) + (1 if ranks > 1 else 0)) * tok
    cache = share(capacity(cfg, window, calls * T, N), P)
    item = _item(cfg)
    # A piece's k and v, and (other than float32) the float32 draw of one being converted;
    # with a window, the live rows of a piece also pass through the all-to-all that deals
    # them (gathered, sent, received, sorted, split: about five copies).
    piece = piece_tokens(cfg, P) // P * per_token(cfg)
    fill = int(piece * (1 if item == 4 else 1 + 2 / item))
    if window is not None:
        fill += 5 * min(piece, -(-max(window[0], 0) // P) * per_token(cfg))
    message = (P + 2) * (32 + B * T * Z * (d + 1) * 4)
    extra = max(fill, 2 * CHECK_BYTES, message + (16 << 20))
    packet = cache  # the ring way's packets hold the largest shard, at most a share
    ring = (dict(host=cache, shared=packet, peers=(P - 1) * packet) if shm
            else dict(device=cache + 2 * packet) if gpu else dict(host=cache + (2 if P > 1 else 1) * packet))
    one = share(capacity(cfg, window, one_rank_calls * T, N), 1)
    on = lambda n: dict(device=n, host=extra) if gpu else dict(host=n + extra)
    return [Stage("the decode", **on(cache)),
            Stage("the ring way", required=False, **ring, why="its columns show -"),
            Stage(ONE_RANK, required=False, ranks=[0], **on(one), why="its columns show -")]
