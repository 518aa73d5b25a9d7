"""K emulated hosts on one Linux machine, and the MPI's launcher starting ranks across them.

``Cluster(hosts=4).up()`` makes a Linux bridge in the root namespace (the root namespace
gets an address on it, for ``mpiexec``), K hosts (``hosts.Host``) plugged into it, a
hostfile and the state file the ssh stand-in (``launcher.py``) reads; ``down()`` removes
all of it, and so does ``python -m tests.cluster.harness down --all`` after a crash.

Addresses: only 198.18.0.0/24 (RFC 2544's benchmarking range, never routed), cut into
eight /27 slots so that several clusters can exist at once; nothing is routed, so the
hosts reach each other and the root namespace and nothing else. Every name the harness
makes starts with ``bmpi<slot>`` (bridge ``bmpi0br``, ports ``bmpi0p<i>``, namespaces
``bmpi0h<i>``), and its state lives in ``/run/burstmpi-cluster/slot<slot>``, so leftovers
are easy to find and remove (``clean``).

``Cluster.mpiexec_argv`` is the launch line the tests use, that of the MPI this
environment holds (``mpis``): for MPICH's and Intel MPI's hydra
``mpiexec -launcher ssh -launcher-exec SSH -iface BRIDGE -f HOSTFILE -ppn P -n N ...``, for
Open MPI's PRRTE ``mpirun --prtemca plm_ssh_agent SSH ...``; with the environment of
``Cluster.env``: UCX and libfabric pointed at the host's NIC, one BLAS thread per rank,
what the launcher needs, and no ``BURSTMPI_RANKS_PER_NODE``: the nodes must come from MPI.
"""

import argparse
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import mpis
from .faults import LOSS_TABLE
from .hosts import NIC, Host
from .shell import ClusterError, missing_tools, run

__all__ = ["Cluster", "Job", "clean", "kill_launchers", "kill_under", "tcp_retries2"]

