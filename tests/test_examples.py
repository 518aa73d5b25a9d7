"""The examples in ``examples/`` run as their docstrings say, at 2 ranks, and check themselves.

Each example prints its own check on rank 0: "largest error against float64 X" (X must be
far below 1e-5 for float32, relative to the largest value where the example says so) and
"the same bits on every rank: True". The training steps also run at 1 rank: the split over
ranks changes only rounding, so the losses agree step by step. The Slurm job script runs
outside Slurm with ``SLURM_NTASKS=2``, launching as it does in a job (``mpiexec -n
$SLURM_NTASKS``; ``tests/cluster/test_slurm.py`` runs it under a real Slurm). Programs that import
torch or JAX are marked ``extras`` (``.ci/run``'s second phase). Every run has a timeout that
kills its whole process group (``test_mpi.mpiexec``).
"""

import ast
import importlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import NRANKS, REPORTS
from test_mpi import CHECK, MPIEXEC, mpiexec, printed_checks

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
SAME = "the same bits on every rank: True"
# The names examples may import: what a user can rely on across releases.
PUBLIC = {"burstmpi", "burstmpi.masks", "burstmpi.reference", "burstmpi.torch", "burstmpi.jax"}
# Examples that measure internals on purpose, and why.
INTERNAL = {"mask_planning.py": "times the planner (burstmpi._ring.geometry), which runs inside a plan's first call",
            "balance_choice.py": "times the balance choice (burstmpi._ring.balance), which runs inside a plan's first call"}

pytestmark = [
    pytest.mark.skipif(NRANKS > 1 or os.environ.get("BURSTMPI_UNDER_MPIEXEC") == "1",
                       reason="launches its own mpiexec"),
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)"),
]


def _examples():
    return sorted(p for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh"))


def _checks(name, out, limit=1e-5):
    """The example's check lines: each error below ``limit``, no same-bits claim False."""
    return printed_checks(name, out, limit)


def _run(name, *args, n=2, timeout=300):
    rc, out, secs = mpiexec(n, [str(EXAMPLES / name), *args], timeout=timeout)
    assert rc == 0, f"{name} under mpiexec -n {n} failed (exit {rc}):\n{out[-4000:]}"
    return out, secs


# -- what every example must have ---------------------------------------------------------


@pytest.mark.parametrize("path", _examples(), ids=lambda p: p.name)
def test_example_says_what_it_shows_and_how_to_run_it(path):
    """A docstring (a comment block for a shell script) that names the command to run it."""
    text = path.read_text()
    if path.suffix == ".py":
        doc = ast.get_docstring(ast.parse(text))
        assert doc and len(doc.splitlines()) >= 3, f"{path.name}: no docstring"
    else:
        doc = "".join(line for line in text.splitlines(True)[1:] if line.startswith("#"))
    assert f"examples/{path.name}" in doc, f"{path.name}: its docstring does not say how to run it"


def _public_names(module):
    """What ``from module import X`` and ``module.X`` may name: its ``__all__`` and the
    public submodules."""
    mod = importlib.import_module(module)
    return set(getattr(mod, "__all__", ())) | {m[len(module) + 1:] for m in PUBLIC if m.startswith(module + ".")}


@pytest.mark.parametrize("path", [p for p in _examples() if p.suffix == ".py"], ids=lambda p: p.name)
def test_example_uses_only_public_names(path):
    """Examples are what users copy: they use ``burstmpi``'s public names only (the modules
    in PUBLIC, and what their ``__all__`` lists), which stay where they are when modules
    move inside the package."""
    private = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            private |= {a.name for a in node.names if a.name.split(".")[0] == "burstmpi" and a.name not in PUBLIC}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "burstmpi":
            if node.module not in PUBLIC:
                private.add(node.module)
            else:
                private |= {f"{node.module}.{a.name}" for a in node.names
                            if a.name not in _public_names(node.module)}
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "burstmpi"
              and node.attr not in _public_names("burstmpi")):
            private.add(f"burstmpi.{node.attr}")
    if path.name in INTERNAL:
        assert private, f"{path.name} is listed as using internals but does not: take it off INTERNAL"
        pytest.skip(f"{path.name} {INTERNAL[path.name]}: {', '.join(sorted(private))}")
    assert not private, f"{path.name} uses internal names {sorted(private)}; public: {sorted(PUBLIC)}"


def test_every_example_is_listed_in_the_manual():
    docs = ROOT / "docs"
    if not docs.is_dir():
        pytest.skip("no docs/ in this checkout")
    text = "\n".join(p.read_text() for p in docs.rglob("*.md")) + "\n".join(
        p.read_text() for p in docs.rglob("*.rst"))
    missing = [p.name for p in _examples() if f"examples/{p.name}" not in text]
    assert not missing, f"not named in docs/: {missing}"


