"""burstmpi.bench.plot draws a PNG from bench JSON (skipped without matplotlib)."""

import json

import pytest
from click.testing import CliRunner

pytestmark = pytest.mark.extras  # .ci/run's second phase, with the optional packages
pytest.importorskip("matplotlib")

from burstmpi.bench.plot import main  # noqa: E402

from conftest import NRANKS  # noqa: E402


@pytest.mark.skipif(NRANKS > 1, reason="one process draws")
def test_plot_from_json(tmp_path):
    rows = [dict(ranks=P, dtype="float32", causal=c, layout="zigzag", bwd_mode="burst", seqlen=n,
                 fwdbwd_tflops=0.1 * P / (1 + c), fwdbwd_tflops_all=0.1 * P * P)
            for P in (1, 2) for c in (0, 1) for n in (1024, 2048)]
    src = tmp_path / "rows.json"
    src.write_text(json.dumps({"rows": rows}))
    out = tmp_path / "fig.png"
    res = CliRunner().invoke(main, [str(src), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10000
