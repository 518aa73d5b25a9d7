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


def test_new_columns_are_consistent():
    res = CliRunner().invoke(main, SMALL + ["-m", "none", "--no-progress", "-J", "/dev/null"])
    assert res.exit_code == 0, res.output
    if RANK == 0:
        header = [l for l in res.output.splitlines() if l.startswith("#  ") and "algbw" in l]
        assert header, res.output


def _shared(tmp_path):
    """Rank 0's temporary folder, the same path on every rank (one machine)."""
    from conftest import COMM
    from pathlib import Path
    return Path(COMM.bcast(str(tmp_path), root=0))


def _run(tmp_path, name, extra):
    path = tmp_path / name
    res = CliRunner().invoke(main, SMALL + ["-m", "causal", "--no-progress", "-J", str(path)] + extra)
    rows = json.loads(path.read_text())["rows"] if RANK == 0 else None
    return res, rows


def test_rows_carry_min_avg_max_bandwidth_and_overlap(tmp_path):
    res, rows = _run(_shared(tmp_path), "a.json", [])
    assert res.exit_code == 0, res.output
    if RANK == 0:
        for r in rows:
            assert r["fwdbwd_ms_min"] <= r["fwdbwd_ms_avg"] <= r["fwdbwd_ms_max"]
            assert abs(r["fwdbwd_ms"] - r["fwdbwd_ms_max"]) < 1e-9  # -a 3, the default
            assert 0 < r["overlap"] <= 1 and r["vs_local"] > 0 and r["local_fwdbwd_tflops"] > 0
            assert r["busbw"] == r["algbw"] and (r["algbw"] > 0) == (NRANKS > 1)


def test_regression_mode_passes_on_itself_and_fails_against_a_faster_baseline(tmp_path):
    tmp_path = _shared(tmp_path)
    res, rows = _run(tmp_path, "base.json", [])
    assert res.exit_code == 0, res.output
    base = tmp_path / "base.json"
    fast = tmp_path / "fast.json"
    if RANK == 0:
        data = json.loads(base.read_text())
        for r in data["rows"]:
            r["fwdbwd_ms"] *= 0.7
        fast.write_text(json.dumps(data))
    from conftest import COMM
    COMM.Barrier()
    res, _ = _run(tmp_path, "again.json", ["--baseline", str(base), "--tolerance", "10"])
    assert res.exit_code == 0, res.output
    junit = tmp_path / "j.xml"
    # Slower than a baseline made 30 % faster, with a 5 % tolerance: exit 3, and JUnit failures.
    res, _ = _run(tmp_path, "again2.json", ["--baseline", str(fast), "--tolerance", "0.05", "--junit", str(junit)])
    # Noise can make a tiny run faster than 0.7x its own time; the rows are big enough not to.
    assert res.exit_code == 3, res.output
    if RANK == 0:
        assert "# REGRESSED" in res.output and "FAILED" in res.output
        assert 'failures="' in junit.read_text() and "<failure" in junit.read_text()


def test_presets_set_the_published_shapes_and_flags_still_win(tmp_path):
    path = tmp_path / "p.json"
    res = CliRunner().invoke(main, ["--preset", "ring-flash-attn", "-H", "4", "-K", "1", "-D", "32",
                                    "-d", "float32", "-b", f"{64 * NRANKS}", "-e", f"{64 * NRANKS}",
                                    "-n", "1", "-w", "0", "-J", str(path)])
    assert res.exit_code == 0, res.output
    if RANK == 0:
        (row,) = json.loads(path.read_text())["rows"]
        assert (row["heads"], row["kv_heads"], row["head_dim"], row["dtype"]) == (4, 1, 32, "float32")
        assert row["causal"] == 1 and row["layout"] == "zigzag"  # from the preset
        assert "preset ring-flash-attn" in res.output


def test_a_missing_baseline_is_one_error_on_every_rank(tmp_path):
    res = CliRunner().invoke(main, SMALL + ["--baseline", str(tmp_path / "nope.json")])
    assert res.exit_code == 2 and "--baseline" in res.output and "nope.json" in res.output


def test_progress_goes_to_stderr_as_plain_lines():
    res = CliRunner().invoke(main, SMALL + ["-m", "none", "--progress"])
    assert res.exit_code == 0, res.output
    if RANK == 0:
        assert "# [2/2] seqlen" in res.stderr and "[2/2]" not in res.stdout
        assert "\r" not in res.stderr  # not a terminal: plain lines
