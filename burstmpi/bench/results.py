"""The end of a burstmpi-bench sweep: the footer, the regression verdicts, the JSON (``-J``)
and JUnit (``--junit``) files and the exit status; the same for the rows done when the run
is interrupted (``burstmpi.bench.interrupt``).

Every rank holds the rows (each is the same on every rank); rank 0 prints and writes.
No collectives: an interrupted run ends here on rank 0 alone while the other ranks may be
anywhere in a row.
"""

import json
import sys

import click

from .. import __version__
from . import regress

__all__ = ["finish", "EXIT_WRONG", "EXIT_REGRESSED", "EXIT_REFUSED"]

EXIT_WRONG, EXIT_REGRESSED, EXIT_REFUSED = 1, 3, 4


def say(comm, *lines):
    """Print ``lines`` on rank 0 (the bench's every line of output)."""
    if comm.Get_rank() == 0:
        for line in lines:
            click.echo(line)
        sys.stdout.flush()


def finish(comm, *, mode, params, configs, rows, refused, footer, check, config_keys, metric, base_rows=None,
           baseline=None, tolerance=0.1, json_path=None, junit_path=None, interrupted=None):
    """Print the footer and the regression verdicts and write the files (rank 0); return the
    exit status: 1 if a value was wrong, else 4 if a row was refused for memory, else 3 if a
    configuration regressed, else 0. ``interrupted`` (a signal's name, e.g. "SIGTERM"): the
    rows so far, the configurations not run listed in the JSON file (``not_run``) and as
    skipped test cases in the JUnit file, and a last line ``# INTERRUPTED by SIGTERM after N
    rows ...`` (the caller then ends the job with the signal's code)."""
    P = comm.Get_size()
    wrong = sum(max(r["wrong"], 0) for r in rows)
    say(comm, f"# Out of bounds values : {wrong} {'OK' if wrong == 0 else 'FAILED'}"
               + ("" if check else " (not checked: -c 0)"),
         *(footer(rows) if rows else []),
         *([f"# Max peak memory per rank (MB) : {max(r['peak_mb'] for r in rows):.0f}"] if rows else []),
         f"# Rows refused for memory : {len(refused)} {'OK' if not refused else 'FAILED'}")
    regressed = 0
    verdicts = [dict(row=r, base=None, ratio=None, status="wrong" if r["wrong"] > 0 else "ok") for r in rows]
    if base_rows is not None:
        verdicts = regress.compare(rows, base_rows, tolerance, config_keys, metric)
        for v in verdicts:
            r = v["row"]
            if v["status"] == "regressed":
                say(comm, f"# REGRESSED {regress.describe(r, config_keys)}: {metric} {r[metric]:.3f} vs "
                           f"baseline {v['base'][metric]:.3f} ({100 * (v['ratio'] - 1):+.1f} %)")
            elif v["status"] == "new":
                say(comm, f"# NEW (no baseline row) {regress.describe(r, config_keys)}")
        regressed = sum(v["status"] == "regressed" for v in verdicts)
        worst = max((v["ratio"] for v in verdicts if v["ratio"] is not None), default=float("nan"))
        say(comm, f"# Regressions against {baseline} (tolerance {100 * tolerance:.0f} %, slowest ratio "
                   f"{worst:.2f}) : {regressed} {'OK' if regressed == 0 else 'FAILED'}")
    not_run = configs[len(rows) + len(refused):] if interrupted else []
    if comm.Get_rank() == 0:
        if json_path:
            data = {"version": __version__, "mode": mode, "ranks": P, "params": params, "rows": rows,
                    "refused": refused}
            if interrupted:
                data.update(interrupted=interrupted, not_run=not_run)
            with open(json_path, "w") as fh:
                json.dump(data, fh, indent=1)
        if junit_path:
            # A configuration's ``bwd_comm`` names its backward as a row's ``bwd_mode`` would.
            named = lambda c, **kw: dict(c, mode=mode, ranks=P, **({"bwd_mode": c["bwd_comm"]} if "bwd_comm" in c
                                                                   and "bwd_mode" not in c else {}), **kw)
            cases = verdicts + [dict(row=named(r), base=None, ratio=None, status="refused") for r in refused]
            cases += [dict(row=named(c, why=f"not run: the run was interrupted by {interrupted}"), base=None,
                           ratio=None, status="not run") for c in not_run]
            with open(junit_path, "w") as fh:
                fh.write(regress.junit_xml(cases, config_keys, metric=metric))
    if interrupted:
        written = " and ".join(p for p in (json_path, junit_path) if p)
        say(comm, f"# INTERRUPTED by {interrupted} after {len(rows)} row{'' if len(rows) == 1 else 's'} "
                   f"(of {len(configs)}; {len(not_run)} not run)"
                   + (f": the rows measured are in {written}" if written else ""))
    return EXIT_WRONG if wrong else EXIT_REFUSED if refused else EXIT_REGRESSED if regressed else 0
