"""Every ordering point of the GPU path is needed: taken out, a test fails (item 4 of
issue 53).

Each case of ``POINTS`` takes one line out of burstmpi (``mutation.without``: a
``wait_event``, an event's ``record``, a ``transport.wait`` of the ring's channels, the
all-to-all's, the decode's allgather's, a host synchronisation, the wait of a call on a new
stream) and runs the calls that go through it on the asynchronous fake GPU
(tests/gpu/fake_device.py, ``late``: queued transfers run only when something needs them)
with the stream sanitizer, over NCCL, or over the MPI transports for the channels' own
waits (on NCCL every request of a group shares one event, and a later event on the same
stream covers the earlier ones). The case passes when every rank agrees that the run
failed: a race the sanitizer found, or a value off float64 by flash-attn's rule; with
nothing taken out every scenario passes (``test_every_scenario_passes_as_is``).

Points no test can fail, because another always covers them, are in ``COVERED`` with what
covers them (and, where the cover can go too, the proof that the two together fail);
``test_every_ordering_point_is_listed`` checks that the two lists name every ordering
point in burstmpi/ (the lines that call ``wait_event``, ``record``, ``.wait(`` of a
transport, ``synchronize`` or an event's ``done``). The runs need 2+ ranks (one rank
transfers nothing) and g++ for the emulated kernels; the scan runs once, at 1 rank.
"""

import re
from pathlib import Path

import numpy as np
import pytest

import burstmpi
import fake_cupy as fake
import kernel_harness as kh
from burstmpi import reference as ref
from conftest import COMM, NRANKS, RANK, REPORTS, check_close
from mutation import without
from test_stream_switch import plan_on_two_streams

emulated = pytest.mark.skipif(not kh.available(), reason="no C++ compiler (g++) for the CUDA emulator")
ranks = pytest.mark.skipif(NRANKS < 2, reason="one rank transfers nothing (run under mpiexec)")

D = 32
ROOT = Path(burstmpi.__file__).resolve().parent


def _ring(xp, mode, calls=2, Z=4, Zkv=2, layout="zigzag", **opts):
    """``calls`` forward and backward calls (causal, zigzag by default) checked against float64."""
    N = 16 * NRANKS + 3
    q, k, v, do = ref.random_problem(1, N, Z, Zkv, D, dtype=np.float32, seed=5)
    sh = lambda x: xp.asarray(burstmpi.shard(x, layout=layout))
    un = lambda x: burstmpi.unshard(x.get(), layout=layout)
    plan = burstmpi.BurstAttention(layout=layout, causal=True, bwd_comm=mode, **opts)
    assert plan is not None
    exact, plain = ref.forward(q, k, v, causal=True), ref.forward(q, k, v, causal=True, precision="plain")
    gexact = ref.backward(do, q, k, v, causal=True)
    gplain = ref.backward(do, q, k, v, causal=True, precision="plain")
    ql, kl, vl, dol = sh(q), sh(k), sh(v), sh(do)
    for _ in range(calls):
        out, lse = plan.forward(ql, kl, vl)
        grads = plan.backward(dol, ql, kl, vl, out, lse)
        check_close("mutant out", un(out), exact[0], plain[0], "float32", record=False)
        for name, g, e, p in zip(("dq", "dk", "dv"), grads, gexact, gplain):
            check_close(f"mutant {name}", un(g), e, p, "float32", record=False)
    want = {"mpi": "mpi" if opts.get("cuda_aware_mpi") else "mpi-staged"}.get(opts.get("transport"), "nccl")
    assert plan.transport.name == want


def _decode(xp, transport="nccl", **opts):
    """A cache on the fake GPU, two decode calls (the allgather's), checked against float64."""
    S, T = 4 * NRANKS + 1, 2
    total = S + 2 * T
    q, k, v, _ = ref.random_problem(1, total, 4, 2, D, dtype=np.float32, seed=6)
    cache = burstmpi.KVCache(capacity=total, batch=1, kv_heads=2, head_dim=D, dtype=np.float32,
                             transport="auto" if transport == "nccl" else transport, **opts)
    sh = lambda x: xp.asarray(burstmpi.shard(x[:, :S], layout="zigzag"))
    cache.prefill(sh(q), sh(k), sh(v), layout="zigzag")
    o64, _ = ref.forward(q, k, v, causal=True)
    op, _ = ref.forward(q, k, v, causal=True, precision="plain")
    for t in range(2):
        rows = slice(S + t * T, S + (t + 1) * T)
        out = cache.decode(*[xp.asarray(x[:, rows]) for x in (q, k, v)])
        check_close("mutant decode", out.get(), o64[:, rows], op[:, rows], "float32", record=False)
    want = "nccl" if transport == "nccl" else "mpi" if opts.get("cuda_aware_mpi") else "mpi-staged"
    assert cache.runtime.transport.name == want


