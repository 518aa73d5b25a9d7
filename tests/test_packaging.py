"""The README's commands are the ones CI runs, and the package exports what it says."""

import re
from pathlib import Path

import burstmpi

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```\n(.*?)\n```", readme, flags=re.S)
    commands = [b for b in blocks if "\n" not in b]
    assert len(commands) == 2, f"README should show exactly two set-up commands, found {commands}"
    assert "mpiexec -n 4 burstmpi-bench" in commands[0]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[1] in ci, f"{commands[1]!r} is not a line of .ci/run"


def test_public_api():
    assert set(burstmpi.__all__) >= {"attention", "attention_backward", "shard", "unshard",
                                      "BurstAttention"}
    for name in burstmpi.__all__:
        assert getattr(burstmpi, name) is not None