STATE_ROOT = Path("/run/burstmpi-cluster")
SUBNET, SLOT_BITS, SLOTS = "198.18.0", 27, 8  # eight /27s: addresses 32*slot .. 32*slot+31
MAX_HOSTS = 29  # .1 is the bridge's, .2 .. .30 the hosts', .31 broadcast
HERE = Path(__file__).resolve().parent
CHECKOUT = HERE.parent.parent
# What every rank needs on an emulated host (``Cluster.env`` adds the NIC's name).
RANK_ENV = {"OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def tcp_retries2(seconds):
    """The smallest ``net.ipv4.tcp_retries2`` with which TCP gives up on a connection whose
    data has gone unanswered for ``seconds``: the kernel's model of the give-up time is a
    retransmission timeout starting at 200 ms and doubling, capped at 120 s (15, the
    default, gives 924.6 s; 6 gives 25.4 s)."""
    for n in range(1, 64):
        rtos = [min(0.2 * 2 ** i, 120.0) for i in range(n + 1)]
        if sum(rtos) >= seconds:
            return n
    raise ValueError(f"seconds: {seconds} is beyond what tcp_retries2 can express")


def prefix_of(slot):
    return f"bmpi{slot}"


class Cluster:
    """``hosts`` emulated hosts, each to run ``ppn`` ranks, links shaped to ``rate`` (a tc
    rate, e.g. ``1gbit``; None leaves them unshaped). ``slot``: which /27 of
    198.18.0.0/24 (default: the first free one).

    ``tcp_give_up``: seconds of unanswered retransmissions after which the hosts' TCP drops
    a connection (``tcp_retries2`` in each host's namespace). A cut-off host's launcher
    proxy never learns that mpiexec aborted the job; it exits once its ranks have ended
    (their watchdog ends them), unless it blocked writing to mpiexec into the dead link (a
    full send buffer): then only TCP giving up ends it, after 924.6 s with Linux's default.
    Keep it above the jobs' ``BURSTMPI_TIMEOUT``: healthy ranks' connections to a silent
    host obey it too, and the watchdog must speak before they fail."""

    def __init__(self, hosts=4, ppn=2, rate="1gbit", slot=None, tcp_give_up=25):
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts: expected 1 to {MAX_HOSTS}, got {hosts}")
        self.count, self.ppn, self.rate, self.slot = hosts, ppn, rate, slot
        self.tcp_give_up = tcp_give_up
        self.hosts = []

    # -- names and files ----------------------------------------------------------------------

    @property
    def prefix(self):
        return prefix_of(self.slot)

    @property
    def bridge(self):
        return f"{self.prefix}br"

    @property
    def state(self):
        return STATE_ROOT / f"slot{self.slot}"

    @property
    def bridge_address(self):
        return f"{SUBNET}.{32 * self.slot + 1}"

    @property
    def hostfile(self):
        return self.state / "hostfile"

    @property
    def ssh(self):
        """The ``-launcher-exec`` script: ``launcher.py`` bound to this cluster's state."""
        return self.state / "ssh"

    def address(self, i):
        return f"{SUBNET}.{32 * self.slot + 2 + i}"

    def host(self, name):
        """The host called ``name`` (``host2``), or with that address."""
        for h in self.hosts:
            if name in (h.name, h.address):
                return h
        raise KeyError(f"no host {name!r}; the cluster has {[h.name for h in self.hosts]}")

    # -- up and down ---------------------------------------------------------------------------

    def up(self):
        """Make everything; on any failure remove what was made and raise."""
        why = missing_tools()
        if why:
            raise ClusterError(f"cannot emulate hosts here: {why}")
        self._claim_slot()
        try:
            self._make()
        except BaseException:
            self.down()
            raise
        return self

    def _claim_slot(self):
        """The first free slot (``mkdir`` is the lock); remove dead owners' leftovers first."""
        STATE_ROOT.mkdir(parents=True, exist_ok=True)
        clean(only_dead=True)
        for slot in ([self.slot] if self.slot is not None else range(SLOTS)):
            try:
                (STATE_ROOT / f"slot{slot}").mkdir()
            except FileExistsError:
                continue
            self.slot = slot
            (self.state / "owner").write_text(str(os.getpid()))
            return
        raise ClusterError(f"no free slot under {STATE_ROOT}: clusters of live processes hold them all "
                           f"({sorted(p.name for p in STATE_ROOT.iterdir())}); "
                           "python -m tests.cluster.harness down --all removes them")

    def _make(self):
        # The pinned mount namespaces' files must sit on a private mount (unshare(1)).
        (self.state / "hosts.d").mkdir()
        run(["mount", "--bind", str(self.state / "hosts.d"), str(self.state / "hosts.d")])
        run(["mount", "--make-private", str(self.state / "hosts.d")])
        run(["ip", "link", "add", self.bridge, "type", "bridge"])
        run(["sysctl", "-q", "-w", f"net.ipv6.conf.{self.bridge}.disable_ipv6=1"])
        run(["ip", "addr", "add", f"{self.bridge_address}/{SLOT_BITS}", "dev", self.bridge])
        run(["ip", "link", "set", self.bridge, "up"])
        self.hosts = [Host(self.prefix, i, self.address(i), SLOT_BITS, self.state / "hosts.d")
                      for i in range(self.count)]
        etc_hosts = self.state / "etc-hosts"
        etc_hosts.write_text("127.0.0.1 localhost\n" + f"{self.bridge_address} head\n"
                             + "".join(f"{h.address} {h.name}\n" for h in self.hosts))
        sysctls = {"net.ipv4.tcp_retries2": tcp_retries2(self.tcp_give_up)} if self.tcp_give_up else {}
        for h in self.hosts:
            h.create(self.bridge, etc_hosts, self.rate, sysctls)
        self.hostfile.write_text(mpis.hostfile_lines([h.address for h in self.hosts], self.ppn))
        state = {"bridge_address": self.bridge_address, "python": sys.executable,
                 "remote": str(HERE / "remote.py"), "rate": self.rate, "ppn": self.ppn,
                 "tcp_give_up": self.tcp_give_up,
                 "hosts": [{"name": h.name, "address": h.address, "netns": h.netns, "port": h.port,
                            "enter": h.enter([], cwd=str(CHECKOUT))[:-1]} for h in self.hosts]}
        (self.state / "state.json").write_text(json.dumps(state, indent=1))
        self.ssh.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -I {HERE / 'launcher.py'} "
                            f"{self.state / 'state.json'} \"$@\"\n")
        self.ssh.chmod(0o755)

    def down(self):
        """Remove every host, the bridge and the state; raise the errors together at the end."""
        if self.slot is not None:
            teardown(self.slot)

    @classmethod
    def attach(cls, slot):
        """The cluster already up in ``slot`` (for the command line)."""
        path = STATE_ROOT / f"slot{slot}" / "state.json"
        if not path.exists():
            raise ClusterError(f"no cluster in slot {slot} ({path} is missing): python -m tests.cluster.harness up")
        state = json.loads(path.read_text())
        self = cls(len(state["hosts"]), state["ppn"], state["rate"], slot, state["tcp_give_up"])
        self.hosts = [Host(self.prefix, i, h["address"], SLOT_BITS, self.state / "hosts.d")
                      for i, h in enumerate(state["hosts"])]
        return self

    # -- launching -----------------------------------------------------------------------------

    def env(self, **extra):
        """The launch environment: this one, without ``BURSTMPI_RANKS_PER_NODE``, plus
        ``RANK_ENV``, the NIC for UCX and libfabric, what the MPI's launcher needs
        (``mpis.launcher_env``), and ``extra``."""
        env = {k: v for k, v in os.environ.items() if k != "BURSTMPI_RANKS_PER_NODE"}
        env.update(RANK_ENV, UCX_NET_DEVICES=NIC, FI_TCP_IFACE=NIC, FI_SOCKETS_IFACE=NIC, **mpis.launcher_env())
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT / "tests"), env.get("PYTHONPATH")) if p)
        env.update({k: str(v) for k, v in extra.items()})
        return env

    @property
    def subnet(self):
        return f"{SUBNET}.{32 * self.slot}/{SLOT_BITS}"

    def mpiexec_argv(self, argv, n=None, ppn=None, hosts=None):
        """``mpiexec`` across the hosts (``hosts``: a subset, by name; default all),
        ``ppn`` ranks each, ``n`` in all (default every slot), running ``argv``: the
        launch line of this environment's MPI (``mpis``)."""
        ppn = ppn or self.ppn
        chosen = [self.host(h) for h in hosts] if hosts else self.hosts
        hostfile = self.hostfile
        if hosts or ppn != self.ppn:
            hostfile = self.state / f"hostfile-{'-'.join(h.name for h in chosen)}-{ppn}"
            hostfile.write_text(mpis.hostfile_lines([h.address for h in chosen], ppn))
        n = n or ppn * len(chosen)
        return [*mpis.launch_argv(self.ssh, hostfile, ppn, n, self.subnet, self.bridge), *argv]

    def start(self, argv, env=None, **where):
        """Start ``mpiexec`` across the hosts in the background: a ``Job``."""
        return Job(self.mpiexec_argv(argv, **where), self.env(**(env or {})))

    def mpiexec(self, argv, timeout=300, env=None, **where):
        """Run ``argv`` across the hosts to its end: the finished ``Job`` (``rc``, ``out``,
        ``err``, ``seconds``). Past ``timeout`` seconds the job is killed, ``rc`` None."""
        job = self.start(argv, env, **where)
        job.wait(timeout)
        return job

    # -- what is on the hosts -----------------------------------------------------------------

    def leftovers(self):
        """{host: [what is left]}: processes and /dev/shm files, for hosts that have any."""
        found = {}
        for h in self.hosts:
            left = [f"pid {p}: {c}" for p, c in h.processes().items()]
            left += [f"/dev/shm/{f}" for f in h.shm_files()]
            if left:
                found[h.name] = left
        return found

    def wait_reachable(self, hosts=None, timeout=20.0):
        """Wait until each of ``hosts`` (default: all) opens a TCP connection to the head (the
        bridge's address), as a launcher's far side must; return {host: seconds it took}.
        A link set up again after a fault can take a moment to carry packets (the neighbour
        entries a dead link failed are learned anew); a host still cut off after
        ``timeout`` s raises ``ClusterError`` naming it, instead of a job failing later to
        launch there."""
        took = {}
        with socket.create_server((self.bridge_address, 0)) as server:
            port = server.getsockname()[1]
            probe = ("import socket, sys, time\n"
                     f"deadline = time.monotonic() + {timeout}\n"
                     "while True:\n"
                     "    try:\n"
                     f"        socket.create_connection(({self.bridge_address!r}, {port}), timeout=2).close(); break\n"
                     "    except OSError as e:\n"
                     "        if time.monotonic() > deadline: sys.exit(f'{e}')\n"
                     "        time.sleep(0.2)\n")
            for h in hosts or self.hosts:
                start = time.monotonic()
                proc = run(h.enter([sys.executable, "-I", "-c", probe]), timeout=timeout + 10, check=False)
                if proc.returncode != 0:
                    raise ClusterError(f"{h.name} ({h.address}) cannot reach the head {self.bridge_address} "
                                       f"within {timeout} s: {proc.stderr.strip()[-500:]}")
                took[h.name] = time.monotonic() - start
        return took

    def scrub(self):
        """Kill every process and empty /dev/shm on every host, and end the ssh stand-ins of
        finished jobs (between tests, when no job runs)."""
        kill_launchers(self.slot)
        for h in self.hosts:
            h.kill_all()
            h.sh("rm -rf /dev/shm/* /dev/shm/.[!.]* 2>/dev/null; true", timeout=10)