SCENARIOS = {
    "ring burst": lambda xp: _ring(xp, "burst"),
    "ring ring": lambda xp: _ring(xp, "ring"),
    "head parallel": lambda xp: _ring(xp, "burst", calls=1, Z=2 * NRANKS, Zkv=NRANKS, head_parallel=NRANKS),
    # Contiguous shards re-sharded to zigzag and back (the causal balancing's all-to-alls).
    "balanced": lambda xp: _ring(xp, "ring", calls=1, layout="contiguous", balance="zigzag"),
    "decode": _decode,
    "two streams": lambda xp: plan_on_two_streams(xp, record=False),
    "staged MPI ring": lambda xp: _ring(xp, "burst", transport="mpi"),
    "staged MPI decode": lambda xp: _decode(xp, "mpi"),
    "CUDA-aware MPI ring": lambda xp: _ring(xp, "burst", transport="mpi", cuda_aware_mpi=True),
    "CUDA-aware MPI decode": lambda xp: _decode(xp, "mpi", cuda_aware_mpi=True),
    "staged MPI ring ring": lambda xp: _ring(xp, "ring", transport="mpi"),
    "CUDA-aware MPI ring ring": lambda xp: _ring(xp, "ring", transport="mpi", cuda_aware_mpi=True),
    # A rank a node: from 4 ranks on, a home partial's two send buffers come round again.
    "CUDA-aware MPI two-level ring": lambda xp: _ring(xp, "ring", topology="two-level", ranks_per_node=1,
                                                      transport="mpi", cuda_aware_mpi=True),
}

NO_EVENT = "{} = self._cupy.cuda.Event()"  # an event recorded nowhere: complete, so a wait on it waits for nothing

# (module, function, the line taken out, what stands in for it, the scenarios through it)
POINTS = {
    "comm stream waits for the kernels before a group's transfers":
        ("_transport.nccl", "NCCLTransport.group", "self.stream.wait_event(compute.record())", "pass", ["ring burst"]),
    "a group's transfers record their event":
        ("_transport.nccl", "NCCLTransport.group", "done = self.stream.record()", NO_EVENT.format("done"), ["ring burst"]),
    "compute stream waits for a group's transfers":
        ("_transport.nccl", "NCCLTransport.wait", "compute.wait_event(r.event)", "pass", ["ring burst"]),
    "comm stream waits for the kernels before the allgather":
        ("_transport.nccl", "NCCLTransport.allgather", "self.stream.wait_event(compute.record())", "pass", ["decode"]),
    "the allgather records its event":
        ("_transport.nccl", "NCCLTransport.allgather", "self._last = self.stream.record()", NO_EVENT.format("self._last"), ["decode"]),
    "a packet is read only after it arrived (Channel.wait)":
        ("_transport.comm", "Channel.wait", "self.transport.wait(reqs, peers)", "pass", ["ring burst"]),
    "a gradient partial is read only after it arrived (PartialChannel.received)":
        ("_transport.comm", "PartialChannel.received", 'self.transport.wait([req], [("receive a gradient partial from", '
                            'self._sources.pop(home))])', "self._sources.pop(home)", ["ring ring"]),
    # The channels' waits on their own requests: on NCCL each is covered (every request of
    # a group shares one event, and a later event on the same comm stream covers the earlier
    # ones: the next Channel.wait or PartialChannel.received comes first), so they fail a
    # test over the MPI transports, whose requests complete one by one. Their buffers come
    # round again within a phase from 4 ranks on, the next phase's from 3 (the 6th field:
    # the fewest ranks that show it).
    "a partial's send buffer is refilled only after its send (PartialChannel.send_buffer)":
        ("_transport.comm", "PartialChannel.send_buffer", 'self.transport.wait([self._send_reqs[i]], [("send a '
         'gradient partial to", self._dests[i])])', "pass", ["CUDA-aware MPI ring ring", "staged MPI ring ring"], 4),
    "a phase's partial sends end before the next phase refills them (PartialChannel.drain)":
        ("_transport.comm", "PartialChannel.drain", "self.transport.wait([r for r, _ in sent], [p for _, p in "
         "sent])", "pass", ["CUDA-aware MPI ring ring", "staged MPI ring ring"], 3),
    "two-level: a home partial's send buffer is refilled only after its send (_Home.buffer)":
        ("_ring.twolevel_backward", "_Home.buffer", "self.t.wait([self.sreq[i]])", "pass",
         ["CUDA-aware MPI two-level ring"], 4),
    "two-level: a home partial is read only after it arrived (_Home.received)":
        ("_ring.twolevel_backward", "_Home.received", "self.t.wait([req])", "pass", ["CUDA-aware MPI two-level ring"]),
    "two-level: a phase's home sends end before the next phase refills them (_Home.drain)":
        ("_ring.twolevel_backward", "_Home.drain", "self.t.wait(reqs)", "pass", ["CUDA-aware MPI two-level ring"]),
    "a call on another stream than the last waits for the last's (CupyBackend.follow)":
        ("_backends.cupy_backend", "CupyBackend.follow", "cur.wait_event(prev.record())", "pass", ["two streams"]),
    "the all-to-alls' shares are read only after they arrived (head parallelism, balancing)":
        ("_transport.alltoall", "AllToAll._point_to_point", "t.wait(reqs, peers)", "pass",
         ["head parallel", "balanced"]),
    # Host synchronisations of MPI on device buffers: the host, through MPI, reads and writes
    # memory a stream writes and reads.
    "CUDA-aware MPI: a send reads the packet only after the kernels wrote it":
        ("_transport.mpi", "DeviceMPITransport.isend", "self._synchronize()", "pass", ["CUDA-aware MPI ring"]),
    "CUDA-aware MPI: the allgather reads the partials only after the kernels wrote them":
        ("_transport.mpi", "DeviceMPITransport.allgather", "self._synchronize()", "pass", ["CUDA-aware MPI decode"]),
}

