"""The stand-in for ssh that hydra calls: ``launcher.py STATE [ssh options] HOST COMMAND...``.

MPICH's hydra starts one proxy (``hydra_pmi_proxy``) per host through its ssh launcher
(``mpiexec -launcher ssh -launcher-exec SCRIPT``), which calls ``SCRIPT [options] HOST
COMMAND...``. This script skips the options, finds the emulated host whose address (or
name) is HOST in the cluster's state file STATE (``harness`` writes it), and runs COMMAND
there through ``sh -c``, as sshd would.

Why not just ``nsenter ... sh -c COMMAND`` with the output on a local pipe? Because then the
emulation would lie exactly where the fault tests look: a host whose link is pulled would
still deliver its output, and mpiexec killing this process would kill that host's proxy
through a local signal, which no real cluster can do. So, as with ssh, the command runs
detached inside the host (``remote.py``, the sshd side), and its output and exit status
come back over a TCP connection that crosses the host's own link: a pulled or lossy link
stalls them, and ending this process only closes the connection (the far side then stops
forwarding, as sshd does for a session without a terminal; the command runs on).

Exit status: the command's; 255 when the host cannot be reached or the connection closes
before the command ends (ssh's convention). The far side's own errors (before it calls back,
e.g. a connect that failed) go to a log in a temporary file, printed if it never calls back.
"""

import json
import os
import secrets
import socket
import struct
import subprocess
import sys
import tempfile

__all__ = ["split_ssh_args", "main"]

# ssh options that take an argument (OpenSSH's getopt string); the others are flags.
WITH_ARGUMENT = set("BbcDEeFIiJLlmOoPpQRSWw")
CONNECT_TIMEOUT = 30  # seconds for the far side to call back: ssh's ConnectTimeout-like limit
STDOUT, STDERR, EXIT = 1, 2, 3  # frame kinds (remote.py writes them)
HEADER = struct.Struct("!BI")


def split_ssh_args(argv):
    """(host, command) from ssh's arguments: options first (``-x``, ``-o Opt=v``,
    ``-p22``), then the host, then the command's words (joined by spaces, as ssh does)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-":
        if argv[i] == "--":
            i += 1
            break
        flags = argv[i][1:]
        for j, flag in enumerate(flags):
            if flag in WITH_ARGUMENT:
                if j == len(flags) - 1:  # its argument is the next word
                    i += 1
                break
        i += 1
    if i >= len(argv) - 1:
        raise SystemExit(f"launcher: expected [ssh options] HOST COMMAND..., got {argv}")
    return argv[i], " ".join(argv[i + 1:])


def find_host(state, host):
    """The state file's entry for ``host`` (an address or a hostname)."""
    for entry in state["hosts"]:
        if host in (entry["address"], entry["name"]):
            return entry
    names = ", ".join(f"{e['name']} ({e['address']})" for e in state["hosts"])
    raise SystemExit(f"launcher: no emulated host {host!r} in {state['path']}; the cluster has {names}")


def receive(conn, size):
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return data


def main(argv):
    state_path, rest = argv[0], argv[1:]
    with open(state_path) as fh:
        state = dict(json.load(fh), path=state_path)
    host, command = split_ssh_args(rest)
    entry = find_host(state, host)
    token = secrets.token_hex(8)
    with socket.create_server((state["bridge_address"], 0)) as server:
        server.settimeout(CONNECT_TIMEOUT)
        port = server.getsockname()[1]
        far_side = entry["enter"] + [state["python"], "-I", state["remote"], state["bridge_address"], str(port),
                                     token, command]
        with tempfile.TemporaryFile() as log:
            far = subprocess.Popen(far_side, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                   start_new_session=True, close_fds=True)
            try:
                conn, _ = server.accept()
            except socket.timeout:
                log.seek(0)
                said = log.read().decode(errors="replace").strip()[-2000:]
                status = "still running" if far.poll() is None else f"exit {far.poll()}"
                print(f"launcher: {host} ({entry['name']}) did not call back within {CONNECT_TIMEOUT} s "
                      f"(the far side: {status}; its stderr: {said or 'nothing'})", file=sys.stderr)
                return 255
    with conn:
        conn.settimeout(None)
        if receive(conn, len(token)) != token.encode():
            print(f"launcher: {host}: the far side sent a wrong token", file=sys.stderr)
            return 255
        out = {STDOUT: sys.stdout.buffer, STDERR: sys.stderr.buffer}
        while True:
            header = receive(conn, HEADER.size)
            if header is None:
                print(f"launcher: connection to {host} ({entry['name']}) closed", file=sys.stderr)
                return 255
            kind, size = HEADER.unpack(header)
            if kind == EXIT:
                return size
            data = receive(conn, size)
            if data is None:
                return 255
            out[kind].write(data)
            out[kind].flush()


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except BrokenPipeError:  # whoever read our output is gone
        os._exit(255)
