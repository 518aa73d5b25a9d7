"""burstmpi.bench.ringpeer: the comparison with the JAX ring-attention peer.

Its command line is checked everywhere; a small run of both sides only where the peer
(pip install ringattention jax flax einops) and mpiexec are installed.
"""

import importlib.util
import shutil

import pytest
from click.testing import CliRunner

from burstmpi.bench.ringpeer import main

from conftest import NRANKS


def test_help_and_a_length_the_peer_cannot_split():
    res = CliRunner().invoke(main, ["--help"])
    assert res.exit_code == 0 and "--cores" in res.output and "fake CPU devices" in res.output
    res = CliRunner().invoke(main, ["-n", "4", "-s", "3000"])
    assert res.exit_code == 2
    assert "expected a multiple of 4 x 512 (the peer's blocks) and of 2 x 4 (the zigzag layout), got 3000" in res.output


@pytest.mark.skipif(NRANKS > 1, reason="launches its own mpiexec")
@pytest.mark.skipif(importlib.util.find_spec("ringattention") is None or importlib.util.find_spec("flax") is None,
                    reason="the peer is not installed (pip install ringattention jax flax einops)")
@pytest.mark.skipif(shutil.which("mpiexec") is None, reason="needs mpiexec")
@pytest.mark.timeout(600)
def test_both_sides_agree_on_a_small_problem():
    res = CliRunner().invoke(main, ["-n", "2", "-s", "2K", "-H", "2", "-D", "16", "-i", "1", "--balance", "zigzag,off"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    rows = [l.split() for l in res.output.splitlines() if l and not l.startswith("#")]
    # causal, balance, the layout the ring ran on (the peer's contiguous one, or balanced)
    assert [r[:3] for r in rows] == [["0", "zigzag", "zigzag"], ["0", "off", "contiguous"],
                                     ["1", "zigzag", "zigzag"], ["1", "off", "contiguous"]]
    for r in rows:
        assert all(float(x) > 0 for x in r[3:9])
        assert max(float(x) for x in r[9:13]) < 1e-4  # out, dq, dk, dv: both exact in float32


def test_a_balance_it_does_not_know():
    res = CliRunner().invoke(main, ["-n", "2", "-s", "2K", "--balance", "auto,sometimes"])
    assert res.exit_code == 2 and "got 'sometimes'" in res.output
