"""What the torch and JAX adapter tests share: the problems, masks and the dense reference
of a projection -> attention -> loss step, in NumPy float64."""

import numpy as np

import burstmpi
from burstmpi import reference as ref
from burstmpi.masks import Causal, Chunked, PerHead, Sinks, Window

# (name, causal, window, documents?, burstmpi.masks mask) - documents are packed with a causal mask.
MASKS = [("causal", True, None, False, None), ("window", False, (4, 2), False, None), ("docs", True, None, True, None),
         ("sinks-chunks-per-head", True, None, True,
          PerHead([Sinks(2) | Window(3, 0), Chunked(4), Causal(), Sinks(1) | Chunked(3)]))]
LAYOUTS = ["contiguous", "zigzag", "striped"]
B, E, H, HKV, D = 1, 12, 4, 2, 8  # batch, embedding, query heads, kv heads, head dim


def step_problem(N, seed=0):
    """The global tokens x (B, N, E), a projection W (E, (H + 2 HKV) D) and a target, in float64."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((B, N, E))
    W = rng.standard_normal((E, (H + 2 * HKV) * D)) / np.sqrt(E)
    target = rng.standard_normal((B, N, H, D))
    return x, W, target


def docs_for(N):
    return np.array([0, 1, N // 3, N // 3, N // 2 + 1, N])


def split(qkv):
    """(B, N, (H + 2 HKV) D) -> q (B, N, H, D), k, v (B, N, HKV, D)."""
    b, n, _ = qkv.shape
    q = qkv[..., :H * D].reshape(b, n, H, D)
    k = qkv[..., H * D:(H + HKV) * D].reshape(b, n, HKV, D)
    v = qkv[..., (H + HKV) * D:].reshape(b, n, HKV, D)
    return q, k, v


def dense_weight_grad(x, W, target, causal, window, cu, mask=None):
    """d/dW of sum(attention(x W) * target) on the whole sequence, from the float64 reference
    (chain rule through the projection)."""
    q, k, v = split(x @ W)
    opts = dict(causal=causal, window=window, cu_seqlens=cu, mask=mask)
    dq, dk, dv = ref.backward(target, q, k, v, **opts)
    dqkv = np.concatenate([g.reshape(g.shape[0], g.shape[1], -1) for g in (dq, dk, dv)], axis=-1)
    return np.einsum("bne,bnf->ef", x, dqkv)


def local_rows(N, layout, cu):
    return burstmpi.shard_indices(N, layout=layout, cu_seqlens=cu)