# -- the examples, run --------------------------------------------------------------------


def test_numpy_attention_at_two_ranks():
    """examples/numpy_attention.py: each rank makes only its shard; forward and backward of
    a 4096-token causal zigzag problem, out, dq, dk, dv against float64."""
    out, secs = _run("numpy_attention.py", "4096")
    lines = _checks("numpy_attention.py", out)
    assert SAME in out, out[-2000:]
    REPORTS.append((f"examples/numpy_attention.py 4096 under mpiexec -n 2 ({secs:.0f} s)", ["  " + c for c in lines]))


def test_numpy_attention_with_a_length_that_does_not_divide():
    """Any N: 1001 tokens at 2 ranks (zigzag's 4 chunks are uneven)."""
    out, _ = _run("numpy_attention.py", "1001")
    _checks("numpy_attention.py", out)
    assert SAME in out, out[-2000:]


def _gpus():
    if importlib.util.find_spec("cupy") is None:
        return 0
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def test_dlpack_embedding_at_two_ranks():
    """examples/dlpack_embedding.py: a NumPy layer through a plan, NumPy in and NumPy out;
    the CuPy path where a GPU is present, else the plain skip line (and exit 0)."""
    out, secs = _run("dlpack_embedding.py", "2048")
    lines = _checks("dlpack_embedding.py", out)
    assert "numpy.ndarray in, numpy.ndarray out (the same type: True)" in out, out[-2000:]
    assert out.count(SAME) == len(lines), out[-2000:]
    if _gpus():
        assert "cupy.ndarray in, cupy.ndarray out (the same type: True)" in out, out[-2000:]
        assert len(lines) == 2, out[-2000:]
    else:
        assert "no GPU: ran the NumPy path only" in out, out[-2000:]
        assert len(lines) == 1, out[-2000:]
    REPORTS.append((f"examples/dlpack_embedding.py 2048 under mpiexec -n 2 ({secs:.0f} s)", ["  " + c for c in lines]))


def test_streaming_decode_at_two_ranks():
    """examples/streaming_decode.py: sinks and a window decoding past the capacity, checked
    against float64 under the same mask, the same bits on every rank."""
    out, secs = _run("streaming_decode.py", "600")
    m = re.search(r"largest error against float64 ([0-9.e+-]+);.*the same bits on every rank: True", out)
    assert m and float(m.group(1)) < 1e-5, out[-2000:]
    REPORTS.append((f"examples/streaming_decode.py 600 under mpiexec -n 2 ({secs:.0f} s)",
                    ["  " + line for line in out.splitlines() if CHECK.search(line)]))


def test_make_use_free_at_two_ranks():
    """examples/make_use_free.py: 1,100 communicators made, used and freed (MPICH has 2,048
    context ids; the loop died at round 1,023 before burstmpi freed its own with the
    caller's): as many communicators left at the end as at round 100, and right results."""
    out, _ = _run("make_use_free.py", timeout=400)
    _checks("make_use_free.py", out)
    left = [int(x) for x in re.findall(r"communicators MPI can still make (\d+)", out)]
    assert len(left) == 2 and left[1] >= left[0] > 1000, out[-3000:]


@pytest.mark.extras
@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_training_step_the_same_at_one_and_two_ranks(framework):
    """Each training step under mpiexec -n 1 and -n 2: the loss falls, the losses agree step
    by step (exact attention: the split over ranks changes only rounding), and the weights
    after the last step have the same bits on every rank."""
    pytest.importorskip(framework)
    losses = {}
    for n in (1, 2):
        out, secs = _run(f"{framework}_train_step.py", n=n)
        losses[n] = [float(line.split("loss ")[1].split()[0]) for line in out.splitlines()
                     if line.startswith(f"{framework} step")]
        assert len(losses[n]) == 5, out[-3000:]
        assert SAME in out, out[-2000:]
    assert losses[1][-1] < losses[1][0]
    assert max(abs(a - b) for a, b in zip(losses[1], losses[2])) < 1e-3, losses
    REPORTS.append((f"examples/{framework}_train_step.py under mpiexec -n 1 and -n 2 ({secs:.0f} s at 2)",
                    [f"  losses at 1 rank {losses[1]}", f"  losses at 2 ranks {losses[2]}"]))


