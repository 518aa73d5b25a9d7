"""The far side of ``launcher.py``, inside an emulated host: what sshd does for one command.

``remote.py ADDRESS PORT TOKEN COMMAND`` connects back to the launcher over the host's own
link, runs ``sh -c COMMAND`` and forwards its stdout and stderr, then its exit status, as
frames (one byte of kind, four of length or status). Like sshd's session without a
terminal:
- it buffers at most ``WINDOW`` bytes the link has not taken yet, then stops reading the
  command's output, so a command writing into a dead link blocks, as it would over ssh;
- when the launcher goes away (the connection closes), it stops forwarding and closes the
  command's pipes; the command runs on (and is killed by SIGPIPE only if it writes);
- after the command ends it tries for ``LINGER`` seconds to deliver what is left, then
  gives up (sshd would wait for TCP to time out; no test needs that).
It runs in a session of its own, so nothing but the connection ties it to the launcher.

Connecting back is retried until ``CONNECT_FOR`` seconds have passed, as ssh's client
retries a SYN: a link that has just come back up (a fault test's undo) may drop the first
packets or answer "no route to host" while the neighbour entry is re-learned. Each failed
try is written to stderr, which the launcher keeps in a log and prints if we never call
back.
"""

import selectors
import socket
import struct
import subprocess
import sys
import time

STDOUT, STDERR, EXIT = 1, 2, 3
HEADER = struct.Struct("!BI")
WINDOW = 1 << 20  # bytes (sshd's channel window is of this order)
LINGER = 10.0     # seconds
CONNECT_FOR = 25.0  # seconds of tries to call back (the launcher waits 30)


def connect(address, port):
    """A connection to the launcher, retried (0.2 s doubling to 2 s apart) for ``CONNECT_FOR`` s."""
    deadline, pause = time.monotonic() + CONNECT_FOR, 0.2
    while True:
        try:
            return socket.create_connection((address, port), timeout=max(1.0, deadline - time.monotonic()))
        except OSError as e:
            left = deadline - time.monotonic()
            print(f"remote: connecting to {address}:{port}: {e}; {max(left, 0):.1f} s of tries left",
                  file=sys.stderr, flush=True)
            if left <= 0:
                raise
            time.sleep(min(pause, left))
            pause = min(2 * pause, 2.0)


def main(address, port, token, command):
    conn = connect(address, int(port))
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # sshd's TCPKeepAlive yes
    conn.sendall(token.encode())
    conn.setblocking(False)
    child = subprocess.Popen(["sh", "-c", command], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    sel = selectors.DefaultSelector()
    pipes = {child.stdout: STDOUT, child.stderr: STDERR}
    for pipe in pipes:
        sel.register(pipe, selectors.EVENT_READ)
    sel.register(conn, selectors.EVENT_READ)
    pending, connected, reading = bytearray(), True, True
    deadline = None
    while connected and (pipes or pending) and (deadline is None or time.monotonic() < deadline):
        want = selectors.EVENT_READ | (selectors.EVENT_WRITE if pending else 0)
        sel.modify(conn, want)
        if reading != (len(pending) < WINDOW):  # the window is full: let the command block
            reading = not reading
            for pipe in pipes:
                (sel.register if reading else sel.unregister)(pipe, selectors.EVENT_READ)
        for key, events in sel.select(timeout=1.0):
            if key.fileobj is conn:
                if events & selectors.EVENT_READ and not _alive(conn):
                    connected = False
                    break
                if events & selectors.EVENT_WRITE and pending:
                    try:
                        del pending[:conn.send(pending)]
                    except (BlockingIOError, InterruptedError):
                        pass
                    except OSError:
                        connected = False
                        break
            else:
                data = key.fileobj.read1(65536)
                if data:
                    pending += HEADER.pack(pipes[key.fileobj], len(data)) + data
                else:
                    sel.unregister(key.fileobj)
                    del pipes[key.fileobj]
        if not pipes and deadline is None:  # the command's output is over: deliver the end
            code = child.wait()
            pending += HEADER.pack(EXIT, code if code >= 0 else 128 - code)
            deadline = time.monotonic() + LINGER
    for pipe in list(pipes):  # the launcher is gone: as sshd, close the command's pipes
        pipe.close()
    child.wait()
    conn.close()


def _alive(conn):
    """Read from the launcher (it sends nothing): False when it closed the connection."""
    try:
        return conn.recv(4096) != b""
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False


if __name__ == "__main__":
    main(*sys.argv[1:5])
