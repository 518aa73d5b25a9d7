"""burstmpi.jax with several devices in one process: what each way of spreading a program
over them gives. Run alone or under mpiexec, with the devices forced, e.g.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python tests/adapters/jax_devices_check.py

Prints one JSON line per case on rank 0: {"case", "path", "refused": the message or None,
"err": the largest error of out (and dq, dk, dv) against float64 burstmpi.reference, or None,
"calls": how many forwards and backwards this rank ran}. test_adapter_devices.py reads them.
"""

import json
import sys

import numpy as np
from mpi4py import MPI

import jax

jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

import burstmpi  # noqa: E402
import burstmpi.jax as bj  # noqa: E402
from burstmpi import reference  # noqa: E402
from burstmpi._plan import BurstAttention  # noqa: E402

COMM = MPI.COMM_WORLD
CALLS = []
for _phase in ("forward", "backward"):
    def _spy(self, *arrays, _run=getattr(BurstAttention, _phase), _name=_phase, **kwargs):
        CALLS.append(_name)
        return _run(self, *arrays, **kwargs)

    setattr(BurstAttention, _phase, _spy)

LAYOUT = "contiguous"
B, H, D = 2, 2, 8  # the batch splits over the devices
N = 6 * COMM.Get_size()
rng = np.random.default_rng(0)
q64, k64, v64, w64 = (rng.standard_normal((B, N, H, D)) for _ in range(4))
o64, _ = reference.forward(q64, k64, v64, causal=True)
grads64 = reference.backward(w64, q64, k64, v64, causal=True)
q, k, v, w = (jnp.asarray(burstmpi.shard(x, layout=LAYOUT)) for x in (q64, k64, v64, w64))
mesh = Mesh(np.array(jax.devices()), ("devices",))
one = Mesh(np.array(jax.devices()[:1]), ("devices",))
sharded = NamedSharding(mesh, P("devices"))


def attend(q, k, v):
    return bj.attention(q, k, v, causal=True, layout=LAYOUT)


def loss(q, k, v):
    return (attend(q, k, v) * w).sum()


def shard_map(fn, on=mesh):
    return jax.shard_map(fn, mesh=on, in_specs=(P("devices"),) * 3, out_specs=P("devices"))


def per_device(x):  # (B, ...) -> (devices, B / devices, ...), for pmap
    return x.reshape((len(jax.devices()), -1) + x.shape[1:])


def cases():
    """name: (the program, its arguments, whether it returns the gradients); new programs at
    each call, as JAX keeps a function's trace and each path must be traced anew."""
    return {
        "jit": (jax.jit(attend), (q, k, v), False),
        "jit grad": (jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v), True),
        "jit on sharded inputs": (jax.jit(attend), [jax.device_put(x, sharded) for x in (q, k, v)], False),
        "jit grad on sharded inputs": (jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                                       [jax.device_put(x, sharded) for x in (q, k, v)], True),
        "shard_map over one device": (jax.jit(shard_map(attend, one)), (q, k, v), False),
        "shard_map": (jax.jit(shard_map(attend)), (q, k, v), False),
        "shard_map eager": (shard_map(attend), (q, k, v), False),
        "shard_map grad": (jax.jit(jax.grad(lambda q, k, v: (shard_map(attend)(q, k, v) * w).sum(), argnums=(0, 1, 2))),
                           (q, k, v), True),
        "pmap": (lambda q, k, v: jax.pmap(attend)(*map(per_device, (q, k, v))).reshape(q.shape), (q, k, v), False),
        # the buffer path's lowering refuses it too, without the trace's check (lowered only)
        "shard_map lowered without the trace's check": (lowered_only(jax.jit(shard_map(attend))), (q, k, v), False),
    }


def lowered_only(program):
    def lower(*args):
        check, bj._check_devices_at_trace = bj._check_devices_at_trace, lambda: None
        try:
            program.lower(*args)
        finally:
            bj._check_devices_at_trace = check
        raise AssertionError("lowered without a refusal")
    return lower


def run(program, args, grads):
    del CALLS[:]
    try:
        result = program(*args)
        jax.block_until_ready(result)
    except Exception as e:  # what the case gives is the point: recorded, then checked by the test
        return {"refused": f"{type(e).__name__}: {e}", "err": None, "calls": len(CALLS)}
    got = result if grads else (result,)
    want = grads64 if grads else (o64,)
    err = max(np.abs(burstmpi.unshard(np.asarray(g), layout=LAYOUT) - x).max() for g, x in zip(got, want))
    return {"refused": None, "err": COMM.allreduce(float(err), op=MPI.MAX), "calls": len(CALLS)}


for path in ([True, False] if bj._BUFFERS else [False]):
    bj._BUFFERS = path
    programs = cases()
    for name in (sys.argv[1:] or programs):
        if name.startswith("shard_map lowered") and not path:
            continue  # the io_callback path lowers as JAX's io_callback: the trace's check is its only one
        program, args, grads = programs[name]
        result = dict(case=name, path="buffers" if path else "io_callback", devices=len(jax.devices()),
                      **run(program, args, grads))
        if COMM.Get_rank() == 0:
            print(json.dumps(result), flush=True)
