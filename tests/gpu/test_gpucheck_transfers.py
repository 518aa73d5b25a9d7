"""``burstmpi-gpucheck``'s transfer check and stored rate, without a GPU: the bound's
comparison on counts made up to break it, the check's own flow on the CPU backend (with a
NumPy stand-in for CuPy, so nothing is copied and every count is 0), and the rate it
stores where ``topology="auto"`` reads it. The silicon's counts come from a GPU session."""

import types

import numpy as np
import pytest

import burstmpi
from burstmpi._config import Settings, stored_rate
from burstmpi._transfers import Transfers
from burstmpi.bench import gpucheck
from conftest import NRANKS

pytestmark = pytest.mark.skipif(NRANKS > 1, reason="one process's own checks; run once, not per rank")


def test_a_transfer_that_grows_with_the_sequence_is_named():
    header = Transfers(d2h=1, d2h_bytes=8, h2d=1, h2d_bytes=64, syncs=1)
    assert gpucheck.transfer_growth("forward", {1024: header, 4096: header}) == []
    assert gpucheck.transfer_growth("forward", {1024: header, 4096: Transfers()}) == []  # fewer is fine
    tokens = Transfers(d2h=1, d2h_bytes=8 * 1024, h2d=1, h2d_bytes=64, syncs=1)
    grows = Transfers(d2h=1, d2h_bytes=8 * 4096, h2d=1, h2d_bytes=64, syncs=4)
    assert gpucheck.transfer_growth("decode", {4096: grows, 1024: tokens}) == [
        "decode: d2h_bytes grows with the sequence: 8192 at N=1024, 32768 at N=4096",
        "decode: syncs grows with the sequence: 1 at N=1024, 4 at N=4096"]
    assert gpucheck.transfer_line("forward", {4096: Transfers(), 1024: header}) == (
        "forward N=1024: 1 to host (8 B), 1 to device (64 B), 1 synchronisations; "
        "N=4096: 0 to host (0 B), 0 to device (0 B), 0 synchronisations")


def _host_stand_in(monkeypatch):
    """CuPy's names the check calls, on NumPy; the plan and the cache on the CPU backend."""
    stream = types.SimpleNamespace(synchronize=lambda: None)
    cupy = types.SimpleNamespace(asarray=np.asarray,
                                 cuda=types.SimpleNamespace(get_current_stream=lambda: stream))
    on_cpu = lambda cls: lambda *a, **kw: cls(*a, **dict(kw, backend="cpu"))
    monkeypatch.setattr(gpucheck, "BurstAttention", on_cpu(burstmpi.BurstAttention))
    monkeypatch.setattr(gpucheck, "KVCache", on_cpu(burstmpi.KVCache))
    return cupy


def test_the_transfer_check_runs_each_call_at_both_lengths(monkeypatch, capsys):
    cupy = _host_stand_in(monkeypatch)
    rep = gpucheck.Report()
    gpucheck.check_transfers(cupy, rep, lengths=(64, 128), Z=4, Zkv=2, d=16)
    lines = capsys.readouterr().out.splitlines()
    nothing = "0 to host (0 B), 0 to device (0 B), 0 synchronisations"
    assert lines == [f"ok   transfers per call: {what} N=64: {nothing}; N=128: {nothing}"
                     for what in ("forward", "backward", "decode")]
    assert rep.failed == 0


def test_the_bench_rate_is_stored_where_auto_reads_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("BURSTMPI_KERNEL_TFLOPS", raising=False)
    props = lambda i: {"name": b"NVIDIA H100 80GB HBM3"}
    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDeviceProperties=props)))
    gpucheck.store_measured_rate(cupy, 0, {False: (412.5, 301.25), True: (300.0, 200.0)})
    out = capsys.readouterr().out
    assert "# kernel rate stored for topology='auto': NVIDIA H100 80GB HBM3: forward 412.5, backward 301.2" in out
    entry = stored_rate("NVIDIA H100 80GB HBM3")
    assert (entry["fwd_tflops"], entry["bwd_tflops"], entry["burstmpi"]) == (412.5, 301.25, burstmpi.__version__)
    assert Settings().kernel_rate("cuda", "NVIDIA H100 80GB HBM3")[:2] == (412.5, 301.25)
    (tmp_path / "burstmpi" / "rates.json").unlink()
    (tmp_path / "burstmpi").rmdir()
    (tmp_path / "burstmpi").write_text("a file where the folder should be")
    gpucheck.store_measured_rate(cupy, 0, {False: (412.5, 301.25)})
    assert "# kernel rate not stored (" in capsys.readouterr().out