# Points another one always covers, so that taking one out alone fails nothing: where it is
# (module, function, line, stand-in), the scenario through it, why it is covered, and the
# lines that cover it where those can go too: taken out alone they fail nothing either, and
# with the point they fail the scenario (the point is needed once its cover is gone).
COVERED = {
    "NCCLTransport.allgather: compute.wait_event(self._last)": dict(
        at=("_transport.nccl", "NCCLTransport.allgather", "compute.wait_event(self._last)", "pass"),
        scenario="decode",
        why="the decode waits for the allgather on the host (NCCLTransport.finish) before it reads the headers, "
            "and every later operation is queued after that wait",
        cover=[("_transport.nccl", "NCCLTransport.finish", "while not self._last.done:  # an event query: it "
                "never blocks, so the loop keeps the deadline", "while False:")],),
    "NCCLTransport.finish: the phase's host wait": dict(
        at=("_transport.nccl", "NCCLTransport.finish", "while not self._last.done:  # an event query: it never "
            "blocks, so the loop keeps the deadline", "while False:"),
        scenario="decode",
        why="it orders nothing the stream waits do not: it is the deadline and NCCL's error check "
            "(test_nccl_deadline.py fails without it: the job hangs instead of ending)",
        cover=[("_transport.nccl", "NCCLTransport.allgather", "compute.wait_event(self._last)", "pass")],),
    "staged MPI: a host copy is refilled only after the copy to the device read it": dict(
        at=("_runtime", "Runtime._gpu_transport", "transfers.synchronize(stream())  # host buffer free for the "
            "next receive", "pass"),
        scenario="staged MPI ring",
        why="the next transfer's copy to the host waits for the stream first (its synchronize, and CuPy's "
            "blocking get), before MPI refills a host copy",
        cover=[],),
    "staged MPI: the host waits for the kernels before copying a packet out": dict(
        at=("_runtime", "Runtime._gpu_transport", "transfers.synchronize(stream())  # the producing kernels are "
            "done", "pass"),
        scenario="staged MPI ring",
        why="the copy to the host (get) runs on the same stream after the kernels, and the host waits for it",
        cover=[],),
    "links.py: a link's timing messages": dict(
        at=("_transport.links", "_ring_seconds", 'transport.wait(reqs, [("send a link\'s timing message to", dest), '
            '("receive one from", source)])', "pass"),
        scenario=None,
        why="the timing's bytes are never read, and NCCLTransport.finish right after waits on the host for the "
            "same event",
        cover=[],),
}

MESSAGES = []
COVERED_MESSAGES = []


@pytest.fixture
def gpu(monkeypatch):
    return fake.emulated(monkeypatch, COMM, [("float32", D, D)], "late")


def _outcome(xp, scenario):
    """What went wrong on this rank: the sanitizer's first race, else the first wrong
    value, else None."""
    try:
        SCENARIOS[scenario](xp)
        wrong = None
    except AssertionError as e:
        wrong = f"failed: {str(e).splitlines()[0]}"  # a value off float64, mostly
    except Exception as e:  # garbage read as a header, say: every rank raises alike
        wrong = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    races = fake.DEVICE.sanitizer.races
    first = races[0] if races else wrong
    fake.DEVICE.sanitizer.reset()
    return first


