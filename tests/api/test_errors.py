"""Bad input raises a clear error naming the argument, on every rank, without hanging."""

import numpy as np
import pytest

import burstmpi
from burstmpi import reference as ref
from burstmpi._backends import CpuBackend

from conftest import NRANKS, RANK, check_fully_masked_rows, needs_ranks

pytestmark = pytest.mark.timeout(60)


def local_problem(C=8, Z=4, Zkv=2, d=16, dtype=np.float32):
    q, k, v, do = ref.random_problem(1, C, Z, Zkv, d, dtype=dtype, seed=RANK)
    return q, k, v, do


@pytest.mark.parametrize("mutate,exc,words", [
    (lambda q, k, v: (q.astype(np.int32), k, v), TypeError, ["q.dtype", "int32"]),
    (lambda q, k, v: (q, k.astype(np.float64), v), TypeError, ["k.dtype", "float32", "float64"]),
    (lambda q, k, v: (q[0], k, v), ValueError, ["q:", "4 dims", "(8, 4, 16)"]),
    (lambda q, k, v: (q, k[:, :4], v), ValueError, ["k.shape", "(1, 4, 2, 16)"]),
    (lambda q, k, v: (q, k, v[:, :, :1]), ValueError, ["v.shape"]),
    (lambda q, k, v: (q[:, :, :3], k, v), ValueError, ["k.shape[2]", "3 query heads"]),
    (lambda q, k, v: (q, k, "not an array"), TypeError, ["v:"]),
])
def test_bad_forward_arguments(mutate, exc, words):
    q, k, v, _ = local_problem()
    with pytest.raises(exc) as info:
        burstmpi.attention(*mutate(q, k, v))
    for w in words:
        assert w in str(info.value), f"{w!r} missing from: {info.value}"
    assert "rank 0" in str(info.value)  # every rank failed; the message names the first


@pytest.mark.parametrize("kw,words", [
    (dict(layout="diagonal"), ["layout", "diagonal", "zigzag"]),
    (dict(window=(3,)), ["window", "(3,)"]),
    (dict(window=(-2, 0)), ["window", "-2"]),
    (dict(causal=True, window=(4, 2)), ["right bound", "(4, 2)"]),
    (dict(softmax_scale=float("nan")), ["softmax_scale", "nan"]),
    (dict(softmax_scale="0.5"), ["softmax_scale", "'0.5'", "str"]),
    (dict(softmax_scale=True), ["softmax_scale", "True", "bool"]),
    (dict(causal="yes"), ["causal", "'yes'"]),
])
def test_bad_options(kw, words):
    q, k, v, _ = local_problem()
    with pytest.raises((ValueError, TypeError)) as info:
        burstmpi.attention(q, k, v, **kw)
    for w in words:
        assert w in str(info.value), f"{w!r} missing from: {info.value}"


def test_bad_backward_arguments():
    q, k, v, do = local_problem()
    out, lse = burstmpi.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match=r"lse.shape.*\(1, 4, 8\)"):
        burstmpi.attention_backward(do, q, k, v, out, lse[:, :2])
    with pytest.raises(ValueError, match="bwd_comm"):
        burstmpi.attention_backward(do, q, k, v, out, lse, bwd_comm="fast")
    with pytest.raises(TypeError, match="dout.dtype"):
        burstmpi.attention_backward(do.astype(np.float64), q, k, v, out, lse)


def test_empty_global_sequence_is_refused():
    q, k, v, _ = local_problem(C=0)
    with pytest.raises(ValueError, match=r"at least 1 token, got 0"):
        burstmpi.attention(q, k, v)
    with pytest.raises(ValueError, match=r"shard: x.shape\[1\]: expected a global length >= 1"):
        burstmpi.shard(np.zeros((1, 0, 2)))
    with pytest.raises(ValueError, match=r"shard_indices: n: expected the global length"):
        burstmpi.shard_indices(0)


@needs_ranks(2)
def test_error_on_one_rank_raises_everywhere():
    q, k, v, _ = local_problem()
    if RANK == 1:
        q = q.astype(np.int16)
    with pytest.raises(TypeError, match=r"rank 1: .*q\.dtype.*int16"):
        burstmpi.attention(q, k, v)


@needs_ranks(2)
def test_ranks_disagreeing_raise_everywhere():
    q, k, v, _ = local_problem()
    with pytest.raises(ValueError, match=r"ranks disagree on causal: rank 0 has False, rank 1 has True"):
        burstmpi.attention(q, k, v, causal=RANK == 1, layout="contiguous")
    C = 8 if RANK == 0 else 6
    q, k, v, _ = local_problem(C=C)
    with pytest.raises(ValueError, match=r"q.shape\[1\]: expected the local lengths .*rank 0 has 8"):
        burstmpi.attention(q, k, v)
    q, k, v, _ = local_problem(Z=4 if RANK == 0 else 2, Zkv=2)
    with pytest.raises(ValueError, match=r"ranks disagree on q.shape"):
        burstmpi.attention(q, k, v)
    q, k, v, _ = local_problem(dtype=np.float32 if RANK else np.float64)
    with pytest.raises(ValueError, match=r"ranks disagree on q.dtype"):
        burstmpi.attention(q, k, v)


@needs_ranks(2)
def test_unshard_mismatch_raises_everywhere():
    with pytest.raises(ValueError, match=r"ranks disagree on x_local.shape"):
        burstmpi.unshard(np.zeros((1, 4, 2 + RANK)))
    with pytest.raises(ValueError, match=r"unshard: x_local.shape\[1\]: expected the local lengths"):
        burstmpi.unshard(np.zeros((1, 4 + 2 * RANK, 2)))


def test_fully_masked_rows_give_zero_and_minus_inf():
    """Queries that see no key (possible inside a block) end with out 0, lse -inf, no NaN."""
    check_fully_masked_rows(CpuBackend(tile_q=4, tile_k=3), np.float32, 8)
