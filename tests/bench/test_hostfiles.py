"""hostfiles/: the scripts parse, the hostfiles have the formats they claim, and the nightly
regression job records a baseline, then passes against it and fails against a faster one."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import NRANKS

ROOT = Path(__file__).resolve().parents[2]
HOSTS = ROOT / "hostfiles"
pytestmark = pytest.mark.skipif(NRANKS > 1, reason="launches its own mpiexec; run once")


def _entries(path):
    return [l.strip() for l in path.read_text().splitlines() if l.strip() and not l.startswith("#")]


def test_hostfile_formats():
    assert all(re.fullmatch(r"[\w.-]+:\d+", e) for e in _entries(HOSTS / "mpich.hosts"))
    assert all(re.fullmatch(r"[\w.-]+ slots=\d+", e) for e in _entries(HOSTS / "openmpi.hosts"))
    assert _entries(HOSTS / "localhost") == ["localhost:4"]


@pytest.mark.parametrize("script", ["slurm.sbatch", "nightly-regression.sh"])
def test_scripts_parse(script):
    res = subprocess.run(["bash", "-n", str(HOSTS / script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "#SBATCH --nodes" in (HOSTS / "slurm.sbatch").read_text()


@pytest.mark.timeout(300)
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
def test_nightly_regression_job(tmp_path):
    env = dict(os.environ, RANKS="2", OUT=str(tmp_path), TOLERANCE="10", OPENBLAS_NUM_THREADS="1",
               SWEEP="-b 128 -e 256 -f 2 -H 2 -D 32 -m causal -n 1 -w 0",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = lambda: subprocess.run(["bash", str(HOSTS / "nightly-regression.sh")], env=env, cwd=ROOT,
                                 capture_output=True, text=True, timeout=240)
    first = run()
    assert first.returncode == 0, first.stdout + first.stderr
    assert "# recorded" in first.stdout and (tmp_path / "baseline.json").exists()
    second = run()
    assert second.returncode == 0 and "# nightly: OK" in second.stdout, second.stdout + second.stderr
    assert "Regressions against" in second.stdout
    # A baseline 1000x faster than any run: the job must fail with exit 3 and JUnit failures.
    # (30x was not enough: with the tolerance at 1000 %, a third run 5x faster than the first,
    # whose tiny rows ran while other jobs loaded the 2 cores, passed, in CI on 2026-12-04.)
    base = json.loads((tmp_path / "baseline.json").read_text())
    for r in base["rows"]:
        r["fwdbwd_ms"] /= 1000
    (tmp_path / "baseline.json").write_text(json.dumps(base))
    third = run()
    assert third.returncode == 3 and "PERFORMANCE REGRESSION" in third.stdout, third.stdout + third.stderr
    junits = sorted(tmp_path.glob("junit-*.xml"))
    assert junits and "<failure" in junits[-1].read_text()
