"""burstmpi-bench --torch: PyTorch's scaled_dot_product_attention on the whole problem, timed
on rank 0 side by side with burstmpi's iterations (``burstmpi.bench.attention``)."""

import numpy as np

from .._api import unshard
from .common import cores, guard, idle_barrier, wall

__all__ = ["torch_timer"]


def torch_timer(comm, cfg, local, gpu=False):
    """Torch SDPA on the whole global problem, timed on rank 0 (on its GPU with ``gpu``)
    while the other ranks sleep. Returns ``tick``, which times one forward and one
    forward+backward (collective: the bench calls it between its own timed iterations,
    so both are measured side by side on machines whose speed drifts), and the list of
    (fwd_s, fwdbwd_s) it fills on rank 0. Warmed up here, untimed."""
    with guard(comm, "torch's global problem (unshard)"):
        glob = [unshard(x, layout=cfg["layout"]) for x in local]
    times, rank0 = [], comm.Get_rank() == 0
    if rank0:
        import torch
        import torch.nn.functional as F

        # The other ranks sleep meanwhile: give torch every core this process may use
        # (under mpiexec torch otherwise starts with a single thread). Our own threads and
        # BLAS keep their counts (torch has its own pool).
        torch.set_num_threads(cores())

        def t(x):
            a = x.view(np.int16) if cfg["dtype"] == "bfloat16" else x
            tt = torch.from_numpy(np.ascontiguousarray(a))
            # torch's attention wants (B, heads, N, d); give it a contiguous copy, its fast path.
            tt = (tt.view(torch.bfloat16) if cfg["dtype"] == "bfloat16" else tt).transpose(1, 2).contiguous()
            return tt.cuda() if gpu else tt

        q, k, v, do = (t(x) for x in glob)
        gqa = dict(enable_gqa=True) if cfg["kv_heads"] != cfg["heads"] else {}
        causal = bool(cfg["causal"])

        def fwd():
            with torch.no_grad():
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal, **gqa)

        qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

        def fwdbwd():
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal, **gqa).backward(do)

        sync = torch.cuda.synchronize if gpu else (lambda: None)
        fwd(), fwdbwd()
    del glob
    idle_barrier(comm)

    def tick():
        if rank0:
            times.append((wall(fwd, sync), wall(fwdbwd, sync)))
        idle_barrier(comm)

    return tick, times
