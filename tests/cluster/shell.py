"""Subprocesses for the harness: every one has a timeout, and a failure names the command.

The harness drives ``ip``, ``tc``, ``nft``, ``unshare``, ``nsenter`` and ``mount``; a
step that fails or hangs must stop the set-up with a message saying which step, not leave
a half-made host behind silently (the callers tear down on any error).
"""

import os
import shlex
import shutil
import subprocess

__all__ = ["ClusterError", "run", "missing_tools", "TOOLS"]

# What the harness calls; nft only for the loss fault (checked where it is used).
TOOLS = ("ip", "tc", "unshare", "nsenter", "mount", "umount")


class ClusterError(RuntimeError):
    """A harness step failed: the message names the command and what it printed."""


def run(args, timeout=30, check=True, input=None, env=None, cwd=None):
    """Run ``args`` (a list, in directory ``cwd``) and return the ``CompletedProcess`` (text,
    stdout and stderr captured). ``check``: raise ``ClusterError`` on a non-zero exit. A run
    past ``timeout`` seconds is killed and raises in any case."""
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout, input=input,
                              env=env, cwd=cwd, stdin=None if input is not None else subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        raise ClusterError(f"{shlex.join(args)}: no answer within {timeout} s") from e
    except FileNotFoundError as e:
        raise ClusterError(f"{shlex.join(args)}: {args[0]} not found") from e
    if check and proc.returncode != 0:
        raise ClusterError(f"{shlex.join(args)} failed (exit {proc.returncode}): "
                           f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
    return proc


def missing_tools(tools=TOOLS):
    """Why the harness cannot run here, or None: it needs root and these programs."""
    if os.geteuid() != 0:
        return "needs root (network, mount and UTS namespaces, veth links, tc): run as root"
    absent = [t for t in tools if shutil.which(t) is None]
    if absent:
        return f"needs {', '.join(absent)} (apt-get install iproute2 util-linux mount)"
    return None
