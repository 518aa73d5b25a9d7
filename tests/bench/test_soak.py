"""burstmpi-soak (``burstmpi.bench.soak``): a long job's life in a minute, and its failures.

The documented command runs for hours (docs/guide/long-jobs.md); here it runs half a minute
after its warm-up at 2 ranks (hundreds of rounds): communicators made and freed every round, the functional API over more option sets
than the plan cache keeps, plans and KV caches made and released, checked against float64,
and nothing may grow past the baseline. A leak injected on purpose must fail it (exit 3).
"""

import os
import re
import sys
import textwrap

import pytest

from conftest import NRANKS

pytestmark = pytest.mark.skipif(NRANKS > 1 or os.environ.get("BURSTMPI_UNDER_MPIEXEC") == "1",
                                reason="runs mpiexec itself")


def _run(args, timeout, script=None, tmp_path=None, **env):
    from test_mpi import MPIEXEC, mpiexec

    if MPIEXEC is None:
        pytest.skip("mpiexec not found")
    if script is not None:
        path = tmp_path / "soak.py"
        path.write_text(script)
        args = [str(path), *args]
    else:
        args = ["-m", "burstmpi.bench.soak", *args]
    return mpiexec(2, args, timeout=timeout, **env)


def test_half_a_minute_of_soak_passes():
    rc, out, secs = _run(["--minutes", "0.5", "--report", "10", "--adapters", "none", "--timeout", "120"], timeout=400)
    assert rc == 0, out[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("round ")]
    assert len(lines) >= 3, out[-4000:]  # the baseline, reports, the last
    assert "burstmpi-soak: passed:" in out
    held = {re.search(r"held: (.*?)  cache", line).group(1) for line in lines}
    assert len(held) == 1, lines  # what burstmpi holds between rounds never changed
    rounds = int(re.search(r"passed: (\d+) rounds", out).group(1))
    assert rounds > 2 * 24, out[-2000:]


LEAK = textwrap.dedent("""
    import sys
    from burstmpi._transport import lifetime
    from burstmpi.bench import soak
    real = lifetime._free_comms
    def leaky(comms, collective):  # burstmpi's counts go down, MPI's communicators stay
        real(comms, False)
    lifetime._free_comms = leaky
    sys.exit(soak.soak(30, warmup=24, check_every=10, report_s=5, rss_growth=64, adapters=set()))
""")


def test_a_leak_fails_the_soak(tmp_path):
    """burstmpi's duplicates forgotten but never freed (its own counts say nothing): the
    first report after the baseline sees MPI make fewer communicators, and the run exits 3."""
    rc, out, _ = _run([], timeout=300, script=LEAK, tmp_path=tmp_path)
    assert rc == 3, out[-4000:]
    assert re.search(r"burstmpi-soak: FAILED at round \d+: MPI can make \d+ fewer communicators", out), out[-3000:]


@pytest.mark.extras
def test_the_soak_with_the_adapters():
    import importlib.util

    which = [m for m in ("torch", "jax") if importlib.util.find_spec(m)]
    if not which:
        pytest.skip("neither torch nor JAX is installed")
    rc, out, _ = _run(["--minutes", "0.25", "--report", "5", "--adapters", ",".join(which), "--timeout", "120"],
                      timeout=400)
    assert rc == 0 and "burstmpi-soak: passed:" in out, out[-4000:]
    assert f"adapters: {', '.join(sorted(which))}" in out
