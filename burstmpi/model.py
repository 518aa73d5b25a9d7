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
throughput; transfers use the bytes ``burstmpi.ring`` actually moves (the ``Schedule``
decides which steps send) over the slowest link of the ring, intra-node when the ring
stays in one node. What it leaves out: kernel efficiency on partly masked tiles, and
contention between the ranks that share a node's network link.

    python -m burstmpi.model predict --machine h100-ib -P 32 -N 1M -H 40 -D 128 --causal
    python -m burstmpi.model check rows.json [more.json ...] --intra-gbps 5
"""

import json
from dataclasses import asdict, dataclass

import click
import numpy as np

from . import ring
from .transport.comm import Channel, PartialChannel
from .layout import LAYOUTS, Layout
from .masks.intervals import Bounds, Mask, count_visible
from .schedule import Schedule, pair_matrix

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
    """The two-way backward (``burstmpi.twoway``) in lockstep: K/V and the query side each
    travel their arcs both ways, no partial; a rank computes dQ against every K/V block it
    receives (3 of the backward's 5 GEMMs) and dK/dV against every query block (4 of 5),
    its own block once in full. Each step's transfers to the two neighbours run side by
    side. Returns what ``_phase`` does."""
    from .twoway import TwoWaySchedule

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


# -- command line -------------------------------------------------------------------------------

def _size(ctx, param, value):
    from .bench import parse_size
    return parse_size(ctx, param, value)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main():
    """Predict burstmpi's ring before running it; check the predictions against runs."""


_TABLE = [("layout", "10s"), ("bwd_mode", "6s"), ("fwd_ms", "10.2f"), ("bwd_ms", "10.2f"),
          ("fwdbwd_ms", "10.2f"), ("fwd_exposed_ms", "9.2f"), ("bwd_exposed_ms", "9.2f"),
          ("fwd_mb_sent", "9.1f"), ("bwd_mb_sent", "9.1f"), ("memory_mb", "9.0f"), ("fwdbwd_tflops", "8.1f")]


@main.command()
@click.option("--machine", type=click.Choice(sorted(MACHINES)), default="h100-ib", show_default=True)
@click.option("--fwd-tflops", type=float, default=None, help="Override the machine's local forward rate.")
@click.option("--bwd-tflops", type=float, default=None, help="Override the machine's local backward rate.")
@click.option("-P", "--ranks", default=8, show_default=True)
@click.option("-N", "--seqlen", default="128K", callback=_size, show_default=True)
@click.option("-B", "--batch", default=1, show_default=True)
@click.option("-H", "--heads", default=32, show_default=True)
@click.option("-K", "--kv-heads", default=None, type=int)
@click.option("-D", "--head-dim", default=128, show_default=True)
@click.option("--dtype-bytes", default=2, show_default=True, type=click.Choice([2, 4, 8]))
@click.option("--causal", is_flag=True)
@click.option("--ranks-per-node", type=int, default=None, help="Node size (default: the machine's).")
@click.option("--inter-gbps", type=float, default=None, help="Override the machine's network GB/s per rank.")
def predict_cmd(machine, fwd_tflops, bwd_tflops, ranks, seqlen, batch, heads, kv_heads, head_dim,
                dtype_bytes, causal, ranks_per_node, inter_gbps):
    """Predicted time, traffic and memory for every layout and backward mode, then for the
    flat ring, the two-level ring and head parallelism across the nodes (zigzag)."""
    m = MACHINES[machine]
    m = Machine(**{**asdict(m), **({"fwd_tflops": fwd_tflops} if fwd_tflops else {}),
                   **({"bwd_tflops": bwd_tflops} if bwd_tflops else {}),
                   **({"ranks_per_node": ranks_per_node} if ranks_per_node else {}),
                   **({"inter_gbps": inter_gbps} if inter_gbps else {})})
    shape = Shape(batch, seqlen, heads, kv_heads or heads, head_dim, head_dim, dtype_bytes, causal)
    rows = recommend(shape, m, ranks)
    click.echo(f"# {m}\n# {shape}, {ranks} ranks")
    click.echo("# " + " ".join(k for k, _ in _TABLE))
    for r in rows:
        click.echo("  " + " ".join(format(r[k], f) for k, f in _TABLE))
    best = rows[0]
    click.echo(f"# Recommended: layout {best['layout']}, bwd {best['bwd_mode']} "
               f"({best['fwdbwd_tflops']:.1f} TFLOP/s per rank predicted)")
    from .model_topology import predict_ring

    g = min(m.ranks_per_node, ranks)
    options = [("flat", 1), ("two-level", 1)] + ([("flat", g)] if g > 1 and ranks % g == 0 and heads % g == 0 else [])
    click.echo(f"# Across nodes of {g} ranks (zigzag): topology, head_parallel, fwd ms, bwd ms, f+b ms, "
               "exposed ms, inter-node MB per rank (busiest)")
    ring_rows = [predict_ring(shape, m, ranks, "zigzag", t, u, ranks_per_node=g) for t, u in options]
    for r in ring_rows:
        click.echo(f"  {r['topology']:>9} {r['head_parallel']:3d} {r['fwd_ms']:10.2f} {r['bwd_ms']:10.2f} "
                   f"{r['fwdbwd_ms']:10.2f} {r['exposed_ms']:9.2f} {r['inter_mb']:9.1f}")
    top = min(ring_rows, key=lambda r: r["fwdbwd_ms"])
    click.echo("# Recommended across nodes: " + (f"head_parallel={top['head_parallel']}" if top["head_parallel"] > 1
                                                  else f"topology={top['topology']!r}"))


main.add_command(predict_cmd, name="predict")


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--intra-gbps", default=5.0, show_default=True, help="Measured rank-to-rank bandwidth (GB/s).")
@click.option("--inter-gbps", default=None, type=float,
              help="Between nodes (GB/s); default --intra-gbps (the runs' --internode-gbps when simulated).")
@click.option("--ranks-per-node", default=None, type=int, help="The runs' node size (default: all ranks).")
@click.option("--latency-us", default=5.0, show_default=True)
def check(files, intra_gbps, inter_gbps, ranks_per_node, latency_us):
    """Predicted against measured f+b time for each row of burstmpi-bench JSON files; the
    local kernel rates come from each row's own "local" measurement. Rows of
    ``--topology``/``--head-parallel`` runs are predicted for the ring they ran
    (``burstmpi.model_topology``)."""
    from .model_topology import predict_ring

    click.echo(f"# {'ranks':>5} {'seqlen':>7} {'causal':>6} {'layout':>10} {'bwd':>5} {'ring':>9} {'hp':>3} "
               f"{'measured':>10} {'predicted':>10} {'ratio':>6}")
    for path in files:
        with open(path) as fh:
            data = json.load(fh)
        for r in data["rows"]:
            P, N, B, Z, d = r["ranks"], r["seqlen"], r["batch"], r["heads"], r["head_dim"]
            C = -(-N // P)  # the local kernel ran on the largest rank's block
            dense = 4.0 * B * Z * C * C * d
            m = Machine("measured", fwd_tflops=dense / (r["local_fwd_ms"] * 1e-3) / 1e12,
                        bwd_tflops=2.5 * dense / (r["local_bwd_ms"] * 1e-3) / 1e12,
                        intra_gbps=intra_gbps, inter_gbps=inter_gbps or intra_gbps, intra_latency_us=latency_us,
                        inter_latency_us=latency_us, ranks_per_node=ranks_per_node or max(P, 1))
            e = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[r["dtype"]]
            shape = Shape(B, N, Z, r["kv_heads"], d, d, e, bool(r["causal"]))
            topology, hp = r.get("ring") or "flat", r.get("hp") or 1
            if topology == "flat" and hp == 1 and ranks_per_node is None:
                p = predict(shape, m, P, r["layout"], r["bwd_mode"])
            else:
                p = predict_ring(shape, m, P, r["layout"], topology, hp, bwd_mode=r["bwd_mode"])
            click.echo(f"  {P:5d} {N:7d} {r['causal']:6d} {r['layout']:>10} {r['bwd_mode']:>5} {topology:>9} {hp:3d} "
                       f"{r['fwdbwd_ms']:10.1f} {p['fwdbwd_ms']:10.1f} {r['fwdbwd_ms'] / p['fwdbwd_ms']:6.2f}")


@main.command()
@click.option("--mbytes", default=64, show_default=True, help="Message size for the bandwidth.")
def pingpong(mbytes):
    """Rank-to-rank bandwidth and latency over MPI (run with mpiexec -n 2): the figures
    ``check`` and ``predict`` want for the links."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise click.UsageError("run under mpiexec -n 2")
    peer = 1 - comm.Get_rank()
    big, small = np.zeros(mbytes << 20, np.uint8), np.zeros(8, np.uint8)

    def rtt(buf, reps):
        comm.Barrier()
        t0 = MPI.Wtime()
        for _ in range(reps):
            if comm.Get_rank() == 0:
                comm.Send(buf, peer)
                comm.Recv(buf, peer)
            else:
                comm.Recv(buf, peer)
                comm.Send(buf, peer)
        return (MPI.Wtime() - t0) / reps

    rtt(big, 1)
    lat = rtt(small, 200) / 2
    bw = big.nbytes / (rtt(big, 5) / 2 - lat)
    if comm.Get_rank() == 0:
        click.echo(f"# latency {lat * 1e6:.1f} us, bandwidth {bw / 1e9:.2f} GB/s ({mbytes} MiB messages)")


@main.command()
@click.option("--machine", type=click.Choice(sorted(MACHINES)), default="h200-ib", show_default=True)
@click.option("-H", "--heads", default=32, show_default=True)
@click.option("-K", "--kv-heads", "kv_list", default="32,8", show_default=True, help="K/V heads to tabulate.")
@click.option("-D", "--head-dim", default=128, show_default=True)
@click.option("--ranks", "ranks_list", default="8,32,128,512,1024,4096", show_default=True)
@click.option("--tokens", "tokens_list", default="128K,512K,1M,4M,16M", show_default=True)
def scale(machine, heads, kv_list, head_dim, ranks_list, tokens_list):
    """Flat, two-level and head-parallel rings from 8 to 4096 GPUs and 128K to 16M tokens
    (dense causal attention under zigzag, bf16): predicted f+b time, exposed communication,
    efficiency (time computing over time), and the tokens per GPU each needs to hide its
    transfers (``burstmpi.model_topology.scale_row``, closed form)."""
    from .bench import parse_size
    from .model_topology import RINGS, scale_row

    m = MACHINES[machine]
    click.echo(f"# {m}\n# dense causal, zigzag, bf16, {heads} heads, head dim {head_dim}; "
               "hide: tokens per GPU above which the transfers hide behind compute")
    names = RINGS
    click.echo(f"# {'kvh':>3} {'GPUs':>5} {'tokens':>7} " + " ".join(
        f"{n + ' ms':>16} {'exp%':>5} {'eff':>5} {'hide':>7}" for n in names) + "  best")
    for kvh in (int(x) for x in kv_list.split(",")):
        for P in (int(x) for x in ranks_list.split(",")):
            for tok in tokens_list.split(","):
                N = parse_size(None, None, tok)
                shape = Shape(1, N, heads, kvh, head_dim, head_dim, 2, True)
                rows = [scale_row(shape, m, P, n) for n in names]
                best = min(rows, key=lambda r: r["fwdbwd_ms"])["topology"]
                click.echo(f"  {kvh:3d} {P:5d} {tok:>7} " + " ".join(
                    f"{r['fwdbwd_ms']:16.1f} {100 * r['exposed_ms'] / r['fwdbwd_ms']:5.1f} {r['efficiency']:5.2f} "
                    f"{_tokens(r['hide_tokens']):>7}" for r in rows) + f"  {best}")


def _tokens(n):
    return f"{n / 1024:.0f}K" if n < 1 << 20 else f"{n / (1 << 20):.1f}M"


if __name__ == "__main__":
    main()
