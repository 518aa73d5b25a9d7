"""One emulated host: its namespaces, its link to the bridge, its shaping.

A host is what MPI must see as a separate machine. So each gets
- its own network namespace (``ip netns``), reached only through one veth pair whose
  outer end is a port of the cluster's bridge: everything it sends to another host crosses
  that port, so the port's byte counters measure the host's traffic, and pulling the port
  down cuts the host off;
- its own hostname (UTS), System V IPC and mount namespaces, pinned to files so that every
  process started on the host later (``enter``) joins the same ones: the ranks of one host
  must share memory with each other, and never with another host's;
- in its mount namespace, a private tmpfs on ``/dev/shm`` (where MPI's shared-memory
  windows live) and on ``LOCAL_TMP`` (the host's own temporary directory: Slurm's
  ``TmpFS``, where its PMIx plugin makes each step's directories, named alike on every
  node), a fresh ``/sys`` (so it sees its own NIC only) and an ``/etc/hosts`` naming every
  host. The rest of the file system (the checkout, the venv, ``/tmp``) is shared.

The NIC inside is called ``eth0`` on every host, so one ``UCX_NET_DEVICES=eth0`` serves
the whole job. The link is shaped on both ends with ``tc``'s token bucket (``tbf``), so
each direction runs at the host's line rate; ``sch_netem`` (delay, loss) may be missing
from the kernel, which is why loss comes from nftables (``faults``).
"""

import os
import signal
import time
from pathlib import Path

from .shell import ClusterError, run

__all__ = ["Host", "NIC"]

NIC = "eth0"  # the host's end of its link, the same name in every host
# A directory each host mounts a tmpfs of its own on (an empty mount point elsewhere).
LOCAL_TMP = Path("/run/burstmpi-cluster/local-tmp")
# tbf's burst and queue as the harness's brief measured them: 1 Gbit/s moved 0.96 Gbit/s.
BURST, LATENCY = "125kb", "50ms"


