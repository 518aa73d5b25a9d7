"""One configuration: the settings' table in the guide is the code's, and every setting with
a keyword is a keyword of ``BurstAttention`` and ``KVCache``, read once when they are made."""

import inspect
import re
from pathlib import Path

import pytest

import burstmpi
from burstmpi._config import FIELDS, Settings

PAGE = Path(__file__).resolve().parents[1] / "docs" / "guide" / "configuration.md"
ROW = re.compile(r"^\| `(BURSTMPI_\w+)` \| (.+?) \| (.+?) \| .+ \|$")


def _shown(f):
    """A default as the table writes it (the environment's spelling)."""
    if f.default is None:
        return "measured"
    if isinstance(f.default, bool):
        return f"`{int(f.default)}`"
    if isinstance(f.default, float) and f.default.is_integer():
        return f"`{int(f.default)}`"
    return f"`{f.default}`"


def table():
    return {m.group(1): (m.group(2), m.group(3)) for line in PAGE.read_text().splitlines() if (m := ROW.match(line))}


def test_the_guides_table_is_the_codes():
    rows = table()
    assert list(rows) == [f.variable for f in FIELDS], "the table's variables, in order, are config.FIELDS'"
    for f in FIELDS:
        keyword, default = rows[f.variable]
        if f.keyword is None:
            assert keyword.startswith("(environment only"), f"{f.variable}: {keyword}"
        else:
            assert keyword == f"`{f.keyword}`", f"{f.variable}: the table says {keyword}, the code {f.keyword}"
        assert default == _shown(f), f"{f.variable}: the table's default {default}, the code's {_shown(f)}"


@pytest.mark.parametrize("cls", [burstmpi.BurstAttention, burstmpi.KVCache])
def test_every_setting_with_a_keyword_is_one_and_documented(cls):
    params = inspect.signature(cls).parameters
    doc = cls.__doc__
    for f in FIELDS:
        if f.keyword is None:
            assert f.keyword not in params
            continue
        assert f.keyword in params and params[f.keyword].kind is inspect.Parameter.KEYWORD_ONLY, f.keyword
        assert re.search(rf"\b{f.keyword}\b", doc), f"{cls.__name__}'s docstring does not name {f.keyword}"


def test_settings_are_read_once_when_a_plan_is_made(monkeypatch):
    monkeypatch.setenv("BURSTMPI_TILE_Q", "64")
    plan = burstmpi.BurstAttention(threads=1, tile_k=32, timeout=30)
    monkeypatch.setenv("BURSTMPI_TILE_Q", "128")  # too late for this plan
    monkeypatch.setenv("BURSTMPI_TIMEOUT", "5")
    s = plan.settings
    assert (s.tile_q, s.tile_k, s.threads, s.timeout) == (64, 32, 1, 30.0)
    assert burstmpi.BurstAttention().settings.tile_q == 128


@pytest.mark.parametrize("keyword,value,message", [
    ("threads", -1, r"^BurstAttention: threads: expected an integer >= 0, got -1$"),
    ("tile_q", 0, r"^BurstAttention: tile_q: expected an integer >= 1, got 0$"),
    ("tile_k", 2.5, r"^BurstAttention: tile_k: expected an integer, got 2.5$"),
    ("cpu_kernels", "fast", r"^BurstAttention: cpu_kernels: expected one of \['auto', 'numba', 'numpy'\], got 'fast'$"),
    ("check", 1, r"^BurstAttention: check: expected True or False, got 1$"),
    ("link_gbps", (1, 0), r"^BurstAttention: link_gbps: expected two positive numbers .*, got \(1, 0\)$"),
    ("timeout", 0, r"^BurstAttention: timeout: expected a finite number of seconds > 0"),
])
def test_a_bad_setting_names_the_keyword(keyword, value, message):
    with pytest.raises((TypeError, ValueError), match=message):
        burstmpi.BurstAttention(**{keyword: value})


def test_the_environment_alone_and_keywords_resolve_alike(monkeypatch):
    monkeypatch.setenv("BURSTMPI_LINK_GBPS", "10,1.5")
    monkeypatch.setenv("BURSTMPI_CHECK", "0")
    env = Settings.from_env()
    assert env.link_gbps == (10.0, 1.5) and env.check is False
    assert Settings.resolve("f", link_gbps=(10, 1.5), check=False) == env
    with pytest.raises(TypeError, match="f: unexpected setting 'blas'"):
        Settings.resolve("f", blas="mkl")  # per process: the environment only


def test_numpy_is_the_cpu_backends_old_name(monkeypatch):
    with pytest.warns(FutureWarning, match=r"BurstAttention: backend: 'numpy' is the CPU backend's old name; say 'cpu'"):
        plan = burstmpi.BurstAttention(backend="numpy")
    assert plan.settings.backend == "cpu"
    monkeypatch.setenv("BURSTMPI_BACKEND", "numpy")
    with pytest.warns(FutureWarning, match="environment variable BURSTMPI_BACKEND: 'numpy'"):
        assert Settings.from_env().backend == "cpu"
    with pytest.raises(ValueError, match=r"^BurstAttention: backend: expected 'auto', 'cpu' or 'cuda', got 'gpu'$"):
        burstmpi.BurstAttention(backend="gpu")