@emulated
@ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_scenario_passes_as_is(gpu, scenario):
    """Nothing taken out: each scenario passes on every rank (so what fails below, fails
    for the line taken out)."""
    got = COMM.allgather(_outcome(gpu, scenario))
    assert not any(got), f"{scenario}: {next(f for f in got if f)}"


@emulated
@ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", list(POINTS))
def test_each_ordering_point_is_needed(gpu, monkeypatch, point):
    module, function, line, stand_in, scenarios, *fewest = POINTS[point]
    if NRANKS < (fewest or [2])[0]:
        pytest.skip(f"its buffers come round again from {fewest[0]} ranks on")
    mod = __import__(f"burstmpi.{module}", fromlist=["_"])
    lineno = without(monkeypatch, mod, function, line, stand_in)
    for scenario in scenarios:
        failed = COMM.allgather(_outcome(gpu, scenario))
        assert any(failed), f"{point}: {module}:{lineno} taken out, {scenario!r} still passes on every rank"
        if RANK == 0:
            if not MESSAGES:
                REPORTS.append((f"ordering points taken out, at {NRANKS} ranks (what failed first)", MESSAGES))
            MESSAGES.append(f"    {point} ({module.replace('.', '/')[1:]}.py:{lineno}), {scenario}: "
                            f"{next(f for f in failed if f)[:300]}")


def _report(title, lines, line):
    if RANK == 0:
        if not lines:
            REPORTS.append((title, lines))
        lines.append(line)


@emulated
@ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("point", [p for p in COVERED if COVERED[p]["scenario"]])
def test_each_covered_point_is_covered_and_needed_without_its_cover(gpu, monkeypatch, point):
    """Taken out alone, a covered point fails nothing (its cover holds, as ``why`` says;
    one that starts to fail alone moves to ``POINTS``). Where its cover can go too: the
    cover taken out alone fails nothing, and the two together fail the scenario."""
    case = COVERED[point]
    runs = [("the point", [case["at"]], False)]
    if case["cover"]:
        runs += [("its cover", case["cover"], False), ("the point and its cover", [case["at"]] + case["cover"], True)]
    for what, lines, fails in runs:
        with monkeypatch.context() as m:
            for mod, fn, ln, st in lines:
                without(m, __import__(f"burstmpi.{mod}", fromlist=["_"]), fn, ln, st)
            got = COMM.allgather(_outcome(gpu, case["scenario"]))
        first = next((f for f in got if f), None)
        if fails:
            assert first, f"{point}: {what} taken out, {case['scenario']!r} still passes on every rank"
            _report(f"covered ordering points, at {NRANKS} ranks (taken out with their cover: what failed first)",
                    COVERED_MESSAGES, f"    {point}: {first[:300]}")
        else:
            assert first is None, f"{point}: {what} taken out, {case['scenario']!r} failed: {first}"


@pytest.mark.skipif(NRANKS > 1, reason="reads the source: once, not per rank")
def test_every_ordering_point_is_listed():
    """Each line of burstmpi/ that orders GPU work (a ``wait_event``, an event ``record``, a
    transport's ``wait``, a ``synchronize``, an event's ``done``) is in ``POINTS`` or
    ``COVERED``; the benches' own timing is left out."""
    from collections import Counter

    listed = Counter((m, ln.split("  #")[0].strip()) for m, _, ln, *_ in POINTS.values())
    listed += Counter((c["at"][0], c["at"][2].split("  #")[0].strip()) for c in COVERED.values())
    pattern = re.compile(r"wait_event\(|\.record\(\)|transport\.wait\(|\bt\.wait\(|\._synchronize\(\)|"
                         r"synchronize\(stream\(\)\)|\._last\.done")
    found = Counter()
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "bench" or rel.name == "_transfers.py" or rel.name == "shm.py":
            continue  # the benches' own timing; the counters; shm moves host memory only
        module = ".".join(rel.with_suffix("").parts)
        for text in path.read_text().splitlines():
            code = text.split("  #")[0].strip()
            if pattern.search(code) and not code.startswith(("def ", "return ", '"', "#")):
                found[(module, code)] += 1
    missing, stale = sorted((found - listed).elements()), sorted((listed - found).elements())
    assert not stale, f"POINTS or COVERED name lines burstmpi no longer has: {stale}"
    assert not missing, f"ordering points in neither POINTS nor COVERED: {missing}"
