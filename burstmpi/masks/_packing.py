"""Packed documents for ``burstmpi-bench --docs SPEC``, and the padded way peers force.

A SPEC says how documents fill each global length N:

``fixed:LEN``
    documents of LEN tokens (the last one cut to fit);
``lognormal:MEAN``
    lengths drawn from a log-normal distribution of mean MEAN tokens and shape sigma 1
    (the median is MEAN / e^0.5, a few documents are several times MEAN, as in real
    pretraining packs), seeded by ``--seed`` and N, at least 1 token, the last one cut;
``file:PATH``
    one length per line (blank lines and ``#`` comments skipped), used in order and
    repeated until N is full, the last one cut.

``padded_documents`` gives what ring-attention peers make users do instead: pad each
document to a multiple of 2P tokens so it splits into zigzag chunks, and run it as its
own sequence (TransformerEngine's per-sequence padding to 2 x CP, ring-flash-attention's
zigzag divisibility rule).
"""

import numpy as np

__all__ = ["parse_docs", "pack", "padded_documents"]

SIGMA = 1.0


def parse_docs(spec):
    """Check a SPEC (see the module docstring); return (kind, value) or raise ValueError."""
    kind, _, arg = str(spec).partition(":")
    if kind in ("fixed", "lognormal"):
        try:
            value = float(arg) if kind == "lognormal" else int(arg)
        except ValueError:
            value = 0
        if not value >= 1:
            raise ValueError(f"--docs {spec!r}: expected {kind}:N with N >= 1")
        return kind, value
    if kind == "file":
        try:
            with open(arg) as fh:
                lengths = [int(line.split("#")[0]) for line in fh if line.split("#")[0].strip()]
        except (OSError, ValueError) as e:
            raise ValueError(f"--docs {spec!r}: expected a file of document lengths, one per line ({e})") from None
        if not lengths or min(lengths) < 0 or max(lengths) == 0:
            raise ValueError(f"--docs {spec!r}: expected non-negative lengths, not all 0")
        return kind, lengths
    raise ValueError(f"--docs {spec!r}: expected fixed:LEN, lognormal:MEAN or file:PATH")


def pack(spec, seqlen, seed=0):
    """``cu_seqlens`` (int64 offsets 0..seqlen) of documents packed into ``seqlen`` tokens."""
    kind, value = parse_docs(spec) if isinstance(spec, str) else spec
    if kind == "fixed":
        lengths = np.full(-(-seqlen // value), value, dtype=np.int64)
    elif kind == "lognormal":
        rng = np.random.default_rng([seed, seqlen])
        mu = np.log(value) - SIGMA ** 2 / 2  # so that the mean is `value`
        lengths, total = [], 0
        while total < seqlen:
            n = max(1, int(round(rng.lognormal(mu, SIGMA))))
            lengths.append(n)
            total += n
        lengths = np.array(lengths, dtype=np.int64)
    else:
        reps = -(-seqlen // max(1, sum(value)))
        lengths = np.tile(np.array(value, dtype=np.int64), reps + 1)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    cut = int(np.searchsorted(cu, seqlen))  # first offset at or past the end
    cu = cu[:cut + 1].copy()
    cu[-1] = seqlen
    return cu


def padded_documents(cu_seqlens, nranks):
    """(lengths, padded lengths) of the non-empty documents, padded to multiples of 2P."""
    lengths = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    lengths = lengths[lengths > 0]
    unit = 2 * nranks
    return lengths, -(-lengths // unit) * unit
