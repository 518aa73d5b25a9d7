"""A real Slurm on the emulated cluster: ``slurmctld`` on the head, one ``slurmd`` per host.

``Slurm(cluster).up()`` runs, all of it under the cluster's state directory
(``/run/burstmpi-cluster/slot<slot>/slurm``), so that nothing of the machine's own Slurm or
munge (``/etc/slurm``, ``/etc/munge``, ``/run/munge``) is read or touched:

- ``munged`` in the root namespace, with a key of its own and its socket in that directory.
  The socket is a file, so the daemons inside the hosts reach it too: their mount
  namespaces see the same files (one munged serves the whole "site", as one key does);
- ``slurmctld`` in the root namespace, reached at the bridge's address, with a UTS
  namespace of its own named ``head`` (the head is where ``sbatch``, ``squeue`` and
  ``sacct`` run, like a cluster's login node);
- one ``slurmd`` per host, started inside the host's namespaces (``Host.enter``) with its
  node name (``host0``...) and address: the batch script and every job step run there, so
  ranks see the host's hostname, NIC and ``/dev/shm``, and a pulled link cuts that slurmd
  off from slurmctld as it would on a cluster.

``slurm.conf`` (``conf``) is generated: one partition of the K hosts, as many CPUs per
host as the machine has (the hosts share them: the emulation oversubscribes, as the
harness's ranks already do), processes tracked by their parents (``proctrack/linuxproc``:
no cgroup hierarchy is delegated to the hosts), no task binding, a short ``KillWait``.
There is no accounting database: ``jobcomp/filetxt`` writes each ended job's record
(state, exit code, elapsed) to a file, which ``sacct --completion`` reads (``sacct``).

Every wait here has a timeout; daemons are run in the foreground as children of the test
process and killed by PID in ``down()``; a killed test session's daemons are found by
their command lines (which name the state directory) and killed by the harness's
teardown of the slot (``harness.kill_under``).
"""

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from . import mpis
from .hosts import LOCAL_TMP
from .shell import ClusterError, run

__all__ = ["Slurm", "missing_slurm", "DAEMONS", "CLIENTS"]

DAEMONS = ("munged", "slurmctld", "slurmd", "slurmstepd")
CLIENTS = ("sbatch", "srun", "squeue", "sinfo", "sacct", "scontrol", "scancel")
PACKAGES = "apt-get install slurmctld slurmd slurm-client munge"
KILL_WAIT = 10       # s between a time limit's SIGTERM and SIGKILL (Slurm's default: 30)
SLURMD_TIMEOUT = 120  # s of silence before slurmctld marks a node DOWN (see ``conf``)


def missing_slurm():
    """Why Slurm cannot run here, or None: its daemons and commands must be installed."""
    absent = [t for t in DAEMONS + CLIENTS if shutil.which(t) is None
              and not Path("/usr/sbin", t).exists()]
    if absent:
        return f"needs Slurm and munge ({', '.join(absent)} missing): {PACKAGES}"
    return None


def _exe(name):
    return shutil.which(name) or str(Path("/usr/sbin", name))