@pytest.mark.extras
def test_adapter_overhead_at_two_ranks():
    """examples/adapter_overhead.py, small: the plain call and each installed adapter timed."""
    if not any(importlib.util.find_spec(m) for m in ("torch", "jax")):
        pytest.skip("neither torch nor jax is installed")
    out, _ = _run("adapter_overhead.py", "512", "2", "64", "1")
    for phase in ("fwd :", "f+b :"):
        line = next((x for x in out.splitlines() if x.startswith(phase)), "")
        assert "plain" in line and all(f"{m} " in line for m in ("torch", "jax") if importlib.util.find_spec(m)), out


def test_mask_planning():
    """examples/mask_planning.py at 64K tokens (one process): both masks planned, in well
    under a minute."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "mask_planning.py"), "65536", "4"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    times = [float(x) for x in re.findall(r"planned in ([0-9.]+) s", proc.stdout)]
    assert len(times) == 2 and max(times) < 60, proc.stdout


def test_balance_choice():
    """examples/balance_choice.py small (one process): a row per size, each choosing a
    layout, zigzag for contiguous causal at 16K tokens and 8 ranks."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "balance_choice.py"), "2,8", "4096,16384"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = re.findall(r"^ +(\d+) +(\d+) +\d+ ms +\d+ ms +\d+ ms +(\w+)$", proc.stdout, re.M)
    assert len(rows) == 4 and ("8", "16384", "zigzag") in rows, proc.stdout


def test_slurm_job_script(tmp_path):
    """examples/slurm_job.sh as a job of 2 tasks would run it (its default launcher,
    ``mpiexec -n $SLURM_NTASKS``, here without Slurm), with a one-row bench and a small example: the bench's JSON and JUnit files, its footer, the example's check,
    exit 0. Then again against that JSON as a baseline (regression mode), and once more
    against a baseline 100 times faster, where the job must exit 3 (a regression)."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    python = bindir / "python"  # the job's `python`: this interpreter (a symlink would lose its venv)
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    path = [str(bindir), os.path.dirname(MPIEXEC), os.environ.get("PATH", "")]  # the job's mpiexec: this one
    env = dict(os.environ, PATH=os.pathsep.join(path),
               SLURM_NTASKS="2", SLURM_JOB_ID="4242", OPENBLAS_NUM_THREADS="1", BURSTMPI_UNDER_MPIEXEC="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OUT=str(tmp_path / "out"), BENCH_ARGS="-b 1K -e 1K -n 1 -w 0 -H 2 -D 64 -m causal",
               EXAMPLE_ARGS="1024")
    env.pop("SLURM_SUBMIT_DIR", None)
    runs = []
    fast = tmp_path / "fast.json"
    cases = [({}, 0), ({"BASELINE": str(tmp_path / "baseline.json"), "TOLERANCE": "100"}, 0),
             ({"BASELINE": str(fast), "TOLERANCE": "0.10"}, 3)]
    for extra, status in cases:
        t0 = time.perf_counter()
        proc = subprocess.Popen(["bash", str(EXAMPLES / "slurm_job.sh")], cwd=ROOT, env=dict(env, **extra),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            pytest.fail(f"examples/slurm_job.sh hung for 300 s:\n{out[-4000:]}")
        assert proc.returncode == status, f"examples/slurm_job.sh: exit {proc.returncode}, expected {status}:\n{out[-4000:]}"
        assert "# Out of bounds values : 0 OK" in out, out[-3000:]
        assert f"# burstmpi-bench exit status {status}" in out, out[-3000:]
        lines = _checks("slurm_job.sh", out)
        assert SAME in out, out[-2000:]
        rows = json.loads((tmp_path / "out" / "bench.json").read_text())
        assert rows, out[-2000:]
        assert (tmp_path / "out" / "junit.xml").is_file()
        if not extra:
            (tmp_path / "out" / "bench.json").rename(tmp_path / "baseline.json")
            baseline = json.loads((tmp_path / "baseline.json").read_text())
            for row in baseline["rows"]:  # every time 100 times shorter: the next runs regress
                row.update({key: value / 100 for key, value in row.items()
                            if key.endswith("_ms") and isinstance(value, (int, float))})
            fast.write_text(json.dumps(baseline))
        else:
            verdict = "OK" if status == 0 else "FAILED"
            assert re.search(rf"# Regressions against .* {verdict}", out), out[-3000:]
        what = "first run" if not extra else ("with BASELINE" if status == 0 else "against a faster BASELINE")
        runs.append(f"  {what} ({time.perf_counter() - t0:.0f} s, exit {proc.returncode}): {lines[-1]}")
    REPORTS.append(("examples/slurm_job.sh outside Slurm, SLURM_NTASKS=2 (mpiexec -n 2)", runs))