class Job:
    """An ``mpiexec`` run in its own process group; stdout and stderr go to temporary files
    (a pipe nobody reads would stall the job)."""

    def __init__(self, argv, env):
        self.argv, self.rc, self.seconds = argv, None, None
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, env=env, cwd=CHECKOUT, stdin=subprocess.DEVNULL, stdout=self._out,
                                     stderr=self._err, start_new_session=True)

    @property
    def command(self):
        return shlex.join(self.argv)

    def wait(self, timeout):
        """Wait up to ``timeout`` seconds; return the exit status, or None (and kill the
        whole process group) if it was still running."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None
        return self.poll()

    def poll(self):
        """The exit status, or None while it runs; ``rc`` and ``seconds`` are set when it ends."""
        if self.rc is None and self.proc.poll() is not None:
            self.rc, self.seconds = self.proc.returncode, time.monotonic() - self.started
        return self.rc

    def kill(self):
        """SIGKILL to the job's process group (mpiexec and its launchers), if still running.
        The exit status of a job killed so stays None."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
            self.seconds = time.monotonic() - self.started

    def _read(self, fh):
        fh.seek(0)
        return fh.read().decode(errors="replace")

    @property
    def out(self):
        return self._read(self._out)

    @property
    def err(self):
        return self._read(self._err)

    def report(self, tail=4000):
        seconds = self.seconds if self.seconds is not None else time.monotonic() - self.started
        ended = (f"exit {self.rc}" if self.rc is not None
                 else "still running" if self.proc.poll() is None else "killed by the harness")
        return (f"$ {self.command}\n{ended} after {seconds:.1f} s\n"
                f"--- stdout\n{self.out[-tail:]}\n--- stderr\n{self.err[-tail:]}")


