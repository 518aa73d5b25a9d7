"""burstmpi-bench: time and check distributed attention, the way nccl-tests does for NCCL.

    mpiexec -n 4 burstmpi-bench                      # the ring: forward and backward, 1K..4K tokens
    mpiexec -n 4 burstmpi-bench -b 4K -e 32K -f 2 -d all -J out.json
    mpiexec -n 4 burstmpi-bench --decode -b 16K -e 256K -f 4    # decode over a sharded KV cache

One command, two modes, each in its own module: ``burstmpi.bench.attention`` (the default;
its columns, ``LEGEND`` and presets in ``burstmpi.bench.columns``) and
``burstmpi.bench.decode`` (``--decode``, its columns there); ``--legend`` prints them. Both print the same way (``burstmpi.bench.common``:
preamble, one row per configuration, footer, ``-J`` JSON rows, ``--baseline`` regression
mode, ``--junit``), check each row's memory before it runs (``burstmpi.bench.memory``) and
exit non-zero when a value is wrong (1), a row did not fit in memory (4) or a
configuration regressed (3). Every wait on other ranks has a deadline (``--timeout``): past
it the watchdog ends the job with exit 75 (``burstmpi._transport.watchdog``). SIGINT or
SIGTERM write the rows done (``-J``, ``--junit``) and exit 130 or 143
(``burstmpi.bench.interrupt``).
"""

import os

import click
from mpi4py import MPI

from .._config import settings
from ..masks._layout import LAYOUTS
from .._transport import watchdog
from .._validate import BALANCE, TOPOLOGIES
from . import attention, decode as decode_mode
from .attention import COLUMNS, CONFIG_KEYS, PRESETS, check_docs, flops, run_config
from .common import DTYPES, comma_list, cpu_line, legend, parse_bytes, parse_counts, parse_size, parse_window, say
from .interrupt import Interrupts
from .patterns import check_spec

__all__ = ["main", "flops", "parse_size", "cpu_line", "run_config", "COLUMNS", "CONFIG_KEYS"]


def _balances(value):
    return comma_list(value, lambda x: x if x in BALANCE else None, f"some of {', '.join(BALANCE)}")


def _topologies(value):
    return comma_list(value, lambda x: x if x in TOPOLOGIES else None, f"some of {', '.join(TOPOLOGIES)}")


@click.command(context_settings=dict(help_option_names=["-h", "--help"]))
@click.option("-b", "--minseq", default="1K", callback=parse_size, show_default=True,
              help="Smallest global sequence length (K/M suffixes); --decode: cached tokens.")
@click.option("-e", "--maxseq", default="4K", callback=parse_size, show_default=True,
              help="Largest global sequence length.")
@click.option("-f", "--stepfactor", default=2, show_default=True, help="Multiply the length by this each step.")
@click.option("-n", "--iters", default=3, show_default=True, help="Timed iterations per configuration.")
@click.option("-w", "--warmup", default=1, show_default=True, help="Untimed iterations first.")
@click.option("-c", "--check", default=1, show_default=True, type=click.IntRange(0, 1),
              help="Check sampled rows against float64 (the #wrong column).")
@click.option("-d", "--dtype", default="float32", show_default=True, type=click.Choice(DTYPES + ["all"]))
@click.option("-a", "--average", "reduce", default=3, show_default=True, type=click.IntRange(0, 3),
              help="Reduce times over ranks: 0 rank 0, 1 average, 2 minimum, 3 maximum.")
@click.option("-J", "--json", "json_path", default=None, help="Also write the rows to this JSON file.")
@click.option("-B", "--batch", default=1, show_default=True)
@click.option("-H", "--heads", default=8, show_default=True, help="Query heads.")
@click.option("-K", "--kv-heads", default=None, type=int, help="Key/value heads (default: --heads).")
@click.option("-D", "--head-dim", default=128, show_default=True)
@click.option("-m", "--mask", default="both", show_default=True, callback=check_spec, metavar="SPEC",
              help="none, causal, both (dense), or a sparse pattern run causal: streaming:SINKS:WINDOW, "
                   "chunked:SIZE, blocks:DENSITY[:BS], bigbird:G:W:R[:BS], strided:STRIDE:LOCAL[:BS] "
                   "(burstmpi.bench.patterns); patterns add the visible fraction, vs dense and sparse "
                   "efficiency columns.")
