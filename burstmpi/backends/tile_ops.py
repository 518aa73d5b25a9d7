"""The elementwise work of a NumPy tile, shared by the ring's forward and the decode.

Kept apart from the tile loops so that a compiled version (one fused sweep instead of
NumPy's several passes) can replace it in one place.
"""

import numpy as np

__all__ = ["online_update"]


def online_update(s, vt, acc, m, l):
    """Merge one tile of scores ``s`` (rows x keys, masked entries -inf; overwritten) and
    its values ``vt`` into the unnormalised running state ``acc``, ``m``, ``l`` (in place),
    as FlashAttention-2 merges one K tile into the next."""
    m_new = np.maximum(m, s.max(axis=-1))
    # A row with no visible key so far keeps m = -inf; shift it by 0 instead,
    # so exp() sees -inf - 0 = -inf (giving 0) rather than -inf - -inf = NaN.
    m_safe = np.where(m_new == -np.inf, 0, m_new)
    alpha = np.exp(m - m_safe)
    s -= m_safe[..., None]
    np.exp(s, out=s)
    l *= alpha
    l += s.sum(axis=-1)
    acc *= alpha[..., None]
    acc += s @ vt
    m[...] = m_new
