"""Plots from burstmpi-bench JSON files (needs matplotlib: pip install 'burstmpi[plot]').

    python -m burstmpi.plot run.json [more.json ...] -o bench.png

Left: forward+backward TFLOP/s per rank against the global sequence length, one line per
(ranks, dtype, mask, layout, backward mode). Right, when the files hold runs on different
numbers of ranks: the whole job's TFLOP/s against the number of ranks, one line per length
(weak and strong scaling at a glance).
"""

import json
from collections import defaultdict

import click

__all__ = ["plot_rows", "main"]


def _load(paths):
    rows = []
    for path in paths:
        with open(path) as fh:
            rows += json.load(fh)["rows"]
    return rows


def plot_rows(rows, out):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = sorted({r["ranks"] for r in rows})
    fig, axes = plt.subplots(1, 2 if len(ranks) > 1 else 1, figsize=(12 if len(ranks) > 1 else 6.5, 4.5),
                             squeeze=False)
    lines = defaultdict(list)
    for r in rows:
        mask = "causal" if r["causal"] else "dense"
        lines[(r["ranks"], r["dtype"], mask, r["layout"], r["bwd_mode"])].append(r)
    ax = axes[0][0]
    for key, rs in sorted(lines.items()):
        rs.sort(key=lambda r: r["seqlen"])
        ax.plot([r["seqlen"] for r in rs], [r["fwdbwd_tflops"] for r in rs], marker="o",
                label="P={} {} {} {} {}".format(*key))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global sequence length (tokens)")
    ax.set_ylabel("fwd+bwd TFLOP/s per rank")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    if len(ranks) > 1:
        ax = axes[0][1]
        by_len = defaultdict(list)
        for r in rows:
            by_len[(r["seqlen"], r["dtype"], r["causal"], r["layout"], r["bwd_mode"])].append(r)
        for key, rs in sorted(by_len.items()):
            rs.sort(key=lambda r: r["ranks"])
            if len(rs) > 1:
                ax.plot([r["ranks"] for r in rs], [r["fwdbwd_tflops_all"] for r in rs], marker="o",
                        label="N={} {} causal={} {} {}".format(*key))
        ax.set_xticks(ranks)
        ax.set_xlabel("ranks")
        ax.set_ylabel("fwd+bwd TFLOP/s, all ranks")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--out", default="burstmpi-bench.png", show_default=True)
def main(files, out):
    """Plot burstmpi-bench JSON results."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise click.UsageError("plots need matplotlib: pip install 'burstmpi[plot]'") from None
    click.echo(plot_rows(_load(files), out))


if __name__ == "__main__":
    main()
