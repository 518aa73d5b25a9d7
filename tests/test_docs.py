"""The manual (docs/) builds with Sphinx, warnings as errors, and every page becomes HTML.

The build is the README's command, ``sphinx-build -W -b html docs docs/_build/html``, into a
temporary folder instead, so a test run leaves the checkout as it was. ``-j 1`` because the
machines CI uses have 2 cores and the build is mostly autodoc importing burstmpi; ``-q``
prints only warnings, which ``-W`` turns into a failure that this test shows.
"""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import NRANKS

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TOCTREE = re.compile(r"^```\{toctree\}\n(.*?)^```", flags=re.S | re.M)

pytestmark = [
    pytest.mark.skipif(NRANKS > 1, reason="one build is enough: it runs on one rank"),
    pytest.mark.skipif(importlib.util.find_spec("sphinx") is None,
                       reason="sphinx is not installed: pip install \".[docs]\" (the test extra has it)"),
]


def toctree_pages(page=DOCS / "index.md"):
    """Every page the toctrees reach from ``page``, as paths relative to docs/ without .md."""
    found = []
    for tree in TOCTREE.findall(page.read_text()):
        for line in tree.splitlines():
            entry = line.strip()
            if not entry or entry.startswith(":"):  # options such as :maxdepth:
                continue
            name = (page.parent.relative_to(DOCS) / entry).as_posix()
            found.append(name)
            found += toctree_pages(DOCS / f"{name}.md")
    return found


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("html")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("BURSTMPI_UNDER_MPIEXEC", None)
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-b", "html", "-j", "1",
                           "-q", "-d", str(out / ".doctrees"), str(DOCS), str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    return proc, out


def test_the_manual_builds_without_warnings(built):
    proc, _ = built
    assert proc.returncode == 0, (f"sphinx-build -W failed (exit {proc.returncode}):\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    assert "WARNING" not in proc.stderr, proc.stderr[-6000:]


def test_every_page_in_the_toctree_has_html(built):
    _, out = built
    pages = toctree_pages()
    for required in ("getting-started", "guide/index", "guide/masks", "bench", "performance", "design",
                     "architecture", "api", "commands", "examples", "changelog"):
        assert required in pages, f"docs/index.md's toctrees do not reach {required}.md"
    missing = [p for p in ["index"] + pages if not (out / f"{p}.html").is_file()]
    assert not missing, f"no HTML for these pages: {missing}"


def test_every_page_is_in_a_toctree():
    """A page outside every toctree is unreachable from the sidebar (Sphinx warns too)."""
    pages = set(toctree_pages()) | {"index"}
    sources = {p.relative_to(DOCS).with_suffix("").as_posix() for p in DOCS.rglob("*.md")
               if not {"_build", "_ext"} & set(p.relative_to(DOCS).parts)}
    assert sources <= pages, f"pages in no toctree: {sorted(sources - pages)}"


def test_the_api_reference_documents_every_public_name(built):
    import burstmpi
    import burstmpi.masks

    _, out = built
    html = (out / "api.html").read_text()
    names = [f"burstmpi.{n}" for n in burstmpi.__all__ if n != "__version__"]
    names += [f"burstmpi.masks.{n}" for n in burstmpi.masks.__all__]
    names += ["burstmpi.torch.attention", "burstmpi.jax.attention"]
    missing = [n for n in names if f'id="{n}"' not in html]
    assert not missing, f"docs/api.md documents no entry for {missing}"
