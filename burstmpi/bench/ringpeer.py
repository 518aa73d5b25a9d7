"""burstmpi against the JAX ring-attention peer on the same inputs, on the same cores.

    pip install ringattention jax flax einops
    python -m burstmpi.bench.ringpeer -n 4 -s 8K -H 8 -D 64          # causal and not

The peer is haoliuhl/ringattention (``ring_attention``, the blockwise JAX version its
README shows for CPUs and GPUs): each of ``-n`` fake CPU devices
(``XLA_FLAGS=--xla_force_host_platform_device_count=N``) holds a contiguous block of the
sequence under ``jax.shard_map``, and the K/V blocks travel by ``lax.ppermute``. burstmpi
runs the same global inputs as ``mpiexec -n N`` ranks, by default in the peer's own layout
(``--layout contiguous``), with its causal balancing on and, with ``--balance auto,off``,
off beside it (``BurstAttention(balance=)``). Both are pinned to the
same cores (``--cores``, default: every core this process may use), one after the other,
in this one command, so their ratio is measured side by side.

Each side times the forward and the forward+backward (min over ``-i`` iterations after
one warm-up; burstmpi: the slowest rank), then writes its output and gradients; the table
gives the times, ``x peer`` (the peer's time over ours: above 1, burstmpi is faster) and the
largest difference between the two sides' out, dq, dk and dv (both compute exact attention
in float32, so it is rounding). Release 0.1.2 of the peer reads
``jax.lib.xla_bridge.get_backend()``, gone from current JAX; ``_import_peer`` supplies it.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types

import click
import numpy as np

from .._validate import BALANCE
from .common import cpu_line, parse_size

__all__ = ["main"]

BLOCK = 512  # the peer's query/key chunk (its README's setting); must divide N / devices


def _inputs(N, H, D, seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, N, H, D), dtype=np.float32) for _ in range(4)]  # q, k, v, do


def _best(fn, iters):
    fn()  # warm-up (JAX compiles here)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _import_peer():
    """``ringattention`` 0.1.2 on current JAX: its ``__init__`` asks
    ``jax.lib.xla_bridge.get_backend().platform`` to pick a kernel; answer it."""
    import jax

    if not hasattr(jax.lib, "xla_bridge"):
        jax.lib.xla_bridge = types.SimpleNamespace(
            get_backend=lambda: types.SimpleNamespace(platform=jax.default_backend()))
    from ringattention import ringattention_jax

    return ringattention_jax


def _run_peer(args, out_dir):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec as PS

    ring_attention = _import_peer()
    n, N = args["ranks"], args["seqlen"]
    devices = jax.devices("cpu")
    if len(devices) != n:
        raise SystemExit(f"ringpeer: expected {n} CPU devices, JAX has {len(devices)} (XLA_FLAGS?)")
    mesh = Mesh(np.array(devices), ("sp",))
    q, k, v, do = (jnp.asarray(x) for x in _inputs(N, args["heads"], args["head_dim"], args["seed"]))
    spec = PS(None, "sp", None, None)
    rows = {}
    for causal in args["masks"]:
        kw = dict(causal_block_size=1 if causal else None, query_chunk_size=BLOCK, key_chunk_size=BLOCK,
                  deterministic=True, dropout_rng=None, attn_pdrop=0.0, dtype=jnp.float32,
                  policy=jax.checkpoint_policies.nothing_saveable, precision=None, prevent_cse=True)

        def attn(q, k, v, kw=kw):
            return ring_attention(q, k, v, None, None, None, "sp", True, kw)

        sharded = jax.shard_map(attn, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
        fwd = jax.jit(sharded)
        fwdbwd = jax.jit(lambda q, k, v: jax.vjp(sharded, q, k, v)[1](do))
        tf = _best(lambda: fwd(q, k, v).block_until_ready(), args["iters"])
        tfb = _best(lambda: jax.block_until_ready(fwdbwd(q, k, v)), args["iters"])
        out = np.asarray(fwd(q, k, v))
        grads = [np.asarray(g) for g in fwdbwd(q, k, v)]
        np.savez(os.path.join(out_dir, f"peer_{int(causal)}.npz"), out=out, dq=grads[0], dk=grads[1], dv=grads[2])
        rows[int(causal)] = dict(fwd_s=tf, fwdbwd_s=tfb)
    return rows


def _run_burstmpi(args, out_dir):
    from mpi4py import MPI

    import burstmpi

    from .._config import settings
    from .._transport import watchdog

    # Its collectives under the watchdog's deadline (BURSTMPI_TIMEOUT), as burstmpi-bench's.
    comm = watchdog.guarded(MPI.COMM_WORLD, settings().timeout, who="burstmpi.bench.ringpeer")
    N = args["seqlen"]
    glob = _inputs(N, args["heads"], args["head_dim"], args["seed"])
    layout = args["layout"]
    local = [burstmpi.shard(x, layout=layout) for x in glob]
    q, k, v, do = local
    rows = {}
    for causal, balance in ((c, b) for c in args["masks"] for b in args["balance"]):
        plan = burstmpi.BurstAttention(causal=causal, layout=layout, balance=balance)
        state = {}

        def fwd():
            comm.Barrier()
            state["out"], state["lse"] = plan.forward(q, k, v)

        def fwdbwd():
            comm.Barrier()
            out, lse = plan.forward(q, k, v)
            state["grads"] = plan.backward(do, q, k, v, out, lse)

        tf = comm.allreduce(_best(fwd, args["iters"]), op=MPI.MAX)
        tfb = comm.allreduce(_best(fwdbwd, args["iters"]), op=MPI.MAX)
        full = [burstmpi.unshard(x, layout=layout) for x in (state["out"], *state["grads"])]
        if comm.Get_rank() == 0:
            np.savez(os.path.join(out_dir, f"ours_{int(causal)}_{balance}.npz"),
                     **dict(zip(("out", "dq", "dk", "dv"), full)))
        rows[f"{int(causal)}_{balance}"] = dict(fwd_s=tf, fwdbwd_s=tfb, ring_layout=plan.last_stats.ring_layout)
    return rows if comm.Get_rank() == 0 else None


def _cores(spec):
    if spec is None:
        return sorted(os.sched_getaffinity(0))
    out = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def _launch(cmd, env, cores):
    """Run ``cmd`` pinned to ``cores`` (children inherit the mask); return its JSON line."""
    res = subprocess.run(cmd, env=env, capture_output=True, text=True,
                         preexec_fn=lambda: os.sched_setaffinity(0, cores))
    if res.returncode != 0:
        raise click.ClickException(f"{' '.join(cmd)} failed (exit {res.returncode}):\n{res.stdout[-3000:]}"
                                   f"{res.stderr[-3000:]}")
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1])


@click.command(context_settings=dict(help_option_names=["-h", "--help"]))
@click.option("-n", "--ranks", default=4, show_default=True, help="MPI ranks = the peer's fake CPU devices.")
@click.option("-s", "--seqlen", default="8K", callback=parse_size, show_default=True, help="Global sequence length.")
@click.option("-H", "--heads", default=8, show_default=True)
@click.option("-D", "--head-dim", default=64, show_default=True)
@click.option("-m", "--mask", default="both", show_default=True, type=click.Choice(["none", "causal", "both"]))
@click.option("-l", "--layout", default="contiguous", show_default=True,
              type=click.Choice(["contiguous", "zigzag", "striped"]),
              help="burstmpi's layout (the peer's is contiguous).")
@click.option("--balance", default="auto", show_default=True, metavar="B[,B...]",
              help="burstmpi's causal balancing, auto or off (or a layout); a list runs each.")
@click.option("-i", "--iters", default=3, show_default=True, help="Timed iterations (the minimum is kept).")
@click.option("--seed", default=0, show_default=True)
@click.option("--cores", default=None, help="Cores to pin both sides to, e.g. 0-3 (default: all this process may use).")
@click.option("--role", type=click.Choice(["peer", "burstmpi"]), default=None, hidden=True)
@click.option("--out-dir", default=None, hidden=True)
def main(ranks, seqlen, heads, head_dim, mask, layout, balance, iters, seed, cores, role, out_dir):
    """Time burstmpi and the JAX ring-attention peer on the same inputs and cores."""
    masks = {"none": [False], "causal": [True], "both": [False, True]}[mask]
    balances = balance.split(",")
    bad = [b for b in balances if b not in BALANCE]
    if bad:
        raise click.BadParameter(f"expected some of {', '.join(BALANCE)}, got {bad[0]!r}", param_hint="--balance")
    args = dict(ranks=ranks, seqlen=seqlen, heads=heads, head_dim=head_dim, masks=masks, iters=iters, seed=seed,
                layout=layout, balance=balances)
    if role is not None:  # one side, in its own process
        rows = (_run_peer if role == "peer" else _run_burstmpi)(args, out_dir)
        if rows is not None:
            print(json.dumps(rows))
        return
    if seqlen % (2 * ranks) or (seqlen // ranks) % BLOCK:
        raise click.BadParameter(f"expected a multiple of {ranks} x {BLOCK} (the peer's blocks) and of 2 x {ranks} "
                                 f"(the zigzag layout), got {seqlen}", param_hint="--seqlen")
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise click.ClickException("mpiexec not found (pip install mpich)")
    pinned = _cores(cores)
    me = [sys.executable, "-m", "burstmpi.bench.ringpeer", "-n", str(ranks), "-s", str(seqlen), "-H", str(heads),
          "-D", str(head_dim), "-m", mask, "-l", layout, "--balance", balance, "-i", str(iters), "--seed", str(seed)]
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={ranks}", JAX_PLATFORMS="cpu")
        peer = _launch(me + ["--role", "peer", "--out-dir", tmp], env, pinned)
        env = dict(os.environ)
        if ranks > len(pinned):
            env["OPENBLAS_NUM_THREADS"] = "1"
        ours = _launch([mpiexec, "-n", str(ranks), sys.executable, "-m", "mpi4py", *me[1:], "--role", "burstmpi",
                        "--out-dir", tmp], env, pinned)
        diffs = {}
        for c in masks:
            for bal in balances:
                a = np.load(os.path.join(tmp, f"ours_{int(c)}_{bal}.npz"))
                b = np.load(os.path.join(tmp, f"peer_{int(c)}.npz"))
                diffs[c, bal] = {name: float(np.abs(a[name] - b[name]).max()) for name in ("out", "dq", "dk", "dv")}
    import jax

    import burstmpi

    click.echo(f"# burstmpi {burstmpi.__version__} vs ringattention (JAX {jax.__version__}): {ranks} ranks / devices, "
               f"N {seqlen}, {heads} heads, head dim {head_dim}, float32, pinned to cores "
               f"{','.join(map(str, pinned))}; burstmpi's layout {layout}")
    click.echo(cpu_line())
    click.echo("#  causal balance        ran   peer fwd   ours fwd  x peer   peer f+b   ours f+b  x peer    "
               "max |ours - peer| out/dq/dk/dv")
    click.echo("#                                  (ms)       (ms)              (ms)       (ms)")
    for c, bal in ((c, b) for c in masks for b in balances):
        p, o, d = peer[str(int(c))], ours[f"{int(c)}_{bal}"], diffs[c, bal]
        click.echo(f"  {int(c):7d} {bal:>7s} {o['ring_layout']:>10s} {1e3 * p['fwd_s']:10.1f} {1e3 * o['fwd_s']:10.1f} "
                   f"{p['fwd_s'] / o['fwd_s']:7.2f} "
                   f"{1e3 * p['fwdbwd_s']:10.1f} {1e3 * o['fwdbwd_s']:10.1f} {p['fwdbwd_s'] / o['fwdbwd_s']:7.2f}    "
                   + " ".join(f"{d[k]:.1e}" for k in ("out", "dq", "dk", "dv")))


if __name__ == "__main__":
    main()
