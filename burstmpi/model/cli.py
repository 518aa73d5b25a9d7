"""``python -m burstmpi.model``: the performance model's command line.

    python -m burstmpi.model predict --machine h100-ib -P 32 -N 1M -H 40 -D 128 --causal
    python -m burstmpi.model check rows.json [more.json ...] --intra-gbps 5
    python -m burstmpi.model scale --machine h200-ib
    mpiexec -n 2 python -m mpi4py -m burstmpi.model pingpong

``predict`` prints the model's figures for one problem on one machine (``flat`` within a
node, ``topology`` across nodes); ``check`` sets them beside the bench's JSON rows;
``scale`` tabulates the ring against head parallelism at scale; ``pingpong`` measures the
bandwidth ``check`` needs.
"""

import json
from dataclasses import asdict

import click
import numpy as np

from .._sizes import parse_size
from .balance import predict_balanced, predict_resharded
from .flat import MACHINES, Machine, Shape, recommend
from .topology import RINGS, predict_ring, scale_row


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
@click.option("-N", "--seqlen", default="128K", callback=parse_size, show_default=True)
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
    rows = sorted(rows + [dict(predict_balanced(shape, m, ranks, "contiguous"), layout="contig>bal")],
                  key=lambda r: r["fwdbwd_ms"])
    click.echo(f"# {m}\n# {shape}, {ranks} ranks; contig>bal: contiguous shards re-sharded by balance='auto'")
    click.echo("# " + " ".join(k for k, _ in _TABLE))
    for r in rows:
        click.echo("  " + " ".join(format(r[k], f) for k, f in _TABLE))
    best = rows[0]
    click.echo(f"# Recommended: layout {best['layout']}, bwd {best['bwd_mode']} "
               f"({best['fwdbwd_tflops']:.1f} TFLOP/s per rank predicted)")

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
    (``burstmpi.model.topology``)."""

    click.echo(f"# {'ranks':>5} {'seqlen':>7} {'causal':>6} {'layout':>10} {'ran':>10} {'bwd':>5} {'ring':>9} "
               f"{'hp':>3} {'measured':>10} {'predicted':>10} {'ratio':>6}")
    for path in files:
        with open(path) as fh:
            data = json.load(fh)
        window = data.get("params", {}).get("window")
        if data.get("params", {}).get("docs"):
            click.echo(f"# {path}: rows of packed documents (--docs) are left out: the model has no documents")
            continue
        for r in data["rows"]:
            P, N, B, Z, d = r["ranks"], r["seqlen"], r["batch"], r["heads"], r["head_dim"]
            C = -(-N // P)  # the local kernel ran on the largest rank's block
            dense = 4.0 * B * Z * C * C * d
            m = Machine("measured", fwd_tflops=dense / (r["local_fwd_ms"] * 1e-3) / 1e12,
                        bwd_tflops=2.5 * dense / (r["local_bwd_ms"] * 1e-3) / 1e12,
                        intra_gbps=intra_gbps, inter_gbps=inter_gbps or intra_gbps, intra_latency_us=latency_us,
                        inter_latency_us=latency_us, ranks_per_node=ranks_per_node or max(P, 1))
            e = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[r["dtype"]]
            shape = Shape(B, N, Z, r["kv_heads"], d, d, e, bool(r["causal"]), None if window is None else tuple(window))
            topology, hp = r.get("ring") or "flat", r.get("hp") or 1
            ran = r.get("ring_layout") or r["layout"]  # rows from before balancing ran their own layout
            if topology == "flat" and hp == 1 and ranks_per_node is None:
                p = predict_resharded(shape, m, P, r["layout"], ran, r["bwd_mode"])
            else:
                p = predict_ring(shape, m, P, r["layout"], topology, hp, bwd_mode=r["bwd_mode"])
            click.echo(f"  {P:5d} {N:7d} {r['causal']:6d} {r['layout']:>10} {ran:>10} {r['bwd_mode']:>5} {topology:>9} "
                       f"{hp:3d} "
                       f"{r['fwdbwd_ms']:10.1f} {p['fwdbwd_ms']:10.1f} {r['fwdbwd_ms'] / p['fwdbwd_ms']:6.2f}")


@main.command()
@click.option("--mbytes", default=64, show_default=True, help="Message size for the bandwidth.")
def pingpong(mbytes):
    """Rank-to-rank bandwidth and latency over MPI (run with mpiexec -n 2): the figures
    ``check`` and ``predict`` want for the links."""
    from mpi4py import MPI

    from .._config import settings
    from .._transport.watchdog import guard

    comm = MPI.COMM_WORLD
    if comm.Get_size() != 2:
        raise click.UsageError("run under mpiexec -n 2")
    peer = 1 - comm.Get_rank()
    big, small = np.zeros(mbytes << 20, np.uint8), np.zeros(8, np.uint8)

    def rtt(buf, reps):
        with guard(f"pingpong of {buf.nbytes} bytes", settings().timeout):  # a peer that dies ends the job
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
    transfers (``burstmpi.model.topology.scale_row``, closed form)."""

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

