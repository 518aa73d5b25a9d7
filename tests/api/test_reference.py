"""The oracle itself: the sampled-row references the bench uses agree with dense float64."""

import numpy as np
import pytest

from burstmpi import reference as ref


@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (3, 5)), (True, (6, -1))])
def test_sampled_rows_match_dense(causal, window, monkeypatch):
    monkeypatch.setattr(ref, "CHUNK", 7)  # several blocks, the last one ragged
    q, k, v, do = ref.random_problem(2, 40, 4, 2, 16, dv=8, dtype=np.float64, seed=3)
    opts = dict(causal=causal, window=window)
    o, lse = ref.forward(q, k, v, **opts)
    dq, dk, dv = ref.backward(do, q, k, v, **opts)
    rows = np.array([0, 5, 17, 39])
    o2, lse2, dq2 = ref.rows(q[:, rows], k, v, do[:, rows], rows, **opts)
    delta = (do * o).sum(-1).transpose(0, 2, 1)
    dk2, dv2 = ref.key_rows(q, k[:, rows], v[:, rows], do, lse, delta, rows, **opts)
    for got, want in [(o2, o[:, rows]), (lse2, lse[:, :, rows]), (dq2, dq[:, rows]),
                      (dk2, dk[:, rows]), (dv2, dv[:, rows])]:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-13)


def test_key_rows_of_no_rows_and_no_queries():
    """No key rows (a rank that holds none) and no queries give empty gradients of the right
    shape, not a reshape error."""
    q, k, v, do = ref.random_problem(1, 12, 4, 2, 8, dv=6, dtype=np.float64, seed=5)
    lse, delta = np.zeros((1, 4, 12)), np.zeros((1, 4, 12))
    dk, dv = ref.key_rows(q, k[:, :0], v[:, :0], do, lse, delta, np.zeros(0, np.int64), causal=True)
    assert dk.shape == (1, 0, 2, 8) and dv.shape == (1, 0, 2, 6)
    dk, dv = ref.key_rows(q[:, :0], k[:, :3], v[:, :3], do[:, :0], lse[:, :, :0], delta[:, :, :0], np.arange(3))
    assert dk.shape == (1, 3, 2, 8) and dv.shape == (1, 3, 2, 6) and not dk.any() and not dv.any()


def test_plain_precision_rounds_like_the_dtype():
    q, k, v, _ = ref.random_problem(1, 32, 2, 2, 16, dtype=np.float16, seed=1)
    exact, _ = ref.forward(q, k, v)
    plain, _ = ref.forward(q, k, v, precision="plain")
    err = np.abs(plain - exact).max()
    assert 1e-5 < err < 1e-2, "the plain float16 reference should carry float16-sized error"
    assert np.array_equal(plain.astype(np.float16).astype(np.float64), plain)
