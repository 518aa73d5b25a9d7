"""burstmpi.jax with several devices in one process (JAX's one process per host, here 2
forced CPU devices): refused inside shard_map and pmap at trace time (and at lowering, on
the buffer path), with a message that says how to run one rank per device; a jax.jit of
arrays sharded over the devices runs the call once, on the gathered arrays, and is exact.
Without this, the per-device calls ran at once on one plan: wrong values, XLA aborts, hangs.

Each run is a subprocess (the device count is fixed when JAX starts) with a timeout that
kills its process group: a hang fails the test. The program is jax_devices_check.py."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NRANKS
from test_mpi import MPIEXEC, mpiexec

pytestmark = [pytest.mark.extras,
              pytest.mark.skipif(NRANKS > 1, reason="spawns its own interpreters; once is enough")]
pytest.importorskip("jax")

PROGRAM = Path(__file__).resolve().parent / "jax_devices_check.py"
DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
REFUSED = ("NotImplementedError: burstmpi.jax.attention: devices per call: expected 1, got 2: jax.shard_map or "
           "jax.pmap runs this call on each of 2 devices of this process")
HOW = ("Run one MPI rank per device, each seeing one: on GPUs set CUDA_VISIBLE_DEVICES per rank",
       "XLA_FLAGS=--xla_force_host_platform_device_count=1")
WORKS = ["jit", "jit grad", "jit on sharded inputs", "jit grad on sharded inputs", "shard_map over one device"]
REFUSES = ["shard_map", "shard_map eager", "shard_map grad", "pmap"]


def _alone(timeout):
    """The program in one process (an MPI singleton), killed with its group on timeout."""
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", **DEVICES)
    proc = subprocess.Popen([sys.executable, str(PROGRAM)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"jax_devices_check.py hung for {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out


@pytest.mark.parametrize("ranks", [1, 2])
def test_two_devices_in_one_process(ranks):
    if ranks == 1:
        rc, out = _alone(timeout=300)
    else:
        if MPIEXEC is None:
            pytest.skip("mpiexec not found (pip install mpich)")
        rc, out, _ = mpiexec(2, [str(PROGRAM)], timeout=300, **DEVICES)
    assert rc == 0, f"exit {rc}:\n{out[-4000:]}"
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    paths = sorted({r["path"] for r in results})
    assert paths in (["buffers", "io_callback"], ["io_callback"]), paths
    got = {(r["case"], r["path"]): r for r in results}
    for path in paths:
        for case in WORKS:  # exact: float64 against burstmpi.reference, the forward (and backward) once
            r = got[(case, path)]
            assert r["devices"] == 2 and r["refused"] is None and r["err"] < 1e-12, r
            assert r["calls"] == (2 if "grad" in case else 1), r
        for case in REFUSES + (["shard_map lowered without the trace's check"] if path == "buffers" else []):
            r = got[(case, path)]  # refused before anything ran: no call, no XLA error
            assert r["refused"].startswith(REFUSED) and all(h in r["refused"] for h in HOW), r
            assert r["calls"] == 0 and r["err"] is None, r
