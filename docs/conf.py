"""Sphinx configuration of burstmpi's manual.

Build it from the repository root with one command:

    sphinx-build -W -b html docs docs/_build/html

``-W`` turns every warning into an error; ``tests/test_docs.py`` builds it that way in CI.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# The checkout's package, not an installed copy, so the reference shows the code being
# documented; _ext holds the one local extension (command output captured at build time).
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE / "_ext"))

import burstmpi  # noqa: E402  (after the path change)

project = "burstmpi"
author = "the burstmpi developers"
copyright = "2026, the burstmpi developers"
release = burstmpi.__version__
version = release

extensions = [
    # MyST: the pages are Markdown because the README is, so a recipe or an example moves
    # between the two unchanged and one syntax serves both.
    "myst_parser",
    # autodoc reads the docstrings of the public names; napoleon (bundled with Sphinx, no
    # extra dependency) because the docstrings are prose with few numpydoc sections, which
    # it renders where present and leaves the prose alone elsewhere (numpydoc would add a
    # dependency and expect every docstring to follow its layout).
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    # Each command's --help and the bench's column legend, run at build time, so the pages
    # never drift from the code.
    "command_output",
]

source_suffix = {".md": "markdown"}
master_doc = "index"
exclude_patterns = ["_build", "_ext"]

# MyST: anchors for headings down to "###", so pages link to sections as the README does
# (guide/masks.md#recipes). autodoc runs inside ```{eval-rst} blocks.
myst_heading_anchors = 3

# The API reference documents the names as users import them (burstmpi.attention, not
# burstmpi._api.attention), so the reference survives a move of modules inside the package.
add_module_names = True
autodoc_member_order = "bysource"
autodoc_typehints = "none"  # the signatures are keyword-heavy; the prose says the types
autodoc_default_options = {"members": False, "undoc-members": False}
# The adapters import their frameworks at import time; the manual must build in a bare
# environment (CI's first phase has neither), so both are stood in for while documenting.
autodoc_mock_imports = ["torch", "jax", "jaxlib"]
napoleon_google_docstring = False
napoleon_numpy_docstring = True
# The docstrings' types are prose ("array (batch, seqlen_local, heads, head_dim)"), not
# names to cross-reference: rendered as one field each, they read as written.
napoleon_use_param = False
napoleon_use_rtype = False

# furo: a sidebar with the whole table of contents, and search, with no configuration.
html_theme = "furo"
html_title = f"burstmpi {release}"
html_static_path = []
html_show_sourcelink = False