@click.option("-l", "--layout", default="zigzag", show_default=True, type=click.Choice(list(LAYOUTS) + ["all"]))
@click.option("--window", default=None, callback=parse_window, help="Sliding window LEFT,RIGHT (-1 = unbounded).")
@click.option("--docs", default=None, callback=lambda ctx, p, v: None if v is None else check_docs(v),
              help="Pack each sequence with documents: fixed:LEN, lognormal:MEAN (seeded) or file:PATH "
                   "(one length per line); also times the padded-per-document way.")
@click.option("--bwd", "bwd_comm", default="auto", show_default=True,
              type=click.Choice(["auto", "burst", "ring", "two-way", "all"]),
              help="Backward communication mode; all = burst, ring and two-way side by side.")
@click.option("--head-parallel", default="1", show_default=True, callback=parse_counts, metavar="U[,U...]",
              help="Groups of U consecutive ranks of a node share the heads and the ring runs over the groups "
                   "(BurstAttention(head_parallel=U)); a list runs each side by side (1: the flat ring).")
@click.option("--topology", default="flat", show_default=True, callback=lambda ctx, p, v: _topologies(v),
              metavar="T[,T...]",
              help="The ring: flat, two-level (a ring in each node and one between nodes) or auto; a list runs "
                   "each side by side (BurstAttention(topology=)).")
@click.option("--balance", default="auto", show_default=True, callback=lambda ctx, p, v: _balances(v),
              metavar="B[,B...]",
              help="Causal balancing: auto (re-shard to a balanced layout where the row's leaves ranks idle), off "
                   "(run the row's layout as it is), or a layout to force; a list runs each side by side "
                   "(BurstAttention(balance=)).")
@click.option("--internode-gbps", default=None, type=click.FloatRange(0, min_open=True), metavar="X",
              help="A simulation aid: transfers between nodes (BURSTMPI_RANKS_PER_NODE fakes them) take at least "
                   "bytes / (X GB/s), as over a network of X GB/s per rank; sets BURSTMPI_INTERNODE_GBPS "
                   "(burstmpi._transport.slowlinks). Host arrays over MPI.")
@click.option("--torch/--no-torch", "use_torch", default=False, show_default=True,
              help="Also time PyTorch scaled_dot_product_attention on the global problem (rank 0).")
@click.option("--trace-memory", is_flag=True,
              help="Trace NumPy allocations: exact peak array bytes per rank and phase.")
@click.option("--seed", default=0, show_default=True)
@click.option("--bind", default="auto", show_default=True, type=click.Choice(["auto", "none"]),
              help="auto: when a node's ranks outnumber its cores and the launcher left them unbound, pin "
                   "rank i of the node to core i mod cores (as mpiexec -bind-to core); none: as launched.")
@click.option("--backend", default="auto", show_default=True, type=click.Choice(["auto", "cpu", "cuda", "numpy"]),
              help="Where the arrays live: auto = the GPU when every rank has one, else the host (cpu; "
                   "numpy is its old name).")
@click.option("--transport", default="auto", show_default=True, type=click.Choice(["auto", "nccl", "mpi", "shm"]),
              help="Ring transport (see BurstAttention): GPU arrays nccl or mpi, host arrays shm (read in "
                   "place, ranks on one node) or mpi (copied); auto picks.")
@click.option("--preset", type=click.Choice(sorted(PRESETS)), default=None,
              help="A published setup (explicit flags still win): ring-flash-attn = 32/8 heads, "
                   "d 128, bf16, causal zigzag, 8K tokens per rank; burstengine = 40 heads, d 128, "
                   "bf16, causal, 128K..1M tokens; varlen = packed lognormal:4096 documents, causal "
                   "zigzag, 8 heads, d 128, 16K..32K tokens.")
@click.option("--baseline", type=click.Path(dir_okay=False), default=None,
              help="Regression mode: compare with this -J file; exit 3 if a configuration is slower "
                   "than --tolerance allows.")
