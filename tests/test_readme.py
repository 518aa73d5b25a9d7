"""The README's Python examples run as printed, under mpiexec at the rank count each names.

A block whose first line is ``# run with: mpiexec -n N python -m mpi4py FILE`` starts a
program; a block without one continues the program before it (as a user pasting it into
the same file would), so examples that follow one another share their variables. Each
program runs once, the concatenation of its blocks; every block must print its check on
rank 0, a line with "largest error against float64 X" (every such print must show, and X
must be small for float32), and a block that says whether every rank got the same bits
must say True.
Programs that import torch or JAX run where those are installed (``.ci/run``'s second
phase: they are marked ``extras``).
"""

import importlib.util
import re
from pathlib import Path

import pytest

from test_mpi import MPIEXEC, mpiexec
from conftest import NRANKS, REPORTS

README = Path(__file__).resolve().parent.parent / "README.md"
HEAD = re.compile(r"^# run with: mpiexec -n (\d+) python -m mpi4py (\S+)")
CHECK = re.compile(r"largest error against float64 ([0-9.e+-]+)")


def programs():
    """[(file name, ranks, source, blocks)] from the README's python blocks, in order."""
    out = []
    for block in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S):
        head = HEAD.match(block)
        if head:
            out.append([head.group(2), int(head.group(1)), block, 1])
        else:
            assert out, f"the README's first python block must say how to run it:\n{block[:200]}"
            out[-1][2] += "\n" + block
            out[-1][3] += 1
    return [tuple(p) for p in out]


def _needs(source):
    return [m for m in ("torch", "jax") if re.search(rf"^import {m}\b", source, flags=re.M)]


def _param(program):
    name, n, source, blocks = program
    marks = [pytest.mark.extras] if _needs(source) else []
    return pytest.param(program, id=f"{name}-np{n}", marks=marks)


pytestmark = [
    pytest.mark.skipif(NRANKS > 1, reason="launches its own mpiexec"),
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)"),
]


def test_every_block_is_in_a_program_that_names_its_ranks_and_prints_a_check():
    progs = programs()
    assert len(progs) >= 3 and all(n >= 1 for _, n, _, _ in progs)
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert sum(b for *_, b in progs) == len(blocks)
    for block in blocks:
        assert "largest error against float64" in block, f"this README block prints no check:\n{block[:300]}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("program", [_param(p) for p in programs()])
def test_readme_program_runs_and_checks_itself(program, tmp_path):
    name, n, source, blocks = program
    for module in _needs(source):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{name} needs {module}")
    path = tmp_path / name
    path.write_text(source)
    rc, out, secs = mpiexec(n, [str(path)], timeout=540)
    assert rc == 0, f"{name} under mpiexec -n {n} failed (exit {rc}):\n{out[-4000:]}"
    checks = [line for line in out.splitlines() if CHECK.search(line)]
    prints = source.count("largest error against float64")
    assert len(checks) == prints, f"{name}: expected {prints} check lines, got:\n{out[-3000:]}"
    for line in checks:
        assert float(CHECK.search(line).group(1)) < 1e-4, line  # float32 examples
    if "the same bits on every rank" in source:
        assert "the same bits on every rank: True" in out, out[-2000:]
    REPORTS.append((f"README's {name} under mpiexec -n {n} ({secs:.0f} s)", ["  " + c for c in checks]))
