"""burstmpi-bench --mask PATTERN: every pattern runs, is checked against float64, and adds
the visible fraction, vs dense and sparse efficiency columns; bad SPECs are refused."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

from burstmpi import reference as ref
from burstmpi.bench import main
from burstmpi.bench.patterns import build
from conftest import NRANKS, RANK

SPECS = ["streaming:2:24", "chunked:40", "blocks:0.3:16", "bigbird:1:1:2:16", "strided:3:2:16"]


@pytest.mark.parametrize("spec", SPECS)
def test_every_pattern_runs_checked_with_its_columns(spec, tmp_path):
    path = tmp_path / "rows.json"
    N = 48 * NRANKS + 7
    res = CliRunner().invoke(main, ["-b", str(N), "-e", str(N), "-H", "4", "-K", "2", "-D", "16", "-n", "1",
                                    "-w", "0", "-m", spec, "-l", "zigzag", "-J", str(path)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    if RANK == 0:
        assert "# Out of bounds values : 0 OK" in res.output
        (row,) = json.loads(path.read_text())["rows"]
        assert row["mask_spec"] == spec and row["causal"] == 1 and row["wrong"] == 0
        # The visible fraction is the pattern's, with the causal mask, averaged over heads.
        pos = np.arange(N)
        seen = ref.visible(pos, pos, causal=True, mask=build(spec, N, 4), heads=4, seqlen=N)
        assert row["visible"] == pytest.approx(seen.reshape(-1, N, N).mean(axis=(1, 2)).mean(), rel=1e-3)
        assert row["vs_dense"] == pytest.approx(row["dense_fwdbwd_ms"] / row["fwdbwd_ms"])
        assert row["eff_fwdbwd"] == pytest.approx(row["dense_fwdbwd_ms"] * row["visible"] / row["fwdbwd_ms"])
        header = [l for l in res.output.splitlines() if l.startswith("#  seqlen")]
        assert header and "visible" in header[0] and "eff" in header[0]


@pytest.mark.parametrize("spec,words", [("stripes:2", "expected none, causal, both or one of"),
                                        ("chunked", "chunked: expected 1 arguments"),
                                        ("blocks:2", "DENSITY: expected a fraction"),
                                        ("streaming:a:b", "expected numbers")])
def test_bad_mask_spec_is_refused(spec, words):
    res = CliRunner().invoke(main, ["-m", spec])
    assert res.exit_code == 2 and words in res.output, res.output


def test_patterns_are_the_same_on_every_rank_and_seeded():
    a, b = build("blocks:0.2:8", 100, 2, seed=1), build("blocks:0.2:8", 100, 2, seed=1)
    assert a == b and build("blocks:0.2:8", 100, 2, seed=2) != a
    assert build("strided:4:2:8", 100, 3).heads == 3