# -- leftovers -----------------------------------------------------------------------------------

def _kill_where(match):
    """SIGKILL every process of this machine (but this one) whose command line (a list of
    bytes) ``match`` accepts; return their PIDs."""
    killed = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if match(argv):
            try:
                os.kill(int(proc.name), signal.SIGKILL)
                killed.append(int(proc.name))
            except ProcessLookupError:
                pass
    return killed


def kill_launchers(slot):
    """SIGKILL the ssh stand-ins (``launcher.py``) of ``slot``'s cluster still running in the
    root namespace, found by the state file on their command line; return their PIDs.

    Like an ssh client, a launcher waits on its connection until the far side closes it.
    When a host's processes are killed as its namespace goes (a test's end), that close can
    be lost with the namespace, and mpiexec leaves its launchers be when it exits: one sat
    in ``recv`` after its job had passed. ``ip netns pids`` cannot see them."""
    marker = str(STATE_ROOT / f"slot{slot}" / "state.json").encode()
    return _kill_where(lambda argv: any(a.endswith(b"launcher.py") for a in argv) and marker in argv)


def kill_under(slot):
    """SIGKILL every process whose command line names a path in ``slot``'s state directory
    (the daemons ``slurm.Slurm`` runs in the root namespace: munged, slurmctld); return
    their PIDs. ``Slurm.down`` ends its own daemons; this is for those of a killed session,
    which the hosts' teardown cannot see (they are outside the hosts' namespaces)."""
    marker = str(STATE_ROOT / f"slot{slot}").encode() + b"/"
    return _kill_where(lambda argv: any(marker in a for a in argv))


