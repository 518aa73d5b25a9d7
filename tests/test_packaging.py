"""The README's commands are the ones CI runs, and the package exports what it says."""

import re
from pathlib import Path

import burstmpi

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"^```(\w*)\n(.*?)\n```$", readme, flags=re.S | re.M)  # (language, text)
    commands = [text for lang, text in blocks if not lang and "\n" not in text]
    assert len(commands) == 2, f"README should show exactly two set-up commands, found {commands}"
    assert "mpiexec -n 4 burstmpi-bench" in commands[0]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci, f"{commands[1]!r} is not a line of .ci/run"


def test_public_api():
    assert set(burstmpi.__all__) >= {"attention", "attention_backward", "shard", "unshard",
                                      "BurstAttention"}
    for name in burstmpi.__all__:
        assert getattr(burstmpi, name) is not None


def test_ci_runs_the_readme_command_bare_before_any_optional_package():
    """Phase 1 is what a new user runs: the README's test command in a venv with nothing
    else installed; phase 2 adds the optional packages and runs the tests marked extras."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    run = [i for i, line in enumerate(ci) if line.startswith('pip install ".[test]" && python -m pytest')]
    installs = [i for i, line in enumerate(ci) if "pip install" in line and not line.startswith("#") and i not in run]
    assert len(run) == 1 and installs and min(installs) > run[0], ci
    assert any(line.strip() == "python -m pytest -m extras" for line in ci[run[0] + 1:])
    assert "extras:" in (ROOT / "pytest.ini").read_text()
