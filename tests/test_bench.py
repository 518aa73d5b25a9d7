"""burstmpi-bench: output conventions, JSON, and a non-zero exit on wrong results."""

import json

import numpy as np
import pytest
from click.testing import CliRunner

import burstmpi
from burstmpi.bench import COLUMNS, flops, main, parse_size

from conftest import NRANKS, RANK

SMALL = ["-b", f"{32 * NRANKS}", "-e", f"{64 * NRANKS}", "-f", "2", "-H", "4", "-K", "2",
         "-D", "16", "-n", "1", "-w", "0"]


def test_sizes_and_flops():
    assert parse_size(None, None, "4K") == 4096 and parse_size(None, None, "1M") == 1 << 20
    assert parse_size(None, None, "1000") == 1000
    assert flops(1, 1024, 8, 128, False) == 4 * 8 * 1024 ** 2 * 128
    assert flops(1, 1024, 8, 128, True, "fwdbwd") == 3.5 * 2 * 8 * 1024 ** 2 * 128


def test_bench_table_json_and_exit_code(tmp_path):
    path = tmp_path / "rows.json"
    res = CliRunner().invoke(main, SMALL + ["-l", "all", "-J", str(path)])
    assert res.exit_code == 0, res.output + repr(res.exception)
    if RANK == 0:
        lines = res.output.splitlines()
        data = [l for l in lines if l and not l.startswith("#")]
        assert len(data) == 2 * 2 * 3  # lengths x masks x layouts
        assert "# Out of bounds values : 0 OK" in lines
        assert sum(l.startswith("#  Rank") for l in lines) == NRANKS
        rows = json.loads(path.read_text())["rows"]
        assert len(rows) == len(data)
        assert {key for key, *_ in COLUMNS} <= set(rows[0])
        assert all(r["wrong"] == 0 and r["fwd_tflops"] > 0 for r in rows)
        if NRANKS > 1:
            assert rows[0]["fwd_mb_sent"] > 0


def _break_forward(real):
    def broken(self, q, k, v):
        out, lse = real(self, q, k, v)
        return out + np.float32(0.01), lse
    return broken


def _break_dk(real):
    def broken(self, *args):
        dq, dk, dv = real(self, *args)
        return dq, dk * np.float32(1.01), dv
    return broken


@pytest.mark.parametrize("method,breaker", [("forward", _break_forward), ("backward", _break_dk)])
def test_bench_fails_loudly_on_wrong_results(monkeypatch, method, breaker):
    monkeypatch.setattr(burstmpi.BurstAttention, method, breaker(getattr(burstmpi.BurstAttention, method)))
    res = CliRunner().invoke(main, SMALL + ["-m", "none"])
    assert res.exit_code == 1
    if RANK == 0:
        assert "FAILED" in res.output


def test_bench_refuses_uneven_lengths():
    res = CliRunner().invoke(main, ["-b", f"{2 * NRANKS + 1}", "-e", f"{2 * NRANKS + 1}"])
    if NRANKS > 1:
        assert res.exit_code == 2 and "equal chunks" in res.output
    else:
        pytest.skip("every length splits over one rank")
