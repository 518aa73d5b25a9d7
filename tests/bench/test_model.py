"""The performance model: exact pair counts, the bytes algorithm.md gives, sane predictions."""

import numpy as np
import pytest
from click.testing import CliRunner

from burstmpi.model import cli, flat as model
from burstmpi.masks._layout import LAYOUTS, Layout
from burstmpi.masks._intervals import Bounds, Mask


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal,window", [(False, None), (True, None), (False, (5, 2)), (True, (9, 0))])
def test_visible_pairs_count_the_mask_exactly(layout, causal, window):
    P, C = 4, 12
    lay, win = Layout(layout, P, P * C), Bounds(causal, window)
    for h in range(P):
        for o in range(P):
            brute = int(Mask(win, P * C).visible(lay.positions(h), lay.positions(o)).sum())
            assert model.visible_pairs(lay, h, o, win) == brute


def test_traffic_matches_algorithm_md():
    """Non-causal: every rank sends P-1 full packets a phase: fwd 2 e B C Zkv d; burst
    (2e+4) B C Z d + 8 B C Z; ring (2e+8) B C Zkv d (partials included)."""
    B, N, Z, Zkv, d, e, P = 1, 8192, 32, 8, 128, 2, 4
    C = N // P
    shape = model.Shape(B, N, Z, Zkv, d, d, e, causal=False)
    m = model.MACHINES["h100-ib"]
    burst = model.predict(shape, m, P, "contiguous", "burst")
    ringm = model.predict(shape, m, P, "contiguous", "ring")
    mb = lambda x: x / 1e6
    assert burst["fwd_mb_sent"] == pytest.approx(mb((P - 1) * 2 * e * B * C * Zkv * d))
    assert burst["bwd_mb_sent"] == pytest.approx(mb((P - 1) * ((2 * e + 4) * B * C * Z * d + 8 * B * C * Z)))
    assert ringm["bwd_mb_sent"] == pytest.approx(mb((P - 1) * (2 * e + 8) * B * C * Zkv * d))


def test_predictions_behave():
    m = model.MACHINES["h100-ib"]
    shape = model.Shape(1, 64 * 1024, 32, 32, 128, 128, 2, causal=True)
    rows = model.recommend(shape, m, 8)
    assert rows == sorted(rows, key=lambda r: r["fwdbwd_ms"])
    by = {(r["layout"], r["bwd_mode"]): r for r in rows}
    # Causal load balance: zigzag and striped beat contiguous.
    assert by[("zigzag", "burst")]["fwdbwd_ms"] < by[("contiguous", "burst")]["fwdbwd_ms"]
    # One rank cannot beat the device: per-rank rate stays below the kernel's.
    one = model.predict(model.Shape(1, 8192, 8, 8, 128, 128, 2), m, 1, "contiguous", "burst")
    assert one["fwdbwd_tflops"] <= m.fwd_tflops and one["fwd_exposed_ms"] == 0
    # A slow network shows up as exposed communication.
    slow = model.Machine("slow", 350, 250, intra_gbps=1, inter_gbps=1)
    s = model.predict(model.Shape(1, 16384, 8, 8, 128, 128, 2), slow, 4, "contiguous", "burst")
    assert s["fwd_exposed_ms"] > 0.5 * s["fwd_ms"]


def test_cli_predicts_and_recommends():
    res = CliRunner().invoke(cli.main, ["predict", "-P", "4", "-N", "16K", "-H", "8", "--causal"])
    assert res.exit_code == 0, res.output
    assert "# Recommended: layout" in res.output and "# Recommended across nodes:" in res.output
    # 6 layout x mode rows and contiguous re-sharded by balance="auto" ("contig>bal"), then
    # flat, two-level and head-parallel across the nodes
    rows = [l.split() for l in res.output.splitlines() if not l.startswith("#")]
    assert len(rows) == 10 and [r[0] for r in rows].count("contig>bal") == 1


def test_two_way_backward_moves_each_block_one_hop_each_way():
    """A symmetric window on the contiguous layout: each rank's neighbours alone read its
    block, so the two-way backward moves its K/V and its query side one hop up and one
    down, and nothing else (no partial), in two steps."""
    from burstmpi._ring import flat as ring

    P, N, Z, d = 4, 4096, 8, 64
    shape = model.Shape(1, N, Z, Z, d, d, 4, causal=False, window=(16, 16))
    m = model.Machine("m", 10, 10, intra_gbps=10, inter_gbps=10)
    row = model.predict(shape, m, P, "contiguous", "two-way")
    dims = (1, N // P, Z, Z, d, d)
    kv, q = (ring.nbytes(ring.packet_fields(x, dims, np.float32, np.float32)[0]) for x in ("forward", "burst"))
    assert row["bwd_mb_sent"] == pytest.approx(2 * (kv + q) / 1e6)
    assert row["bwd_ms"] > 0


def test_topologies_bytes_across_nodes():
    """Non-causal, 8 ranks as 4 nodes of 2: the flat ring's busiest rank sends P - 1
    packets across the network a phase, the two-level ring's N - 1 (plus the backward's
    partials home), head parallelism's P/u - 1 packets of the same size."""
    from burstmpi.model.topology import predict_ring

    B, N, Z, d, e, P, g = 1, 8192, 8, 64, 4, 8, 2
    C = N // P
    shape = model.Shape(B, N, Z, Z, d, d, e, causal=False)
    m = model.Machine("m", 10, 10, intra_gbps=10, inter_gbps=1, ranks_per_node=g)
    kv = 2 * e * B * C * Z * d / 1e6
    flat = predict_ring(shape, m, P, "contiguous", "flat", bwd_mode="ring")
    two = predict_ring(shape, m, P, "contiguous", "two-level", bwd_mode="ring")
    heads = predict_ring(shape, m, P, "contiguous", "flat", head_parallel=g, bwd_mode="ring")
    partial = 2 * 4 * B * C * Z * d / 1e6  # dK, dV in float32
    assert flat["inter_mb"] == pytest.approx((P - 1) * (2 * kv + partial))
    assert two["inter_mb"] == pytest.approx((P // g - 1) * (2 * kv + partial))
    assert heads["inter_mb"] == pytest.approx((P // g - 1) * (2 * kv + partial))
    assert two["fwdbwd_ms"] < flat["fwdbwd_ms"] and two["topology"] == "two-level"


def test_scale_cli_tabulates_every_topology():
    res = CliRunner().invoke(cli.main, ["scale", "--ranks", "8,1024", "--tokens", "128K,16M", "-K", "32"])
    assert res.exit_code == 0, res.output
    rows = [l.split() for l in res.output.splitlines() if not l.startswith("#")]
    assert len(rows) == 4 and all(r[-1] in ("flat", "two-level", "head-parallel") for r in rows)
    # 1024 GPUs, 128K tokens: 128 tokens each cannot hide the flat ring's network hops
    small = next(r for r in rows if r[1] == "1024" and r[2] == "128K")
    assert float(small[3]) > float(small[7])  # flat slower than two-level