class Slurm:
    """Slurm on ``cluster`` (a ``harness.Cluster`` that is up). ``port``: slurmctld's TCP
    port on the head, slurmd's the next one (default 16817 + 2 * slot: away from a real
    Slurm's 6817 and 6818, and from another slot's)."""

    def __init__(self, cluster, port=None):
        self.cluster = cluster
        self.port = port or 16817 + 2 * cluster.slot
        self.dir = cluster.state / "slurm"
        self.procs = {}  # name -> Popen of a daemon we started

    # -- files ----------------------------------------------------------------------------------

    @property
    def conf(self):
        return self.dir / "slurm.conf"

    @property
    def socket(self):
        return self.dir / "munge" / "munge.socket"

    @property
    def jobcomp(self):
        return self.dir / "jobcomp.txt"

    @property
    def partition(self):
        """The one partition, named as the cluster (``bmpi<slot>``)."""
        return self.cluster.prefix

    def env(self, **extra):
        """The environment of Slurm's commands here (and, through ``sbatch``'s default
        ``--export=ALL``, of the jobs): the cluster's launch environment plus ``SLURM_CONF``,
        with this interpreter's directory first on ``PATH`` (the jobs' ``python`` and
        ``mpiexec``, as a site's module system would put them there)."""
        env = self.cluster.env(SLURM_CONF=self.conf, **extra)
        env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
        # Inside an allocation Slurm gives Open MPI its slots; oversubscribing there maps
        # every rank to the first node (measured with Open MPI 5.0.11).
        for name in mpis.OVERSUBSCRIBE:
            env.pop(name, None)
        return env

    def write_conf(self):
        c = self.cluster
        cpus = os.cpu_count() or 1
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.address} NodeHostname={h.name} CPUs={cpus} "
                          f"State=UNKNOWN" for h in c.hosts)
        names = ",".join(h.name for h in c.hosts)
        d = self.dir
        # cgroup.conf beside slurm.conf: slurmd loads a cgroup plugin whatever the other
        # plugins are, and its autodetection fails where /sys/fs/cgroup is not mounted (the
        # hosts' fresh /sys). cgroup/v1 is loaded without looking; nothing here uses it.
        (self.dir / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")
        self.conf.write_text(f"""\
# Generated by tests/cluster/slurm.py for the emulated cluster in slot {c.slot}.
ClusterName={c.prefix}
SlurmctldHost=head({c.bridge_address})
SlurmctldPort={self.port}
SlurmdPort={self.port + 1}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={d}/ctld
SlurmdSpoolDir={d}/spool-%n
# Each host's own temporary directory (the shared /tmp would collide: srun --mpi=pmix makes
# /tmp/spmix_appdir_<uid>_<job>.<step> on every node).
TmpFS={LOCAL_TMP}
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
SlurmctldDebug=info
MailProg=/bin/true
SlurmdDebug=info
# No cgroup hierarchy is delegated to the emulated hosts: processes are tracked by their
# parent chain, tasks are not bound (the hosts share the machine's cores anyway).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# No slurmdbd: each ended job's record (state, exit code, elapsed) goes to a file that
# `sacct --completion` reads.
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp}
# A time limit's SIGTERM is followed by SIGKILL this much later. The jobs here end within
# seconds of the SIGTERM (the bench writes its rows in about one); shorter than Slurm's
# 30 s default so that a job which did not would hold its nodes less long.
KillWait={KILL_WAIT}
# A cut-off host's slurmd is silent: slurmctld marks it DOWN after this long. Longer than
# the fault test's watchdog, so the job ends by the watchdog first (FAILED, not NODE_FAIL),
# and the link is back before the node goes DOWN.
SlurmdTimeout={SLURMD_TIMEOUT}
# A node that was DOWN for not answering is used again as soon as its slurmd registers.
ReturnToService=2
{nodes}
PartitionName={self.partition} Nodes={names} Default=YES MaxTime=INFINITE State=UP
""")

    # -- up and down ----------------------------------------------------------------------------

    def up(self, timeout=60):
        """Start munged, slurmctld and every slurmd; wait until every node is idle. On any
        failure stop what was started and raise ``ClusterError`` with the daemons' logs."""
        why = missing_slurm()
        if why:
            raise ClusterError(why)
        try:
            self._start(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _start(self, timeout):
        (self.dir / "munge").mkdir(parents=True, mode=0o700)
        (self.dir / "ctld").mkdir()
        for h in self.cluster.hosts:
            (self.dir / f"spool-{h.name}").mkdir()
        key = self.dir / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.write_conf()
        m = self.dir / "munge"
        self._spawn("munged", [_exe("munged"), "--foreground", "--force", f"--socket={self.socket}",
                               f"--key-file={key}", f"--pid-file={m / 'munged.pid'}",
                               f"--log-file={m / 'munged.log'}", f"--seed-file={m / 'munged.seed'}"])
        self._wait(lambda: self.socket.exists(), timeout, "munged's socket", "munged")
        env = self.env()
        # slurmctld runs only where the host name is SlurmctldHost's: the head gets a UTS
        # namespace of its own, named as in the hosts' /etc/hosts (still the root network
        # namespace, where the bridge's address is).
        # -i: a new cluster each time, no saved state to read.
        self._spawn("slurmctld", ["unshare", "--uts", "--", "sh", "-c", 'hostname head && exec "$@"', "slurmctld",
                                  _exe("slurmctld"), "-D", "-i", "-f", str(self.conf)], env=env)
        for h in self.cluster.hosts:
            self._spawn(f"slurmd-{h.name}", h.enter([_exe("slurmd"), "-D", "-N", h.name, "-f", str(self.conf)]),
                        env=env)
        self.wait_idle(timeout=timeout)

    def _spawn(self, name, argv, env=None):
        log = open(self.dir / f"{name}.out", "wb")
        self.procs[name] = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            env=env, start_new_session=True)
        log.close()

    def _wait(self, ready, timeout, what, *daemons):
        deadline = time.monotonic() + timeout
        while not ready():
            for name in daemons or self.procs:
                p = self.procs.get(name)
                if p is not None and p.poll() is not None:
                    raise ClusterError(f"{name} exited {p.returncode} before {what}:\n{self.logs(name)}")
            if time.monotonic() > deadline:
                raise ClusterError(f"no {what} within {timeout} s:\n{self.logs()}")
            time.sleep(0.2)

    def logs(self, *names, tail=3000):
        """The last ``tail`` characters of the daemons' logs (``names``: default all)."""
        files = sorted(self.dir.glob("*.log")) + sorted(self.dir.glob("*.out")) + [self.dir / "munge" / "munged.log"]
        out = []
        for f in files:
            if f.exists() and (not names or any(f.name.startswith(n) for n in names)):
                out.append(f"--- {f.name}\n{f.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def down(self):
        """Cancel every job, then SIGKILL the daemons we started (slurmd first, so no
        job step outlives its slurmd) and wait for them."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            run(["scancel", "--full", "--partition", self.partition], check=False, timeout=15, env=self.env())
        for name in sorted(self.procs, key=lambda n: (not n.startswith("slurmd"), n == "munged")):
            p = self.procs[name]
            if p.poll() is None:
                p.kill()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                raise ClusterError(f"{name} (pid {p.pid}) still running 10 s after SIGKILL")
        self.procs.clear()
        # Job steps run on the hosts (slurmstepd and the ranks): the hosts' teardown kills them.

    # -- commands -------------------------------------------------------------------------------

    def command(self, argv, timeout=30, check=True, env=None):
        """A Slurm command (``sbatch``, ``sinfo``...) on the head, with ``SLURM_CONF``."""
        return run(argv, timeout=timeout, check=check, env=env or self.env())

    def nodes(self):
        """{node: state} as sinfo says (``idle``, ``alloc``, ``down*``...)."""
        out = self.command(["sinfo", "--noheader", "--Node", "--format=%N %t"], check=False).stdout
        return dict(line.split() for line in out.splitlines() if len(line.split()) == 2)

    def wait_idle(self, nodes=None, timeout=60):
        """Wait until each of ``nodes`` (names; default every host) is idle and no job is
        queued, running or completing on them (the state a test starts from); raise
        ``ClusterError`` naming the nodes and jobs that are not."""
        names = set(nodes or (h.name for h in self.cluster.hosts))

        def ready():
            states = self.nodes()
            return (names <= set(states) and all(states[n] == "idle" for n in names)
                    and not any(names & set(where) for where in self.queue().values()))
        try:
            self._wait(ready, timeout, f"idle nodes {sorted(names)}")
        except ClusterError as e:
            raise ClusterError(f"Slurm not idle within {timeout} s: nodes {self.nodes()}, jobs {self.queue()}\n"
                               f"{e}") from None

    def queue(self):
        """{job id: [its nodes]} of the jobs slurmctld still knows as pending, running or
        completing (a pending job's list is empty)."""
        out = self.command(["squeue", "--noheader", "--format=%i %N"], check=False).stdout
        jobs = {}
        for line in out.splitlines():
            job, _, where = line.strip().partition(" ")
            if job:
                hosts = self.command(["scontrol", "show", "hostnames", where.strip()], check=False).stdout.split() \
                    if where.strip() else []
                jobs[job] = hosts
        return jobs

    def sbatch(self, argv, env=None, cwd=None, timeout=30):
        """``sbatch --parsable ARGV...`` from ``cwd``; return the job id."""
        proc = run(["sbatch", "--parsable", *argv], timeout=timeout, env=self.env(**(env or {})), cwd=cwd)
        return proc.stdout.strip().split(";")[0]

    def sacct(self, job):
        """The job's completion record as ``sacct --completion`` shows it: {"JobID", "State",
        "ExitCode", "Elapsed", "NodeList"}, or None before the job has ended."""
        fields = ("JobID", "State", "ExitCode", "Elapsed", "NodeList")
        out = self.command(["sacct", "--completion", "--noheader", "--parsable2", "-j", str(job),
                            "--format=" + ",".join(fields)], check=False).stdout
        for line in out.splitlines():
            values = line.split("|")
            if values[0] == str(job):
                return dict(zip(fields, values))
        return None

    def wait(self, job, timeout):
        """Wait until ``job`` has ended (its completion record is written); return the record.
        Past ``timeout`` s raise ``ClusterError`` with what squeue and the daemons say.

        The record is written when slurmctld decides the job's end: at a time limit that is
        before the SIGTERM has had its effect, so the job's processes may still run (and
        write) until it leaves ``squeue`` (``wait_idle``)."""
        deadline = time.monotonic() + timeout
        while True:
            record = self.sacct(job)
            if record is not None:
                return record
            if time.monotonic() > deadline:
                raise ClusterError(f"job {job} not ended within {timeout} s: squeue says {self.queue()}, "
                                   f"nodes {self.nodes()}\n{self.logs('slurmctld', tail=2000)}")
            time.sleep(0.5)
