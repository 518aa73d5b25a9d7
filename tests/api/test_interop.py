"""Arrays of other frameworks in, the same kind out (DLPack); bfloat16 through torch."""

import numpy as np
import pytest

import burstmpi

from conftest import NRANKS

pytestmark = pytest.mark.extras  # .ci/run's second phase, with the optional packages
torch = pytest.importorskip("torch")


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_torch_in_torch_out(dtype):
    tdt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    N = 16 * NRANKS
    q, k, v, do = (torch.randn(1, N, 4, 32, generator=g).to(tdt) for _ in range(4))
    sh = lambda x: burstmpi.shard(x, layout="zigzag")
    ql, kl, vl, dol = sh(q), sh(k), sh(v), sh(do)
    assert isinstance(ql, torch.Tensor) and ql.dtype == tdt
    out, lse = burstmpi.attention(ql, kl, vl, causal=True, layout="zigzag", return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == tdt and out.shape == ql.shape
    assert isinstance(lse, torch.Tensor) and lse.dtype == torch.float32
    dq, dk, dv = burstmpi.attention_backward(dol, ql, kl, vl, out, lse, causal=True, layout="zigzag")
    assert all(isinstance(t, torch.Tensor) and t.dtype == tdt for t in (dq, dk, dv))

    # Against autograd through torch's own attention, and against float64.
    qg, kg, vg = (x.detach().double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
    o.backward(do.double().transpose(1, 2))
    un = lambda x: burstmpi.unshard(x, layout="zigzag").float().numpy()
    np.testing.assert_allclose(un(out), o.detach().transpose(1, 2).numpy(),
                               atol={"float32": 1e-5}.get(dtype, 3e-2))
    for ours, t in zip((dq, dk, dv), (qg, kg, vg)):
        np.testing.assert_allclose(un(ours), t.grad.transpose(1, 2).numpy(),
                                   atol={"float32": 1e-5}.get(dtype, 6e-2))


def test_torch_requires_grad_and_noncontiguous_inputs():
    x = torch.randn(1, 4, 8 * NRANKS, 16, dtype=torch.float64)
    q = burstmpi.shard(x.transpose(1, 2).requires_grad_(), axis=1)  # a non-contiguous view
    out = burstmpi.attention(q, q, q)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    assert out.is_contiguous()
