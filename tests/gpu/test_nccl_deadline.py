"""NCCL under the deadline: a peer that stops answering inside NCCL ends the job with the
watchdog's line naming the NCCL step, and exit 75, as on the MPI path
(``burstmpi._transport.nccl``'s docstring).

Each case is a real job of 2 ranks under ``mpiexec`` (``test_mpi.mpiexec``: a hard timeout
kills the process group, so a deadline that never fires fails the test instead of
stalling CI), through the public API (``BurstAttention(transport="nccl")``) on the fake
CuPy and NCCL (``fake_cupy.install``; the kernels are left out: these jobs test waits, not
numbers). Rank 1 stops (``fake_cupy.stop_peer``: SIGSTOP, a frozen host) at a chosen NCCL
step; rank 0 must end the job within the deadline plus the watchdog's linger, counted
from the moment rank 1 stopped.
"""

import re
import textwrap
import time
from pathlib import Path

import pytest

from burstmpi._transport import watchdog
from conftest import REPORTS
from test_mpi import ended_with, mpiexec, pytestmark as under_mpiexec  # noqa: F401  (skips alike)

pytestmark = under_mpiexec

TIMEOUT = 4  # seconds: the plan's deadline
# From rank 1's stop to the job's end: the deadline, the watchdog's linger (1 s at 4 s),
# MPI_Abort's pause and the launcher's teardown, on 2 busy cores.
MOST = TIMEOUT + 8

JOB = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    import numpy as np
    import pytest
    import burstmpi
    import fake_cupy as fake
    from burstmpi._backends.cupy_backend import CupyBackend

    class NoKernels(CupyBackend):
        def launch(self, spec):  # the waits are under test, not the numbers
            pass

    xp = fake.install(pytest.MonkeyPatch(), NoKernels)
    fake.stop_peer(1, {at!r}, {n})
    q = xp.asarray(np.random.default_rng(0).standard_normal((1, 64, 4, 32), dtype=np.float32))
    plan = burstmpi.BurstAttention(layout="contiguous", transport="nccl", timeout={timeout}, **{opts!r})
    for _ in range(2):
        plan.forward(q, q, q)
    print("both calls returned", flush=True)
""")

CASES = {
    # No connection yet: rank 0's ncclGroupEnd waits on the host for rank 1's side.
    "never connects (first transfer)": ("group", 1, {}, r"ncclGroupEnd of NCCL's transfers with rank 1 \("),
    # The communicator of head parallelism's group (``NCCLTransport.on``), made at the call.
    "never connects (head parallelism's set-up)": ("init", 2, {"head_parallel": 2},
                                                   r"ncclCommInitRank, NCCL's communicator set-up over ranks \[0, 1\]"),
    # Connected by the first call: the second call's transfer is queued and never
    # completes; ``finish``'s polled deadline names it.
    "dies after its first transfer": ("group", 2, {}, r"the phase's NCCL transfers with rank 1 \(.*\) did not complete"),
}
MEASURED = []


@pytest.mark.parametrize("case", list(CASES))
def test_a_peer_that_stops_inside_nccl_ends_the_job_by_the_deadline(case):
    at, n, opts, expect = CASES[case]
    script = JOB.format(here=str(Path(__file__).parent), at=at, n=n, opts=opts, timeout=TIMEOUT)
    rc, out, secs = mpiexec(2, ["-c", script], timeout=120)
    rc, ended = ended_with(rc, out), time.time()
    stop = re.search(r"fake NCCL: rank 1 stops answering \(SIGSTOP\) at its \w+ #\d+ at ([0-9.]+)", out)
    assert stop, f"{case}: rank 1 did not stop where asked:\n{out[-3000:]}"
    lines = [line for line in out.splitlines() if line.startswith(watchdog.PREFIX)]
    assert rc == watchdog.EXIT_TIMEOUT, f"{case}: expected exit {watchdog.EXIT_TIMEOUT}, got {rc}:\n{out[-3000:]}"
    assert "both calls returned" not in out, out[-3000:]
    assert len(lines) == 1 and re.search(expect, lines[0]), f"{case}: expected one line matching {expect!r}:\n{out}"
    assert re.match(rf"{watchdog.PREFIX}rank 0 \(.+\) in BurstAttention\.forward: .*; aborting the job "
                    rf"\(MPI_Abort, exit {watchdog.EXIT_TIMEOUT}\)$", lines[0]), lines[0]
    after = ended - float(stop.group(1))
    assert TIMEOUT <= after < MOST, f"{case}: the job ended {after:.1f} s after rank 1 stopped (deadline {TIMEOUT} s)"
    if not MEASURED:
        REPORTS.append((f"NCCL deadline, fake NCCL, 2 ranks, timeout={TIMEOUT} s (from the stop to the end; "
                        "the whole job)", MEASURED))
    MEASURED.append(f"    {case}: {after:.1f} s; {secs:.1f} s; exit {rc}; {lines[0]}")
