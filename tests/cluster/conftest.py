"""The emulated cluster the multi-host tests share, made once per session and always removed.

The tests run only where they can and where they are asked for:
- as root, with ``ip``, ``tc``, ``unshare``, ``nsenter`` and ``mount`` (the harness makes
  namespaces, links and mounts);
- with ``BURSTMPI_CLUSTER=1``: ``.ci/run``'s multi-host phase sets it. The README's test
  command runs the whole suite, and as root it would otherwise spend minutes here that its
  own phase spends anyway;
- not under ``mpiexec`` (these tests launch their own jobs).
The Slurm tests (``test_slurm``) also need Slurm and munge installed (``slurm.missing_slurm``).
Otherwise each test skips with the reason. The clusters (4 hosts x 2 ranks, 1 Gbit/s links)
are torn down by a finalizer, so also after a failure or Ctrl-C; leftovers of a run that was
killed are removed by the next one (``harness.clean``) or by
``python -m tests.cluster.harness down --all``.
"""

import os

import pytest

from conftest import NRANKS

from .harness import Cluster
from .shell import missing_tools
from .slurm import Slurm, missing_slurm

HOSTS, PPN, RATE = 4, 2, "1gbit"


def why_not():
    """Why the multi-host tests cannot run here, or None."""
    if NRANKS > 1 or os.environ.get("BURSTMPI_UNDER_MPIEXEC") == "1":
        return "already under mpiexec: the multi-host tests launch their own jobs"
    if os.environ.get("BURSTMPI_CLUSTER") != "1":
        return ("multi-host tests run in .ci/run's multi-host phase; set BURSTMPI_CLUSTER=1 to run them "
                "here (needs root, iproute2, util-linux)")
    return missing_tools()


@pytest.fixture(scope="session")
def cluster(request):
    """4 hosts x 2 ranks on 1 Gbit/s links, up for the session."""
    why = why_not()
    if why:
        pytest.skip(why)
    c = Cluster(HOSTS, PPN, RATE)
    request.addfinalizer(c.down)  # before up(): a failed up() has already cleaned, down() is then a no-op
    return c.up()


@pytest.fixture
def hosts(cluster):
    """The cluster, with nothing running on any host and empty /dev/shm before and after
    the test (a fault test checks the leftovers itself before this scrubs them), and every
    host's link carrying packets to the head before it (after a fault's undo)."""
    cluster.scrub()
    cluster.wait_reachable()
    yield cluster
    cluster.scrub()


@pytest.fixture(scope="module")
def slurm(request):
    """Slurm (``slurm.Slurm``) on a cluster of its own, 4 hosts on 1 Gbit/s links, up for
    the module. Its own: the ``hosts`` fixture kills every process on its hosts between
    tests, and slurmd is one of them here."""
    why = why_not() or missing_slurm()
    if why:
        pytest.skip(why)
    c = Cluster(HOSTS, PPN, RATE)
    request.addfinalizer(c.down)  # finalizers run last-in first-out: Slurm goes before its hosts
    c.up()
    s = Slurm(c)
    request.addfinalizer(s.down)
    return s.up()
