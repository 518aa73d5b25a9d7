"""The public surface is what the API page lists, and every other module says by its name
that it is internal.

Public: ``burstmpi`` (its ``__all__``), ``burstmpi.masks``, ``burstmpi.torch``,
``burstmpi.jax``, ``burstmpi.reference`` (the float64 oracle the README checks with) and
the commands (``burstmpi.bench``, ``burstmpi.model``, ``burstmpi.kernelcheck``,
``burstmpi.plot``: run with ``-m``, their modules are the commands' code, not an API).
Everything else lives in a module or package whose name starts with ``_``, as mpi4jax
keeps its ``_src``: importing it works, depending on it is at the caller's risk.
"""

import importlib
import re
from pathlib import Path

import burstmpi
import burstmpi.masks
import burstmpi.reference

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "burstmpi"
PAGE = ROOT / "docs" / "api.md"
# Modules that are public, or the commands' packages (whose modules are theirs).
PUBLIC = {"burstmpi", "burstmpi.masks", "burstmpi.torch", "burstmpi.jax", "burstmpi.reference",
          "burstmpi.kernelcheck", "burstmpi.plot"}
COMMANDS = ("burstmpi.bench", "burstmpi.model")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_module_is_public_a_command_or_named_internal():
    loose = [m for m in _modules()
             if m not in PUBLIC and not m.startswith(COMMANDS)
             and not any(part.startswith("_") and part != "__init__" for part in m.split(".")[1:])]
    assert not loose, f"neither public nor named internal (a leading underscore): {loose}"


def _expected():
    names = {f"burstmpi.{n}" for n in burstmpi.__all__ if n != "__version__"}
    names |= {f"burstmpi.masks.{n}" for n in burstmpi.masks.__all__}
    names |= {f"burstmpi.reference.{n}" for n in burstmpi.reference.__all__}
    names |= {"burstmpi.torch.attention", "burstmpi.jax.attention"}
    return names


def test_the_api_page_lists_exactly_the_public_names():
    documented = set(re.findall(r"^\.\. auto(?:function|class|data):: (\S+)$", PAGE.read_text(), re.M))
    expected = _expected()
    assert documented == expected, (f"on the page, not public: {sorted(documented - expected)}; "
                                    f"public, not on the page: {sorted(expected - documented)}")


def test_the_public_names_resolve_and_are_documented():
    for name in _expected():
        if name.startswith(("burstmpi.torch.", "burstmpi.jax.")):
            continue  # optional frameworks: the adapters' own tests import them
        module, _, attr = name.rpartition(".")
        obj = getattr(importlib.import_module(module), attr)
        assert (obj.__doc__ or "").strip(), f"{name} has no docstring"