class Host:
    """Host ``index`` of the cluster whose names start with ``prefix``. ``address``: its
    IPv4 address on the bridge's subnet (``prefixlen`` bits); ``state``: the cluster's
    private state directory (the pinned namespace files live under it)."""

    def __init__(self, prefix, index, address, prefixlen, state):
        self.index, self.address, self.prefixlen = index, address, prefixlen
        self.name = f"host{index}"             # the hostname its processes see
        self.netns = f"{prefix}h{index}"       # ip netns name
        self.port = f"{prefix}p{index}"        # the link's outer end, a bridge port
        self.dir = Path(state) / self.name     # pinned namespace files: uts, ipc, mnt

    def __repr__(self):
        return f"Host({self.name} {self.address}, netns {self.netns}, port {self.port})"

    # -- inside the host ----------------------------------------------------------------------

    def enter(self, argv, cwd="/"):
        """``argv`` run inside this host (all four namespaces, working directory ``cwd``)."""
        d = self.dir
        return ["nsenter", f"--net=/run/netns/{self.netns}", f"--uts={d / 'uts'}", f"--ipc={d / 'ipc'}",
                f"--mount={d / 'mnt'}", f"--wd={cwd}", "--", *argv]

    def sh(self, script, timeout=30, check=True):
        """Run a shell ``script`` inside the host; return the ``CompletedProcess``."""
        return run(self.enter(["sh", "-c", script]), timeout=timeout, check=check)

    def pids(self):
        """Every process in the host's network namespace (``ip netns pids``)."""
        out = run(["ip", "netns", "pids", self.netns], timeout=10, check=False).stdout
        return sorted(int(p) for p in out.split())

    def processes(self):
        """{pid: command line} of the processes running on the host."""
        found = {}
        for pid in self.pids():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
                # A zombie (ended, not yet reaped by its parent) has no command line.
                found[pid] = cmd or f"[{Path(f'/proc/{pid}/comm').read_text().strip()}, ended]"
            except OSError:  # gone meanwhile
                pass
        return found

    def shm_files(self):
        """The names in the host's private ``/dev/shm``."""
        return sorted(self.sh("ls -A /dev/shm", timeout=10).stdout.split())

    def tx_rx(self):
        """Bytes (sent by the host, received by the host) so far, from the bridge port's
        counters (the port sends what the host receives)."""
        stats = Path(f"/sys/class/net/{self.port}/statistics")
        return int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())

    # -- making and tearing down ----------------------------------------------------------------

    def create(self, bridge, hosts_file, rate, sysctls=None):
        """Make the host: namespaces, a veth link into ``bridge``, shaping at ``rate`` (a tc
        rate such as ``1gbit``; None: unshaped), ``hosts_file`` as its /etc/hosts, and the
        network namespace's ``sysctls`` ({name: value})."""
        run(["ip", "netns", "add", self.netns])
        run(["ip", "link", "add", self.port, "type", "veth", "peer", "name", NIC, "netns", self.netns])
        run(["ip", "link", "set", self.port, "master", bridge, "up"])
        inside = ["ip", "-n", self.netns]
        run([*inside, "link", "set", "lo", "up"])
        run([*inside, "addr", "add", f"{self.address}/{self.prefixlen}", "dev", NIC])
        run([*inside, "link", "set", NIC, "up"])
        # Nothing but our IPv4 on the link: no IPv6 autoconfiguration chatter.
        settings = {"net.ipv6.conf.all.disable_ipv6": 1, **(sysctls or {})}
        run(["ip", "netns", "exec", self.netns, "sysctl", "-q", "-w", *(f"{k}={v}" for k, v in settings.items())])
        if rate:
            self.shape(rate)
        self._pin_namespaces(hosts_file)

    def shape(self, rate):
        """Both directions of the link at ``rate``: tbf on the port (towards the host) and
        on the NIC (from it)."""
        tbf = ["root", "tbf", "rate", rate, "burst", BURST, "latency", LATENCY]
        run(["tc", "qdisc", "replace", "dev", self.port, *tbf])
        run(["tc", "-n", self.netns, "qdisc", "replace", "dev", NIC, *tbf])

    def _pin_namespaces(self, hosts_file):
        """UTS, IPC and mount namespaces bound to files under ``self.dir`` (a private
        mount, see ``harness``), set up once: hostname, /dev/shm, /sys, /etc/hosts."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for ns in ("uts", "ipc", "mnt"):
            (self.dir / ns).touch()
        LOCAL_TMP.mkdir(parents=True, exist_ok=True)  # the mount point, in the root namespace
        setup = (f"hostname {self.name} && mount -t tmpfs -o mode=1777,size=4g shm /dev/shm && "
                 f"mount -t tmpfs -o mode=1777,size=256m tmp {LOCAL_TMP} && "
                 f"mount -t sysfs sysfs /sys && mount --bind {hosts_file} /etc/hosts")
        run(["nsenter", f"--net=/run/netns/{self.netns}", "unshare", f"--uts={self.dir / 'uts'}",
             f"--ipc={self.dir / 'ipc'}", f"--mount={self.dir / 'mnt'}", "--propagation", "private",
             "sh", "-c", setup])

    def kill_all(self, sig=signal.SIGKILL, wait=10):
        """Send ``sig`` to every process on the host, by PID; with SIGKILL wait up to ``wait``
        seconds for them to go. Return the PIDs signalled."""
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait
        while sig == signal.SIGKILL and self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        return pids

    def destroy(self):
        """Kill what runs on the host, unpin its namespaces, delete its netns and link.
        Each step runs even when an earlier one failed; the errors are raised together."""
        errors = []
        for step in (self.kill_all, self._unpin, self._delete_netns):
            try:
                step()
            except (ClusterError, OSError) as e:
                errors.append(f"{self.name}: {e}")
        if self.pids():
            errors.append(f"{self.name}: processes still running after SIGKILL: {self.pids()}")
        if errors:
            raise ClusterError("; ".join(errors))

    def _unpin(self):
        for ns in ("mnt", "ipc", "uts"):
            path = self.dir / ns
            if path.exists():
                run(["umount", "-l", str(path)], check=False, timeout=10)
                path.unlink(missing_ok=True)
        if self.dir.exists():
            self.dir.rmdir()

    def _delete_netns(self):
        if Path(f"/run/netns/{self.netns}").exists():
            run(["ip", "netns", "del", self.netns], timeout=20)
        if Path(f"/sys/class/net/{self.port}").exists():  # gone with its peer, normally
            run(["ip", "link", "del", self.port], check=False, timeout=10)
