"""``burstmpi-bench --mask SPEC``: the sparse patterns long-context models run, built
from ``burstmpi.masks`` for a given length.

A SPEC is ``none``, ``causal`` or ``both`` (dense attention, as always), or one pattern,
run with the causal mask on top (the language-model setting):

==============================  =============================================================
``streaming:SINKS:WINDOW``      StreamingLLM: ``Sinks(SINKS) | Window(WINDOW, 0)``
``chunked:SIZE``                Llama 4's chunked attention: ``Chunked(SIZE)``
``blocks:DENSITY[:BS]``         random block-sparse: each block (BS tokens a side, default
                                128) set with probability DENSITY, the diagonal always;
                                seeded by ``--seed``
``bigbird:G:W:R[:BS]``          BigBird: G global blocks (rows and columns), W blocks each
                                side of the diagonal, R random blocks per block row
``strided:STRIDE:LOCAL[:BS]``   per-head strided blocks (Phi-3-small's kind): head h sees the
                                LOCAL blocks up to its own and every STRIDE-th block column,
                                shifted by h
==============================  =============================================================

Sizes take K/M suffixes (``streaming:4:1K``). ``build(spec, seqlen, heads, seed)`` makes
the mask; the same arguments make the same mask on every rank.
"""

import click
import numpy as np

from ..masks import BlockSparse, Chunked, Sinks, Window
from .._sizes import suffixed

__all__ = ["DENSE", "PATTERNS", "check_spec", "build"]

DENSE = ("none", "causal", "both")
PATTERNS = {"streaming": (2, 2), "chunked": (1, 1), "blocks": (1, 2), "bigbird": (3, 4), "strided": (2, 3)}


def _parse(spec):
    """(name, [arguments]) of a pattern SPEC; ValueError naming what is wrong."""
    name, _, rest = spec.partition(":")
    if name not in PATTERNS:
        raise ValueError(f"expected none, causal, both or one of {', '.join(f'{p}:...' for p in PATTERNS)}, got {spec!r}")
    args = rest.split(":") if rest else []
    least, most = PATTERNS[name]
    if not least <= len(args) <= most:
        raise ValueError(f"{name}: expected {least}{'' if least == most else f' to {most}'} arguments, got {spec!r}")
    try:
        values = [float(a) if name == "blocks" and i == 0 else suffixed(a) for i, a in enumerate(args)]
    except ValueError:
        raise ValueError(f"{name}: expected numbers (sizes may end in K or M), got {spec!r}") from None
    if name == "blocks" and not 0 <= values[0] <= 1:
        raise ValueError(f"blocks: DENSITY: expected a fraction in [0, 1], got {args[0]}")
    least = {"chunked": [1], "strided": [1, 0, 1], "blocks": [0, 1], "bigbird": [0, 0, 0, 1]}.get(name, [0, 0])
    if any(v < m for v, m in zip(values, least)):
        raise ValueError(f"{name}: expected non-negative arguments, sizes, strides and block sizes >= 1, got {spec!r}")
    return name, values


def check_spec(ctx, param, value):
    """click callback for --mask: the SPEC, checked."""
    if value in DENSE:
        return value
    try:
        _parse(value)
    except ValueError as e:
        raise click.BadParameter(str(e))
    return value


def _grid(seqlen, bs):
    nb = -(-seqlen // bs)
    i = np.arange(nb)
    return nb, i[:, None], i[None, :]


def build(spec, seqlen, heads, seed=0):
    """The ``burstmpi.masks`` mask of a pattern SPEC for ``seqlen`` tokens and ``heads``
    query heads (not ANDed with causal: the bench passes ``causal=True``)."""
    name, a = _parse(spec)
    if name == "streaming":
        return Sinks(int(a[0])) | Window(int(a[1]), 0)
    if name == "chunked":
        return Chunked(int(a[0]))
    rng = np.random.default_rng([seed, seqlen])
    if name == "blocks":
        bs = int(a[1]) if len(a) > 1 else 128
        nb, i, j = _grid(seqlen, bs)
        return BlockSparse((rng.random((nb, nb)) < a[0]) | (i == j), bs)
    if name == "bigbird":
        g, w, r = (int(x) for x in a[:3])
        bs = int(a[3]) if len(a) > 3 else 128
        nb, i, j = _grid(seqlen, bs)
        blocks = (i < g) | (j < g) | (np.abs(i - j) <= w)
        picks = rng.integers(0, nb, size=(nb, r))
        blocks[np.repeat(np.arange(nb), r), picks.reshape(-1)] = True
        return BlockSparse(blocks, bs)
    stride, local = int(a[0]), int(a[1])
    bs = int(a[2]) if len(a) > 2 else 128
    nb, i, j = _grid(seqlen, bs)
    planes = [((i - j >= 0) & (i - j < local)) | ((j + h) % stride == 0) for h in range(heads)]
    return BlockSparse(np.stack(planes), bs)
