"""``{command-output}``: a command's output, captured when the manual is built.

    ```{command-output} burstmpi-bench --legend
    ```

shows ``$ burstmpi-bench --legend`` and what it printed. The pages name commands as users
type them (``burstmpi-bench``, ``burstmpi-gpucheck``, ``python -m MODULE``); each runs here
as ``python -m MODULE`` in the interpreter that builds the manual, so --help texts and the
bench's column legend can never drift from the code.

Every command of every page runs in one helper interpreter, started once per build (each
command would otherwise pay a Python start and burstmpi's imports, ~2 s apiece). The
helper runs them one after another with ``runpy``, each with its own ``sys.argv``, and
returns what each printed and its exit status. A command that fails is a build warning
(an error under ``sphinx-build -W``) naming the command and its output.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from docutils import nodes
from docutils.parsers.rst import Directive, directives

# The console scripts setup.py declares, and the module each runs.
SCRIPTS = {"burstmpi-bench": "burstmpi.bench", "burstmpi-gpucheck": "burstmpi.bench.gpucheck",
           "burstmpi-soak": "burstmpi.bench.soak"}
DIRECTIVE = re.compile(r"^```\{command-output\}[ \t]+(.+?)[ \t]*$", re.M)

# The helper: argv lists in on stdin (JSON), [output, exit status] per command out.
HELPER = r"""
import contextlib, io, json, runpy, sys
results = []
for module, args in json.load(sys.stdin):
    out = io.StringIO()
    code = 0
    sys.argv = [module] + args
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except Exception as e:
            code = 1
            print(f"{type(e).__name__}: {e}")
    results.append([out.getvalue(), code])
sys.stdout.write(json.dumps(results))
"""


def _module_and_args(command):
    """(module, args) that ``command`` runs, e.g. 'burstmpi-bench -h' -> ('burstmpi.bench', ['-h'])."""
    words = command.split()
    if words[0] in SCRIPTS:
        return SCRIPTS[words[0]], words[1:]
    if words[:2] == ["python", "-m"] and len(words) >= 3:
        return words[2], words[3:]
    raise ValueError(f"command-output: expected a console script ({', '.join(SCRIPTS)}) or "
                     f"'python -m MODULE ...', got {command!r}")


def _run_all(app):
    """Run every command the pages name, once, in one helper interpreter."""
    src = Path(app.srcdir)
    commands = sorted({m.group(1) for page in src.rglob("*.md") if "_build" not in page.parts
                       for m in DIRECTIVE.finditer(page.read_text())})
    app.env_command_output = {}
    if not commands:
        return
    env = dict(os.environ, COLUMNS="88", PYTHONPATH=os.pathsep.join(
        [str(src.parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("BURSTMPI_UNDER_MPIEXEC", None)
    todo = [_module_and_args(c) for c in commands]
    proc = subprocess.run([sys.executable, "-c", HELPER], input=json.dumps(todo), env=env,
                          cwd=src.parent, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"command-output: the helper interpreter failed (exit "
                           f"{proc.returncode}):\n{proc.stderr[-3000:]}")
    for command, (module, _), (out, code) in zip(commands, todo, json.loads(proc.stdout)):
        script = command.split()[0]
        if script in SCRIPTS:  # click names a module run with -m "python -m MODULE"
            out = out.replace(f"Usage: python -m {module} ", f"Usage: {script} ")
        app.env_command_output[command] = (out, code)


class CommandOutput(Directive):
    """The output of the command given as the directive's argument."""

    required_arguments = 1
    final_argument_whitespace = True
    option_spec = {"returncode": directives.nonnegative_int}

    def run(self):
        command = " ".join(self.arguments[0].split())
        app = self.state.document.settings.env.app
        out, code = app.env_command_output.get(command, (None, None))
        expected = self.options.get("returncode", 0)
        if out is None:
            raise self.error(f"command-output: {command!r} was not run (the page scan missed it)")
        if code != expected:
            raise self.error(f"command-output: {command!r} exited {code}, expected {expected}:\n"
                             f"{out[-2000:]}")
        text = f"$ {command}\n{out.rstrip()}"
        block = nodes.literal_block(text, text)
        block["language"] = "text"
        return [block]


def setup(app):
    app.connect("builder-inited", _run_all)
    app.add_directive("command-output", CommandOutput)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
