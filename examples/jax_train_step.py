"""A training step through burstmpi's ring in JAX, jitted, on this rank's part of the sequence.

    mpiexec -n 2 python -m mpi4py examples/jax_train_step.py

Embedding -> Q/K/V projections -> burstmpi.jax.attention (causal, zigzag) -> output
projection -> next-token loss -> SGD with momentum, the whole step under ``jax.jit`` with
``jax.value_and_grad``: burstmpi's forward and backward run inside the compiled step on
XLA's own buffers, each call carrying JAX's ordering token, so in program order on every
rank. Every rank holds the same weights and its own tokens; the
gradients are summed over ranks with MPI, so the update is the same everywhere. Prints the
loss of each step on rank 0, and whether the weights after the last step have the same bits
on every rank.
"""

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

import burstmpi
import burstmpi.jax as bj

comm = MPI.COMM_WORLD
vocab, E, H, D, N = 64, 32, 4, 8, 96  # N: the global sequence length
tokens = np.random.default_rng(0).integers(0, vocab, N + 1)  # the same text on every rank
rows = burstmpi.shard_indices(N, layout="zigzag")  # this rank's positions
x_ids, y_ids = jnp.asarray(tokens[:-1][rows]), jnp.asarray(tokens[1:][rows])

keys = jax.random.split(jax.random.PRNGKey(0), 3)  # the same weights on every rank
params = {"embed": jax.random.normal(keys[0], (vocab, E)) * 0.1,
          "qkv": jax.random.normal(keys[1], (E, 3 * H * D)) / np.sqrt(E),
          "proj": jax.random.normal(keys[2], (H * D, vocab)) / np.sqrt(H * D)}


def loss_fn(p, x_ids, y_ids):
    h = p["embed"][x_ids][None]                              # (1, C, E): this rank's tokens
    q, k, v = (h @ p["qkv"]).reshape(1, -1, 3, H, D).transpose(2, 0, 1, 3, 4)
    a = bj.attention(q, k, v, causal=True, layout="zigzag")  # exact attention over all ranks
    logits = a.reshape(1, -1, H * D) @ p["proj"]
    logp = jax.nn.log_softmax(logits[0])
    return -jnp.take_along_axis(logp, y_ids[:, None], axis=1).sum()


step_grad = jax.jit(jax.value_and_grad(loss_fn))
velocity = jax.tree_util.tree_map(jnp.zeros_like, params)
for step in range(5):
    loss, grads = step_grad(params, x_ids, y_ids)            # collective: forward and backward
    grads = jax.tree_util.tree_map(                          # data-parallel gradient sum
        lambda g: jnp.asarray(comm.allreduce(np.asarray(g), op=MPI.SUM)), grads)
    velocity = jax.tree_util.tree_map(lambda m, g: 0.9 * m + g, velocity, grads)
    params = jax.tree_util.tree_map(lambda w, m: w - 1e-3 * m, params, velocity)
    total = comm.allreduce(float(loss), op=MPI.SUM) / N
    if comm.Get_rank() == 0:
        print(f"jax step {step}: loss {total:.4f} ({comm.Get_size()} ranks, {N} tokens)", flush=True)
leaves = jax.tree_util.tree_leaves(params)
same = len(set(comm.allgather(b"".join(np.asarray(w).tobytes() for w in leaves)))) == 1
if comm.Get_rank() == 0:
    print(f"jax: the weights after 5 steps, the same bits on every rank: {same}")
