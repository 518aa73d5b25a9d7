"""burstmpi-bench under SIGINT and SIGTERM (``burstmpi.bench.interrupt``): the rows measured
before the signal are written to -J and --junit, the last line says INTERRUPTED, and the job
ends with 130 or 143 through mpiexec; and ``--timeout`` reaches the preamble.

The signal tests start their own ``mpiexec -n 2`` (each in a session of its own, killed
whole if it outlives its timeout) and send the signal to mpiexec once the first data row
is out, as a Ctrl-C or a scheduler's time limit would.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from click.testing import CliRunner
from mpi4py import MPI

from burstmpi.bench import main
from burstmpi.bench import interrupt, results
from burstmpi._transport.watchdog import PREFIX

from cluster.mpis import flavor
from conftest import NRANKS

ROOT = Path(__file__).resolve().parents[2]
# Seven rows (256 to 16K tokens) of which the first takes well under a second: the signal
# lands while rows remain.
SWEEP = ["-b", "256", "-e", "16K", "-f", "2", "-H", "2", "-D", "32", "-m", "causal", "-n", "2", "-w", "1",
         "--no-progress"]
ROW = re.compile(r"^ +\d", re.M)
alone = pytest.mark.skipif(NRANKS > 1, reason="launches its own mpiexec; run once")
needs_mpiexec = pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")


def _env():
    return dict(os.environ, OPENBLAS_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))


def _signal_after_first_row(cmd, sig, out, to_group=False, env=None, limit=240):
    """Start ``cmd`` in a session of its own with stdout to ``out``; once a data row is there,
    send ``sig`` to it (to its whole process group with ``to_group``); return (exit status,
    stdout, stderr). Kills the whole group if it is not done within ``limit`` seconds."""
    err = out.with_suffix(".err")
    with open(out, "w") as fo, open(err, "w") as fe:
        # SIGINT as a terminal's job has it: a test run started in the background (``cmd &``
        # in a script) ignores SIGINT, its children inherit that, and a shell cannot trap a
        # signal ignored on entry, so the nightly script would never see its Ctrl-C.
        proc = subprocess.Popen(cmd, stdout=fo, stderr=fe, env=env or _env(), start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        try:
            t0 = time.monotonic()
            while not ROW.search(out.read_text()):
                assert proc.poll() is None, f"ended before its first row: {out.read_text()}{err.read_text()}"
                assert time.monotonic() - t0 < limit, f"no data row within {limit} s: {out.read_text()}"
                time.sleep(0.05)
            (os.killpg if to_group else os.kill)(proc.pid, sig)
            rc = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return rc, out.read_text(), err.read_text()


@alone
@needs_mpiexec
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_keeps_the_rows_done_and_ends_the_job(tmp_path, sig):
    """At mpi4py's default level (MPI_THREAD_MULTIPLE) the signal thread ends the job itself:
    the rows done are kept (``_interrupted_run``'s checks), and a signal, not the watchdog,
    ended it."""
    out, err = _interrupted_run(tmp_path, sig)
    assert "; MPI at MPI_THREAD_" not in out, out  # the default level: nothing handed over
    assert PREFIX not in err and "ending without writing the rows" not in err, err


@alone
@needs_mpiexec
@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig, level", [(signal.SIGTERM, "funneled"), (signal.SIGINT, "serialized")],
                         ids=["SIGTERM-funneled", "SIGINT-serialized"])
def test_signal_below_thread_multiple_ends_the_job_from_the_main_thread(tmp_path, sig, level):
    """Below MPI_THREAD_MULTIPLE the signal thread calls no MPI: it hands the report and
    the abort to the main thread, which takes them at its next poll, so the rows done are
    written and mpiexec returns 128 + signal as at the default level."""
    out, err = _interrupted_run(tmp_path, sig, level)
    if flavor() != "openmpi":  # where the footer's lines reach the launcher (``_interrupted_run``)
        assert f"; MPI at MPI_THREAD_{level.upper()}: " in out, out
    assert "ending without writing the rows" not in err, err


def _interrupted_run(tmp_path, sig, level=None):
    """The bench under mpiexec -n 2 (at ``level``, ``MPI4PY_RC_THREAD_LEVEL``, where given)
    and ``sig`` after its first row: the exit status, the footer, the JSON and the JUnit file
    of an interrupted run. Returns its (stdout, stderr)."""
    js, junit = tmp_path / "run.json", tmp_path / "junit.xml"
    cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "burstmpi.bench", *SWEEP,
           "-J", str(js), "--junit", str(junit)]
    env = dict(_env(), **({"MPI4PY_RC_THREAD_LEVEL": level} if level else {}))
    rc, out, err = _signal_after_first_row(cmd, sig, tmp_path / "out.txt", env=env)
    name = signal.Signals(sig).name
    lines = out.splitlines()
    rows = [l for l in lines if ROW.match(l)]
    if flavor() == "openmpi":
        # Open MPI 5.0.11's mpirun passes the signal on and kills the ranks 0.2 s later
        # (measured): the files are written by then, the footer's lines and MPI_Abort's code
        # do not reach it, and it exits 1. hostfiles/nightly-regression.sh reads the JSON.
        assert rc == 1, f"exit {rc}, expected Open MPI's 1:\n{out}\n{err}"
    else:
        assert rc == 128 + sig, f"exit {rc}, expected {128 + sig}:\n{out}\n{err}"
        footer = [l for l in lines if l.startswith("# INTERRUPTED")]
        assert footer and footer == [lines[-1]], out
        assert re.fullmatch(rf"# INTERRUPTED by {name} after {len(rows)} rows? \(of 7; {7 - len(rows)} not run\): "
                            rf"the rows measured are in {re.escape(str(js))} and {re.escape(str(junit))}", footer[0])
        assert "# Out of bounds values : 0 OK" in lines
    assert 1 <= len(rows) < 7
    # hydra's own notice of a Ctrl-C ("[mpiexec@host] Sending Ctrl-C to processes") aside
    ours = [l for l in lines if l and not l.startswith("[mpiexec@")]
    assert all(l.startswith("#") or ROW.match(l) for l in ours), "a line that is neither data nor #"
    data = json.loads(js.read_text())
    # Under Open MPI the last rows printed may not reach mpirun before the kill.
    done = len(data["rows"])
    assert done == len(rows) or (flavor() == "openmpi" and len(rows) <= done < 7), (done, out)
    # Open MPI's mpirun ends the job with SIGTERM to the ranks, whichever signal it got.
    assert data["interrupted"] == ("SIGTERM" if flavor() == "openmpi" else name) and len(data["not_run"]) == 7 - done
    assert [r["seqlen"] for r in data["rows"]] == [256 << i for i in range(done)]
    assert all(r["wrong"] == 0 for r in data["rows"])
    suite = ET.parse(junit).getroot()
    cases = suite.findall("testcase")
    assert len(cases) == 7 and suite.get("failures") == "0" and suite.get("skipped") == str(7 - done)
    assert sum(c.find("skipped") is None for c in cases) == done
    assert all(data["interrupted"] in c.find("skipped").get("message") for c in cases[done:])
    return out, err


@alone
@needs_mpiexec
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", [["-m", "causal"], ["--decode"]], ids=["attention", "decode"])
def test_timeout_reaches_the_preamble_and_the_json(tmp_path, mode):
    """In a fresh process each: a KV cache built on the bench's guarded communicator once
    failed there (its duplicate), where in-process tests found a duplicate made before."""
    js = tmp_path / "run.json"
    res = subprocess.run(["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", "-m", "burstmpi.bench", "-b", "128",
                          "-e", "128", "-H", "2", "-D", "16", *mode, "-n", "1", "-w", "0", "--timeout", "42",
                          "-J", str(js)], env=_env(), capture_output=True, text=True, timeout=100)
    assert res.returncode == 0, res.stdout + res.stderr
    watchdog = [l for l in res.stdout.splitlines() if l.startswith("#  Watchdog: ")]
    assert len(watchdog) == 1 and " longer than 42 s ends the job with exit 75" in watchdog[0]
    assert json.loads(js.read_text())["params"]["timeout"] == 42.0


def test_bad_timeout_is_refused():
    res = CliRunner().invoke(main, ["--timeout", "0"])
    assert res.exit_code == 2 and "--timeout" in res.output


def test_interrupted_results_name_the_rows_not_run(tmp_path, capsys):
    """``results.finish`` for an interrupted run: the footer's last line, the JSON's
    ``interrupted`` and ``not_run``, skipped JUnit cases named like rows."""
    configs = [dict(seqlen=n, dtype="float32", bwd_comm="burst") for n in (128, 256, 512)]
    rows = [dict(configs[0], bwd_mode="burst", wrong=0, peak_mb=1.0, fwdbwd_ms=2.0)]
    js, junit = tmp_path / "r.json", tmp_path / "j.xml"
    status = results.finish(MPI.COMM_SELF, mode="attention", params={}, configs=configs, rows=rows, refused=[],
                            footer=lambda rows: ["# mode footer"], check=1, config_keys=("seqlen", "bwd_mode"),
                            metric="fwdbwd_ms", json_path=str(js), junit_path=str(junit), interrupted="SIGTERM")
    assert status == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"# INTERRUPTED by SIGTERM after 1 row (of 3; 2 not run): the rows measured are in {js} and {junit}"
    assert "# mode footer" in out and "# Out of bounds values : 0 OK" in out
    data = json.loads(js.read_text())
    assert data["interrupted"] == "SIGTERM" and [c["seqlen"] for c in data["not_run"]] == [256, 512]
    names = [c.get("name") for c in ET.parse(junit).getroot().findall("testcase")]
    assert names == [f"seqlen={n} bwd_mode=burst" for n in (128, 256, 512)]


def test_interrupts_put_the_handlers_back_and_nest():
    before = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
    wakeup = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(wakeup)
    outer_report, inner_report = (lambda name: None), (lambda name: None)
    with interrupt.Interrupts(MPI.COMM_SELF, outer_report) as outer:
        assert all(signal.getsignal(s) is interrupt._ignore for s in interrupt.SIGNALS)
        with interrupt.Interrupts(MPI.COMM_SELF, inner_report) as inner:
            assert inner is outer and outer.report is inner_report  # the sweep's report, in the same handlers
        assert outer.report is outer_report
    assert {s: signal.getsignal(s) for s in interrupt.SIGNALS} == before
    assert signal.set_wakeup_fd(wakeup) == wakeup
    assert interrupt.exit_code(signal.SIGINT) == 130 and interrupt.exit_code(signal.SIGTERM) == 143


WAITS = '''
import sys, time
from mpi4py import MPI
from burstmpi._transport import watchdog
from burstmpi.bench.common import barrier, guard
comm = watchdog.guarded(MPI.COMM_WORLD, 2.0, who="burstmpi-bench")


def split():
    with guard(comm, "a split"):
        comm.Split_type(MPI.COMM_TYPE_SHARED)


if comm.Get_rank() == 0:  # rank 1 never comes
    {"barrier": lambda: barrier(comm, idle=True), "allreduce": lambda: comm.allreduce(1),
     "split": split}[sys.argv[1]]()
else:
    time.sleep(60)
'''


@alone
@needs_mpiexec
@pytest.mark.timeout(120)
@pytest.mark.parametrize("wait, says", [("barrier", "rank 1 did not reach a barrier of burstmpi-bench within 2 s"),
                                        ("allreduce", "burstmpi-bench: allreduce did not complete within 2 s"),
                                        ("split", "burstmpi-bench: a split did not complete within 2 s")])
def test_the_bench_waits_end_at_the_deadline(tmp_path, wait, says):
    """The bench's barriers, its pickled collectives (``watchdog.guarded``) and its blocking
    calls (``guard``): a rank that never arrives ends the job with exit 75 and one line."""
    (tmp_path / "waits.py").write_text(WAITS)
    t0 = time.monotonic()
    res = subprocess.run(["mpiexec", "-n", "2", sys.executable, str(tmp_path / "waits.py"), wait], env=_env(),
                         capture_output=True, text=True, timeout=100)
    assert res.returncode == 75, res.stdout + res.stderr
    lines = [l for l in res.stderr.splitlines() if l.startswith("burstmpi watchdog: rank 0 ")]
    assert len(lines) == 1 and says in lines[0] and lines[0].endswith("(MPI_Abort, exit 75)"), res.stderr
    assert time.monotonic() - t0 < 40
