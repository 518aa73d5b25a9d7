"""A training step through burstmpi's ring in PyTorch, on this rank's part of the sequence.

    mpiexec -n 2 python -m mpi4py examples/torch_train_step.py

Embedding -> Q/K/V projections -> burstmpi.torch.attention (causal, zigzag) -> output
projection -> next-token loss -> AdamW. Every rank holds the same weights and its own
tokens; the weight gradients are summed over ranks (an allreduce, as data parallelism does),
so the update is the same everywhere. Prints the loss of each step on rank 0, and whether
the weights after the last step have the same bits on every rank.
"""

import numpy as np
import torch
from mpi4py import MPI

import burstmpi
import burstmpi.torch as bt

comm = MPI.COMM_WORLD
torch.manual_seed(0)  # the same weights on every rank
vocab, E, H, D, N = 64, 32, 4, 8, 96  # N: the global sequence length
tokens = np.random.default_rng(0).integers(0, vocab, N + 1)  # the same text on every rank
rows = burstmpi.shard_indices(N, layout="zigzag")  # this rank's positions
x_ids, y_ids = torch.tensor(tokens[:-1][rows]), torch.tensor(tokens[1:][rows])

embed = torch.nn.Embedding(vocab, E)
qkv = torch.nn.Linear(E, 3 * H * D, bias=False)
proj = torch.nn.Linear(H * D, vocab)
params = [*embed.parameters(), *qkv.parameters(), *proj.parameters()]
opt = torch.optim.AdamW(params, lr=3e-3)

for step in range(5):
    h = embed(x_ids)[None]                                   # (1, C, E): this rank's tokens
    q, k, v = qkv(h).view(1, len(rows), 3, H, D).unbind(2)
    a = bt.attention(q, k, v, causal=True, layout="zigzag")  # exact attention over all ranks
    logits = proj(a.reshape(1, len(rows), H * D))
    loss = torch.nn.functional.cross_entropy(logits[0], y_ids, reduction="sum")
    opt.zero_grad()
    loss.backward()                                          # collective: burstmpi's backward
    for p in params:                                         # data-parallel gradient sum
        g = p.grad.numpy()
        comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
    opt.step()
    total = comm.allreduce(loss.item(), op=MPI.SUM) / N
    if comm.Get_rank() == 0:
        print(f"torch step {step}: loss {total:.4f} ({comm.Get_size()} ranks, {N} tokens)", flush=True)
same = len(set(comm.allgather(b"".join(p.detach().numpy().tobytes() for p in params)))) == 1
if comm.Get_rank() == 0:
    print(f"torch: the weights after 5 steps, the same bits on every rank: {same}")
