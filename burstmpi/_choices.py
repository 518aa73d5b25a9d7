"""The choices a plan asks the performance model and the ranks' loads for, made alike on
every rank from agreed inputs: which layout the ring runs on (``balance="auto"``,
``burstmpi._ring.balance``), which ring (``topology="auto"``), which backward mode
(``bwd_comm="auto"``), and the kernel rate the model plans with. Functions of the plan
(``BurstAttention``), whose state they read and whose caches (``_links``, ``_rates``,
``_auto``, ``_loads``, ``_balancing``) they fill; the plan holds the calls.
"""

import numpy as np

from ._gpu.device import device_name
from .model.balance import choose as choose_layout
from .model.flat import Machine, Shape
from .model.topology import choose_topology
from ._ring.balance import NOMINAL_GBPS, Balancing
from ._ring.geometry import geometry
from ._transport.links import link_speeds
from ._transport.watchdog import allgather

__all__ = ["rebalanced", "auto_topology", "kernel_rate", "bwd_mode", "balanced_mode"]


def rebalanced(plan, geo, kind, dims, dtype, cu):
    """The geometry of the balanced layout the call runs on, or None for the caller's
    (``_ring.balance.Balancing.target``, asking ``model.balance.choose`` at the slowest
    rank's kernel rate and the configured or nominal link speeds)."""
    if plan._balancing is None:
        plan._balancing = Balancing(plan.comm)
    where = "cuda" if kind == "cuda" else "host"
    N = geo.layout.seqlen

    def choose(candidates, caller):
        if where not in plan._rates:  # collective: every rank decides here alike (the geometry is agreed)
            plan._rates[where] = kernel_rate(plan, where)
        fwd, bwd, _ = plan._rates[where]
        cfg = plan.runtime.settings
        intra, inter = cfg.link_gbps or NOMINAL_GBPS[where]
        inter = min(inter, cfg.internode_gbps) if cfg.internode_gbps else inter
        B, _, Z, Zkv, d, dv = dims
        shape = Shape(B, N, Z, Zkv, d, dv, np.dtype(dtype).itemsize)
        machine = Machine("balance", fwd_tflops=fwd, bwd_tflops=bwd, intra_gbps=intra, inter_gbps=inter)
        return choose_layout(shape, machine, plan.nranks, caller, candidates, node_of=plan.runtime.nodes.node_of)

    return plan._balancing.target(plan.balance, geo,
                                  lambda name: geometry(name, plan.nranks, N, plan.window, cu, plan.mask), choose)


def auto_topology(plan, where, dims, dtype, seqlen, layout):
    """The model's choice between the flat and the two-level ring for this call's shape
    (``model.topology.choose_topology``), at the links' configured or measured speeds
    (``transport.links``: measured once per plan and kind of arrays, collectively: MPI
    on host buffers, or the plan's GPU transport on device buffers) and the kernel rate
    for ``where`` ("host" or "cuda"; ``kernel_rate``): both rings compute the same
    pairs, so the rate decides only where both hide their transfers, and there they tie
    and the flat ring is kept. Cached per shape; the same on every rank (the inputs are
    agreed, the measurements reduced). ``last_stats`` records the rate."""
    layout = plan.layout_name if layout is None else layout
    key = (where, tuple(dims), str(dtype), seqlen, layout)
    if where not in plan._links:
        gpu = dict(transport=plan.transport, alloc=plan.backend.alloc) if where == "cuda" else {}
        plan._links[where] = link_speeds(plan.comm, plan.runtime.nodes, timeout=plan.runtime.timeout,
                                         settings=plan.runtime.settings, **gpu)
        plan._rates[where] = kernel_rate(plan, where)
    fwd, bwd, source = plan._rates[where]
    plan.last_stats.rate_tflops, plan.last_stats.rate_source = (fwd, bwd), source
    if key not in plan._auto:
        nodes = plan.runtime.nodes
        intra, inter = plan._links[where]
        B, _, Z, Zkv, d, dv = dims
        shape = Shape(B, seqlen, Z, Zkv, d, dv, np.dtype(dtype).itemsize, plan.causal, plan.window_arg)
        g = len(nodes.members[0])
        machine = Machine("auto", fwd_tflops=fwd, bwd_tflops=bwd, intra_gbps=intra, inter_gbps=inter,
                          ranks_per_node=g)
        mode = None if plan.bwd_comm == "auto" else plan.bwd_comm
        plan._auto[key] = choose_topology(shape, machine, plan.nranks, layout, g, mode)
    return plan._auto[key]


def kernel_rate(plan, where):
    """``(forward, backward TFLOP/s, source)`` the model plans with for arrays on
    ``where`` (``config.Settings.kernel_rate``: the setting, the rate file's measurement
    for this GPU's model, or nominal), the slowest rank's: every rank must choose the
    same ring, and the ring goes at its slowest rank's pace. Collective."""
    backend = plan.backend
    gpu = where == "cuda" and getattr(backend, "xp", np) is not np  # a CuPy backend (not an emulated one)
    mine = plan.runtime.settings.kernel_rate(where, device_name(backend.xp, backend.device_id) if gpu else None)
    every = allgather(plan.comm, mine, plan.runtime.timeout,
                      "the allgather of the ranks' kernel rates (topology='auto')")
    return min(every)


def bwd_mode(plan, call, dims, dtype):
    """The backward mode of a call with these dims and dtype: fewest bytes moved, or with
    host arrays on one node the better balanced one-way mode (``balanced_mode``)."""
    if plan.bwd_comm == "two-way" and plan.nranks < 3:
        return "burst"  # both directions would reach the same neighbour
    if plan.bwd_comm != "auto":
        return plan.bwd_comm
    # Ties (one rank: nothing moves) go to the smaller full step, then to "burst".
    cost = call.backward_costs(dims, dtype, plan.nranks >= 3 and getattr(plan.backend, "split_backward_free",
                                                                         False))
    best = min(cost, key=lambda m: cost[m])  # dicts keep order: ties go to burst, ring
    one_node = plan.runtime.nodes.count == 1 and plan.backend.name == "cpu"
    return balanced_mode(plan, call.geometry, best) if best != "two-way" and one_node else best


def balanced_mode(plan, geo, fewest_bytes):
    """The one-way backward for a call on host arrays with every rank on one node, given
    the one that moves fewer bytes. There packets move through memory (or are read where
    they lie: the "shm" transport), at a small cost next to the tiles', and the busiest
    rank sets the pace: the other mode is taken when its busiest rank computes at least
    2 % fewer pairs. Both transports choose alike, so they still give the same bits.

    Masks can leave the ranks' keys much less evenly visible than their queries (the
    bench's ``blocks:0.3`` on zigzag and causal leaves the busiest rank several per cent
    more pairs as keys than as queries, ``bigbird`` with global keys on rank 0 much
    more): the mode that moves fewer bytes is then not the faster one. Each rank counts
    its own two loads (``Geometry.loads``); they are gathered once per geometry (a
    collective: every rank's call gets here alike)."""
    busiest = plan._loads.get(geo)  # keyed by the object itself (identity): it stays alive
    if busiest is None:
        every = allgather(plan.comm, geo.loads(plan.rank), plan.runtime.timeout,
                          "the allgather of the ranks' loads (bwd_comm='auto')")
        if len(plan._loads) >= 32:
            plan._loads.pop(next(iter(plan._loads)))
        busiest = plan._loads[geo] = {"burst": max(b for b, _ in every), "ring": max(r for _, r in every)}
    other = "ring" if fewest_bytes == "burst" else "burst"
    return other if busiest[other] < 0.98 * busiest[fewest_bytes] else fewest_bytes
