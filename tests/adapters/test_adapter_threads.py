"""Which threads the frameworks call burstmpi from, and the adapters at each MPI thread level.

XLA runs burstmpi.jax's callbacks (both paths, eagerly and under jit) on the calling thread
or on threads of its own, as it dispatches; torch runs the CPU backward on the thread that
calls backward(). MPI allows calls from a thread other than the one that initialised it only
at MPI_THREAD_MULTIPLE (mpi4py's default), so below it burstmpi.jax refuses when it traces,
and burstmpi.torch refuses a forward or backward on another thread, before any MPI call.
threads_check.py runs the adapters under mpiexec at each level."""

import json
import threading

import numpy as np
import pytest

import burstmpi
from conftest import NRANKS, REPORTS
from test_mpi import MPIEXEC, mpiexec

pytestmark = pytest.mark.extras
ASK = ('mpi4py.rc.thread_level = "multiple" before `from mpi4py import MPI`, or MPI4PY_RC_THREAD_LEVEL=multiple '
       "in the environment")


@pytest.fixture
def threads_of_calls(monkeypatch):
    """The thread of every call of a plan's forward and backward: (phase, thread name, whether
    it is the thread that initialised MPI)."""
    from mpi4py import MPI

    from burstmpi._plan import BurstAttention

    calls = []
    for phase in ("forward", "backward"):
        def spy(self, *arrays, _run=getattr(BurstAttention, phase), _phase=phase, **kwargs):
            calls.append((_phase, threading.current_thread().name, MPI.Is_thread_main()))
            return _run(self, *arrays, **kwargs)

        monkeypatch.setattr(BurstAttention, phase, spy)
    return calls


def test_which_threads_run_the_callbacks(threads_of_calls, monkeypatch):
    """Measured, not assumed: every call runs on this thread or on a thread that XLA (not
    Python) started, which threading names Dummy-n; torch's CPU backward on this thread."""
    jax = pytest.importorskip("jax")
    torch = pytest.importorskip("torch")
    import jax.numpy as jnp

    import burstmpi.jax as bj
    import burstmpi.torch as bt

    rng = np.random.default_rng(0)
    N = 2048 * NRANKS
    q, k, v = (burstmpi.shard(rng.standard_normal((1, N, 4, 32)).astype(np.float32)) for _ in range(3))
    seen, lines = {}, []
    for path in [True, False] if bj._BUFFERS else [False]:
        monkeypatch.setattr(bj, "_BUFFERS", path)
        for how in ("eager", "jit"):
            def loss(q, k, v):
                h = q
                for _ in range(4):  # work before the call: XLA may dispatch the next program meanwhile
                    h = jnp.tanh(h @ jnp.eye(32, dtype=h.dtype))
                return bj.attention(h, k, v, causal=True, layout="contiguous").sum()

            step = jax.grad(loss, argnums=(0, 1, 2))
            step = jax.jit(step) if how == "jit" else step
            del threads_of_calls[:]
            jax.block_until_ready([step(*map(jnp.asarray, (q, k, v))) for _ in range(3)])  # not waited between
            name = f"jax {'buffers' if path else 'io_callback'} {how}"
            seen[name] = sorted(set(threads_of_calls))
            assert len(threads_of_calls) == 6, (name, threads_of_calls)
    main = threading.current_thread().name
    for name, calls in seen.items():
        for _, thread, is_main in calls:
            assert (thread == main and is_main) or (thread.startswith("Dummy-") and not is_main), (name, calls)
        lines.append(f"  {name:22s} {', '.join(sorted({f'{p} on {t}' for p, t, _ in calls}))}")
    del threads_of_calls[:]
    ts = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    bt.attention(*ts, causal=True, layout="contiguous").sum().backward()
    assert threads_of_calls == [("forward", main, True), ("backward", main, True)], threads_of_calls
    lines.append(f"  {'torch cpu':22s} forward and backward on {main}")
    REPORTS.append((f"threads that ran burstmpi's calls ({NRANKS} rank(s), 3 steps dispatched without waiting)",
                    lines))


LEVELS = ["funneled", "serialized", "multiple"]


@pytest.mark.skipif(NRANKS > 1, reason="spawns its own mpiexec; once is enough")
@pytest.mark.skipif(MPIEXEC is None, reason="mpiexec not found (pip install mpich)")
@pytest.mark.parametrize("level", LEVELS)
def test_adapters_at_each_thread_level(level):
    """funneled and serialized: JAX refused while tracing, torch refused on another thread,
    torch on the main thread exact; multiple: all exact (float64 against burstmpi.reference)."""
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    rc, out, _ = mpiexec(2, ["adapters/threads_check.py"], timeout=300, MPI4PY_RC_THREAD_LEVEL=level)
    assert rc == 0, f"exit {rc}:\n{out[-4000:]}"
    got = {r["case"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    assert sorted(got) == ["jax jit grad", "torch backward on another thread", "torch forward and backward",
                           "torch forward on another thread"], out[-4000:]
    assert all(r["level"] == level for r in got.values()), got
    exact = ["torch forward and backward"] + (list(got) if level == "multiple" else [])
    for case in exact:
        assert got[case]["refused"] is None and got[case]["err"] < 1e-12, got[case]
    if level == "multiple":
        return
    expected = f"MPI thread level: expected MPI_THREAD_MULTIPLE, got MPI_THREAD_{level.upper()}"
    jax_case = got["jax jit grad"]
    assert jax_case["when"] == "trace" and jax_case["err"] is None, jax_case
    assert jax_case["refused"].startswith(f"burstmpi.jax.attention: {expected}: XLA runs the callbacks"), jax_case
    for phase in ("forward", "backward"):
        r = got[f"torch {phase} on another thread"]
        assert r["refused"].startswith(f"burstmpi.torch.attention: {expected}: the {phase} runs on thread 'worker'")
    assert all(ASK in r["refused"] for r in got.values() if r["refused"]), got
