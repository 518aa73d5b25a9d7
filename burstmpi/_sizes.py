"""Sizes with binary suffixes on the command lines (``burstmpi-bench``, ``python -m
burstmpi.model``): '4K' -> 4096, '1M' -> 1048576; click callbacks that name what they
expected."""

import click

__all__ = ["suffixed", "parse_size", "parse_bytes"]


def suffixed(value, number=int):
    """'4K' -> 4096, '1M' -> 1048576, '1000' -> 1000 (binary K/M/G/T); ``number`` reads the
    digits (``float`` also takes '1.5G'). Raises ValueError."""
    text = str(value).strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(text[-1:], 1)
    return int(number(text[:-1] if mult > 1 else text) * mult)


def parse_size(ctx, param, value):
    """A length: '4K' -> 4096, '1M' -> 1048576, '1000' -> 1000."""
    if isinstance(value, int):
        return value
    try:
        n = suffixed(value)
    except ValueError:
        raise click.BadParameter(f"expected a length like 4096, 4K or 1M, got {value!r}")
    if n < 1:
        raise click.BadParameter(f"expected a positive length, got {value!r}")
    return n


def parse_bytes(ctx, param, value):
    """Bytes: '16G' -> 17179869184 (K/M/G/T suffixes, '1.5G' too), or None."""
    if value is None:
        return None
    try:
        n = suffixed(value, float)
    except ValueError:
        n = 0
    if n < 1:
        raise click.BadParameter(f"expected a positive number of bytes like 16G, 512M or 1000000, got {value!r}")
    return n
