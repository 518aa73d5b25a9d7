"""The Python programs of the README and of the manual (docs/) run as printed, under mpiexec
at the rank count each names.

On each page, a block whose first line is ``# run with: mpiexec -n N python -m mpi4py FILE``
starts a program; a block without one continues the program before it on the same page (as
a user pasting it into the same file would), so examples that follow one another share
their variables. Each program runs once, the concatenation of its blocks; every block must
print its check on rank 0, a line with "largest error against float64 X" (every such print
must show, and X must be small for float32), and a block that says whether every rank got
the same bits must say True. Every ```python block of these pages is run: code that is not
meant to run goes in a ```bash or ```text block.
Programs that import torch or JAX run where those are installed (``.ci/run``'s second
phase: they are marked ``extras``).
"""

import importlib.util
import re
from pathlib import Path

import pytest

from test_mpi import MPIEXEC, mpiexec, printed_checks
from conftest import NRANKS, REPORTS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
HEAD = re.compile(r"^# run with: mpiexec -n (\d+) python -m mpi4py (\S+)")
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def pages():
    """The README, then the manual's Markdown pages (its build output left out)."""
    docs = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
    return [README] + docs


def blocks(page):
    return BLOCK.findall(page.read_text())


def programs(page):
    """[(file name, ranks, source, blocks)] from ``page``'s python blocks, in order."""
    out = []
    for block in blocks(page):
        head = HEAD.match(block)
        if head:
            out.append([head.group(2), int(head.group(1)), block, 1])
        else:
            assert out, (f"{page.relative_to(ROOT)}: the first python block must say how to run it "
                         f"('# run with: mpiexec -n N python -m mpi4py FILE'):\n{block[:200]}")
            out[-1][2] += "\n" + block
            out[-1][3] += 1
    return [tuple(p) for p in out]


def test_every_python_block_is_one_the_suite_runs():
    """A fence spelled otherwise (```py, ```Python, trailing blanks) would never run: every
    fence that opens Python code on a page must be exactly ```python."""
    odd = [f"{page.relative_to(ROOT)}: {fence!r}" for page in pages()
           for fence in re.findall(r"^```[ \t]*(?:py|python|python3|ipython)\b.*$", page.read_text(), flags=re.M | re.I)
           if fence != "```python"]
    assert not odd, odd


def all_programs():
    """[(page, program)] over every page."""
    return [(page, prog) for page in pages() for prog in programs(page)]


def _needs(source):
    return [m for m in ("torch", "jax") if re.search(rf"^import {m}\b", source, flags=re.M)]


def _param(page, program):
    name, n, source, blocks = program
    marks = [pytest.mark.extras] if _needs(source) else []
    return pytest.param(page, program, id=f"{page.relative_to(ROOT)}:{name}-np{n}", marks=marks)


pytestmark = [
    pytest.mark.skipif(NRANKS > 1, reason="launches its own mpiexec"),
    pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)"),
]


def test_every_block_is_in_a_program_that_names_its_ranks_and_prints_a_check():
    # The README shows a NumPy, a decode (continuing it) and a framework example.
    assert len(blocks(README)) >= 3 and len(programs(README)) >= 2, programs(README)
    for page in pages():
        progs, found = programs(page), blocks(page)
        assert all(n >= 1 for _, n, _, _ in progs), page
        assert sum(b for *_, b in progs) == len(found), page
        for block in found:
            assert "largest error against float64" in block, \
                f"{page.relative_to(ROOT)}: this block prints no check:\n{block[:300]}"


def test_program_names_are_unique_on_a_page():
    """A page's programs are files a user saves side by side: two of one name would clash."""
    for page in pages():
        names = [name for name, *_ in programs(page)]
        assert len(names) == len(set(names)), f"{page.relative_to(ROOT)}: {names}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("page,program", [_param(page, p) for page, p in all_programs()])
def test_program_runs_and_checks_itself(page, program, tmp_path):
    name, n, source, blocks = program
    where = f"{page.relative_to(ROOT)}'s {name}"
    for module in _needs(source):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{where} needs {module}")
    path = tmp_path / name
    path.write_text(source)
    rc, out, secs = mpiexec(n, [str(path)], timeout=540)
    assert rc == 0, f"{where} under mpiexec -n {n} failed (exit {rc}):\n{out[-4000:]}"
    checks = printed_checks(where, out, 1e-4)  # float32 examples
    prints = source.count("largest error against float64")
    assert len(checks) == prints, f"{where}: expected {prints} check lines, got:\n{out[-3000:]}"
    if "the same bits on every rank" in source:
        assert "the same bits on every rank: True" in out, out[-2000:]
    REPORTS.append((f"{where} under mpiexec -n {n} ({secs:.0f} s)", ["  " + c for c in checks]))