@click.option("--tolerance", default=0.10, show_default=True, type=click.FloatRange(0),
              help="Allowed slow-down in regression mode, as a fraction (0.1 = 10 %).")
@click.option("--junit", "junit_path", default=None, help="Write JUnit XML (one test case per row).")
@click.option("--progress/--no-progress", default=None,
              help="Progress lines on stderr (rank 0); default: on for sweeps of several rows.")
@click.option("--mem-limit", default=None, callback=parse_bytes,
              help="Bytes the bench may plan to use per node (K/M/G suffixes, e.g. 16G): at most this and "
                   "85 % of what each node has free. Baselines that do not fit are skipped, rows refused (exit 4).")
@click.option("--timeout", default=None, type=click.FloatRange(0, min_open=True), metavar="SECONDS",
              help="Seconds any wait on other ranks may last (the bench's own collectives and every BurstAttention "
                   "and KVCache it builds) before the watchdog prints who it waited for and ends the job "
                   "(exit 75). Default: BURSTMPI_TIMEOUT, else 300.")
@click.option("--legend", is_flag=True,
              help="Print one line per column (its header, unit and definition) and exit; with --decode, "
                   "the decode mode's columns.")
@click.option("--decode", is_flag=True,
              help="Decode mode: -b/-e/-f sweep the cached length of a KVCache, -T new tokens per call; "
                   "compared with the ring way and one rank (burstmpi/bench/decode.py).")
@click.option("-T", "--tokens", default=1, show_default=True, type=click.IntRange(1),
              help="Decode mode: new tokens per decode call.")
@click.option("--sinks", default=0, show_default=True, type=click.IntRange(0),
              help="Decode mode, with --window LEFT,0: keep the first SINKS tokens for the life of the cache "
                   "(StreamingLLM; KVCache(sinks=)). Attention mode: use --mask streaming:SINKS:WINDOW.")
@click.pass_context
def main(ctx, **opts):
    """Benchmark exact distributed attention over the ranks of MPI_COMM_WORLD.

    Exit status: 0; 1 a wrong value; 4 a row refused for memory; 3 a regression
    (--baseline); 75 the watchdog ended the job (a rank or link stopped answering within
    --timeout); 130/143 interrupted by SIGINT/SIGTERM (the rows done are in -J and --junit).
    """
    if opts["timeout"] is None:
        try:
            opts["timeout"] = settings().timeout
        except ValueError as e:  # a malformed BURSTMPI_TIMEOUT: the same on every rank
            raise click.BadParameter(str(e), param_hint="--timeout (BURSTMPI_TIMEOUT)")
    # Every pickled collective and barrier of the bench under the deadline; the plans and caches
    # it builds get the same timeout (``timeout=``).
    comm = watchdog.guarded(MPI.COMM_WORLD, opts["timeout"], who="burstmpi-bench")
    if opts.pop("legend"):
        if comm.Get_rank() == 0:
            mode = decode_mode if opts["decode"] else attention
            click.echo("\n".join(legend(mode.ALL_COLUMNS if hasattr(mode, "ALL_COLUMNS") else mode.COLUMNS,
                                         mode.LEGEND)))
        return
    gbps = opts.pop("internode_gbps")
    if gbps is not None:  # every plan of the run reads it (burstmpi._config)
        os.environ["BURSTMPI_INTERNODE_GBPS"] = repr(gbps)
    # A signal before the first row (a first use compiles for a while) ends the job too; the
    # sweep then reports its rows in this one's place (``burstmpi.bench.interrupt``).
    with Interrupts(comm, lambda signame: say(comm, f"# INTERRUPTED by {signame} after 0 rows (before the first)")):
        if opts.pop("decode"):
            decode_mode.main(comm, ctx, opts)
        else:
            for name, flag in (("tokens", "-T/--tokens"), ("sinks", "--sinks")):
                if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
                    raise click.UsageError(f"{flag} is a --decode option" + (
                        " (attention with sinks: --mask streaming:SINKS:WINDOW)" if name == "sinks" else ""))
                opts.pop(name)
            attention.main(comm, ctx, opts)