def teardown(slot):
    """Remove everything of ``slot``, whether or not a ``Cluster`` object knows it: hosts
    found by name (``ip netns``), the bridge, the state directory. Errors are collected and
    raised together at the end, after every step ran."""
    prefix, state, errors = prefix_of(slot), STATE_ROOT / f"slot{slot}", []
    kill_launchers(slot)
    kill_under(slot)
    listed = run(["ip", "netns", "list"], timeout=10).stdout.split()
    indices = sorted({int(n[len(prefix) + 1:]) for n in listed
                      if n.startswith(f"{prefix}h") and n[len(prefix) + 1:].isdigit()})
    for p in (state / "hosts.d").glob("host*") if (state / "hosts.d").exists() else []:
        if p.name[4:].isdigit():
            indices = sorted(set(indices) | {int(p.name[4:])})
    for i in indices:
        try:
            Host(prefix, i, None, SLOT_BITS, state / "hosts.d").destroy()
        except ClusterError as e:
            errors.append(str(e))
    if Path(f"/sys/class/net/{prefix}br").exists():
        try:
            run(["ip", "link", "del", f"{prefix}br"])
        except ClusterError as e:
            errors.append(str(e))
    if shutil.which("nft"):  # the loss fault's tables on the bridge ports (faults.lossy_link)
        for line in run(["nft", "list", "tables"], check=False, timeout=10).stdout.splitlines():
            words = line.split()
            if len(words) == 3 and words[2].startswith(f"{LOSS_TABLE}_{prefix}p"):
                run(["nft", "delete", "table", words[1], words[2]], check=False, timeout=10)
    if (state / "hosts.d").exists():
        run(["umount", "-l", str(state / "hosts.d")], check=False, timeout=10)
    if state.exists():
        for p in sorted(state.rglob("*"), reverse=True):
            p.rmdir() if p.is_dir() and not p.is_symlink() else p.unlink()
        state.rmdir()
    if errors:
        raise ClusterError(f"tearing down slot {slot}: " + "; ".join(errors))


def clean(only_dead=False):
    """Tear down every slot (``only_dead``: those whose owner process has ended). Return the
    slots removed."""
    removed = []
    for state in sorted(STATE_ROOT.glob("slot*")) if STATE_ROOT.exists() else []:
        owner = state / "owner"
        try:
            pid = int(owner.read_text())
            os.kill(pid, 0)
            alive = True
        except (OSError, ValueError):
            alive = False
        if only_dead and alive:
            continue
        teardown(int(state.name[4:]))
        removed.append(int(state.name[4:]))
    return removed


# -- the command line ------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tests.cluster.harness",
                                description="Emulate a cluster of hosts on this machine (root).")
    sub = p.add_subparsers(dest="what", required=True)
    up = sub.add_parser("up", help="make a cluster and leave it up; prints its slot")
    up.add_argument("--hosts", type=int, default=4)
    up.add_argument("--ppn", type=int, default=2)
    up.add_argument("--rate", default="1gbit", help="tc rate of each link, both ways ('none': unshaped)")
    up.add_argument("--tcp-give-up", type=float, default=25,
                    help="seconds before the hosts' TCP drops an unanswered connection (tcp_retries2)")
    down = sub.add_parser("down", help="tear a cluster down")
    down.add_argument("--slot", type=int, default=0)
    down.add_argument("--all", action="store_true", help="every slot, leftovers of crashed runs included")
    runp = sub.add_parser("run", help="mpiexec across the hosts of a cluster that is up")
    runp.add_argument("--slot", type=int, default=0)
    runp.add_argument("--timeout", type=float, default=600)
    runp.add_argument("command", nargs=argparse.REMAINDER)
    status = sub.add_parser("status", help="hosts, addresses, byte counters, leftovers")
    status.add_argument("--slot", type=int, default=0)
    args = p.parse_args(argv)

    if args.what == "up":
        c = Cluster(args.hosts, args.ppn, None if args.rate == "none" else args.rate,
                    tcp_give_up=args.tcp_give_up).up()
        # This command ends now, and ``clean(only_dead=True)`` removes slots whose owner has
        # ended: name init (PID 1, always alive) the owner, so the cluster stays until `down`.
        (c.state / "owner").write_text("1")
        print(f"slot {c.slot}: {len(c.hosts)} hosts on {c.bridge} ({c.bridge_address}/{SLOT_BITS}), "
              f"{c.rate or 'unshaped'} links")
        print("launch:", shlex.join(c.mpiexec_argv(["CMD..."])))
        print("env:    UCX_NET_DEVICES=%s OPENBLAS_NUM_THREADS=1 (python -m tests.cluster.harness run "
              "does both)" % NIC)
    elif args.what == "down":
        removed = clean() if args.all else (teardown(args.slot) or [args.slot])
        print(f"removed slot(s) {removed}")
    elif args.what == "run":
        c = Cluster.attach(args.slot)
        cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
        proc = subprocess.run(c.mpiexec_argv(cmd), env=c.env(), timeout=args.timeout)
        return proc.returncode
    elif args.what == "status":
        c = Cluster.attach(args.slot)
        for h in c.hosts:
            tx, rx = h.tx_rx()
            print(f"{h.name} {h.address} netns {h.netns} port {h.port}: sent {tx} B, received {rx} B, "
                  f"{len(h.pids())} processes, /dev/shm {h.shm_files()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
